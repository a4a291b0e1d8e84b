"""One request in the generator: its state (one enum, checked at every transition), its block
table in the KV arena, and its tokens. The generator owns every Sequence alone."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mmserve.actors.messages import GenerateJob, RequestHandle
from mmserve.cache.block_hash import BlockChain
from mmserve.generation.stops import TextAssembler


class SeqState(enum.Enum):
    PREFILLING = "prefilling"  # its KV is computed a chunk per step (at admission, or after a preemption)
    DECODING = "decoding"      # one token per step
    FINISHED = "finished"      # ended with a finish reason (stop, length)
    FAILED = "failed"          # handling it raised: its caller got the error
    ABORTED = "aborted"        # its caller went away (or was answered by someone else)


_NEXT = {
    SeqState.PREFILLING: {SeqState.DECODING, SeqState.FINISHED, SeqState.FAILED, SeqState.ABORTED},
    # preempted: its blocks freed, it is prefilled again later (the prefix cache makes that cheap)
    SeqState.DECODING: {SeqState.PREFILLING, SeqState.FINISHED, SeqState.FAILED, SeqState.ABORTED},
}
LIVE = frozenset(_NEXT)


@dataclass(eq=False)
class Sequence:
    job: GenerateJob
    assembler: TextAssembler
    rng: torch.Generator | None
    order: int  # admission order: the oldest go first, the newest is preempted first
    chain: BlockChain | None  # how its blocks are keyed (None: no prefix caching)
    state: SeqState = SeqState.PREFILLING
    ids: list[int] = field(default_factory=list)  # prompt, then the answer so far
    table: list[int] = field(default_factory=list)  # its blocks in the arena, in order
    kv_len: int = 0  # tokens whose KV is in its blocks
    hashes: list[bytes] = field(default_factory=list)  # keys of its full blocks (the prompt's first)
    committed: int = 0  # blocks of its table the manager knows the hash of
    epoch: int | None = None  # the manager's life its table belongs to
    registered: bool = False  # the manager holds something for it until a Release
    first_token_at: float | None = None
    last_token_at: float | None = None
    choice: int = 0  # its index among the request's n choices
    forks: list = field(default_factory=list)  # choice 0 until its prefill ends: (rng, matcher) of each other choice
    matcher: Any = None  # its grammar's state (response_format), None when unconstrained
    resumable: bool = False  # preempted: what is still cached of its blocks is looked up before its prefill
    # running (`generation.scheduler`): a step planned it; kept until it ends, through preemptions.
    # A forked choice is born admitted: it exists once its parent's prefill ran, and counts as its request.
    admitted: bool = False
    echoed: bool = False  # /v1/completions' echo (and the prompt's logprobs) was sent to the caller
    prompt_scores: dict = field(default_factory=dict)  # position -> (logprob, rank, top): `prompt_scores`

    def __post_init__(self) -> None:
        self.admitted = self.admitted or self.choice > 0

    @classmethod
    def admit(cls, job: GenerateJob, assembler: TextAssembler, rng: torch.Generator | None, order: int,
              chain: BlockChain | None) -> "Sequence":
        """A new sequence whose cached prefix (found by intake's lookup) starts its block table."""
        prefix = job.prefix
        return cls(job, assembler, rng, order, chain, ids=list(job.prompt.input_ids), table=list(prefix.blocks),
                   kv_len=prefix.hit_tokens, hashes=list(prefix.hashes), committed=len(prefix.blocks),
                   epoch=prefix.epoch if prefix.blocks else None, registered=prefix.registered)

    def move(self, to: SeqState) -> None:
        """The one way a sequence changes state; a transition its life does not allow is a bug."""
        if to not in _NEXT.get(self.state, ()):
            raise RuntimeError(f"sequence {self.request_id}: {self.state.value} → {to.value} is not a transition")
        self.state = to

    @property
    def handle(self) -> RequestHandle:
        return self.job.handle

    @property
    def request_id(self) -> str:
        return self.job.handle.request_id

    @property
    def kv_owner(self) -> str:
        """Whose blocks these are to the cache manager: the request's id, and one per other choice."""
        return self.request_id if self.choice == 0 else f"{self.request_id}/{self.choice}"

    @property
    def priority(self) -> int:
        """Its request's `priority` (lower first): its rank in admission and preemption."""
        return self.handle.request.options.priority

    @property
    def arrived(self) -> float:
        """When its request reached the runtime (monotonic seconds): its priority ages from then."""
        return self.handle.created

    @property
    def label(self) -> str | None:
        return self.job.handle.client_request_id

    @property
    def params(self):
        return self.handle.request.sampling

    @property
    def bidirectional(self) -> tuple[tuple[int, int], ...]:
        """The prompt's bidirectional spans (`PromptInputs.bidirectional`): the scheduler never
        splits one across prefill chunks, and each step masks them."""
        return self.job.prompt.bidirectional

    @property
    def rows(self) -> int:
        """The decode rows its request takes a step once prefilled: one per choice."""
        return self.params.n

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt.input_ids)

    @property
    def tokens(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def hit_tokens(self) -> int:
        return self.job.prefix.hit_tokens

    @property
    def target_len(self) -> int:
        """Tokens whose KV a prefill computes: everything so far (after a preemption the answer too)."""
        return len(self.ids)

    @property
    def table_len(self) -> int:
        return len(self.table)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.tokens)

    def images_to_encode(self, start: int, end: int) -> list[int]:
        """Images among tokens [start, end) without an encoder output: those its cached prefix
        covered whole at admission, whose KV a preemption (or an eviction before its resume) lost."""
        embeds = self.job.image_embeds
        return [i for i, span in enumerate(self.job.prompt.spans)
                if span.start < end and start < span.start + span.length
                and (i >= len(embeds) or embeds[i] is None)]

    def with_embeds(self, outputs: dict[int, torch.Tensor]) -> None:
        """Replaces its job by one with the encoder outputs `outputs` names (image index → output)."""
        spans = self.job.prompt.spans
        embeds = [*self.job.image_embeds, *(None,) * (len(spans) - len(self.job.image_embeds))]
        for i, out in outputs.items():
            embeds[i] = out
        self.job = replace(self.job, image_embeds=tuple(embeds))

"""One request in the generator: its state (one enum, checked at every transition), its KV and
its tokens. The generator owns every Sequence alone; nothing else reads or writes one."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from mmserve.actors.messages import GenerateJob, PinnedBlocks, RequestHandle
from mmserve.generation.stops import TextAssembler


class SeqState(enum.Enum):
    PREFILLING = "prefilling"  # admitted: its prompt's KV is computed a chunk per step
    DECODING = "decoding"      # in the decode batch: one token per step
    FINISHED = "finished"      # ended with a finish reason (stop, length)
    FAILED = "failed"          # handling it raised: its caller got the error
    ABORTED = "aborted"        # its caller went away (or was answered by someone else)


_NEXT = {
    SeqState.PREFILLING: {SeqState.DECODING, SeqState.FINISHED, SeqState.FAILED, SeqState.ABORTED},
    SeqState.DECODING: {SeqState.FINISHED, SeqState.FAILED, SeqState.ABORTED},
}
LIVE = frozenset(_NEXT)


@dataclass(eq=False)
class Sequence:
    job: GenerateJob
    assembler: TextAssembler
    rng: torch.Generator | None
    state: SeqState = SeqState.PREFILLING
    cache: Cache | None = None  # own KV (batch 1, in place) while outside the decode batch
    kv_len: int = 0  # tokens whose KV exists
    hit: PinnedBlocks | None = None  # the cached prefix, until copied into `cache`
    embeds: torch.Tensor | None = None  # prompt embeddings after the cached prefix, until prefilled
    ticket_open: bool = False  # the prefix cache holds something for it until a Commit or Abort
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @classmethod
    def admit(cls, job: GenerateJob, assembler: TextAssembler, rng: torch.Generator | None) -> "Sequence":
        """A new sequence, its cached prefix (pinned by intake's lookup) standing in for its first tokens."""
        prefix = job.prefix
        return cls(job, assembler, rng, kv_len=prefix.hit_tokens, hit=prefix.source, ticket_open=prefix.registered)

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
    def label(self) -> str | None:
        return self.job.handle.client_request_id

    @property
    def hit_tokens(self) -> int:
        return self.job.prefix.hit_tokens

    @property
    def prompt_hashes(self) -> tuple[bytes, ...]:
        return self.job.prefix.hashes

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt.input_ids)

    @property
    def params(self):
        return self.handle.request.sampling

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.tokens)

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= self.prompt_len

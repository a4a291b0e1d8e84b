"""Building a step from its plan: every planned sequence's new tokens, its segment of the arena,
positions and image rows (images whose KV a preemption gave back encoded again), the attention's
host-side metadata (`ModelRunner.prepare`) and the host side of its sampling (`plan_sampling`:
which rows sample, with which parameters, bans and logprobs) — a `StepBuild`, made by the
generator's `StepBuilder`. On the compute thread for a serial step; with overlap
(`actors.step_overlap`), a step launched ahead has all of it built on the event loop while the
step before it runs — the compute thread then only gathers the carried tokens on the device, looks
up their embeddings, runs the forward and samples.

What a step reads of a sequence is frozen when it is launched (`SeqView`), so the event loop may
apply an earlier step's results to the same sequence meanwhile; a token still being sampled by the
step in flight is `CARRIED` in the ids (gathered on the device: `StepInputs.carry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mmserve.errors import ServiceUnavailable
from mmserve.engine.runner import StepInputs
from mmserve.generation.scheduler import Planned
from mmserve.engine.step_sampling import RowSpec, SamplingPlan, plan_sampling
from mmserve.engine.arena import Segment

CARRIED = -2
"""The token id of a step's input that is the token the previous step sampled for that sequence."""


class SeqView:
    """A sequence as one step sees it: its ids, KV length, block table and manager life frozen at
    launch; everything else is read from (and written to) the sequence itself."""

    __slots__ = ("origin", "ids", "kv_len", "table", "epoch")

    def __init__(self, origin, ids: tuple[int, ...], kv_len: int, table: tuple[int, ...], epoch):
        for name, value in (("origin", origin), ("ids", ids), ("kv_len", kv_len), ("table", table), ("epoch", epoch)):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, seq) -> "SeqView":
        return cls(seq, tuple(seq.ids), seq.kv_len, tuple(seq.table), seq.epoch)

    @classmethod
    def ahead(cls, seq) -> "SeqView":
        """`seq` one decode step further than its host state: its next token is the one the step
        now in flight samples (`CARRIED`)."""
        return cls(seq, (*seq.ids, CARRIED), seq.kv_len + 1, tuple(seq.table), seq.epoch)

    def __getattr__(self, name):
        return getattr(self.origin, name)

    def __setattr__(self, name, value) -> None:
        setattr(self.origin, name, value)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.ids[self.origin.prompt_len:]

    @property
    def target_len(self) -> int:
        return len(self.ids)

    @property
    def table_len(self) -> int:
        return len(self.table)


def origin(seq):
    """The sequence behind a step's view (or the sequence itself)."""
    return seq.origin if isinstance(seq, SeqView) else seq


def scores_prompt(request) -> bool:
    """Whether `request` asks for its prompt's own logprobs (`actors.prompt_scores`)."""
    raw = request.prompt
    return raw is not None and raw.logprobs is not None


@dataclass
class PromptRows:
    """The prompt rows a step scores: per sequence (seq, first position j0, end j1) — rows j in
    [j0, j1) predict tokens j+1 — and their flat indices in the step's tokens."""

    spans: list[tuple[object, int, int]]
    rows: torch.Tensor
    targets: torch.Tensor
    k: int

    @classmethod
    def of(cls, chunks: list[tuple[object, int, int, int]]) -> "PromptRows | None":
        """`chunks`: (seq, flat index of its first new token, start, end) of each prefill chunk
        of a scoring sequence; None when none of them holds a row to score."""
        spans, rows, targets, k = [], [], [], 0
        for seq, flat, start, end in chunks:
            j1 = min(end, seq.prompt_len - 1)  # the prompt's last row predicts the answer: not scored
            if j1 <= start:
                continue
            spans.append((seq, start, j1))
            rows += range(flat, flat + j1 - start)
            targets += seq.ids[start + 1:j1 + 1]
            k = max(k, seq.handle.request.prompt.logprobs)
        if not spans:
            return None
        return cls(spans, torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long), k)

    def packed(self, logits: torch.Tensor) -> torch.Tensor:
        """[chosen logprob, rank] per row, then the top-k ids and logprobs, as one float64 vector
        on the logits' device. `logits`: the rows' logits, in order."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = self.targets.to(lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1))
        rank = (lp > chosen).sum(dim=1) + 1
        parts = [chosen.squeeze(1).double(), rank.double()]
        if self.k:
            top = torch.topk(lp, min(self.k, lp.shape[1]), dim=-1)
            parts += [top.indices.double().reshape(-1), top.values.double().reshape(-1)]
        return torch.cat(parts)

    def store(self, host: list[float], vocab: int) -> None:
        """Writes each row's score on its sequence: `prompt_scores[position] = (logprob, rank, top)`."""
        R, k = len(self.targets), min(self.k, vocab)
        chosen, rank, top_ids, top_lp = host[:R], host[R:2 * R], host[2 * R:2 * R + R * k], host[2 * R + R * k:]
        at = 0
        for seq, j0, j1 in self.spans:
            for j in range(j0, j1):
                top = tuple((int(top_ids[at * k + t]), top_lp[at * k + t]) for t in range(k))
                seq.prompt_scores[j + 1] = (chosen[at], int(rank[at]), top)
                at += 1


def row_specs(rows: list[tuple[int, object]], banned: Callable[[object], torch.Tensor],
              grammar_rows: dict[int, int]) -> tuple[list[RowSpec], list[tuple[int, int]]]:
    """The specs of `rows` ((logits row, sequence) each) and, per spec, (position in `rows`,
    choice). `grammar_rows` maps id(sequence) to its row of the step's grammar mask."""
    specs, owners = [], []
    for k, (r, seq) in enumerate(rows):
        params = seq.params
        prompt = seq.ids[:seq.prompt_len] if params.repetition_penalty != 1.0 else ()
        answer = seq.tokens if params.penalized else ()
        ban, grow = banned(seq), grammar_rows.get(id(seq))
        # a seeded choice draws from its own generator (reproducible); the others share the device's
        seeded = params.seed is not None
        specs.append(RowSpec(r, params, seq.rng if seeded else None, ban, prompt, answer, grow))
        owners.append((k, seq.choice))
        for c, (rng, _) in enumerate(seq.forks, 1):  # its other choices' first tokens: same row
            specs.append(RowSpec(r, params, rng if seeded else None, ban, prompt, answer, grow))
            owners.append((k, c))
    return specs, owners


def banned_ids(seq, image_token: torch.Tensor, eos: torch.Tensor, vocab_size: int,
               image_and_eos: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens `seq` may not draw now: the image placeholder always; EOS for the whole answer
    with `ignore_eos` (vLLM: EOS does not end it; banning it makes `max_tokens` end it), and EOS and
    `stop_token_ids` before `min_tokens` (as vLLM's min-tokens processor). A grammar says itself
    when the answer may end: a constrained sequence gets neither ban. `image_and_eos`: the two
    together, made once (a step asks for every sequence's bans)."""
    params = seq.params
    if seq.matcher is not None:
        return image_token
    early = len(seq.tokens) < params.min_tokens
    if not early and not params.ignore_eos:
        return image_token
    stops = [t for t in params.stop_token_ids if t < vocab_size] if early else []
    if not stops and image_and_eos is not None:
        return image_and_eos
    return torch.cat([image_token, eos, torch.tensor(stops, dtype=torch.long)] if stops else [image_token, eos])


@dataclass(eq=False)
class StepBuild:
    """A step's inputs (`StepBuilder.inputs`): per planned sequence its result so far (None, or the
    error that keeps it out of the step), and for the rows that run their tokens, segments,
    positions, image rows, spans and prompt rows scored; `carry_at`: (index in ids, id(sequence))
    of each token that is the previous step's sample for that sequence (`CARRIED`)."""

    results: list
    rows: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    images: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    scoring: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    carry_at: list = field(default_factory=list)
    # made by `StepBuilder.build` once the rows are known
    wanted: list = field(default_factory=list)  # (logits row, index in the plan) of each row due a token
    constrained: list = field(default_factory=list)  # the sequences among them under a grammar
    sampling: "StepSampling | None" = None
    scored: PromptRows | None = None
    step: StepInputs | None = None
    prepared: object = None  # `ModelRunner.prepare(step)`
    entered: object = None  # called on the compute thread as the step's model work starts (overlap)


@dataclass(eq=False)
class StepSampling:
    """The host side of a step's sampling: its `SamplingPlan`, per spec its (position in `wanted`,
    choice), the rows whose own sampling failed beforehand (position -> error), and the spec of
    each sequence that samples exactly one token (id(sequence) -> spec index: where the next step,
    launched ahead, gathers its carried token from)."""

    plan: SamplingPlan
    owners: list
    failed: dict
    carry_rows: dict


@dataclass(eq=False)
class StepOutput:
    """What the compute thread hands back: the results known there (errors, -1 for rows computed
    with no token due) and the step's samples still on their way to the host (`DeviceSample`),
    made into results on the event loop (`actors.step_executor`)."""

    results: list
    built: StepBuild | None = None
    sample: object = None  # DeviceSample


def _no_fault(point: str, label: str | None = None) -> None:
    return None


class StepBuilder:
    """Builds the steps of one model's runner. Owns the bans made once (image token, EOS) and the
    count of images encoded again. `fault`: the fault-injection hook (`actors.faults.fault`);
    `log` and `metrics`: where a re-encoding is told."""

    def __init__(self, adapter, runner, log, metrics=None, fault: Callable = _no_fault):
        self.adapter, self.runner = adapter, runner
        self.log, self.metrics, self.fault = log, metrics, fault
        self.reencoded_images = 0  # images preempted sequences encoded again (their cached KV was gone)
        self._image_token = torch.tensor([adapter.image_token_id])
        self._eos = torch.tensor(sorted(adapter.eos_token_ids), dtype=torch.long)
        self._image_and_eos = torch.cat([self._image_token, self._eos])

    def inputs(self, plan: list[Planned]) -> StepBuild:
        """The step's inputs from its plan: every sequence's new tokens, segment, positions, image
        rows. A failure of one sequence's own work fails it alone."""
        b, epoch, fault = StepBuild([None] * len(plan)), self.runner.epoch, self.fault
        for i, p in enumerate(plan):
            if p.seq.epoch is not None and epoch is not None and p.seq.epoch != epoch:
                # its table belongs to a dead life of the cache manager, which may have given those
                # blocks to a shared-tier restore already: it writes nothing (and fails)
                b.results[i] = ServiceUnavailable("the KV cache of this model was restarted while the request "
                                                  "ran; retry", retry_after_s=1.0)
                continue
            try:
                if not p.decode:
                    fault("generator.prefill", p.seq.label)
                start, end = p.seq.kv_len, p.seq.kv_len + p.tokens
                rope = self.adapter.rope_positions(p.seq.job.prompt, len(p.seq.ids), start, end)
                pieces = []
                if start < p.seq.prompt_len:  # image placeholders are in the prompt only
                    self._encode_lost_images(p.seq, start, end)
                    pieces = self._image_rows(p.seq, start, end)
            except Exception as e:
                b.results[i] = e
                continue
            b.images += [(len(b.ids) + at, emb) for at, emb in pieces]
            if not p.decode and scores_prompt(p.seq.handle.request):  # its prompt's own logprobs
                b.scoring.append((p.seq, len(b.ids), start, end))
            new = p.seq.ids[start:end]
            if new and new[-1] == CARRIED:  # a step launched ahead: its token is the last step's sample
                b.carry_at.append((len(b.ids) + len(new) - 1, id(origin(p.seq))))
                new = (*new[:-1], 0)  # a placeholder: the token is gathered on the device (`StepInputs.carry`)
            b.ids += new
            b.segments.append(Segment(tuple(p.seq.table), start, p.tokens))
            b.spans.append(p.seq.bidirectional)
            b.positions.append(rope)
            b.rows.append(i)
        return b

    def build(self, plan: list[Planned]) -> StepBuild:
        """`inputs`, and what the step's forward and sampling need that the host can know before:
        the rows due a token, the sampling plan, the prompt rows scored, and the attention's
        host-side metadata."""
        b = self.inputs(plan)
        if not b.rows:
            return b
        b.wanted = [(r, i) for r, i in enumerate(b.rows)
                    if plan[i].seq.kv_len + plan[i].tokens == plan[i].seq.target_len]
        b.constrained = [plan[i].seq for _, i in b.wanted if plan[i].seq.matcher is not None]
        b.sampling = self.sampling([(r, plan[i].seq) for r, i in b.wanted],
                                   {id(s): g for g, s in enumerate(b.constrained)})
        b.scored = PromptRows.of(b.scoring) if b.scoring else None
        b.step = StepInputs(tuple(b.ids), tuple(b.segments), tuple(b.images),
                            torch.cat(b.positions, dim=1) if self.adapter.mrope else None,
                            b.scored.rows if b.scored else None, tuple(b.spans) if any(b.spans) else None)
        b.prepared = self.runner.prepare(b.step)
        return b

    def sampling(self, rows: list[tuple[int, object]], grammar_rows: dict[int, int]) -> StepSampling:
        """The host side of sampling `rows` ((logits row, sequence) each); a sequence whose own
        sampling fails fails alone."""
        ok, failed = [], {}
        for k, (_, seq) in enumerate(rows):
            try:
                self.fault("generator.sample", seq.label)
                ok.append(k)
            except Exception as e:
                failed[k] = e
        specs, owners = row_specs([rows[k] for k in ok], self.banned, grammar_rows)
        owners = [(ok[j], c) for j, c in owners]
        per_row: dict[int, list[int]] = {}
        for spec, (k, _) in enumerate(owners):
            per_row.setdefault(k, []).append(spec)
        carry_rows = {id(origin(rows[k][1])): specs_[0] for k, specs_ in per_row.items() if len(specs_) == 1}
        return StepSampling(plan_sampling(specs), owners, failed, carry_rows)

    def banned(self, seq) -> torch.Tensor:
        return banned_ids(seq, self._image_token, self._eos, self.adapter.vocab_size, self._image_and_eos)

    @staticmethod
    def tokens(sampling: StepSampling, sampled: list, count: int) -> list:
        """Per row due a token (`count` of them): its `Sampled`, every choice's for a request whose
        prefill ended, or the error that failed it."""
        got: dict[int, list] = {}
        for (k, _), one in zip(sampling.owners, sampled):
            got.setdefault(k, []).append(one)
        out: list = []
        for k in range(count):
            if k in sampling.failed:
                out.append(sampling.failed[k])
                continue
            bad = [x for x in got[k] if isinstance(x, Exception)]
            out.append(bad[0] if bad else got[k][0] if len(got[k]) == 1 else got[k])
        return out

    def _encode_lost_images(self, seq, start: int, end: int) -> None:
        """Encodes again the images among tokens [start, end) that `seq` has no encoder output of:
        its cached prefix covered them at admission, and a preemption since gave that KV back."""
        lost = seq.images_to_encode(start, end)
        if not lost:
            return
        self.fault("generator.reencode", seq.label)
        prompt = seq.job.prompt
        outputs = self.adapter.encode_images([prompt.pixels(self.adapter, i) for i in lost])
        seq.with_embeds(dict(zip(lost, outputs)))
        self.reencoded_images += len(lost)
        if self.metrics is not None:
            self.metrics.reencoded_images(self.adapter.name, len(lost))
        self.log.info("generator.reencoded", request_id=seq.request_id, images=lost, kv_len=start)

    @staticmethod
    def _image_rows(seq, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """The encoder-output rows over the image placeholders among tokens [start, end) of `seq`:
        (offset from `start`, rows) per image that falls in the range."""
        pieces = []
        for span, emb in zip(seq.job.prompt.spans, seq.job.image_embeds):
            lo, hi = max(span.start, start), min(span.start + span.length, end)
            if lo < hi:
                pieces.append((lo - start, emb[lo - span.start:hi - span.start]))
        return pieces

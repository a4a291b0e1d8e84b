"""Building a step from its plan (a part of `Generator`): every planned sequence's new tokens, its
segment of the arena, positions and image rows (images whose KV a preemption gave back encoded
again), the attention's host-side metadata (`ModelRunner.prepare`) and the host side of its
sampling (`plan_sampling`: which rows sample, with which parameters, bans and logprobs). On the
compute thread for a serial step; with overlap (`step_overlap`), a step launched ahead has all of
it built on the event loop while the step before it runs — the compute thread then only gathers
the carried tokens on the device, looks up their embeddings, runs the forward and samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.actors.faults import fault
from mmserve.actors.prompt_scores import PromptRows, scores_prompt
from mmserve.actors.sequence import Sequence
from mmserve.actors.step_overlap import CARRIED, origin
from mmserve.actors.token_rows import row_specs
from mmserve.errors import ServiceUnavailable
from mmserve.engine.runner import StepInputs
from mmserve.generation.scheduler import Planned
from mmserve.engine.step_sampling import SamplingPlan, plan_sampling
from mmserve.engine.arena import Segment


@dataclass(eq=False)
class StepBuild:
    """A step's inputs (`Generator._inputs`): per planned sequence its result so far (None, or the
    error that keeps it out of the step), and for the rows that run their tokens, segments,
    positions, image rows, spans and prompt rows scored; `carry_at`: (index in ids, id(sequence))
    of each token that is the previous step's sample for that sequence (`step_overlap.CARRIED`)."""

    results: list
    rows: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    images: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    scoring: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    carry_at: list = field(default_factory=list)
    # made by `_build` once the rows are known
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
    made into results on the event loop (`Generator._results`)."""

    results: list
    built: StepBuild | None = None
    sample: object = None  # DeviceSample


class StepBuilding:
    """Generator methods: a step's inputs."""

    def _inputs(self, plan: list[Planned]) -> StepBuild:
        """The step's inputs from its plan: every sequence's new tokens, segment, positions, image
        rows (on the compute thread; with overlap, a step launched ahead has them built on the event
        loop while the step before it runs). A failure of one sequence's own work fails it alone."""
        b = StepBuild([None] * len(plan))
        for i, p in enumerate(plan):
            if p.seq.epoch is not None and self.kv.epoch is not None and p.seq.epoch != self.kv.epoch:
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

    def _build(self, plan: list[Planned]) -> StepBuild:
        """`_inputs`, and what the step's forward and sampling need that the host can know before:
        the rows due a token, the sampling plan, the prompt rows scored, and the attention's
        host-side metadata."""
        b = self._inputs(plan)
        if not b.rows:
            return b
        b.wanted = [(r, i) for r, i in enumerate(b.rows)
                    if plan[i].seq.kv_len + plan[i].tokens == plan[i].seq.target_len]
        b.constrained = [plan[i].seq for _, i in b.wanted if plan[i].seq.matcher is not None]
        b.sampling = self._sampling([(r, plan[i].seq) for r, i in b.wanted],
                                    {id(s): g for g, s in enumerate(b.constrained)})
        b.scored = PromptRows.of(b.scoring) if b.scoring else None
        b.step = StepInputs(tuple(b.ids), tuple(b.segments), tuple(b.images),
                            torch.cat(b.positions, dim=1) if self.adapter.mrope else None,
                            b.scored.rows if b.scored else None, tuple(b.spans) if any(b.spans) else None)
        b.prepared = self.runner.prepare(b.step)
        return b

    def _sampling(self, rows: list[tuple[int, Sequence]], grammar_rows: dict[int, int]) -> StepSampling:
        """The host side of sampling `rows` ((logits row, sequence) each); a sequence whose own
        sampling fails fails alone."""
        ok, failed = [], {}
        for k, (_, seq) in enumerate(rows):
            try:
                fault("generator.sample", seq.label)
                ok.append(k)
            except Exception as e:
                failed[k] = e
        specs, owners = row_specs([rows[k] for k in ok], self._banned, grammar_rows)
        owners = [(ok[j], c) for j, c in owners]
        per_row: dict[int, list[int]] = {}
        for spec, (k, _) in enumerate(owners):
            per_row.setdefault(k, []).append(spec)
        carry_rows = {id(origin(rows[k][1])): specs_[0] for k, specs_ in per_row.items() if len(specs_) == 1}
        return StepSampling(plan_sampling(specs), owners, failed, carry_rows)

    @staticmethod
    def _tokens(sampling: StepSampling, sampled: list, count: int) -> list:
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


    def _encode_lost_images(self, seq: Sequence, start: int, end: int) -> None:
        """Encodes again the images among tokens [start, end) that `seq` has no encoder output of:
        its cached prefix covered them at admission, and a preemption since gave that KV back."""
        lost = seq.images_to_encode(start, end)
        if not lost:
            return
        fault("generator.reencode", seq.label)
        prompt = seq.job.prompt
        outputs = self.adapter.encode_images([prompt.pixels(self.adapter, i) for i in lost])
        seq.with_embeds(dict(zip(lost, outputs)))
        self.reencoded_images += len(lost)
        if self.metrics is not None:
            self.metrics.reencoded_images(self.adapter.name, len(lost))
        self.log.info("generator.reencoded", request_id=seq.request_id, images=lost, kv_len=start)

    @staticmethod
    def _image_rows(seq: Sequence, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """The encoder-output rows over the image placeholders among tokens [start, end) of `seq`:
        (offset from `start`, rows) per image that falls in the range."""
        pieces = []
        for span, emb in zip(seq.job.prompt.spans, seq.job.image_embeds):
            lo, hi = max(span.start, start), min(span.start + span.length, end)
            if lo < hi:
                pieces.append((lo - start, emb[lo - span.start:hi - span.start]))
        return pieces


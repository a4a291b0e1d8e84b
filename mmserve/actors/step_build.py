"""Building a step's inputs from its plan (a part of `Generator`): every planned sequence's new
tokens, its segment of the arena, positions and image rows (images whose KV a preemption gave back
encoded again). On the compute thread; with overlap (`step_overlap`), a step launched ahead has
them built on the event loop while the step before it runs, its carried tokens filled in on the
compute thread."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.actors.faults import fault
from mmserve.actors.prompt_scores import scores_prompt
from mmserve.actors.sequence import Sequence
from mmserve.actors.step_overlap import CARRIED, origin
from mmserve.errors import ServiceUnavailable
from mmserve.generation.scheduler import Planned
from mmserve.models.paged import Segment


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
            b.ids += new
            b.segments.append(Segment(tuple(p.seq.table), start, p.tokens))
            b.spans.append(p.seq.bidirectional)
            b.positions.append(rope)
            b.rows.append(i)
        return b


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


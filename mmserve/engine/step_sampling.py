"""The next token of every row a step samples: penalties, bans, grammar masks, sampling and
log-probabilities, batched on the logits' device, with one device→host transfer — started
asynchronously (`DeviceSample`: pinned memory and an event on CUDA), the sampled ids staying on the
device for the next step. The host side (`plan_sampling`) is built before the step's logits exist.

Log-probabilities are those of the distribution the token was drawn from: after penalties, bans
(the image placeholder; EOS before `min_tokens`), the grammar's mask and temperature (a greedy row
counts as temperature 1); top-k and top-p truncation are not applied to them (as vLLM's
"processed" log-probabilities), so a token they cut off still has a finite log-probability. A
token no longer allowed at all (-inf) is reported as -9999.0, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mmserve.generation.penalties import apply_penalties
from mmserve.generation.sampler import _REASONS, sample_batch_ids, SamplingError
from mmserve.generation.sampling import SamplingParams

NO_PROBABILITY = -9999.0


@dataclass(frozen=True)
class RowSpec:
    """What row `row` of the step's logits samples, for one sequence (several specs may share a
    row: the choices of a request sample their first token from its one prefill)."""

    row: int
    params: SamplingParams
    generator: torch.Generator | None  # None: the device's generator (unseeded rows)
    banned: torch.Tensor | None = None  # token ids never chosen
    prompt: Sequence[int] = ()  # for the repetition penalty
    answer: Sequence[int] = ()  # for all three penalties
    grammar_row: int | None = None  # its row of the step's grammar mask


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float | None = None  # None unless the request asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def sample_rows(logits: torch.Tensor, specs: Sequence[RowSpec],
                allowed: torch.Tensor | None = None) -> list[Sampled | Exception]:
    """One `Sampled` per spec, or a ValueError in its place when its row cannot be sampled.
    `allowed` [G, V] bool is the step's grammar mask (`RowSpec.grammar_row` indexes it)."""
    return sample_rows_and(logits, specs, allowed)[0]


def sample_rows_and(logits: torch.Tensor, specs: Sequence[RowSpec], allowed: torch.Tensor | None = None,
                    extra: torch.Tensor | None = None) -> tuple[list[Sampled | Exception], list[float]]:
    """`sample_rows`, and the host values of `extra` (a 1-D tensor on the logits' device: e.g. the
    prompt's scores) fetched in the same, one device→host transfer."""
    return sample_on_device(logits, plan_sampling(specs), allowed, extra).unpack()


@dataclass(eq=False)
class SamplingPlan:
    """What a step samples, everything the host can know before the step's logits exist: the
    specs, and as small host tensors the logits rows they read, the banned (row, token) pairs, the
    grammar rows, the logprob rows and temperatures. Built before the step — off the compute
    thread for a step launched ahead (overlap scheduling) — so the compute thread only uploads
    them and runs the device work (`sample_on_device`)."""

    specs: tuple[RowSpec, ...]
    params: list[SamplingParams]
    generators: list
    rows: torch.Tensor  # [B] the logits row of each spec
    identity: bool  # rows == 0..B-1: no gather when the logits have exactly B rows
    ban: tuple[torch.Tensor, torch.Tensor] | None  # (spec rows, token ids) never chosen
    penalized: list[int]
    constrained: torch.Tensor | None  # specs under a grammar mask
    grammar_rows: torch.Tensor | None  # their rows of the step's mask
    want: list[int]  # specs that report logprobs
    want_rows: torch.Tensor | None
    temps: torch.Tensor | None  # their temperatures (greedy: 1)
    k: int  # the most top logprobs any of them wants


def plan_sampling(specs: Sequence[RowSpec]) -> SamplingPlan:
    """The host side of sampling `specs` (see `SamplingPlan`): no device work, no sync."""
    specs = tuple(specs)
    params = [s.params for s in specs]
    rows = [s.row for s in specs]
    # the banned (row, token) pairs as two host tensors, made from python lists: most specs share
    # one of a few ban tensors (read once each), and a tensor op per spec costs more than the lists
    ban_rows, ban_ids, flat = [], [], {}
    for b, s in enumerate(specs):
        if s.banned is None:
            continue
        ids = flat.get(id(s.banned))
        if ids is None:
            ids = flat[id(s.banned)] = (s.banned if s.banned.dim() == 1 else s.banned.reshape(-1)).tolist()
        ban_rows += [b] * len(ids)
        ban_ids += ids
    ban = (torch.tensor(ban_rows, dtype=torch.long), torch.tensor(ban_ids, dtype=torch.long)) if ban_ids else None
    constrained = [i for i, s in enumerate(specs) if s.grammar_row is not None]
    want = [i for i, p in enumerate(params) if p.logprobs]
    return SamplingPlan(
        specs, params, [s.generator for s in specs], torch.tensor(rows, dtype=torch.long),
        rows == list(range(len(rows))), ban,
        [i for i, p in enumerate(params) if p.penalized],
        torch.tensor(constrained, dtype=torch.long) if constrained else None,
        torch.tensor([specs[i].grammar_row for i in constrained], dtype=torch.long) if constrained else None,
        want, torch.tensor(want, dtype=torch.long) if want else None,
        torch.tensor([params[i].temperature or 1.0 for i in want], dtype=torch.float32) if want else None,
        max((params[i].top_logprobs for i in want), default=0))


@dataclass(eq=False)
class DeviceSample:
    """A step's samples: `ids` [specs] stay on the device (the next step gathers its carried tokens
    from them there); `host` receives the packed values (ids, logprobs, top logprobs, extra) —
    asynchronously on CUDA (pinned memory, `ready` recorded after the copy), at once on the CPU
    (`ready` None: the same path with nothing to wait for). `unpack` waits for them and makes the
    `Sampled` results: on the event loop, while the next step runs."""

    ids: torch.Tensor
    host: torch.Tensor
    ready: object | None
    plan: SamplingPlan
    extra: int = 0

    def done(self) -> bool:
        """Whether the host values have arrived (without waiting)."""
        return self.ready is None or self.ready.query()

    def wait(self) -> None:
        """Blocks until the host values have arrived (the calling thread sleeps meanwhile)."""
        if self.ready is not None:
            self.ready.synchronize()

    def unpack(self) -> tuple[list[Sampled | Exception], list[float]]:
        self.wait()
        host = self.host.tolist()
        if not self.plan.specs:
            return [], host
        cut = len(host) - self.extra
        return _unpack(host[:cut], self.plan.params, self.plan.want, self.plan.k), host[cut:]


def sample_on_device(logits: torch.Tensor, plan: SamplingPlan, allowed: torch.Tensor | None = None,
                     extra: torch.Tensor | None = None) -> DeviceSample:
    """The device side of sampling `plan`: penalties, bans, grammar masks, the draw and the
    logprobs on the logits' device, no host sync; their host copy started (`DeviceSample`)."""
    n_extra = 0 if extra is None else extra.numel()
    if not plan.specs:
        ids = torch.zeros(0, dtype=torch.long, device=logits.device)
        return _to_host(ids, extra.double() if extra is not None else ids.double(), plan, n_extra)
    x = _processed(logits, plan, allowed)
    ids = sample_batch_ids(x, plan.params, plan.generators)
    packed = [ids.double()]
    if plan.want:
        rows = plan.want_rows.to(x.device, non_blocking=True)
        lp = torch.log_softmax(x.index_select(0, rows) / plan.temps.to(x.device, non_blocking=True).unsqueeze(1), dim=-1)
        packed.append(lp.gather(1, ids.index_select(0, rows).clamp_min(0).unsqueeze(1)).squeeze(1).double())
        if plan.k:
            top = torch.topk(lp, min(plan.k, lp.shape[1]), dim=-1)
            packed += [top.indices.double().reshape(-1), top.values.double().reshape(-1)]
    if extra is not None:
        packed.append(extra.double())
    return _to_host(ids, torch.cat(packed), plan, n_extra)


def _to_host(ids: torch.Tensor, packed: torch.Tensor, plan: SamplingPlan, extra: int) -> DeviceSample:
    """The one device→host transfer, started: pinned memory and an event on CUDA; on the CPU the
    values are on the host already."""
    if packed.device.type != "cuda":
        return DeviceSample(ids, packed, None, plan, extra)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ready = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spinning on a core
    ready.record()
    return DeviceSample(ids, host, ready, plan, extra)


def _processed(logits: torch.Tensor, plan: SamplingPlan, allowed: torch.Tensor | None) -> torch.Tensor:
    dev = logits.device
    x = logits.detach().float()
    if not (plan.identity and x.shape[0] == len(plan.specs)):
        x = x.index_select(0, plan.rows.to(dev, non_blocking=True))
    pen = plan.penalized
    if pen:
        specs = plan.specs
        x = apply_penalties(x, pen, [specs[i].params for i in pen], [specs[i].prompt for i in pen],
                            [specs[i].answer for i in pen])
    if plan.ban is not None:  # advanced indexing, as `logits[banned]`: a negative id counts from the end
        r, c = (t.to(dev, non_blocking=True) for t in plan.ban)
        x = x.index_put((r, c), x.new_full((), float("-inf")))
    if plan.constrained is not None and allowed is not None:
        mask = allowed.index_select(0, plan.grammar_rows.to(dev, non_blocking=True))
        V = x.shape[1]
        if mask.shape[1] < V:
            mask = torch.nn.functional.pad(mask, (0, V - mask.shape[1]), value=False)
        index = plan.constrained.to(dev, non_blocking=True)
        x = x.index_copy(0, index, x.index_select(0, index).masked_fill(~mask[:, :V], float("-inf")))
    return x


def _unpack(host: list[float], params: list[SamplingParams], want: list[int], k: int) -> list:
    B, L = len(params), len(want)
    ids = [int(v) for v in host[:B]]
    chosen = dict(zip(want, host[B:B + L]))
    top_ids, top_lp = host[B + L:B + L + L * k], host[B + L + L * k:]
    slot = {i: j for j, i in enumerate(want)}
    out: list[Sampled | Exception] = []
    for b, token in enumerate(ids):
        if token < 0:
            out.append(SamplingError({b: _REASONS[token]}))
            continue
        if b not in slot:
            out.append(Sampled(token))
            continue
        j, n = slot[b], params[b].top_logprobs
        top = tuple((int(top_ids[j * k + t]), _finite(top_lp[j * k + t])) for t in range(min(n, k)))
        out.append(Sampled(token, _finite(chosen[b]), top))
    return out


def _finite(v: float) -> float:
    return v if v > NO_PROBABILITY else NO_PROBABILITY

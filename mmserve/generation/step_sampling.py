"""The next token of every row a step samples: penalties, bans, grammar masks, sampling and
log-probabilities, batched on the logits' device, with one device→host transfer.

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
from mmserve.generation.sampler import _REASONS, _ban, sample_batch_ids, SamplingError
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
    if not specs:
        return [], [] if extra is None else extra.tolist()
    x = _processed(logits, specs, allowed)
    params = [s.params for s in specs]
    ids = sample_batch_ids(x, params, [s.generator for s in specs])
    want = [i for i, p in enumerate(params) if p.logprobs]
    k = max((params[i].top_logprobs for i in want), default=0)
    packed = [ids.double()]
    if want:
        temps = torch.tensor([p.temperature or 1.0 for p in (params[i] for i in want)], dtype=torch.float32)
        rows = torch.tensor(want, dtype=torch.long, device=x.device)
        lp = torch.log_softmax(x.index_select(0, rows) / temps.to(x.device).unsqueeze(1), dim=-1)
        packed.append(lp.gather(1, ids.index_select(0, rows).clamp_min(0).unsqueeze(1)).squeeze(1).double())
        if k:
            top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
            packed += [top.indices.double().reshape(-1), top.values.double().reshape(-1)]
    if extra is not None:
        packed.append(extra.double())
    host = torch.cat(packed).tolist()  # the one transfer
    cut = len(host) - (0 if extra is None else extra.numel())
    return _unpack(host[:cut], params, want, min(k, x.shape[1])), host[cut:]


def _processed(logits: torch.Tensor, specs: Sequence[RowSpec], allowed: torch.Tensor | None) -> torch.Tensor:
    dev = logits.device
    rows = [s.row for s in specs]
    x = logits.detach().float()
    if rows != list(range(x.shape[0])):
        x = x.index_select(0, torch.tensor(rows, dtype=torch.long).to(dev))
    pen = [i for i, s in enumerate(specs) if s.params.penalized]
    if pen:
        x = apply_penalties(x, pen, [specs[i].params for i in pen], [specs[i].prompt for i in pen],
                            [specs[i].answer for i in pen])
    x = _ban(x, [s.banned for s in specs])
    constrained = [i for i, s in enumerate(specs) if s.grammar_row is not None]
    if constrained and allowed is not None:
        mask = allowed.index_select(0, torch.tensor([specs[i].grammar_row for i in constrained]).to(dev))
        V = x.shape[1]
        if mask.shape[1] < V:
            mask = torch.nn.functional.pad(mask, (0, V - mask.shape[1]), value=False)
        index = torch.tensor(constrained, dtype=torch.long).to(dev)
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

"""Sampling a whole decode batch on the logits' device, with one device→host transfer per step.

`sample_batch` takes the batch's logits [B, V] where the forward left them (CUDA stays on CUDA),
does banning, greedy argmax, temperature, min-p, top-k and top-p for every row at once in float32,
and brings back only the [B] sampled ids (`.tolist()` once). Per-row parameters travel to the device
as small tensors (host→device, non-blocking from pinned memory on CUDA); nothing per row or per
vocabulary entry comes back.

Same results as `sampling.sample` row by row:

* greedy rows (temperature 0) are the argmax of the row with its banned ids at -inf — the first
  maximal index, as `torch.argmax`;
* random rows run the same float32 operations as `sample` (logits / temperature; min-p drops the
  scaled logits below the row's largest + log(min_p); the k-th largest scaled logit as top-k
  threshold, ties kept; softmax; top-p drops the tokens whose preceding mass in the descending sort
  already reaches top_p), batched over rows with per-row parameters;
* a row with a generator draws exactly what `sample` draws. `torch.multinomial(probs, 1, gen)` is,
  in torch, the exponential race ``argmax(probs / q)`` with ``q = empty_like(probs).exponential_(1,
  generator=gen)`` (tests/test_sampler.py pins that). Here the row's q is drawn with the same call
  on the generator's own device — a row of V float32 exponentials, one generator step, as inside
  `multinomial` — and the argmax of ``probs / q`` is taken on the logits' device with the rest of
  the batch. On CPU logits the row's probabilities are bit-identical to `sample`'s (the batched
  ops reduce each row exactly as the 1-D ops do; the one exception, a full 1-D ``sum()``, which
  torch splits across threads once V >= 32768, is done per row as in `sample`), so the token is identical and the
  generator ends in the same state: a seeded request gives the same token sequence as before.
  On CUDA logits the race is the same and the noise is the same numbers, but the GPU's softmax and
  cumulative sums round differently from the CPU's, so a token can differ from CPU `sample` where
  two candidates' ``p / q`` lie within float rounding of each other (the result is still
  reproducible: same seed, same logits, same device → same tokens).
  Cost of such a row: V exponential draws on the generator's device (the same host work `sample`
  did inside `multinomial`), plus — for a CPU generator with CUDA logits — a V×4-byte upload
  (128 KB at V=32000), and a few per-row kernel launches (a Python loop over the seeded rows,
  never over the vocabulary);
* rows without a generator (pass None for an unseeded request) are drawn by inverse CDF with one
  uniform per row from the device's default generator — a cumsum and a searchsorted (top-p rows
  search their already sorted, kept prefix) instead of V exponentials per row: vectorised, the
  same distribution, but not reproducible. (`make_generator` gives every random request a
  generator; pass ``seq.rng if seq.params.seed is not None else None`` to take this path for
  unseeded requests, or every generator to keep all rows exactly as `sample` draws them.)

A row whose every token is banned, or where nothing survives (non-finite logits, a top_p of 0),
is reported by index: `sample_batch` raises `SamplingError` (a ValueError) naming every such row,
or with ``on_error="return"`` puts a ValueError in that row's place (so one bad request fails
alone). The validity check rides in the same transfer as the ids (negative codes).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

from mmserve.generation.sampling import SamplingParams

Banned = Sequence["torch.Tensor | None"] | torch.Tensor | None

ALL_BANNED = -1
"""Code in `sample_batch_ids`' result: every token of the row is banned."""
NOTHING_LEFT = -2
"""Code in `sample_batch_ids`' result: no token survives (NaN/inf logits, or the filters drop all)."""

_REASONS = {
    ALL_BANNED: "every token is banned",
    NOTHING_LEFT: "no token can be sampled (non-finite logits, or top-k/top-p filtered out every token)",
}


class SamplingError(ValueError):
    """Rows of a batch that could not be sampled; `rows` maps each row index to the reason."""

    def __init__(self, rows: dict[int, str]):
        self.rows = dict(rows)
        detail = "; ".join(f"row {b}: {why}" for b, why in sorted(self.rows.items()))
        super().__init__(f"cannot sample {len(self.rows)} row(s) of the batch — {detail}")


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None], banned: Banned = None, *,
                 on_error: Literal["raise", "return"] = "raise") -> list:
    """Next token of every row of `logits` [B, V]: a list of B ints, with exactly one device→host
    transfer (none for B == 0).

    `params[b]` and `generators[b]` are row b's; a random row with a generator is reproducible and
    matches `sampling.sample` (see the module doc), one with None is drawn from the device's default
    generator. `banned` is None, a [B, V] bool mask, or per row a tensor of token ids (or None).
    Rows that cannot be sampled raise `SamplingError` naming them; with ``on_error="return"`` the
    list holds a `ValueError` in their place instead.
    """
    if on_error not in ("raise", "return"):
        raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
    if logits.dim() == 2 and logits.shape[0] == 0:
        _check(logits, params, generators, banned)
        return []
    ids = sample_batch_ids(logits, params, generators, banned).tolist()  # the one transfer
    bad = {b: _REASONS[t] for b, t in enumerate(ids) if t < 0}
    if not bad:
        return ids
    if on_error == "raise":
        raise SamplingError(bad)
    return [SamplingError({b: bad[b]}) if b in bad else t for b, t in enumerate(ids)]


def sample_batch_ids(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None], banned: Banned = None) -> torch.Tensor:
    """`sample_batch` without the transfer: the [B] int64 ids on the logits' device, a negative
    code (`ALL_BANNED`, `NOTHING_LEFT`) for a row that could not be sampled. Never synchronises
    with the device (no `.item()`, no data-dependent shapes)."""
    _check(logits, params, generators, banned)
    B, V = logits.shape
    dev = logits.device
    x = _ban(logits.detach().float(), banned)  # never written in place: it may alias `logits`
    ids = x.argmax(dim=-1)  # greedy for every row: the first maximal index (NaN counts as max)
    best = x.gather(1, ids.unsqueeze(1)).squeeze(1)

    # the random rows, in four blocks: with a generator and no top-p, with both (these two are
    # drawn exactly as `sample` does), without a generator with top-p, without either
    random = [b for b in range(B) if not params[b].greedy]
    key = lambda b: ((0 if params[b].top_p >= 1.0 else 1) if generators[b] is not None
                     else (2 if params[b].top_p < 1.0 else 3))
    order = sorted(random, key=key)  # stable: rows keep their order within a block
    if order:
        blocks = [sum(key(b) < k for b in order) for k in (1, 2, 3)]
        chosen = _sample_random(x, order, [params[b] for b in order],
                                [generators[b] for b in order[: blocks[1]]], blocks, dev)
        if order == list(range(B)):
            ids = chosen
        else:
            ids = ids.index_copy(0, _upload(order, torch.long, dev), chosen)
    # best is -inf when everything is banned, NaN when the row holds a NaN
    return torch.where(best > float("-inf"), ids,
                       torch.where(best == float("-inf"), ALL_BANNED, NOTHING_LEFT))


def _sample_random(x: torch.Tensor, order: list[int], params: list[SamplingParams],
                   generators: list[torch.Generator], blocks: list[int], dev: torch.device) -> torch.Tensor:
    """Samples the rows `order` of the banned logits `x`, laid out in blocks: [0, a) with a
    generator and no top-p, [a, s) with a generator and top-p, [s, c) without a generator with
    top-p, [c, R) without either (`blocks` = [a, s, c]). Their ids, NOTHING_LEFT where no token
    survives."""
    R, V = len(order), x.shape[1]
    a, s, c = blocks
    temps = _upload([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
    if order == list(range(x.shape[0])):
        scaled = x / temps
    else:
        scaled = x.index_select(0, _upload(order, torch.long, dev)).div_(temps)

    # min-p: tokens whose probability is below min_p times the row's top one, as `sample`'s
    if any(p.min_p > 0.0 for p in params):
        floor = _upload([math.log(p.min_p) if p.min_p > 0.0 else float("-inf") for p in params], torch.float32, dev)
        scaled.masked_fill_(scaled < scaled.max(dim=-1, keepdim=True).values + floor.unsqueeze(1), float("-inf"))

    # top-k: the k-th largest scaled logit of each row (ties at it kept), as `sample`'s
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        kth = torch.topk(scaled, max(ks), dim=-1).values.gather(
            1, _upload([max(k, 1) - 1 for k in ks], torch.long, dev).unsqueeze(1))
        if not all(ks):
            kth = kth.masked_fill(_upload([k == 0 for k in ks], torch.bool, dev).unsqueeze(1),
                                  float("-inf"))
        scaled.masked_fill_(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)

    # top-p (rows [a, c)): keep the smallest set whose mass reaches top_p, i.e. drop the tokens
    # whose preceding mass in the descending sort already reaches it; the kept ones are a prefix
    if c > a:
        sorted_probs, sort_order = torch.sort(probs[a:c], dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        tops = _upload([p.top_p for p in params[a:c]], torch.float32, dev).unsqueeze(1)
        drop = (cumulative - sorted_probs) >= tops
        if s > a:  # rows with a generator need the filtered vector itself, as `sample` builds it
            probs[a:s].zero_().scatter_(
                1, sort_order[: s - a], sorted_probs[: s - a].masked_fill_(drop[: s - a], 0.0))

    parts, oks = [], []
    if s:  # with a generator: argmax(p / q), q ~ Exp(1) from the row's generator = multinomial
        seeded = probs[:s]
        noise = torch.empty_like(seeded)
        on_host: list[int] = []
        host = None
        for r, gen in enumerate(generators):
            if r >= a:  # as `sample`: probs / probs.sum() over the 1-D row
                seeded[r].div_(seeded[r].sum())
            if _same_device(gen.device, dev):
                noise[r].exponential_(1.0, generator=gen)
            else:  # a CPU generator for device logits: drawn on the host, uploaded below
                if host is None:
                    host = torch.empty(s, V, dtype=torch.float32, pin_memory=dev.type == "cuda")
                host[len(on_host)].exponential_(1.0, generator=gen)
                on_host.append(r)
        if on_host:
            uploaded = host[: len(on_host)].to(dev, non_blocking=True)
            if on_host == list(range(len(on_host))):
                noise[: len(on_host)].copy_(uploaded)
            else:
                noise.index_copy_(0, _upload(on_host, torch.long, dev), uploaded)
        scores = seeded.div_(noise)
        chosen = scores.argmax(dim=-1, keepdim=True)
        parts.append(chosen)
        # a positive winner; NaN (NaN/inf logits) or 0 (everything dropped) is no token
        oks.append(scores.gather(1, chosen) > 0)
    if R > s:  # without a generator: inverse CDF, one uniform per row from the device's generator
        u = torch.rand(R - s, 1, device=dev)
        if c > s:  # in the sorted order, within the kept prefix
            cum = cumulative[s - a:]
            kept = (~drop[s - a:]).sum(dim=-1, keepdim=True)
            total = cum.gather(1, (kept - 1).clamp_min(0))
            pos = _inverse_cdf(cum, total, u[: c - s])
            parts.append(sort_order[s - a:].gather(1, pos))
            oks.append((total > 0) & (kept > 0))
        if R > c:
            cum = torch.cumsum(probs[c:], dim=-1)
            total = cum[:, -1:]
            parts.append(_inverse_cdf(cum, total, u[c - s:]))
            oks.append(total > 0)
    chosen, ok = (parts[0], oks[0]) if len(parts) == 1 else (torch.cat(parts), torch.cat(oks))
    return torch.where(ok, chosen, NOTHING_LEFT).squeeze(1)


def _inverse_cdf(cum: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first position whose cumulative mass exceeds u·total (never a zero-mass one)."""
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).clamp_max_(cum.shape[1] - 1)


def _ban(x: torch.Tensor, banned: Banned) -> torch.Tensor:
    if banned is None:
        return x
    if isinstance(banned, torch.Tensor):
        return x.masked_fill(_to(banned, x.device), float("-inf"))
    host_rows: list[torch.Tensor] = []
    host_cols: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    for b, ids in enumerate(banned):
        if ids is None or ids.numel() == 0:
            continue
        ids = ids.reshape(-1).long()
        here = ids.device == x.device
        (rows if here else host_rows).append(torch.full(ids.shape, b, dtype=torch.long, device=ids.device))
        (cols if here else host_cols).append(ids)
    if host_cols:  # (typically) host ids for device logits: one upload for all of them
        rows.append(_to(torch.cat(host_rows), x.device))
        cols.append(_to(torch.cat(host_cols), x.device))
    if not cols:
        return x
    r, c = (torch.cat(rows), torch.cat(cols)) if len(cols) > 1 else (rows[0], cols[0])
    # advanced indexing, as `logits[banned]` in `sample`: a negative id counts from the end
    return x.index_put((r, c), x.new_full((), float("-inf")))


def _check(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], banned: Banned) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows of logits but {len(params)} params and {len(generators)} generators")
    if B and V == 0:
        raise ValueError("logits have an empty vocabulary")
    if isinstance(banned, torch.Tensor):
        if banned.dtype != torch.bool or tuple(banned.shape) != (B, V):
            raise ValueError(f"a banned mask must be bool [{B}, {V}], got {banned.dtype} "
                             f"{tuple(banned.shape)}")
    elif banned is not None:
        if len(banned) != B:
            raise ValueError(f"{B} rows of logits but {len(banned)} banned entries")
        for b, ids in enumerate(banned):
            if ids is not None and (ids.dtype == torch.bool or ids.is_floating_point()):
                raise ValueError(f"row {b}: banned must hold token ids (an integer tensor), "
                                 f"got {ids.dtype}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    index = lambda d: d.index if d.index is not None else torch.accelerator.current_device_index()
    return index(a) == index(b)


def _to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor onto `dev` without blocking the host (pinned first on CUDA)."""
    if t.device == dev:
        return t
    if dev.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def _upload(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    return _to(torch.tensor(values, dtype=dtype), dev)

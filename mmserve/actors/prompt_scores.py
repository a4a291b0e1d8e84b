"""The prompt's own log-probabilities (`/v1/completions` with `echo` and `logprobs`, or vLLM's
`prompt_logprobs`): what lm-eval's log-likelihood tasks read.

A request that scores its prompt skips the prefix-cache lookup (a cached block has KV but no
logits), so every prompt token is computed. During each of its prefill chunks the step keeps the
logits rows of the chunk's tokens too (`engine.paged_forward.forward_paged(extra_rows=...)`): row j gives the
distribution of token j+1 given tokens 0..j. On the device: a log-softmax, the next token's
logprob and rank, the top-k; they come back in the step's one device→host transfer
(`sample_rows_and`). Scores are kept per position on the sequence, so a chunk computed again
after a preemption changes nothing; when the prefill ends they go to the caller in one event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.actors.messages import PromptLogprob
from mmserve.actors.sequence import Sequence


def scores_prompt(request) -> bool:
    raw = request.prompt
    return raw is not None and raw.logprobs is not None


@dataclass
class PromptRows:
    """The prompt rows a step scores: per sequence (seq, first position j0, end j1) — rows j in
    [j0, j1) predict tokens j+1 — and their flat indices in the step's tokens."""

    spans: list[tuple[Sequence, int, int]]
    rows: torch.Tensor
    targets: torch.Tensor
    k: int

    @classmethod
    def of(cls, chunks: list[tuple[Sequence, int, int, int]]) -> "PromptRows | None":
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


def scored_blocks(seq: Sequence, block_size: int) -> int | None:
    """How many of its first blocks a preempted sequence that scores its prompt may get back from
    the cache: those whose every row it has scored already (a block restored has KV, no logits —
    its positions would come back without a logprob). None: no limit (it scores nothing, or its
    whole prompt is scored, or they were sent already: its prefill ended once; a forked choice
    scores nothing)."""
    if not scores_prompt(seq.handle.request) or seq.echoed or seq.choice:
        return None
    last = seq.prompt_len - 1  # positions 1..last have a logprob
    scored = 0
    while scored < last and scored + 1 in seq.prompt_scores:
        scored += 1
    return None if scored >= last else scored // block_size


def prompt_logprobs(seq: Sequence, pieces) -> tuple[PromptLogprob, ...]:
    """The prompt's entries (the first without a logprob), token texts from `pieces` (TokenPieces)."""
    out = []
    for j, token in enumerate(seq.job.prompt.input_ids):
        text = pieces(token)[0]
        score = seq.prompt_scores.get(j)
        if j == 0 or score is None:
            out.append(PromptLogprob(token, text, None))
            continue
        lp, rank, top = score
        out.append(PromptLogprob(token, text, lp, rank, tuple((t, pieces(t)[0], v) for t, v in top)))
    return tuple(out)

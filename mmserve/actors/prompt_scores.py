"""The prompt's own log-probabilities (`/v1/completions` with `echo` and `logprobs`, or vLLM's
`prompt_logprobs`): what lm-eval's log-likelihood tasks read.

A request that scores its prompt skips the prefix-cache lookup (a cached block has KV but no
logits), so every prompt token is computed. During each of its prefill chunks the step keeps the
logits rows of the chunk's tokens too (`engine.paged_forward.forward_paged(extra_rows=...)`): row j gives the
distribution of token j+1 given tokens 0..j. On the device: a log-softmax, the next token's
logprob and rank, the top-k; they come back in the step's one device→host transfer
(`sample_rows_and`; `engine.step_inputs.PromptRows`). Scores are kept per position on the sequence, so a chunk computed again
after a preemption changes nothing; when the prefill ends they go to the caller in one event.
"""

from __future__ import annotations

from mmserve.actors.messages import PromptLogprob
from mmserve.actors.sequence import Sequence
from mmserve.engine.step_inputs import scores_prompt  # (the rows a step scores are built with the step)


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

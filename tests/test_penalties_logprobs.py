"""Penalties against a direct, loop-by-loop computation of their definitions; logprobs and grammar
masks of `sample_rows` against a direct log-softmax; seeds reproduce batched or alone."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmserve.engine.step_sampling import NO_PROBABILITY, RowSpec, sample_rows
from mmserve.generation.penalties import apply_penalties
from mmserve.generation.sampling import SamplingParams, make_generator

V = 12


def reference_penalties(row, prompt, answer, p: SamplingParams):
    """OpenAI's presence/frequency definitions and vLLM's repetition penalty, token by token."""
    out = list(row)
    for j in range(len(out)):
        if j in prompt or j in answer:
            out[j] = out[j] / p.repetition_penalty if out[j] > 0 else out[j] * p.repetition_penalty
        count = answer.count(j)
        out[j] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


ids = st.lists(st.integers(0, V - 1), max_size=10)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(ids, ids, st.floats(-2, 2), st.floats(-2, 2), st.floats(0.5, 2.0)),
                     min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_penalties_equal_their_definitions(rows, seed):
    logits = torch.randn(len(rows) + 1, V, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(presence_penalty=pr, frequency_penalty=fr, repetition_penalty=rep)
              for _, _, pr, fr, rep in rows]
    # the last row is not penalized and must come back untouched
    got = apply_penalties(logits, list(range(len(rows))), params, [r[0] for r in rows], [r[1] for r in rows])
    for b, (prompt, answer, *_rest) in enumerate(rows):
        want = reference_penalties(logits[b].tolist(), prompt, answer, params[b])
        assert got[b].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert torch.equal(got[-1], logits[-1])


def test_frequency_penalty_lowers_a_repeated_token_by_count():
    logits = torch.zeros(1, V)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, [0], [p], [()], [(3, 3, 3, 5)])[0]
    assert got[3].item() == pytest.approx(-1.75) and got[5].item() == pytest.approx(-0.75)
    assert got[0].item() == 0


def spec(row, **kw):
    return RowSpec(row, SamplingParams(**{"temperature": 0.0, **kw}), None)


def test_greedy_logprobs_top1_is_the_chosen_token_and_sum_to_one():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    out = sample_rows(logits, [spec(0, logprobs=True, top_logprobs=5), spec(1), spec(2, logprobs=True)])
    direct = torch.log_softmax(logits[0], -1)
    first = out[0]
    assert first.token_id == int(logits[0].argmax())
    assert first.top[0] == (first.token_id, pytest.approx(first.logprob))
    assert first.logprob == pytest.approx(direct[first.token_id].item(), abs=1e-6)
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    assert len(first.top) == 5
    assert math.fsum(math.exp(v) for v in direct.tolist()) == pytest.approx(1.0)
    assert out[1].logprob is None and out[1].top == ()
    assert out[2].top == () and out[2].logprob is not None


def test_logprobs_follow_temperature_and_penalties_not_top_k():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.5, top_k=2, presence_penalty=1.0, logprobs=True, top_logprobs=V)
    answer = (int(logits[0].argmax()),)
    out = sample_rows(logits, [RowSpec(0, params, make_generator(params), answer=answer)])[0]
    want = torch.log_softmax(apply_penalties(logits, [0], [params], [()], [answer])[0] / 0.5, -1)
    assert dict(out.top) == pytest.approx({j: want[j].item() for j in range(V)}, abs=1e-5)
    assert out.logprob == pytest.approx(want[out.token_id].item(), abs=1e-5)


def test_a_grammar_mask_restricts_the_row_and_banned_tokens_read_as_no_probability():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [4, 7]] = True
    specs = [RowSpec(0, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), None, grammar_row=0),
             RowSpec(1, SamplingParams(temperature=0.0), None)]
    out = sample_rows(logits, specs, allowed)
    assert out[0].token_id in (4, 7)
    assert out[0].top[2][1] == NO_PROBABILITY  # a third token is not allowed at all
    assert sum(math.exp(lp) for _, lp in out[0].top[:2]) == pytest.approx(1.0)
    assert out[1].token_id == int(logits[1].argmax())  # the unconstrained row is untouched


def test_a_seeded_row_draws_the_same_alone_or_in_a_batch_with_penalties():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, seed=7, frequency_penalty=0.5, repetition_penalty=1.3)
    alone = sample_rows(logits[2:3], [RowSpec(0, p, make_generator(p), prompt=(1, 2), answer=(3,))])
    others = [RowSpec(b, SamplingParams(temperature=0.8, seed=b), make_generator(SamplingParams(temperature=0.8, seed=b)))
              for b in (0, 1, 3)]
    batched = sample_rows(logits, others[:2] + [RowSpec(2, p, make_generator(p), prompt=(1, 2), answer=(3,))] + others[2:])
    assert batched[2].token_id == alone[0].token_id


def test_choices_of_one_seed_differ_but_each_reproduces():
    g = [make_generator(SamplingParams(seed=5), c) for c in range(4)]
    draws = [torch.rand(4, generator=x).tolist() for x in g]
    assert len({tuple(d) for d in draws}) == 4
    assert torch.rand(4, generator=make_generator(SamplingParams(seed=5), 2)).tolist() == draws[2]

"""The token-budget scheduler: decode first, then prefill chunks oldest first, to the budget."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from mmserve.generation.scheduler import blocks_for, newest, plan_step


@dataclass(eq=False)
class S:
    order: int
    kv_len: int
    target: int
    table: int

    @property
    def target_len(self) -> int:
        return self.target

    @property
    def table_len(self) -> int:
        return self.table


def test_decode_tokens_come_first_then_prefill_oldest_first():
    d1, d2 = S(1, 40, 41, 3), S(0, 20, 21, 2)
    p_old, p_new = S(2, 0, 100, 0), S(3, 0, 50, 0)
    plan = plan_step([d1, d2], [p_new, p_old], block_size=16, max_batched_tokens=64, max_running=8)
    assert [(p.seq, p.tokens, p.decode) for p in plan] == [(d2, 1, True), (d1, 1, True), (p_old, 62, False)]
    assert plan[0].new_blocks == 0 and plan[1].new_blocks == 0  # 21 and 41 tokens fit their tables
    assert plan[2].new_blocks == blocks_for(62, 16) == 4


def test_a_long_prompt_never_starves_decoding():
    decoding = [S(i, 10, 11, 1) for i in range(8)]
    plan = plan_step(decoding, [S(99, 0, 100_000, 0)], block_size=16, max_batched_tokens=32, max_running=64)
    assert sum(p.decode for p in plan) == 8 and plan[-1].tokens == 32 - 8


def test_admission_stops_at_max_running_but_admitted_prefills_go_on():
    running = [S(i, 5, 6, 1) for i in range(2)]
    admitted, fresh = S(2, 16, 64, 1), S(3, 0, 10, 0)
    plan = plan_step(running, [admitted, fresh], block_size=16, max_batched_tokens=1000, max_running=3)
    assert [p.seq for p in plan] == [*running, admitted]


def test_newest_is_preempted():
    seqs = [S(5, 1, 2, 1), S(9, 1, 2, 1), S(7, 1, 2, 1)]
    assert newest(seqs).order == 9 and newest([]) is None


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 300)), max_size=12),
       st.integers(1, 512), st.integers(1, 32), st.integers(1, 16))
def test_plans_respect_the_budget_and_never_overrun_a_target(specs, budget, block, max_running):
    prefilling = [S(i, min(kv, kv + tgt), kv + tgt, blocks_for(kv, block)) for i, (kv, tgt) in enumerate(specs)]
    plan = plan_step([], prefilling, block, budget, max_running)
    assert sum(p.tokens for p in plan) <= budget
    for p in plan:
        assert 0 < p.tokens <= p.seq.target_len - p.seq.kv_len
        assert p.seq.table_len + p.new_blocks >= blocks_for(p.seq.kv_len + p.tokens, block)
    orders = [p.seq.order for p in plan]
    assert orders == sorted(orders)

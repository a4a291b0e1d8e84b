"""The token-budget scheduler: decode first, then prefill chunks oldest first, to the budget; at
most `max_running` requests admitted, admitted strictly oldest first (a cache hit included), the
choices of one request counted once."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.actors.sequence import Sequence
from mmserve.generation.scheduler import Ranking, blocks_for, displaced, newest, plan_step


@dataclass(eq=False)
class S:
    order: int
    kv_len: int
    target: int
    table: int
    admitted: bool = False
    request: str | None = None  # its request (the choices of one share it); by default its own
    decoding: bool = False  # (the simulation below)
    n: int = 1  # choices still to fork when its prefill ends (the simulation below)

    @property
    def request_id(self) -> str:
        return self.request or f"r{self.order}"

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
    admitted, fresh = S(2, 16, 64, 1, admitted=True), S(3, 0, 10, 0)
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


# -- admission ---------------------------------------------------------------------------------------


def planned(plan) -> list:
    return [p.seq for p in plan]


def test_cache_hits_are_gated_like_any_request():
    """Eight requests arriving with their looked-up blocks (hits): one runs at max_running 1."""
    hits = [S(i, 32, 40, 2) for i in range(8)]
    assert planned(plan_step([], hits, 16, 1000, max_running=1)) == [hits[0]]
    assert planned(plan_step([], hits, 16, 1000, max_running=3)) == hits[:3]


def test_a_cache_hit_never_overtakes_an_older_miss():
    """The old miss holds no block, the younger hit does: the miss is admitted first; with no room
    for both, the hit waits (head of line), even though its blocks are pinned already."""
    running = S(0, 20, 21, 2, admitted=True, decoding=True)
    miss, hit = S(1, 0, 30, 0), S(2, 28, 30, 2)
    assert planned(plan_step([running], [hit, miss], 16, 1000, max_running=2)) == [running, miss]
    assert planned(plan_step([], [hit, miss], 16, 1000, max_running=1)) == [miss]
    assert planned(plan_step([running], [hit, miss], 16, 1000, max_running=3)) == [running, miss, hit]


def test_head_of_line_the_oldest_waiting_blocks_the_younger_ones():
    """Room for one more request; the oldest waiting does not fit the token budget this step: it is
    admitted with the budget it gets, and nobody younger is."""
    running = S(0, 20, 21, 2, admitted=True, decoding=True)
    old, young = S(1, 0, 500, 0), S(2, 0, 5, 0)
    plan = plan_step([running], [young, old], 16, 64, max_running=2)
    assert planned(plan) == [running, old] and plan[1].tokens == 63


def test_a_preempted_sequence_keeps_its_admission_and_is_prefilled_first():
    """Preemption gave its blocks back (no table, no KV): it still counts as running, goes before
    any waiting sequence, and keeps a younger hit out while the running set is full."""
    preempted = S(5, 0, 40, 0, admitted=True)
    hit = S(7, 32, 40, 2)
    assert planned(plan_step([], [hit, preempted], 16, 1000, max_running=1)) == [preempted]
    other = S(3, 10, 11, 1, admitted=True, decoding=True)
    plan = plan_step([other], [hit, preempted], 16, 30, max_running=3)
    assert planned(plan) == [other, preempted] and plan[1].tokens == 29  # the budget goes to it first


def test_the_choices_of_one_request_count_once():
    """A request of n=3 at max_running 1: its three choices run (two decoding, one still
    prefilling its own block), another request waits."""
    parent = S(0, 20, 21, 2, admitted=True, request="r", decoding=True)
    child = S(4, 20, 21, 2, admitted=True, request="r", decoding=True)
    prefilling_child = S(5, 16, 20, 1, request="r")  # admitted through its request
    other = S(1, 0, 30, 0)
    plan = plan_step([child, parent], [other, prefilling_child], 16, 1000, max_running=1)
    assert planned(plan) == [parent, child, prefilling_child]


def test_a_forked_choice_is_born_admitted():
    """It exists only once its parent's prefill ran in a step: it belongs to a running request."""
    parent = Sequence(job=None, assembler=None, rng=None, order=0, chain=None)
    child = Sequence(job=None, assembler=None, rng=None, order=1, chain=None, choice=1)
    assert not parent.admitted and child.admitted


def reference_admissions(live: list[S], max_running: int) -> list[S]:
    """Who is admitted this step when the token budget is no limit: the waiting sequences oldest
    first, as long as their requests fit beside the running ones."""
    running = {s.request_id for s in live if s.admitted}
    admitted = []
    for s in sorted((s for s in live if not s.admitted and s.request_id not in running), key=lambda s: s.order):
        if s.request_id not in running and len(running) >= max_running:
            break
        running.add(s.request_id)
        admitted.append(s)
    return admitted


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 96), st.booleans())
def test_admission_is_bounded_oldest_first_and_counts_choices_once(data, max_running, budget, ample):
    """A simulation of the generator's life: requests arrive (misses and hits, n choices each),
    steps are planned and applied (a finished prefill forks the other choices, born admitted),
    the newest holder is preempted, sequences end. After every step: never more than
    `max_running` requests admitted; no sequence admitted while an older one waits; the choices
    of a request count once; with an ample budget, exactly the reference's admissions."""
    block = 4
    orders = itertools.count()
    live: list[S] = []
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(["arrive", "arrive", "step", "step", "step", "preempt", "end"]), label="op")
        if op == "arrive":
            prompt = data.draw(st.integers(2, 40), label="prompt")
            hit = data.draw(st.integers(0, prompt - 1), label="hit tokens")  # a lookup leaves one to compute
            live.append(S(next(orders), hit, prompt, blocks_for(hit, block), n=data.draw(st.integers(1, 3), label="n")))
        elif op == "preempt":
            victim = newest([s for s in live if s.table])
            if victim is not None:  # keeps its admission (the generator does not touch it)
                victim.table, victim.kv_len, victim.decoding = 0, 0, False
        elif op == "end" and live:
            live.remove(data.draw(st.sampled_from(live), label="ends"))  # finished, failed or aborted
        elif op == "step":
            step_budget = 10_000 if ample else budget
            decoding, prefilling = [s for s in live if s.decoding], [s for s in live if not s.decoding]
            was = {id(s) for s in live if s.admitted}
            expected = reference_admissions(live, max_running)
            plan = plan_step(decoding, prefilling, block, step_budget, max_running)
            for p in plan:
                p.seq.admitted = True
            new = [s for s in live if s.admitted and id(s) not in was]
            assert len({s.request_id for s in live if s.admitted}) <= max_running
            for s in new:
                assert all(o.admitted for o in live if o.order < s.order), "admitted while an older one waits"
            assert [p.decode for p in plan] == sorted((p.decode for p in plan), reverse=True)
            decodes = sum(p.decode for p in plan)  # every decoding sequence's token, whatever the budget
            assert decodes == len(decoding) and sum(p.tokens for p in plan) - decodes <= max(0, step_budget - decodes)
            if ample:
                assert new == expected
                assert {id(p.seq) for p in plan} == {id(s) for s in live if s.admitted}  # choices, preempted: all run
            elif live and not was and step_budget > 0:
                assert new and new[0] is min(live, key=lambda s: s.order)  # the oldest always gets in
            for p in plan:
                apply(p, live, orders, block)


def apply(p, live: list[S], orders, block: int) -> None:
    """What the generator does with a planned chunk: its KV is computed; a prefill that reaches
    its target samples a token (and forks the other choices, born admitted), a decode too."""
    s = p.seq
    assert 0 < p.tokens <= s.target - s.kv_len
    s.kv_len += p.tokens
    s.table = max(s.table, blocks_for(s.kv_len, block))
    if s.kv_len == s.target:
        for _ in range(s.n - 1):
            live.append(S(next(orders), s.kv_len, s.kv_len + 1, s.table, admitted=True, request=s.request_id,
                          decoding=True))
        s.n, s.decoding, s.target = 1, True, s.target + 1


def test_decode_rows_and_prefills_share_the_budget():
    """Admission keeps the admitted requests' rows (n per request) within the budget, so decode rows
    never fill a step: an admitted sequence prefilling again (preempted) always gets a chunk, and a
    new request waits (oldest first) instead of taking the room."""
    decoding = [S(i, 10, 11, 1) for i in range(6)]
    preempted = S(1, 0, 11, 0, admitted=True, request="r-old")
    fresh = S(9, 0, 20, 0)
    plan = plan_step(decoding, [fresh, preempted], block_size=16, max_batched_tokens=8, max_running=64)
    assert [p.seq for p in plan] == [*decoding, preempted] and plan[-1].tokens == 2
    # with room for its rows (and tokens left), the fresh request is admitted after it
    plan = plan_step(decoding[:4], [fresh, preempted], block_size=16, max_batched_tokens=16, max_running=64)
    assert [p.seq for p in plan][-2:] == [preempted, fresh]
    # a request of 3 choices takes 3 rows: 7 + 3 > 8, it waits
    wide = S(10, 0, 20, 0)
    wide.rows = 3
    plan = plan_step(decoding, [wide], block_size=16, max_batched_tokens=8, max_running=64)
    assert wide not in [p.seq for p in plan]
    # the first request is always admitted (the generator refuses one whose n exceeds the budget)
    assert [p.seq for p in plan_step([], [wide], block_size=16, max_batched_tokens=2, max_running=64)] == [wide]


# -- priorities (issue 41 item 4) --------------------------------------------------------------------


@dataclass(eq=False)
class P(S):
    """A sequence with a priority (lower first) and an arrival time (aging)."""
    priority: int = 0
    arrived: float = 0.0


def test_a_later_request_of_a_better_priority_is_admitted_first():
    early_low, later_high = P(0, 0, 30, 0, priority=3), P(1, 0, 30, 0, priority=-1)
    later_low = P(2, 0, 30, 0, priority=3)
    ranking = Ranking(now=0.0, aging_s=10.0)
    plan = plan_step([], [early_low, later_low, later_high], 16, 1000, max_running=1, ranking=ranking)
    assert planned(plan) == [later_high]
    # equal priorities keep arrival order (head of line included)
    plan = plan_step([], [later_low, early_low], 16, 1000, max_running=1, ranking=ranking)
    assert planned(plan) == [early_low]


def test_decode_tokens_and_prefill_chunks_go_by_rank():
    d_low, d_high = P(0, 10, 11, 1, admitted=True, priority=2), P(1, 10, 11, 1, admitted=True, priority=0)
    p_low, p_high = P(2, 0, 40, 0, admitted=True, priority=2), P(3, 0, 40, 0, admitted=True, priority=0)
    plan = plan_step([d_low, d_high], [p_low, p_high], 16, 30, max_running=8, ranking=Ranking(0.0, 10.0))
    assert [(p.seq, p.tokens) for p in plan] == [(d_high, 1), (d_low, 1), (p_high, 28)]


def test_aging_improves_a_waiting_priority_by_a_level_per_period():
    old_low, new_high = P(0, 0, 30, 0, priority=2, arrived=0.0), P(1, 0, 30, 0, priority=0, arrived=1.0)
    assert Ranking(now=1.5, aging_s=1.0).priority(old_low) == 1
    # at 2.5 s it is at 0, the newer one (arrived at 1 s) at -1: the newer one still goes first
    assert Ranking(now=2.5, aging_s=1.0).key(old_low) > Ranking(now=2.5, aging_s=1.0).key(new_high)
    # a request of priority q arriving (p - q + 1) × aging_s or more after it never ranks ahead of
    # it, whatever order the two reached the generator in
    later = P(-1, 0, 30, 0, priority=0, arrived=3.0)
    for now in (3.0, 3.3, 3.99, 4.0, 7.7):
        r = Ranking(now=now, aging_s=1.0)
        assert r.key(old_low) < r.key(later)
        assert planned(plan_step([], [later, old_low], 16, 1000, max_running=1, ranking=r)) == [old_low]


def test_a_better_priority_displaces_the_lowest_newest_first_never_an_equal_one():
    r = Ranking(0.0, 10.0)
    a = P(0, 10, 11, 1, admitted=True, priority=3)
    b = P(1, 10, 11, 1, admitted=True, priority=5)
    c = P(2, 10, 11, 1, admitted=True, priority=5)
    high = P(3, 0, 30, 0, priority=1)
    assert displaced([a, b, c], [high], 1000, max_running=3, ranking=r) == ["r2"]  # lowest, newest among equals
    assert displaced([a, b, c], [high], 1000, max_running=4, ranking=r) == []  # room for it: nobody
    # room only once two are gone: the two of priority 5
    assert displaced([a, b, c], [high], 1000, max_running=2, ranking=r) == ["r2", "r1"]
    # the same priority as the lowest running one: nobody is displaced, it waits
    assert displaced([a, b, c], [P(4, 0, 30, 0, priority=5)], 1000, max_running=3, ranking=r) == []
    # making room would take displacing one of a priority not worse than its own: nobody
    assert displaced([a, b, c], [P(4, 0, 30, 0, priority=4)], 1000, max_running=1, ranking=r) == []
    # decode rows count too: a wide request needs its rows freed
    wide = P(5, 0, 30, 0, priority=0)
    wide.rows = 3
    assert displaced([a, b, c], [wide], 5, max_running=8, ranking=r) == ["r2"]
    # the choices of one request go together, and count once
    parent = P(6, 10, 11, 1, admitted=True, request="q", priority=7)
    child = P(7, 10, 11, 1, admitted=True, request="q", priority=7)
    assert displaced([a, parent, child], [high], 1000, max_running=2, ranking=r) == ["q"]


def test_a_preempted_sequence_is_the_lowest_priority_newest_among_equals():
    seqs = [P(5, 1, 2, 1, priority=0), P(9, 1, 2, 1, priority=0), P(7, 1, 2, 1, priority=4), P(3, 1, 2, 1, priority=4)]
    assert newest(seqs, Ranking(0.0, 10.0)) is seqs[2]


def reference_rank_admissions(live: list[P], max_running: int, ranking: Ranking) -> list[P]:
    """Who is admitted this step with an ample token budget: the waiting sequences by rank, as long
    as their requests fit beside the running ones (head of line)."""
    running = {s.request_id for s in live if s.admitted}
    waiting = [s for s in live if not s.admitted and s.request_id not in running]
    first = {r: min(ranking.key(s) for s in waiting if s.request_id == r) for r in {s.request_id for s in waiting}}
    admitted = []
    for s in sorted(waiting, key=lambda s: (first[s.request_id], ranking.key(s))):  # a request's choices together
        if s.request_id not in running and len(running) >= max_running:
            break
        running.add(s.request_id)
        admitted.append(s)
    return admitted


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(4, 96), st.booleans(), st.sampled_from([0.5, 2.0, 1e9]))
def test_priority_admission_against_a_reference(data, max_running, budget, ample, aging_s):
    """A simulated generator life with priorities and aging: requests arrive (priorities -2..2, n
    choices), steps displace then plan, the worst ranked holder is preempted, sequences end, the
    clock moves. After every step: at most `max_running` requests admitted; none admitted while a
    better-ranked one waits; a displaced request has a strictly worse effective priority than the
    request it makes room for, which is then admitted (ample budget); with an ample budget the
    admissions are exactly the reference's."""
    block = 4
    orders = itertools.count()
    clock = [0.0]
    live: list[P] = []
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(["arrive", "arrive", "step", "step", "step", "preempt", "end", "wait"]),
                       label="op")
        ranking = Ranking(clock[0], aging_s)
        if op == "arrive":
            prompt = data.draw(st.integers(2, 40), label="prompt")
            hit = data.draw(st.integers(0, prompt - 1), label="hit tokens")
            live.append(P(next(orders), hit, prompt, blocks_for(hit, block), n=data.draw(st.integers(1, 3), label="n"),
                          priority=data.draw(st.integers(-2, 2), label="priority"), arrived=clock[0]))
        elif op == "wait":
            clock[0] += data.draw(st.floats(0, 3), label="seconds")
        elif op == "preempt":
            victim = newest([s for s in live if s.table], ranking)
            if victim is not None:
                victim.table, victim.kv_len, victim.decoding = 0, 0, False
        elif op == "end" and live:
            live.remove(data.draw(st.sampled_from(live), label="ends"))
        elif op == "step":
            step_budget = 10_000 if ample else budget
            decoding, prefilling = [s for s in live if s.decoding], [s for s in live if not s.decoding]
            out = displaced(decoding, prefilling, step_budget, max_running, ranking)
            if out:
                waiting = [s for s in live if not s.admitted and not any(
                    o.admitted and o.request_id == s.request_id for o in live)]
                head = min(waiting, key=ranking.key)
                assert all(ranking.priority(s) > ranking.priority(head) for s in live if s.request_id in out)
                for s in live:
                    if s.request_id in out:  # the generator's `_displace`: blocks back, admission lost
                        s.table, s.kv_len, s.decoding, s.admitted = 0, 0, False, False
                decoding, prefilling = [s for s in live if s.decoding], [s for s in live if not s.decoding]
            was = {id(s) for s in live if s.admitted}
            expected = reference_rank_admissions(live, max_running, ranking)
            plan = plan_step(decoding, prefilling, block, step_budget, max_running, ranking)
            for p in plan:
                p.seq.admitted = True
            new = [s for s in live if s.admitted and id(s) not in was]
            assert len({s.request_id for s in live if s.admitted}) <= max_running
            # by request (its choices go together, at its best rank): none newly running while a
            # better-ranked request still waits
            running_before = {s.request_id for s in live if id(s) in was}
            rank_of = {}
            for s in live:
                if s.request_id not in running_before:
                    rank_of[s.request_id] = min(rank_of.get(s.request_id, ranking.key(s)), ranking.key(s))
            running_now = {s.request_id for s in live if s.admitted}
            for r in running_now - running_before:
                assert all(o in running_now for o in rank_of if rank_of[o] < rank_of[r]), \
                    "admitted while a better-ranked one waits"
            if ample:
                assert {id(s) for s in new} == {id(s) for s in expected}
                if out:
                    assert head in new, "displaced others, yet not admitted"
            for p in plan:
                apply(p, live, orders, block)
                for c in live:
                    if not isinstance(c, P):  # a forked choice shares its request's priority and arrival
                        live[live.index(c)] = P(c.order, c.kv_len, c.target, c.table, c.admitted, c.request,
                                                c.decoding, c.n, priority=p.seq.priority, arrived=p.seq.arrived)

"""The oracle for Qwen2.5-VL: greedy output with the caches on equals greedy output with them off,
token for token, over hypothesis-generated multi-turn, multi-image workloads on three models of
three families loaded at once — the tiny Qwen2.5-VL (window attention, M-RoPE, 4..64 tokens an
image), the tiny Qwen2-VL (the very same processor settings and hidden size: only the model
signature keeps their encoder outputs apart) and the trained `demo` LLaVA — in a tiny arena and
a 3-entry encoder cache (evictions, preemptions), interleaved turn by turn, concurrently, with
n choices, disconnects, and hits that end inside an image.

The judging rule (PITFALLS.md's float-tie rule) and the workloads are tests/family_oracle.py's.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.config import ModelConfig
from mmserve.models.demo import Q_FIRST, Q_SHAPE, build_untrained
from tests.family_oracle import FamilyOracle, Turn, loaded, oracle_images

SIZES = [(96, 96), (112, 48), (40, 96), (128, 128), (72, 56), (32, 32), (200, 150)]
IMAGES = oracle_images(SIZES, seed=700)
RANDOM = ("q25", "q2")  # random weights: judged token by token with the tie rule
MODELS = ["q25", "q25", "q2", "demo"]  # Qwen2.5-VL drawn most often
ORACLE = FamilyOracle(IMAGES, RANDOM, MODELS)
ask, mismatch, user_message = ORACLE.ask, ORACLE.mismatch, ORACLE.user_message


@pytest.fixture(scope="module")
def runtimes(demo_config, tiny_qwen25_dir, tmp_path_factory):
    q2 = build_untrained("tiny-qwen", tmp_path_factory.mktemp("q2") / "tiny-qwen", seed=0, random_weights=True)
    # 20 blocks of 8 tokens for demo, 80 for the tiny Qwens (smaller KV): one 3-image Qwen turn
    # takes up to 30, so concurrent conversations preempt each other and evict what is cached
    with ORACLE.runtimes(demo_config, [ModelConfig("q25", str(tiny_qwen25_dir)), ModelConfig("q2", str(q2))],
                         kv_cache={"block_size": 8, "budget_bytes": 20 * 16384},
                         encoder_cache={"max_entries": 3}) as rts:
        yield rts


# 12 examples, not 25 (the suite's 10-minute budget): the concurrent test beside it and the strict
# oracle of deterministic mode (tests/test_deterministic_oracle.py) cover this family too
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ORACLE.conversations(), min_size=2, max_size=5))
def test_cache_on_equals_cache_off(runtimes, workload):
    ORACLE.interleaved(runtimes, workload)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ORACLE.conversations(), min_size=2, max_size=6))
def test_cache_on_equals_cache_off_concurrently(runtimes, workload):
    ORACLE.concurrently(runtimes, workload)


# 6 examples: the deterministic strict oracle (n = 2, every family) covers choices too
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ORACLE.asks(), min_size=2, max_size=8))
def test_greedy_choices_equal_the_single_cache_off_answer_concurrently(runtimes, workload):
    ORACLE.greedy_choices(runtimes, workload)


def test_a_hit_ending_inside_an_image_is_exact(runtimes):
    """[X, Y] then [X, Z]: the second prompt hits the blocks before the one where Y and Z part, and
    that boundary lies inside X's placeholders, so the generator gets X's remaining rows."""
    on, off = runtimes
    adapter = loaded(on, "q25").adapter
    x, y, z = 0, 1, 2  # 36, 18 and 15 tokens
    first = [user_message(Turn((x, y), Q_FIRST, None))]
    second = [user_message(Turn((x, z), Q_FIRST, None))]
    chat = [{"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text", "text": Q_FIRST}]}]
    prompt = adapter.tokenize(chat, [IMAGES[x], IMAGES[z]])
    span = prompt.spans[0]
    boundary = (prompt.spans[1].start // 8) * 8  # the block holding Z's first placeholder starts here
    assert span.start < boundary < span.start + span.length
    trio.from_thread.run(on.runtime.reset_caches, "q25", trio_token=on._token)
    ask(on, "q25", first, 4)
    got = ask(on, "q25", second, 8)
    assert got.usage.cached_tokens == boundary
    assert mismatch("q25", got.choices[0], ask(off, "q25", second, 8).choices[0], "inside an image") is None


def test_a_qwen2_vl_and_a_qwen2_5_vl_with_one_processor_never_share_an_encoder_output(runtimes):
    """Both tiny Qwens resize, patch and merge alike and have one hidden size: an encoder output of
    one would fit the other's placeholders without an error. The model signature parts the keys."""
    on, off = runtimes
    adapters = [loaded(on, m).adapter for m in ("q25", "q2")]
    assert adapters[0].processor_digest == adapters[1].processor_digest
    img = IMAGES[3]
    assert adapters[0].image_key(img) != adapters[1].image_key(img)
    for m in ("q25", "q2"):
        trio.from_thread.run(on.runtime.reset_caches, m, trio_token=on._token)
    before = {m: on.stats()[m]["encoder"]["items_encoded"] for m in ("q25", "q2")}
    for i, model in enumerate(("q25", "q2", "q25", "q2")):
        messages = [*([{"role": "system", "content": "Answer briefly."}] if i >= 2 else []),
                    user_message(Turn((3,), Q_SHAPE, None))]  # turns 3 and 4: new prefixes, encoder hits
        problem = mismatch(model, ask(on, model, messages, 6).choices[0], ask(off, model, messages, 6).choices[0], i)
        assert problem is None, (model, problem)
    assert {m: on.stats()[m]["encoder"]["items_encoded"] - before[m] for m in ("q25", "q2")} == {"q25": 1, "q2": 1}


def test_concurrent_requests_in_a_tiny_arena_preempt_and_stay_exact(runtimes):
    ORACLE.in_a_tiny_arena(runtimes, "q25")


def test_the_workloads_reached_what_they_test(runtimes):
    """Run last: the workloads above reached what they test."""
    ORACLE.reached_what_it_tests(runtimes, "q25")

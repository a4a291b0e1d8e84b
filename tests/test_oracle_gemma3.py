"""The oracle for Gemma 3 (issue 31): greedy output with the caches on equals greedy output with
them off, token for token, over hypothesis-generated multi-turn, multi-image workloads of the tiny
Gemma 3 (16 bidirectional tokens an image, a 32-token window that the conversations outgrow,
sliding and global layers) beside the trained `demo` LLaVA — in a tiny arena and a 3-entry
encoder cache (evictions, preemptions), with a 24-token step budget (so prefill chunks end next to
images, and an image is a chunk of its own), interleaved turn by turn, concurrently, with n
choices, disconnects, and prefix hits that end inside an image.

The judging rule (PITFALLS.md's float-tie rule) and the workloads are tests/family_oracle.py's.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.config import ModelConfig
from mmserve.models.demo import Q_FIRST, build_untrained
from tests.family_oracle import FamilyOracle, Turn, loaded, oracle_images

IMAGES = oracle_images([None] * 6, seed=900)  # 64x64
RANDOM = ("g3",)
MODELS = ["g3", "g3", "demo"]
ORACLE = FamilyOracle(IMAGES, RANDOM, MODELS)
ask, mismatch, user_message = ORACLE.ask, ORACLE.mismatch, ORACLE.user_message
BLOCK = 16


@pytest.fixture(scope="module")
def runtimes(demo_config, tmp_path_factory):
    g3 = build_untrained("tiny-gemma3", tmp_path_factory.mktemp("g3") / "tiny-gemma3", seed=0, random_weights=True)
    # 12 blocks of 16 tokens for demo, 32 for the tiny Gemma 3 (768 bytes a token): a 3-image
    # Gemma turn takes ~7, so concurrent conversations preempt each other and evict what is cached
    with ORACLE.runtimes(demo_config, [ModelConfig("g3", str(g3))],
                         kv_cache={"block_size": BLOCK, "budget_bytes": 24 * 16384},
                         encoder_cache={"max_entries": 3}, generator={"max_batched_tokens": 24}) as rts:
        yield rts


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ORACLE.conversations(), min_size=2, max_size=4))
def test_cache_on_equals_cache_off(runtimes, workload):
    ORACLE.interleaved(runtimes, workload)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ORACLE.conversations(), min_size=2, max_size=5))
def test_cache_on_equals_cache_off_concurrently(runtimes, workload):
    ORACLE.concurrently(runtimes, workload)


# 6 examples: the deterministic strict oracle (n = 2, every family) covers choices too
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ORACLE.asks(), min_size=2, max_size=6))
def test_greedy_choices_equal_the_single_cache_off_answer_concurrently(runtimes, workload):
    ORACLE.greedy_choices(runtimes, workload)


def test_a_hit_ending_inside_an_image_is_exact(runtimes):
    """[X, Y] then [X, Z]: the second prompt hits the blocks before the one where Y and Z part, and
    that boundary lies inside X's soft tokens: the rest of X is prefilled in a step of its own
    that starts inside it (its cached part was computed with the whole of X present)."""
    on, off = runtimes
    adapter = loaded(on, "g3").adapter
    x, y, z = 0, 1, 2
    first = [user_message(Turn((x, y), Q_FIRST, None))]
    second = [user_message(Turn((x, z), Q_FIRST, None))]
    chat = [{"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text", "text": Q_FIRST}]}]
    prompt = adapter.tokenize(chat, [IMAGES[x], IMAGES[z]])
    lo, hi = prompt.bidirectional[0]
    boundary = (prompt.bidirectional[1][0] // BLOCK) * BLOCK  # the block holding Z's first token
    assert lo < boundary < hi
    trio.from_thread.run(on.runtime.reset_caches, "g3", trio_token=on._token)
    ask(on, "g3", first, 4)
    got = ask(on, "g3", second, 8)
    assert got.usage.cached_tokens == boundary
    assert mismatch("g3", got.choices[0], ask(off, "g3", second, 8).choices[0], "inside an image") is None


def test_a_conversation_outgrows_the_window_exactly(runtimes):
    """Five turns, an image each: the prompt is several windows long and each turn hits the
    previous one's blocks."""
    on, off = runtimes
    history = []
    for t in range(5):
        history.append(user_message(Turn((t % len(IMAGES),), Q_FIRST, None)))
        want = ask(off, "g3", history, 6).choices[0]
        got = ask(on, "g3", history, 6)
        assert mismatch("g3", got.choices[0], want, f"turn {t}") is None
        if t:
            assert got.usage.cached_tokens >= 32  # the previous turns, at least their first window
        history.append({"role": "assistant", "content": want.text})
    assert got.usage.prompt_tokens > 4 * 32


def test_concurrent_requests_in_a_tiny_arena_preempt_and_stay_exact(runtimes):
    ORACLE.in_a_tiny_arena(runtimes, "g3")


def test_the_workloads_reached_what_they_test(runtimes):
    """Run last: the workloads above reached what they test."""
    ORACLE.reached_what_it_tests(runtimes, "g3")

"""The oracle for Idefics3 / SmolVLM: greedy output with the caches on equals greedy output with
them off, token for token, over hypothesis-generated multi-turn, multi-image workloads on two
models of two families loaded at once — the tiny Idefics3 (tiles, row/column markers, newlines
and a global view: 75..185 tokens an image, its placeholders interleaved with text) and the
trained `demo` LLaVA (one `<image>` token id: only the model signature keeps their keys apart) —
in a tiny arena and a 3-entry encoder cache (evictions, preemptions), interleaved turn by turn,
concurrently, with n choices, disconnects, and prefix hits that end inside an image: inside a
tile's run of `<image>` tokens, and at each kind of marker between them (a
`<fake_token_around_image>`, a `<row_i_col_j>`, a row's newline, the `<global-img>`); and two
replicas on one real redis-server, each restoring the KV blocks and encoder outputs (an image's
rows over its whole expansion) the other wrote.

The random-weight model's answers are judged by PITFALLS.md's tie rule (tests/family_oracle.py);
the trained LLaVA's must be equal text.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve import SyncRuntime
from mmserve.config import ModelConfig
from mmserve.models.demo import Q_FIRST, Q_SHAPE, build_untrained
from tests.family_oracle import FamilyOracle, Turn, loaded, oracle_images
from tests.helpers import run_concurrently
from tests.redis_server import RedisServer

# (width, height): tile grids and tokens under tiny-idefics3 (96 px longest edge, 32 px tiles, 16
# tokens a view): 64x64 3x3: 185, 50x30 2x3: 130, 100x20 1x3: 75, 30x50 3x2: 131, 20x100 3x1:
# 77, 72x56 3x3, 90x60 2x3
SIZES = [(64, 64), (50, 30), (100, 20), (30, 50), (20, 100), (72, 56), (90, 60)]
IMAGES = oracle_images(SIZES, seed=900)
RANDOM = ("smol",)  # random weights: judged token by token with the tie rule
MODELS = ["smol", "smol", "smol", "demo"]  # Idefics3 drawn most often
ORACLE = FamilyOracle(IMAGES, RANDOM, MODELS)
ask, mismatch, user_message = ORACLE.ask, ORACLE.mismatch, ORACLE.user_message
WIDE_BLOCK = 64  # the block size of the runtime whose hits end at each kind of marker


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    return build_untrained("tiny-idefics3", tmp_path_factory.mktemp("smol") / "tiny-idefics3", seed=0,
                           random_weights=True)


@pytest.fixture(scope="module")
def runtimes(demo_config, smol_dir):
    # 40 blocks of 8 tokens for demo, 160 for the tiny Idefics3 (smaller KV): one 3-image turn
    # takes up to ~70, a whole conversation up to ~125, so concurrent conversations preempt each
    # other and evict what is cached
    with ORACLE.runtimes(demo_config, [ModelConfig("smol", str(smol_dir))],
                         kv_cache={"block_size": 8, "budget_bytes": 40 * 16384},
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


def _chat(system: str | None, images: tuple[int, ...], question: str) -> list[dict]:
    return [*([{"role": "system", "content": system}] if system else []), user_message(Turn(images, question, None))]


def _hf_chat(system: str | None, n_images: int, question: str) -> list[dict]:
    return [*([{"role": "system", "content": system}] if system else []),
            {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}]


def _hit_ends_inside_x(on, off, adapter, system: str | None, x: int, y: int, z: int, block: int) -> int:
    """[X, Y] then [X, Z] (caches on, from empty caches): the second hits every block before the
    one where Y and Z part — which starts inside X — and is its cache-off answer. Returns where
    in X the hit ended (the offset of the first token the second request computed)."""
    prompt = adapter.tokenize(_hf_chat(system, 2, Q_FIRST), [IMAGES[x], IMAGES[z]])
    span = prompt.spans[0]
    boundary = (prompt.spans[1].start // block) * block  # the block holding Z's first token starts here
    assert span.start < boundary < span.start + span.length
    trio.from_thread.run(on.runtime.reset_caches, "smol", trio_token=on._token)
    before = on.stats()["smol"]["encoder"]["items_encoded"]
    ask(on, "smol", _chat(system, (x, y), Q_FIRST), 4)
    second = _chat(system, (x, z), Q_FIRST)
    got = ask(on, "smol", second, 8)
    assert got.usage.cached_tokens == boundary
    assert on.stats()["smol"]["encoder"]["items_encoded"] - before == 3  # X once (then a hit), Y, Z
    problem = mismatch("smol", got.choices[0], ask(off, "smol", second, 8).choices[0], f"hit at {boundary}")
    assert problem is None, problem
    return boundary - span.start


def test_a_hit_ending_inside_an_image_inside_a_tile_is_exact(runtimes):
    """The block where Y and Z part starts inside X's global view, in its run of `<image>` rows:
    the generator gets X's remaining rows and the final marker's embedding."""
    on, off = runtimes
    adapter = loaded(on, "smol").adapter
    x, y, z = 0, 1, 3  # 185 (3x3 tiles), 130 and 131 tokens
    offset = _hit_ends_inside_x(on, off, adapter, None, x, y, z, 8)
    tokens = adapter.tokenizer.convert_ids_to_tokens(list(adapter.expansion(adapter.grid(IMAGES[x]))))
    assert tokens[offset] == "<image>" and "<global-img>" in tokens[:offset]


@pytest.fixture(scope="module")
def wide_blocks(runtimes, smol_dir):
    """The tiny Idefics3 alone with blocks of 64 tokens: the last block of X reaches back over
    its last tiles' markers, so a hit can end at any of them."""
    on, _ = runtimes
    config = on.runtime.config.replace(models=(ModelConfig("smol", str(smol_dir), default=True),),
                                       kv_cache={"block_size": WIDE_BLOCK, "budget_bytes": 1 << 22})
    with SyncRuntime(config) as wide:
        yield wide


@pytest.mark.parametrize("where", ["<fake_token_around_image>", "<row_3_col_3>", "\n", "<global-img>", "<image>"])
def test_a_hit_ending_at_a_marker_inside_an_image_is_exact(runtimes, wide_blocks, where):
    """The system prompt's length moves X (3x3 tiles), so the block where Y and Z part starts at
    the wanted token of X: the fake token that opens a tile, the tile's `<row_i_col_j>`, a row's
    closing newline, the global view's tag, or inside a tile's `<image>` run; every time the
    hit is exact and the generator gets X's rows from there on."""
    _, off = runtimes
    adapter = loaded(wide_blocks, "smol").adapter
    x, y, z = 0, 1, 3
    expansion = adapter.tokenizer.convert_ids_to_tokens(list(adapter.expansion(adapter.grid(IMAGES[x]))))
    want = where.replace("\n", "Ċ")  # the byte-level BPE's newline
    for pad in range(WIDE_BLOCK):  # " ." is two tokens, "?" one: every shift of X modulo the block
        system = "Answer briefly." + " ." * (pad // 2) + "?" * (pad % 2)
        prompt = adapter.tokenize(_hf_chat(system, 2, Q_FIRST), [IMAGES[x], IMAGES[z]])
        span = prompt.spans[0]
        offset = (prompt.spans[1].start // WIDE_BLOCK) * WIDE_BLOCK - span.start
        if 0 < offset and expansion[offset] == want and (want != "<image>" or expansion[offset - 1] == "<image>"):
            break
    else:
        pytest.fail(f"no system prompt puts the hit's end at {where!r}")
    assert _hit_ends_inside_x(wide_blocks, off, adapter, system, x, y, z, WIDE_BLOCK) == offset


def test_a_llava_and_an_idefics3_with_one_image_token_never_share_an_encoder_output(runtimes):
    """The demo LLaVA and the tiny Idefics3 share the `<image>` token id; the model signature parts
    their image and block keys."""
    on, off = runtimes
    adapters = {m: loaded(on, m).adapter for m in ("smol", "demo")}
    assert adapters["smol"].image_token_id == adapters["demo"].image_token_id
    img = IMAGES[2]
    assert adapters["smol"].image_key(img) != adapters["demo"].image_key(img)
    for m in adapters:
        trio.from_thread.run(on.runtime.reset_caches, m, trio_token=on._token)
    before = {m: on.stats()[m]["encoder"]["items_encoded"] for m in adapters}
    for i, model in enumerate(("smol", "demo", "smol", "demo")):
        messages = [*([{"role": "system", "content": "Answer briefly."}] if i >= 2 else []),
                    user_message(Turn((2,), Q_SHAPE, None))]  # turns 3 and 4: new prefixes, encoder hits
        problem = mismatch(model, ask(on, model, messages, 6).choices[0], ask(off, model, messages, 6).choices[0], i)
        assert problem is None, (model, problem)
    assert {m: on.stats()[m]["encoder"]["items_encoded"] - before[m] for m in adapters} == {"smol": 1, "demo": 1}


@pytest.fixture(scope="module")
def replicas(runtimes, tmp_path_factory):
    """Two replicas of the cache-on runtime (tiny arena and encoder cache) on one real redis-server."""
    on, _ = runtimes
    shared = {"lookup_deadline_ms": 3000.0, "backoff_s": 0.05, "max_backoff_s": 0.2, "secret": "idefics3-replicas-secret"}
    with RedisServer(tmp_path_factory.mktemp("redis"), None) as server:
        config = on.runtime.config.replace(shared_cache=dict(shared, url=server.url))
        with SyncRuntime(config) as a, SyncRuntime(config) as b:
            yield a, b


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(ORACLE.conversations(), st.integers(0, 1)), min_size=2, max_size=4))
def test_replicas_on_one_redis_answer_as_cache_off(runtimes, replicas, workload):
    """Conversations at once, their turns alternating between the replicas (as a round-robin
    balancer sends them): a turn restores the blocks and encoder outputs the other replica wrote."""
    _, off = runtimes
    problems, errors = [], []

    def converse(c, first) -> None:
        history = [{"role": "system", "content": c.system}] if c.system else []
        try:
            for k, turn in enumerate(c.turns):
                rt = replicas[(first + k) % 2]
                history.append(user_message(turn))
                expected = ask(off, c.model, history, 6).choices[0]
                if turn.disconnect_after is None:
                    problem = mismatch(c.model, ask(rt, c.model, history, 6).choices[0], expected, f"turn {k}")
                    if problem:
                        problems.append((c.model, problem, list(history)))
                else:
                    for i, _ in enumerate(rt.chat(history, model=c.model, temperature=0, max_tokens=6, min_tokens=6)):
                        if i >= turn.disconnect_after:
                            break
                history.append({"role": "assistant", "content": expected.text})
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    hung = run_concurrently(converse, workload)
    assert not errors, errors
    assert not hung, "a conversation never ended"
    assert not problems, problems[:3]


def test_the_replicas_restored_from_redis(replicas):
    """(After the oracle above: its Idefics3 turns did cross replicas through Redis.)"""
    models = [rt.runtime.registry.loaded["smol"] for rt in replicas if "smol" in rt.runtime.registry.loaded]
    assert sum(m.prefix_cache.stats()["shared_restored_blocks"] for m in models) > 0
    assert sum(m.encoder.shared_hits for m in models) > 0


def test_concurrent_requests_in_a_tiny_arena_preempt_and_stay_exact(runtimes):
    ORACLE.in_a_tiny_arena(runtimes, "smol")


def test_the_workloads_reached_what_they_test(runtimes):
    """Run last: the workloads above reached what they test."""
    ORACLE.reached_what_it_tests(runtimes, "smol")

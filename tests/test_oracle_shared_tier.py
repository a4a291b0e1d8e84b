"""The oracle across replicas: two runtimes on one real redis-server, each with a tiny KV arena
and encoder cache, serve hypothesis-generated conversations (three models, random disconnects)
at the same time, their turns alternating between the replicas — so turns restore KV blocks and
encoder outputs the other replica wrote, while preemption and eviction run under them — and
every greedy answer equals the cache-off answer."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import trio

from mmserve import SyncRuntime
from tests.helpers import assert_nothing_held, run_concurrently
from tests.redis_server import RedisServer
from tests.test_oracle import conversations, run_turn, user_message


@pytest.fixture(scope="module")
def replicas(three_model_config, tmp_path_factory):
    config = three_model_config
    shared = {"lookup_deadline_ms": 3000.0, "backoff_s": 0.05, "max_backoff_s": 0.2, "secret": "oracle-replicas-secret"}
    with RedisServer(tmp_path_factory.mktemp("redis"), None) as server:
        tiny = config.replace(kv_cache={"block_size": 8, "budget_bytes": 20 * 16384}, encoder_cache={"max_entries": 3},
                              shared_cache=dict(shared, url=server.url))
        with SyncRuntime(config.replace(kv_cache={"prefix_caching": False}, encoder_cache={"enabled": False})) as off:
            with SyncRuntime(tiny) as a, SyncRuntime(tiny) as b:
                yield (a, b), off, server


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(conversations(), st.integers(0, 1)), min_size=2, max_size=4))
def test_replicas_on_one_redis_answer_as_cache_off(replicas, workload):
    rts, off, _ = replicas
    mismatches, errors = [], []

    def converse(c, first) -> None:
        history = [{"role": "system", "content": c.system}] if c.system else []
        try:
            for k, turn in enumerate(c.turns):
                side = (first + k) % 2  # turns alternate, as a round-robin balancer sends them
                history.append(user_message(turn))
                expected = run_turn(off, c.model, history, None)
                got = run_turn(rts[side], c.model, history, turn.disconnect_after)
                if got is not None and got != expected:
                    mismatches.append((c.model, side, list(history), got, expected))
                history.append({"role": "assistant", "content": expected})
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    hung = run_concurrently(converse, workload)
    assert not errors, errors
    assert not hung, "a conversation never ended"
    assert not mismatches, mismatches[:3]
    for rt in rts:
        trio.from_thread.run(assert_nothing_held, rt.runtime, trio_token=rt._token)


def test_the_replicas_restored_from_redis(replicas):
    """(After the oracle above: its turns did cross replicas through Redis.)"""
    rts, _, _ = replicas
    restored = sum(model.prefix_cache.stats()["shared_restored_blocks"] for rt in rts for model in rt.runtime.registry.loaded.values())
    encoder_hits = sum(model.encoder.shared_hits for rt in rts for model in rt.runtime.registry.loaded.values())
    assert restored > 0 and encoder_hits > 0

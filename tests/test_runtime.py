"""The embedded Runtime API: streaming, completion, cancellation, crash containment."""

from functools import partial

import pytest
import trio

from mmserve import Runtime, SyncRuntime
from mmserve.errors import BadRequest, ModelNotFound, ServiceUnavailable
from tests.helpers import colour_question, wait_until

LONG = dict(max_tokens=400, min_tokens=400, temperature=0)


@pytest.fixture
async def rt(tiny_config):
    async with Runtime.open(tiny_config) as runtime:
        yield runtime


def generator(rt):
    return rt.registry.require("tiny").generator


async def test_stream_and_completion_agree(rt):
    msgs = colour_question("red")
    async with rt.chat(msgs, max_tokens=8, temperature=0) as stream:
        deltas = [d async for d in stream]
    assert deltas[-1].finish_reason in ("stop", "length") and deltas[-1].usage.prompt_tokens > 16
    completion = await rt.chat_completion(msgs, max_tokens=8, temperature=0)
    assert completion.text == "".join(d.text for d in deltas)
    usage = deltas[-1].usage
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert usage.cached_tokens == 0 and completion.usage.cached_tokens > 0  # the second run hits the prefix cache


async def test_seed_reproduces_sampled_output(rt):
    msgs = colour_question("blue")
    a = await rt.chat_completion(msgs, max_tokens=12, temperature=1.0, seed=5)
    b = await rt.chat_completion(msgs, max_tokens=12, temperature=1.0, seed=5)
    assert a.text == b.text


async def test_max_tokens_finishes_with_length(rt):
    c = await rt.chat_completion(colour_question("red"), max_tokens=5, min_tokens=5, temperature=0)
    assert c.finish_reason == "length" and c.usage.completion_tokens == 5


async def test_invalid_input_raises_typed_errors_before_work(rt):
    with pytest.raises(BadRequest):
        rt.chat([{"role": "user", "content": 3}])
    with pytest.raises(ModelNotFound):
        rt.chat(colour_question("red"), model="nope")


async def test_closing_a_stream_aborts_the_sequence(rt):
    async with rt.chat(colour_question("red"), **LONG) as stream:
        await stream.__anext__()
        await stream.__anext__()
    await wait_until(lambda: not generator(rt).running)
    c = await rt.chat_completion(colour_question("green"), max_tokens=4, temperature=0)
    assert c.finish_reason in ("stop", "length")


async def test_cancelled_non_streaming_caller_aborts_the_sequence(rt):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(rt.chat_completion, colour_question("red"), **LONG))
        await wait_until(lambda: [s for s in generator(rt).running if s.state.value == "decoding"], what="the request is decoding")
        nursery.cancel_scope.cancel()  # the caller goes away mid-decode
    assert nursery.cancel_scope.cancelled_caught
    await wait_until(lambda: not generator(rt).running)


async def test_concurrent_requests_interleave(rt):
    results = {}

    async def one(color):
        results[color] = await rt.chat_completion(colour_question(color), max_tokens=6, min_tokens=6, temperature=0)

    async with trio.open_nursery() as n:
        for color in ("red", "green", "blue"):
            n.start_soon(one, color)
    assert all(r.usage.completion_tokens == 6 for r in results.values())


async def test_generator_crash_fails_in_flight_and_restarts(rt, monkeypatch):
    gen = generator(rt)
    real = gen.runner.forward
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real(*a, **kw)

    monkeypatch.setattr(gen.runner, "forward", flaky)
    with pytest.raises(ServiceUnavailable, match="injected forward failure"):
        await rt.chat_completion(colour_question("red"), **LONG)
    await wait_until(lambda: rt.health().ok)
    c = await rt.chat_completion(colour_question("red"), max_tokens=4, temperature=0)
    assert c.usage.completion_tokens >= 1
    assert rt.supervisor.states["generator[tiny]"].restarts == 1


def test_sync_runtime(tiny_config):
    with SyncRuntime(tiny_config) as rt:
        c = rt.chat_completion(colour_question("red"), max_tokens=6, temperature=0)
        streamed = "".join(d.text for d in rt.chat(colour_question("red"), max_tokens=6, temperature=0))
        assert c.text == streamed
        for i, _ in enumerate(rt.chat(colour_question("red"), **LONG)):
            if i == 2:
                break  # leaving the loop aborts the request
        assert rt.health().ok


async def test_deadline_aborts_a_request_that_runs_too_long(tiny_config):
    from mmserve.errors import DeadlineExceeded

    async with Runtime.open(tiny_config.replace(limits={"request_timeout_s": 0.3})) as rt:
        with pytest.raises(DeadlineExceeded):
            await rt.chat_completion(colour_question("red"), max_tokens=3000, min_tokens=3000, temperature=0)
        await wait_until(lambda: not rt.registry.require("tiny").generator.running)
        c = await rt.chat_completion(colour_question("red"), max_tokens=3, temperature=0)
        assert c.usage.completion_tokens >= 1


async def test_the_first_token_is_announced_even_when_its_text_is_held_back(rt):
    """A stop string that might start with the first token's text holds that text back; the
    caller still learns at once that the first token exists (an empty first delta)."""
    msgs = colour_question("red")
    full = (await rt.chat_completion(msgs, temperature=0, max_tokens=6, min_tokens=6)).text
    assert full
    deltas = []
    async with rt.chat(msgs, temperature=0, max_tokens=6, min_tokens=6, stop=[full[0] + "\x00"]) as stream:
        async for delta in stream:
            deltas.append(delta.text)
    assert deltas[0] == "" and "".join(deltas) == full

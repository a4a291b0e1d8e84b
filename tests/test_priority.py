"""Priority scheduling (issue 41 item 4), with `max_running_requests = 1` on the demo model through
the embedded Runtime: `priority` (lower first, as vLLM's) orders admission; a request of a better
priority puts a running one of a worse priority back in the queue (preempted: it completes later
with the same greedy answer as alone), never one of the same priority; equal priorities keep
arrival order; aging bounds every wait. And the field on every HTTP route, a 400 naming it when
invalid."""

from __future__ import annotations

import time

import openai
import pytest
import trio

from mmserve import Runtime
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ServerThread, ask, assert_nothing_held, wait_until

BLOCKS = 12  # of 8 tokens: 96 tokens of KV (as tests/test_preemption.py): two answers below never fit together
LONG = ask(render_image("green", "circle", background="white", seed=42), Q_SHAPE)
SHORT = ask(render_image("blue", "square", background="white", seed=41), Q_COLOR)
GREEDY_LONG = dict(temperature=0, max_tokens=60, min_tokens=60)
GREEDY_SHORT = dict(temperature=0, max_tokens=30, min_tokens=30)


def one_at_a_time(config, **generator):
    return config.replace(generator={"max_running_requests": 1, **generator})


def tiny_arena(config):
    return config.replace(kv_cache={"block_size": 8, "budget_bytes": BLOCKS * 16384})


class Admissions:
    """The request ids in the order the generator admitted them (a plan that first carries one),
    and, per admission, the sequences that were waiting then (observed by wrapping its `_plan`)."""

    def __init__(self, generator):
        self.order: list[str] = []
        self.events: list[tuple[str, list]] = []  # (admitted request id, sequences left waiting)
        self.at: dict[str, float] = {}  # request id -> when it was admitted (monotonic)
        plan = generator._plan

        def recording_plan():
            before = {id(s) for s in generator.seqs if s.admitted}
            planned = plan()
            for p in planned:
                if id(p.seq) not in before and p.seq.request_id not in self.order:
                    self.order.append(p.seq.request_id)
                    self.events.append((p.seq.request_id, [s for s in generator.seqs if not s.admitted]))
                    self.at[p.seq.request_id] = time.monotonic()
            return planned

        generator._plan = recording_plan


async def drain(stream) -> str:
    return "".join([d.text async for d in stream])


async def test_a_later_request_of_a_better_priority_is_admitted_before_earlier_ones(demo_config):
    """One request runs; two of priority 3 and then one of priority 0 (the running one's) wait:
    the later priority-0 one goes first, the two others in arrival order; nobody was preempted
    (the running one's priority equals the newcomer's)."""
    async with Runtime.open(one_at_a_time(demo_config)) as rt:
        generator = rt.registry.require("demo").generator
        seen = Admissions(generator)
        text = dict(temperature=0, max_tokens=6)
        async with trio.open_nursery() as nursery:
            first = rt.chat([{"role": "user", "content": "red"}], temperature=0, max_tokens=150, min_tokens=150)
            await first.__anext__()  # it decodes: everything below waits behind it
            streams = {}
            for name, priority in (("low-1", 3), ("low-2", 3), ("high", 0)):
                streams[name] = rt.chat([{"role": "user", "content": name}], priority=priority, **text)
                await wait_until(lambda: len(generator.seqs) == len(streams) + 1, what=f"{name} reaches the generator")
            assert not first.handle.finished, "the first answer ended before the others queued: make it longer"
            for s in (first, *streams.values()):
                nursery.start_soon(drain, s)
        ids = {name: s.request_id for name, s in streams.items()}
        assert seen.order == [first.request_id, ids["high"], ids["low-1"], ids["low-2"]]
        assert generator.preemptions == 0
        await assert_nothing_held(rt)


async def test_a_better_priority_preempts_a_running_one_which_completes_as_alone(demo_config):
    """A priority-3 answer decodes in a tiny arena; a priority-0 request arrives: it is admitted at
    once (the running one goes back to the queue, preempted), ends first, and the preempted one
    completes with the same greedy answer as alone. A newcomer of the same priority waits instead."""
    async with Runtime.open(one_at_a_time(tiny_arena(demo_config))) as rt:
        generator = rt.registry.require("demo").generator
        long_alone = (await rt.chat_completion(LONG, **GREEDY_LONG)).text
        short_alone = (await rt.chat_completion(SHORT, **GREEDY_SHORT)).text
        for newcomer, displaces in ((0, True), (3, False)):
            preemptions = generator.preemptions
            ended: list[str] = []
            out = {}

            async def run(name, messages, priority, params):
                out[name] = await drain(rt.chat(messages, priority=priority, **params))
                ended.append(name)

            async with trio.open_nursery() as nursery:
                low = rt.chat(LONG, priority=3, **GREEDY_LONG)
                texts = [(await low.__anext__()).text]  # it decodes
                nursery.start_soon(run, "short", SHORT, newcomer, GREEDY_SHORT)
                texts.append(await drain(low))
                ended.append("long")
            assert "".join(texts) == long_alone and out["short"] == short_alone
            if displaces:
                assert ended == ["short", "long"] and generator.preemptions > preemptions
            else:  # never preempted to admit a request of the same priority
                assert ended == ["long", "short"] and generator.preemptions == preemptions
        await assert_nothing_held(rt)


async def test_in_a_full_arena_the_lower_priority_holder_is_preempted(demo_config):
    """Two may run, but the arena holds only one of the two answers: the priority-1 answer that
    decodes is preempted for the priority-0 newcomer (today's rule would preempt the newest), and
    both answers equal their answers alone."""
    async with Runtime.open(tiny_arena(demo_config).replace(generator={"max_running_requests": 2})) as rt:
        generator = rt.registry.require("demo").generator
        long_alone = (await rt.chat_completion(LONG, **GREEDY_LONG)).text
        short_alone = (await rt.chat_completion(SHORT, **GREEDY_SHORT)).text
        victims: list[str] = []
        preempt = generator._preempt

        def recording_preempt(victim):
            victims.append(victim.request_id)
            preempt(victim)

        generator._preempt = recording_preempt
        out = {}
        async with trio.open_nursery() as nursery:
            low = rt.chat(LONG, priority=1, **GREEDY_LONG)
            texts = [(await low.__anext__()).text]

            async def high():
                stream = rt.chat(SHORT, priority=0, **GREEDY_SHORT)
                out["id"] = stream.request_id
                out["short"] = await drain(stream)

            nursery.start_soon(high)
            texts.append(await drain(low))
        assert "".join(texts) == long_alone and out["short"] == short_alone
        assert low.request_id in victims and out["id"] not in victims, victims
        await assert_nothing_held(rt)


async def test_aging_bounds_the_wait_of_a_low_priority_request_under_a_stream_of_high_ones(demo_config):
    """Clients send priority-0 requests back to back; a priority-2 request arrives among them. With
    `priority_aging_s` = A it ranks ahead of every priority-0 request arriving (2 - 0 + 1) × A or
    more after it: no such request is admitted while it waits (it was passed over only by earlier
    ones), and it completes."""
    aging = 0.25
    async with Runtime.open(one_at_a_time(demo_config, priority_aging_s=aging)) as rt:
        generator = rt.registry.require("demo").generator
        seen = Admissions(generator)
        stop = trio.Event()
        arrived: dict[str, float] = {}

        async def client(k):
            while not stop.is_set():
                stream = rt.chat([{"role": "user", "content": f"blue {k}"}], priority=0, temperature=0,
                                 max_tokens=4, min_tokens=4)
                arrived[stream.request_id] = stream.handle.created
                await drain(stream)

        async with trio.open_nursery() as nursery:
            for k in range(3):
                nursery.start_soon(client, k)
            await wait_until(lambda: len(arrived) >= 6, timeout=30, what="the high-priority stream flows")
            low = rt.chat([{"role": "user", "content": "red"}], priority=2, temperature=0, max_tokens=4)
            with trio.fail_after(30):
                await drain(low)
            stop.set()
        t_low = low.handle.created
        bound = t_low + 3 * aging
        passed = [rid for rid, waiting in seen.events if any(s.request_id == low.request_id for s in waiting)]
        assert passed, "the low-priority request was never passed over: the stream did not load the generator"
        late = [rid for rid in passed if arrived.get(rid, 0.0) >= bound]
        assert not late, f"{len(late)} requests arriving 3 × priority_aging_s after it were admitted first"
        print(f"passed over by {len(passed)} earlier high-priority requests; admitted "
              f"{seen.at[low.request_id] - t_low:.3f} s after it arrived (3 × priority_aging_s = {3 * aging} s)")
        await assert_nothing_held(rt)


# -- the field on every route ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(demo_config):
    with ServerThread(demo_config) as server:  # its own: the shared one's state stays as other modules expect
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_priority_is_accepted_on_every_route(client):
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "red"}], max_tokens=2,
                                          extra_body={"priority": -5})
    assert chat.choices[0].finish_reason in ("stop", "length")
    completion = client.completions.create(model="demo", prompt="red", max_tokens=2, extra_body={"priority": 7})
    assert completion.choices[0].text is not None
    response = client.responses.create(model="demo", input="red", max_output_tokens=2, extra_body={"priority": 1})
    assert response.status == "completed"


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
@pytest.mark.parametrize("priority", [1.5, "1", True, 2**31, -(2**31) - 1])
def test_an_invalid_priority_is_a_400_naming_it(client, route, priority):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "red"}], max_tokens=2,
                                           extra_body={"priority": priority})
        elif route == "completions":
            client.completions.create(model="demo", prompt="red", max_tokens=2, extra_body={"priority": priority})
        else:
            client.responses.create(model="demo", input="red", max_output_tokens=2, extra_body={"priority": priority})
    error = e.value.body if isinstance(e.value.body, dict) else {}
    error = error.get("error", error)
    assert e.value.status_code == 400 and error.get("param") == "priority", e.value.body
    assert "priority" in error.get("message", "")


async def test_the_embedded_runtime_takes_priority(demo_config):
    from mmserve.errors import BadRequest

    async with Runtime.open(demo_config) as rt:
        assert (await rt.chat_completion([{"role": "user", "content": "red"}], max_tokens=2, priority=-3)).choices
        assert (await rt.text_completion("red", max_tokens=2, priority=4)).choices
        with pytest.raises(BadRequest) as e:
            rt.chat([{"role": "user", "content": "red"}], priority=0.5)
        assert e.value.status == 400 and e.value.param == "priority"

"""/metrics moves by exactly the expected amounts."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mmserve.models.demo import Q_SHAPE, render_image
from tests.helpers import ServerThread, ask


def scrape(client) -> dict:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = s.value
    return out


def value(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m, name, **labels):
    """The sum of `name`'s samples whose labels include `labels` (over the others)."""
    return sum(v for (n, lb), v in m.items() if n == name and set(labels.items()) <= set(lb))


def test_running_counts_admitted_requests_and_the_rest_wait(tiny_config):
    """With max_running_requests = 1, a long answer runs and a second request waits in the
    generator for admission: running 1, waiting 1 (not 2 running, as when every sequence in the
    generator counted)."""
    import threading
    import time

    config = tiny_config.replace(generator={"max_running_requests": 1})
    long = {"messages": ask(render_image("red", "circle", seed=1)), "max_tokens": 3000, "min_tokens": 3000,
            "temperature": 0, "stream": True}
    second = {"messages": ask(render_image("blue", "square", seed=2)), "max_tokens": 2, "temperature": 0}
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        m = {"model_name": "tiny"}
        with c.stream("POST", "/v1/chat/completions", json=long) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # the long answer is decoding
            t = threading.Thread(target=lambda: c.post("/v1/chat/completions", json=second))
            t.start()
            generator = server.runtime.registry.require("tiny").generator
            deadline = time.monotonic() + 10
            while len(generator.seqs) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            now = scrape(c)
            assert len(generator.seqs) == 2
            assert value(now, "mmserve:num_requests_running", **m) == 1
            assert value(now, "mmserve:num_requests_waiting", **m) == 1
        t.join(30)


def test_metrics_move_by_exact_amounts(tiny_config):
    img = render_image("red", "circle", seed=1)
    with ServerThread(tiny_config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        before = scrape(c)
        first = ask(img)
        r1 = c.post("/v1/chat/completions", json={"messages": first, "max_tokens": 5, "min_tokens": 5, "temperature": 0}).json()
        follow = [*first, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                  {"role": "user", "content": Q_SHAPE}]
        r2 = c.post("/v1/chat/completions", json={"messages": follow, "max_tokens": 3, "min_tokens": 3, "temperature": 0}).json()
        after = scrape(c)
    m = {"model_name": "tiny"}
    delta = lambda name, **lb: value(after, name, **lb) - value(before, name, **lb)  # noqa: E731
    assert delta("mmserve:generation_tokens_total", **m) == 8
    assert delta("mmserve:prompt_tokens_total", **m) == r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"]
    assert delta("mmserve:request_success_total", model_name="tiny", finished_reason="length") == 2
    assert delta("mmserve:time_to_first_token_seconds_count", **m) == 2
    assert delta("mmserve:inter_token_latency_seconds_count", **m) == (5 - 1) + (3 - 1)
    assert delta("mmserve:mm_cache_queries_total", **m) == 2 and delta("mmserve:mm_cache_hits_total", **m) == 1
    assert delta("mmserve:prefix_cache_hits_total", **m) == r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # one step per token (each prompt prefills in one step); 'host' times the gaps between
    # back-to-back steps: none before a request's first step (the generator was idle)
    assert delta("mmserve:step_seconds_count", part="forward", **m) == 8
    assert delta("mmserve:step_seconds_count", part="host", **m) == (5 - 1) + (3 - 1)
    # every step counted once, by the path it took: from the static buffers by kind, else eager by
    # why (the CPU's sdpa backend: every step; triton on a GPU: these prompts fit a token bucket)
    paths = {k: total(after, n, **m) - total(before, n, **m) for k, n in (("static", "mmserve:static_steps_total"),
                                                                          ("eager", "mmserve:eager_steps_total"))}
    assert paths["static"] + paths["eager"] == 8
    if value(after, "mmserve:eager_steps_total", reason="backend_not_capturable", **m):
        assert paths["eager"] == delta("mmserve:eager_steps_total", reason="backend_not_capturable", **m) == 8
    assert value(after, "mmserve:healthy") == 1.0
    assert value(after, "mmserve:num_requests_running", **m) == 0
    # idle: nothing is held by a running request; the cached prefixes are evictable, and count as free
    assert value(after, "mmserve:kv_cache_usage_perc", **m) == 0
    assert 0 < value(after, "mmserve:kv_cache_evictable_perc", **m) <= 1
    assert value(after, "mmserve:encoder_cache_bytes", **m) > 0
    assert value(after, "mmserve:actor_restarts_total", actor="generator[tiny]") == 0

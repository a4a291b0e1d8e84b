"""Two models in one process over HTTP (DESIGN.md F1): encoder outputs never cross models."""

import openai
import pytest
import structlog

from mmserve.models.demo import render_image
from tests.helpers import ServerThread, ask


@pytest.fixture(scope="module")
def server(demo_config):
    with ServerThread(demo_config) as s:
        yield s


def test_same_image_to_two_models_never_shares_an_encoder_output(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = ask(render_image("orange", "square", background="gray", seed=99))
    answers = []
    with structlog.testing.capture_logs() as logs:
        for model in ("demo", "demo-wide", "demo"):
            r = client.chat.completions.create(model=model, messages=messages, temperature=0)
            answers.append(r.choices[0].message.content.strip())
    assert answers == ["orange"] * 3
    events = [(e["event"], e["model"], e["key"]) for e in logs if e["event"] in ("encoder_cache.hit", "encoder_cache.miss")]
    assert [(ev, model) for ev, model, _ in events] == [
        ("encoder_cache.miss", "demo"), ("encoder_cache.miss", "demo-wide"), ("encoder_cache.hit", "demo")]
    assert events[0][2] != events[1][2] and events[2][2] == events[0][2]
    stats = server.run_sync(server.runtime.stats)
    assert stats["demo"]["encoder"]["hits"] == 1 and stats["demo-wide"]["encoder"]["hits"] == 0
    assert stats["demo"]["encoder"]["encoder_runs"] == 1 and stats["demo-wide"]["encoder"]["encoder_runs"] == 1

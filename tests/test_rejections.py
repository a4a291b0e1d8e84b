"""Every rejected request is visible: one `request.rejected` log line naming the internal id, the
client's id, the status, the `param` and the message — for refusals at parse time in the HTTP
layer, at admission, in the intake and from embedded callers alike — and a count in
`mmserve:request_rejected_total{reason}`."""

import io
import json
import re
from contextlib import contextmanager

import httpx
import pytest
import trio
import trio.testing

from mmserve import Runtime
from mmserve.errors import BadRequest
from mmserve.logs import configure_logging
from tests.helpers import colour_question


@contextmanager
def captured():
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    lines: list[dict] = []
    try:
        yield lines
    finally:
        configure_logging("json", "info")
        lines += [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]


def rejected(lines: list[dict]) -> list[dict]:
    return [e for e in lines if e["event"] == "request.rejected"]


def counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^mmserve:request_rejected_total\{reason="([^"]+)"\} (\S+)$', text, re.M)}


def post(url: str, label: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": label, **kw.pop("headers", {})},
                      timeout=60, **kw)


CASES = [
    # (what, request kwargs, status, reason, param)
    ("unknown parameter", dict(json={"messages": colour_question("red"), "ignore_eoss": True}), 400,
     "invalid_request_error", "ignore_eoss"),
    ("beam search", dict(json={"messages": colour_question("red"), "use_beam_search": True}), 400,
     "unsupported_parameter", "use_beam_search"),
    ("not JSON", dict(content=b"{nope", headers={"content-type": "application/json"}), 400,
     "invalid_request_error", None),
    ("not JSON media type", dict(content=b"{}", headers={"content-type": "text/plain"}), 415,
     "unsupported_media_type", None),
    ("unknown model", dict(json={"messages": colour_question("red"), "model": "gpt-9"}), 404,
     "model_not_found", "model"),
    ("undecodable image", dict(json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]}), 400,
     "invalid_image", "messages[0].content (image 0)"),
]


@pytest.mark.parametrize("what, kw, status, reason, param", CASES, ids=[c[0] for c in CASES])
def test_a_rejected_request_logs_one_line_and_counts(demo_server, what, kw, status, reason, param):
    url = demo_server.url
    label = "client-" + re.sub(r"\W", "-", what)
    before = counts(url)
    with captured() as lines:
        r = post(url, label, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert r.headers["x-request-id"] == label
    lines = [e for e in rejected(lines) if e.get("client_request_id") == label]
    assert len(lines) == 1, lines
    line = lines[0]
    assert (line["status"], line["reason"], line["param"], line["error"]) == (status, reason, param, error["message"])
    assert re.fullmatch(r"[0-9a-f]{32}", line["request_id"])  # the internal id, never the client's
    assert counts(url).get(reason, 0) == before.get(reason, 0) + 1


def test_an_admitted_request_is_not_a_rejection(demo_server):
    url = demo_server.url
    before = counts(url)
    with captured() as lines:
        r = post(url, "fine", json={"messages": colour_question("red"), "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and not rejected(lines) and counts(url) == before


def test_the_internal_id_of_a_rejection_is_the_one_the_response_names(demo_server):
    with captured() as lines:
        r = httpx.post(demo_server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=60)
    assert r.status_code == 400
    assert [e["request_id"] for e in rejected(lines)] == [r.headers["x-request-id"]]


def test_an_unauthorized_request_is_a_rejection_too(tiny_config):
    from tests.helpers import ServerThread

    with ServerThread(tiny_config.replace(auth={"api_keys": ("secret",)})) as server:
        with captured() as lines:
            r = post(server.url, "no-key", json={"messages": colour_question("red")})
        assert r.status_code == 401
        assert [(e["status"], e["reason"], e["client_request_id"]) for e in rejected(lines)] == \
            [(401, "invalid_api_key", "no-key")]
        assert counts(server.url) == {"invalid_api_key": 1.0}


async def test_embedded_refusals_are_logged_and_counted(tiny_config):
    with captured() as lines:
        async with Runtime.open(tiny_config) as rt:
            with pytest.raises(BadRequest):
                rt.chat(colour_question("red"), client_request_id="emb", min_p=7)
            with pytest.raises(BadRequest) as info:  # refused by the intake, after admission
                await rt.chat_completion([{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}],
                    client_request_id="emb2")
            assert info.value.code == "invalid_image" and info.value.status == 400
            await trio.testing.wait_all_tasks_blocked(cushion=0.02)
            text = rt.metrics.render().decode()
    got = [(e["client_request_id"], e["status"], e["param"], e["actor"]) for e in rejected(lines)]
    assert got == [("emb", 400, "min_p", "runtime"), ("emb2", 400, "messages[0].content (image 0)", "intake")]
    assert 'mmserve:request_rejected_total{reason="invalid_request_error"} 1.0' in text
    assert 'mmserve:request_rejected_total{reason="invalid_image"} 1.0' in text

"""Every user-caused error over HTTP: the right status, the OpenAI error shape, and the server
keeps serving afterwards."""

import base64
import io
import struct
import zlib

import httpx
import trio
import trio.testing
import pytest
from PIL import Image

from tests.helpers import ServerThread, colour_question, data_url, wait_until

MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def server(tiny_config):
    with ServerThread(tiny_config.replace(server={"max_body_bytes": MAX_BODY})) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def chat(client, body=None, **kw):
    return client.post("/v1/chat/completions", **({"json": body} if body is not None else {}), **kw)


def png_with_header_size(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression-bomb shape)."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = data[12:29]  # b"IHDR" + 13 bytes of fields
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def image_message(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is the shape?"}]}],
        "max_tokens": 2}


def b64(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def assert_error(resp, status, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def assert_still_serving(client):
    ok = chat(client, {"messages": colour_question("red"), "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["role"] == "assistant"


PNG = io.BytesIO()
Image.new("RGB", (8, 8), "red").save(PNG, "PNG")


@pytest.mark.parametrize("case, status, code", [
    ("bad_json", 400, None),
    ("invalid_utf8", 400, None),
    ("not_object", 400, None),
    ("no_messages", 400, None),
    ("n_17", 400, None),
    ("tools", 400, None),
    ("functions", 400, "unsupported_parameter"),
    ("unknown_model", 404, "model_not_found"),
    ("too_large", 413, "payload_too_large"),
    ("bad_base64", 400, "invalid_image"),
    ("not_an_image", 400, "invalid_image"),
    ("truncated_png", 400, "invalid_image"),
    ("gif", 400, "invalid_image"),
    ("huge_dimensions", 400, "image_too_large"),
    ("remote_url", 400, "remote_images_disabled"),
])
def test_error_status_and_shape(client, case, status, code):
    bodies = {
        "bad_json": dict(content=b"{nope", headers={"content-type": "application/json"}),
        "invalid_utf8": dict(content=b'{"messages": "\xff\xfe"}', headers={"content-type": "application/json"}),
        "not_object": dict(json=[1, 2]),
        "no_messages": dict(json={"model": "tiny"}),
        "n_17": dict(json={"messages": colour_question("red"), "n": 17}),
        "tools": dict(json={"messages": colour_question("red"), "tools": [{"type": "function"}]}),
        "functions": dict(json={"messages": colour_question("red"), "functions": [{"name": "f"}]}),
        "unknown_model": dict(json={"messages": colour_question("red"), "model": "gpt-9"}),
        "too_large": dict(json={"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}),
        "bad_base64": dict(json=image_message("data:image/png;base64,@@@notbase64")),
        "not_an_image": dict(json=image_message(b64(b"hello world, not an image"))),
        "truncated_png": dict(json=image_message(b64(PNG.getvalue()[:40]))),
        "gif": dict(json=image_message(data_url(Image.new("RGB", (8, 8)), "GIF"))),
        "huge_dimensions": dict(json=image_message(b64(png_with_header_size(100_000, 100_000)))),
        "remote_url": dict(json=image_message("https://example.com/cat.png")),
    }
    resp = client.post("/v1/chat/completions", **bodies[case])
    assert_error(resp, status, code)
    assert resp.headers["x-request-id"]
    assert_still_serving(client)


def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_not_ready_is_503_for_chat_and_health(server, client):
    server.run_sync(_set_ready, server, False)
    try:
        assert client.get("/health").status_code == 503
        assert client.get("/health").json()["reason"] == "starting"
        assert_error(chat(client, {"messages": colour_question("red")}), 503, "service_unavailable")
    finally:
        server.run_sync(_set_ready, server, True)
    assert client.get("/health").status_code == 200
    assert_still_serving(client)


def _set_ready(server, value):
    server.runtime.supervisor.ready = value


def test_models_and_request_id(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    resp = chat(client, {"messages": colour_question("red"), "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    again = chat(client, {"messages": colour_question("red"), "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    # the client's id is echoed as a label; the completion id is the server's own, unique per request
    assert resp.headers["x-request-id"] == again.headers["x-request-id"] == "abc-123"
    ids = {resp.json()["id"], again.json()["id"]}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-") and "abc-123" not in i for i in ids)


def test_overload_is_429_with_retry_after(tiny_config):
    config = tiny_config.replace(limits={"max_pending_requests": 1})
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": colour_question("red"), "stream": True, "max_tokens": 2000, "min_tokens": 2000}) as long:
            lines = long.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            resp = chat(c, {"messages": colour_question("red"), "max_tokens": 2})
            err = assert_error(resp, 429, "server_overloaded")
            assert resp.headers["Retry-After"] == "1" and err["type"] == "rate_limit_error"
        assert_still_serving(c)


def test_api_keys_and_admin_endpoint(tiny_config):
    config = tiny_config.replace(auth={"api_keys": ("k1", "k2"), "admin_key": "root"})
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        body = {"messages": colour_question("red"), "max_tokens": 2}
        assert_error(c.post("/v1/chat/completions", json=body), 401, "invalid_api_key")
        assert_error(c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/health").status_code == 200  # health stays open for probes
        # vLLM's tokenizer routes are the API's too: keyed
        assert_error(c.post("/tokenize", json={"prompt": "red"}), 401, "invalid_api_key")
        assert_error(c.get("/tokenizer_info"), 401, "invalid_api_key")
        assert c.post("/tokenize", json={"prompt": "red"}, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert_error(c.get("/debug/cache", headers={"Authorization": "Bearer k1"}), 401)
        dbg = c.get("/debug/cache", headers={"Authorization": "Bearer root"}).json()
        assert dbg["tiny"]["encoder_cache"]["entries"] == 1 and dbg["tiny"]["prefix_cache"]["cached_blocks"] >= 1
        assert dbg["tiny"]["prefix_cache"]["owners_holding_blocks"] == 0


def test_admin_endpoints_disabled_without_admin_key(client):
    assert_error(client.get("/debug/cache"), 403, "forbidden")


def test_admin_cache_reset_empties_both_caches_and_serving_goes_on(tiny_config):
    config = tiny_config.replace(auth={"admin_key": "root"})
    admin = {"Authorization": "Bearer root"}
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        body = {"messages": colour_question("red"), "max_tokens": 3, "temperature": 0}
        first = chat(c, body).json()
        again = chat(c, body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert_error(c.post("/admin/cache/reset"), 401)
        assert_error(c.post("/admin/cache/reset", json={"caches": ["kv"]}, headers=admin), 400)
        assert_error(c.post("/admin/cache/reset", json={"model": "nope"}, headers=admin), 404)
        assert_error(c.post("/admin/cache/reset", content=b"[1]", headers={**admin, "content-type": "application/json"}), 400)
        assert_error(c.post("/admin/cache/reset", content=b"[1]", headers=admin), 415)
        r = c.post("/admin/cache/reset", headers=admin)
        assert r.status_code == 200, r.text
        dropped = r.json()["dropped"]["tiny"]
        assert dropped["encoder"] == 1 and dropped["prefix"] >= 1
        dbg = c.get("/debug/cache", headers=admin).json()["tiny"]
        assert dbg["encoder_cache"]["entries"] == 0 and dbg["prefix_cache"]["cached_blocks"] == 0
        after = chat(c, body).json()
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert after["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        only_prefix = c.post("/admin/cache/reset", json={"model": "tiny", "caches": ["prefix"]}, headers=admin).json()
        assert set(only_prefix["dropped"]["tiny"]) == {"prefix"}
        assert c.get("/debug/cache", headers=admin).json()["tiny"]["encoder_cache"]["entries"] == 1


async def test_cache_reset_during_requests_keeps_what_they_use(tiny_config):
    """Entries pinned by requests in flight survive a reset; everything ends consistent."""
    from mmserve import Runtime
    from mmserve.models.demo import render_image
    from tests.helpers import ask

    async with Runtime.open(tiny_config) as rt:
        generator, done = rt.registry.require("tiny").generator, []

        async def one(i):
            await rt.chat_completion(ask(render_image("red", "circle", seed=i % 3)), temperature=0, max_tokens=8)
            done.append(i)

        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)
            for _ in range(4):
                await rt.reset_caches()
                steps = generator.steps  # the requests move on (a decode step) before the next reset
                await wait_until(lambda: generator.steps > steps or len(done) == 6, what="a decode step")
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        m = rt.registry.require("tiny")
        m.prefix_cache.arena.check_invariants()
        assert not m.prefix_cache.arena.owners() and m.encoder.cache.stats().pinned_entries == 0

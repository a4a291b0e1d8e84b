"""Input that is valid JSON (or nearly) but hostile: lone surrogates, deep nesting, huge integers,
bodies that are not JSON, echoed input a megabyte long, and images the processor would blow up.
Each is a clean 4xx naming the problem, and the server answers normally afterwards."""

import io
import json

import httpx
import pytest
import transformers
from PIL import Image

from mmserve.errors import CLIP_CHARS, UnprocessableImage, clip
from mmserve.config import LimitsConfig
from mmserve.inputs.image_budget import check_image_size, processing_pixels, processing_steps
from mmserve.inputs.images import open_image
from tests.helpers import ServerThread, colour_question, data_url

ADMIN = {"Authorization": "Bearer root"}
JSON_HEADERS = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tiny_config):
    with ServerThread(tiny_config.replace(auth={"admin_key": "root"})) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def post_raw(client, raw: bytes, headers=JSON_HEADERS, path="/v1/chat/completions"):
    return client.post(path, content=raw, headers=headers)


def post_json(client, body: dict):
    """json.dumps escapes lone surrogates as \\udXXX (httpx's own encoder would fail on them)."""
    return post_raw(client, json.dumps(body).encode("ascii"))


def assert_error(resp, status, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text[:500]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_still_serving(client):
    ok = client.post("/v1/chat/completions", json={"messages": colour_question("red"), "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def nested(depth: int, inner=1, kind="object"):
    """`depth` containers, one inside the other."""
    value = inner
    for _ in range(depth):
        value = {"a": value} if kind == "object" else [value]
    return value


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                {"type": "text", "text": "bad \ud800 text"}]}]},
     "messages[0].content[1].text"),
    ({"messages": [{"role": "system", "content": "be brief \udc00"}, *USER]}, "messages[0].content"),
    ({"messages": USER, "stop": ["fine", "\udfff"]}, "stop[1]"),
    ({"messages": USER, "cache_salt": "salt\ud800"}, "cache_salt"),
    ({"messages": USER, "user": "\udbff"}, "user"),
    ({"messages": USER, "model": "tiny\ud800"}, "model"),
    ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages[0].name"),
    ({"messages": USER, "metadata": {"k\ud800": "v"}}, "metadata['k\\ud800']"),
], ids=["text", "system", "stop", "cache_salt", "user", "model", "name", "key"])
def test_lone_surrogates_are_refused_naming_the_field(client, body, param):
    err = assert_error(post_json(client, body), 400, param=param)
    assert "surrogate" in err["message"]
    assert_still_serving(client)


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b'{"a":' * 5_000 + b"1" + b"}" * 5_001,
], ids=["100k-arrays", "5k-objects"])
def test_nesting_too_deep_to_parse_is_400(client, raw):
    err = assert_error(post_raw(client, raw), 400)
    assert "deep" in err["message"]
    assert_still_serving(client)


def test_nesting_beyond_max_json_depth_is_400_and_within_it_is_served(client):
    # the body is level 1 and `metadata` (an ignored OpenAI field) level 2: 63 objects reach level 64
    ok = post_json(client, {"messages": USER, "max_tokens": 1, "metadata": nested(63)})
    assert ok.status_code == 200, ok.text
    err = assert_error(post_json(client, {"messages": USER, "max_tokens": 1, "metadata": nested(64)}), 400)
    assert err["param"].startswith("metadata.a.a") and "64" in err["message"]
    assert_error(post_json(client, {"messages": USER, "metadata": nested(64, kind="list")}), 400)
    assert_still_serving(client)


def test_integer_too_long_to_parse_is_400(client):
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5_000 + b"}"
    err = assert_error(post_raw(client, raw), 400)
    assert "number" in err["message"] and len(err["message"]) < 400
    assert_still_serving(client)


@pytest.mark.parametrize("key", ["temperature", "top_p", "max_tokens", "top_k", "presence_penalty"])
def test_huge_integer_parameters_are_400_naming_the_parameter(client, key):
    err = assert_error(post_json(client, {"messages": USER, key: 10**400}), 400, param=key)
    assert len(err["message"]) < 400
    assert_still_serving(client)


@pytest.mark.parametrize("headers", [
    {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {},
    {"content-type": "application/json; charset=latin-1"}, {"content-type": "application/jsonx"},
], ids=["text-plain", "form", "missing", "latin-1", "jsonx"])
def test_a_body_that_is_not_declared_json_is_415(client, headers):
    body = json.dumps({"messages": colour_question("red"), "max_tokens": 2}).encode()
    err = assert_error(post_raw(client, body, headers=headers), 415, code="unsupported_media_type")
    assert err["type"] == "invalid_request_error"
    assert_still_serving(client)  # on the same kept-alive connection: the body was read


def test_json_content_types_with_parameters_and_suffixes_are_accepted(client):
    body = json.dumps({"messages": colour_question("red"), "max_tokens": 2}).encode()
    assert_error(post_raw(client, body, headers={"content-type": "text/json"}), 415)
    for ctype in ["application/json; charset=utf-8", 'Application/JSON;Charset="UTF-8"', "application/vnd.api+json"]:
        resp = post_raw(client, body, headers={"content-type": ctype})
        assert resp.status_code == 200, (ctype, resp.text)


def test_admin_cache_reset_checks_the_content_type_of_a_non_empty_body(client):
    assert_error(post_raw(client, b'{"caches": ["prefix"]}', headers={**ADMIN, "content-type": "text/plain"},
                          path="/admin/cache/reset"), 415, code="unsupported_media_type")
    assert client.post("/admin/cache/reset", headers=ADMIN).status_code == 200  # empty body: no type needed
    assert client.post("/admin/cache/reset", json={"caches": ["prefix"]}, headers=ADMIN).status_code == 200


def test_echoed_input_is_clipped(client):
    resp = post_json(client, {"messages": USER, "model": "m" * 1_000_000})
    err = assert_error(resp, 404, code="model_not_found")
    assert len(err["message"]) < 400 and len(resp.content) < 1000
    assert "1000000 characters" in err["message"]
    resp = post_json(client, {"messages": USER, "k" * 1_000_000: 1, "temperature": 0})
    err = assert_error(resp, 400)
    assert len(err["message"]) < 400 and len(err["param"]) <= CLIP_CHARS and len(resp.content) < 1000
    err = assert_error(post_json(client, {"messages": [{"role": "r" * 100_000, "content": "x"}]}), 400)
    assert len(err["message"]) < 400
    assert_still_serving(client)


def test_extreme_aspect_ratio_image_is_400_over_http(client):
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (1, 10_000)))}},
        {"type": "text", "text": "?"}]}], "max_tokens": 2}
    assert_error(client.post("/v1/chat/completions", json=body), 400, code="image_too_large")
    assert_still_serving(client)


def test_clip():
    assert clip("abc") == "'abc'" and clip(1.5) == "1.5"
    long = clip("x" * 1_000_000)
    assert len(long) <= CLIP_CHARS and long.endswith("… (1000000 characters)")
    assert len(clip("\x00" * 200)) <= CLIP_CHARS  # escapes count too
    assert clip(10**5000) == "<an integer of about 5001 digits>"  # repr() itself would raise
    assert clip("\ud800") == "'\\ud800'"  # escaped: the message stays encodable
    assert len(clip([10**5000])) <= CLIP_CHARS


# --- images: the header's aspect ratio, and what the processor would make of the image ------------


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buf, "PNG")
    return buf.getvalue()


def test_open_image_refuses_an_extreme_aspect_ratio_before_decoding():
    for size in [(1, 10_000), (10_000, 1), (3, 700)]:
        with pytest.raises(UnprocessableImage) as info:
            open_image(png(*size), LimitsConfig(), "messages[0].content[0]")
        assert info.value.status == 400 and info.value.code == "image_too_large"
        assert "aspect ratio" in info.value.message and info.value.param == "messages[0].content[0]"
    assert open_image(png(1, 200), LimitsConfig(), "x").size == (1, 200)  # at the limit
    assert open_image(png(1, 1000), LimitsConfig(max_image_aspect_ratio=1000), "x").size == (1, 1000)


class Recorder:
    """Wraps an image processor's step methods and records the (height, width) each returns."""

    def __init__(self, monkeypatch, ip, names=("resize", "center_crop")):
        self.sizes: list[tuple[str, int, int]] = []
        for name in names:
            monkeypatch.setattr(ip, name, self._wrap(name, getattr(ip, name)))

    def _wrap(self, name, method):
        def wrapped(*args, **kwargs):
            out = method(*args, **kwargs)
            self.sizes.append((name, *out.shape[-2:]))
            return out
        return wrapped


ODD_SIZES = [(33, 47), (47, 33), (7, 5), (1, 150), (150, 1), (640, 17), (31, 32), (32, 32), (1000, 999)]


@pytest.fixture(scope="module")
def tiny_image_processor(tiny_model_dir):
    return transformers.AutoProcessor.from_pretrained(tiny_model_dir).image_processor


def expected_steps(ip, width, height):
    names = {"resize": "resize", "center crop": "center_crop"}
    return [(names[s.name], s.height, s.width) for s in processing_steps(ip, width, height)[1:]]


@pytest.mark.parametrize("width, height", ODD_SIZES)
def test_processing_pixels_matches_the_tiny_models_processor(monkeypatch, tiny_image_processor, width, height):
    ip = tiny_image_processor
    rec = Recorder(monkeypatch, ip)
    ip(images=[Image.new("RGB", (width, height))], return_tensors="np")
    assert rec.sizes == expected_steps(ip, width, height)
    assert processing_pixels(ip, width, height) == max(width * height, *(h * w for _, h, w in rec.sizes))


@pytest.mark.parametrize("kw", [
    {"size": {"shortest_edge": 50}, "crop_size": {"height": 40, "width": 30}},
    {"size": {"height": 20, "width": 70}, "do_center_crop": False},
    {"size": {"shortest_edge": 30, "longest_edge": 90}, "do_center_crop": False},
    {"size": {"max_height": 64, "max_width": 48}, "do_center_crop": False},
], ids=["shortest-edge", "height-width", "shortest-longest", "max-height-width"])
def test_processing_pixels_matches_clip_processors_of_every_size_layout(monkeypatch, kw):
    ip = transformers.CLIPImageProcessorPil(**kw)
    rec = Recorder(monkeypatch, ip)
    for width, height in ODD_SIZES:
        rec.sizes.clear()
        expected = expected_steps(ip, width, height)
        if any(0 in step[1:] for step in expected):  # a side scaled to nothing: PIL refuses it too
            with pytest.raises(ValueError, match="must be > 0"):
                ip(images=[Image.new("RGB", (width, height))], return_tensors="np")
            continue
        ip(images=[Image.new("RGB", (width, height))], return_tensors="np")
        assert rec.sizes == expected, (kw, width, height)


def test_a_thin_strip_explodes_in_a_clip_resize_and_is_refused():
    ip = transformers.CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    assert processing_pixels(ip, 1, 160_000) == 336 * 53_760_000
    lenient = LimitsConfig(max_image_aspect_ratio=1e9)  # so that the pixel budget is what refuses
    with pytest.raises(UnprocessableImage) as info:
        check_image_size(ip, 1, 160_000, lenient, "img")
    assert info.value.code == "image_too_large" and "resize" in info.value.message
    with pytest.raises(UnprocessableImage, match="aspect ratio"):
        check_image_size(ip, 1, 160_000, LimitsConfig(), "img")
    check_image_size(ip, 1, 200, LimitsConfig(), "img")  # 336 x 67,200 fits 40 M pixels
    check_image_size(ip, 4000, 3000, LimitsConfig(), "img")


@pytest.mark.skipif(not hasattr(transformers, "Qwen2VLImageProcessorPil"), reason="no Qwen2-VL PIL processor")
def test_processing_pixels_matches_a_qwen2_vl_processor(monkeypatch):
    ip = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    rec = Recorder(monkeypatch, ip, names=("resize",))
    for width, height in [*ODD_SIZES[:-1], (900, 700), (2000, 30)]:
        rec.sizes.clear()
        out = ip(images=[Image.new("RGB", (width, height))], return_tensors="np")
        steps = processing_steps(ip, width, height)
        resized = next(s for s in steps if s.name == "resize")
        assert rec.sizes == [("resize", resized.height, resized.width)], (width, height)
        patches = out["pixel_values"]  # [patches, channels * temporal * patch * patch]
        assert patches.shape[0] * ip.patch_size**2 == resized.height * resized.width
        assert processing_pixels(ip, width, height) == max(width * height, ip.temporal_patch_size * resized.pixels)
    with pytest.raises(UnprocessableImage, match="image processor cannot take"):  # its own 200:1 rule
        check_image_size(ip, 1, 300, LimitsConfig(max_image_aspect_ratio=1000), "img")


def test_an_unknown_processor_layout_is_bounded_as_decoded():
    from types import SimpleNamespace

    from mmserve.inputs.image_budget import UnknownLayout, check_image_size, processing_pixels

    odd = SimpleNamespace(do_resize=True, size={"tiles": 4})
    with pytest.raises(UnknownLayout):
        processing_pixels(odd, 100, 100)
    limits = LimitsConfig(max_image_pixels=10_000)
    check_image_size(odd, 100, 100, limits, "img")  # as decoded: 10,000 pixels, within the limit
    with pytest.raises(UnprocessableImage):
        check_image_size(odd, 101, 100, limits, "img")

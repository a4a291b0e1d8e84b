"""Video on Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision (tiny random-weight presets, transformers' own classes): the
first-step logits of a prompt with a video and an image within 1e-4 of the model's own forward on
the same frames, and the greedy tokens of the whole Runtime equal to `generate`'s — caches off, caches
on, and again on the caches' hits (the second question about a file skips decoding: the intake's
memo; and encoding: the encoder cache), for several videos, a video beside an image, a second turn,
and one file at two frame rates (two keys, two answers, each its own `generate`'s). A bad file is a
400 and the runtime goes on serving. The frames' preprocessing equals transformers'
`Qwen2VLVideoProcessor` where it can be built (it needs torchvision)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from mmserve import Runtime
from mmserve.config import Config, ModelConfig, VideoConfig
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.paged_forward import forward_paged
from mmserve.errors import BadRequest
from mmserve.inputs.video import decode_video
from mmserve.models.demo import build_untrained, render_image
from mmserve.models.demo.render_video import encode_mp4, render_clip, video_data_url
from mmserve.models.loading import load_adapter
from mmserve.models.qwen3_video import resized_size as qwen3_resized
from mmserve.models.qwen_video import video_patches
from mmserve.models.video_item import VideoItem, VideoSampling
from tests.conftest import on_device
from tests.family_parity import MARGIN_ABS
from tests.helpers import image_part

NEW_TOKENS = 6
QUESTION = "What color is the shape in the video?"


@pytest.fixture(scope="module", params=["tiny-qwen", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-llava-onevision"])
def family(request, tiny_qwen_dir, tiny_qwen25_dir, tmp_path_factory):
    if request.param in ("tiny-qwen3-vl", "tiny-llava-onevision"):
        path = build_untrained(request.param, tmp_path_factory.mktemp("v"), seed=0, random_weights=True)
    else:
        path = tiny_qwen_dir if request.param == "tiny-qwen" else tiny_qwen25_dir
    return request.param, path, load_adapter(request.param, path)


@pytest.fixture(scope="module")
def clips() -> list[bytes]:
    return [encode_mp4(render_clip(c, s, m, seed=i, frames=12, size=(48, 64)), fps=6)
            for i, (c, s, m) in enumerate([("red", "circle", True), ("blue", "square", False)])]


def item(adapter, data: bytes, sampling: VideoSampling) -> VideoItem:
    video = decode_video(data, adapter.video_plan(sampling, 64), VideoConfig(), "v")
    return VideoItem(video.meta, video.indices, video.content, sampling, lambda: video.frames)


def whole_video(adapter, it: VideoItem):
    """A video's patches and grid as the family's video processor makes them: the whole video at
    once (Qwen3-VL's prompt splits it into groups; its processor's tensors do not)."""
    if adapter.config.model_type != "qwen3_vl":
        return adapter.pixel_values([it])[0]
    s = adapter.video_settings
    h, w = qwen3_resized(it, s)
    grid = (-(-len(it.indices) // s.temporal_patch_size), h // s.patch_size, w // s.patch_size)
    return type(adapter.pixel_values([render_image("red", "circle")])[0])(video_patches(it.frames(), (h, w), s),
                                                                          grid, True)


def hf_inputs(adapter, messages: list[dict], items: list) -> dict:
    """The model's inputs, as the family's processor builds them from the frames."""
    if adapter.config.model_type == "llava_onevision":
        return onevision_inputs(adapter, messages, items)
    prompt = adapter.tokenize(messages, items)
    ids = torch.tensor([prompt.input_ids])
    types = (ids == adapter.image_token_id).int() + 2 * (ids == adapter.video_token_id).int()
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
    images = [adapter.pixel_values([it])[0] for it in items if not isinstance(it, VideoItem)]
    videos = [whole_video(adapter, it) for it in items if isinstance(it, VideoItem)]
    pixels = images + videos
    if images:
        out["pixel_values"] = torch.cat([p.patches for p in images])
        out["image_grid_thw"] = torch.tensor([p.grid for p in images])
    if videos:
        out["pixel_values_videos"] = torch.cat([p.patches for p in videos])
        out["video_grid_thw"] = torch.tensor([p.grid for p in videos])
        if adapter.config.model_type == "qwen2_5_vl":
            tps = adapter.video_settings.temporal_patch_size
            out["second_per_grid_ts"] = torch.tensor([tps / v.sampled_fps for v in items if isinstance(v, VideoItem)])
    counts = sum(int(np.prod(p.grid)) // adapter.merge_size ** 2 for p in pixels)
    assert counts == int((types > 0).sum())  # the processor's token counts
    return out, prompt


def onevision_inputs(adapter, messages: list[dict], items: list) -> dict:
    """LlavaOnevisionProcessor's tensors: the images' tiles and sizes, the videos' frames
    [videos, T, C, S, S] (one frame count per prompt, as its batching needs)."""
    prompt = adapter.tokenize(messages, items)
    pixels = adapter.pixel_values(items)
    out = adapter.generate_inputs(prompt, [p for p in pixels if not p.video])
    videos = [p.patches for p in pixels if p.video]
    if videos:
        out["pixel_values_videos"] = torch.stack(videos)
    s = adapter.video_settings
    n_video = sum(s.tokens(len(it.indices)) for it in items if isinstance(it, VideoItem))
    assert n_video == int((out["input_ids"] == adapter.video_token_id).sum())  # the processor's count
    return out, prompt


def chunked_logits(adapter, prompt, rows, chunk: int = 7) -> torch.Tensor:
    """The prompt through the paged arena in chunks of 7 tokens (ending inside videos), each
    chunk's rows handed over by `step_inputs` (Qwen3-VL's DeepStack levels too) -> last logits."""
    n = len(prompt.input_ids)
    arena = KVArena.for_model(adapter, 1 << 22, 16)
    table = tuple(range(-(-n // 16)))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pieces = [(max(s, sp.start) - s, r[max(s, sp.start) - sp.start:min(e, sp.start + sp.length) - sp.start])
                  for sp, r in zip(prompt.spans, rows) if max(s, sp.start) < min(e, sp.start + sp.length)]
        embeds, kw = adapter.step_inputs(prompt.input_ids[s:e], pieces)
        logits = forward_paged(adapter, embeds, [Segment(table, s, e - s)], arena, adapter.rope_positions(prompt, n, s, e),
                                       lm_kwargs=kw)
    return logits[0]


def generate(adapter, hf: dict) -> list[int]:
    with torch.inference_mode():
        out = adapter.model.generate(**hf, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, hf["input_ids"].shape[1]:].tolist()


def test_first_step_logits_equal_transformers_forward(family, clips):
    name, _, adapter = family
    image = render_image("green", "triangle", seed=5).resize((40, 56))
    items = [image, item(adapter, clips[0], VideoSampling(fps=3.0))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]}]
    hf, prompt = hf_inputs(adapter, messages, items)
    rows = adapter.encode_images(adapter.pixel_values(list(prompt.images)))
    logits = chunked_logits(adapter, prompt, rows)
    with torch.inference_mode():
        ref = adapter.model(**hf).logits[0, -1]
    diff = float((logits - ref).abs().max())
    print(f"{name}: video + image, {len(prompt.input_ids)} tokens, max |logit diff| {diff:.3g}")
    assert diff < MARGIN_ABS


def _chat(parts: list, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _video(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": video_data_url(data)}}


def test_runtime_equals_generate_caches_off_on_and_on_hits(family, clips):
    """The oracle over video workloads: each conversation's greedy answer through the Runtime, caches
    off, then on (twice: the second pass on hits), equals transformers' `generate`."""
    name, path, adapter = family
    image = render_image("yellow", "circle", seed=9).resize((48, 48))
    fps3, fps1 = VideoSampling(fps=3.0), VideoSampling(fps=1.0)
    # (messages for the runtime, the same for transformers, items, mm_processor_kwargs)
    cases = [
        ([_chat([_video(clips[0])])], [_chat([{"type": "video"}])], [item(adapter, clips[0], fps3)], {"fps": 3.0}),
        ([_chat([_video(clips[0])])], [_chat([{"type": "video"}])], [item(adapter, clips[0], fps1)], {"fps": 1.0}),
        ([_chat([_video(clips[0]), image_part(image), _video(clips[1])])],
         [_chat([{"type": "video"}, {"type": "image"}, {"type": "video"}])],
         [item(adapter, clips[0], fps3), image, item(adapter, clips[1], fps3)], {"fps": 3.0}),
        ([_chat([_video(clips[1])]), {"role": "assistant", "content": "red"}, _chat([], "Does the shape move?")],
         [_chat([{"type": "video"}]), {"role": "assistant", "content": "red"}, _chat([], "Does the shape move?")],
         [item(adapter, clips[1], fps3)], {"fps": 3.0}),
    ]
    expected = [generate(adapter, hf_inputs(adapter, hf_msgs, items)[0]) for _, hf_msgs, items, _ in cases]
    assert hf_inputs(adapter, *cases[0][1:3])[1].input_ids != hf_inputs(adapter, *cases[1][1:3])[1].input_ids
    lead = adapter.answer_lead

    async def run(config: Config, passes: int) -> list[list[str]]:
        out = []
        async with Runtime.open(config) as rt:
            for _ in range(passes):
                answers = []
                for msgs, _, _, kwargs in cases:
                    c = await rt.chat_completion(msgs, temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                                                 mm_processor_kwargs=kwargs)
                    answers.append(c.choices[0].text)
                out.append(answers)
            stats = rt.stats()[name]
            memo = len(rt.intake.video_memo)
        return out, stats, memo

    want = [adapter.tokenizer.decode(ids, skip_special_tokens=True).removeprefix(lead) for ids in expected]
    base = on_device(Config(models=(ModelConfig(name, str(path), default=True),)))
    off = base.replace(encoder_cache={"enabled": False}, kv_cache={"prefix_caching": False},
                       video={"identity_memo_entries": 0})
    (answers_off,), _, memo_off = trio.run(run, off, 1)
    assert answers_off == want and memo_off == 0
    (first, second), stats, memo = trio.run(run, base, 2)
    assert first == want and second == want
    assert memo == 3  # clip 0 at two rates, clip 1 at one
    print(f"{name}: {len(cases)} video conversations equal generate's, caches off and on; stats {stats}")


def test_a_second_question_skips_decoding_and_encoding(tiny_qwen25_dir, clips, monkeypatch):
    import mmserve.inputs.video_read as video_read

    decoded = []
    real = video_read.decode_video
    monkeypatch.setattr(video_read, "decode_video", lambda *a, **k: decoded.append(1) or real(*a, **k))
    config = on_device(Config(models=(ModelConfig("q", str(tiny_qwen25_dir), default=True),)))

    async def main():
        async with Runtime.open(config) as rt:
            for question in ("What color is the shape?", "Does the shape move?"):
                await rt.chat_completion([_chat([_video(clips[1])], question)], max_tokens=2, temperature=0)
            encoder = rt.stats()["q"]
            with pytest.raises(BadRequest) as e:
                await rt.chat_completion([_chat([_video(clips[1][:200])])], max_tokens=2)
            assert e.value.code == "invalid_video" and "messages[0].content (video 0)" in e.value.message
            await rt.chat_completion([_chat([_video(clips[1])])], max_tokens=2, temperature=0)  # still serving
            return encoder

    stats = trio.run(main)
    assert len(decoded) == 2  # the first question's and the bad file's; the second and third asked the memo
    assert stats["encoder"]["items_encoded"] == 1 and stats["encoder"]["hits"] == 1  # encoded once


def test_frames_equal_transformers_video_processor_where_it_can_be_built(tiny_qwen25_dir, clips):
    pytest.importorskip("torchvision")  # transformers' video processors run on it (no build for this CPU torch)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    adapter = load_adapter("q", tiny_qwen25_dir)
    it = item(adapter, clips[0], VideoSampling(fps=3.0))
    s = adapter.video_settings
    hf = Qwen2VLVideoProcessor(patch_size=s.patch_size, temporal_patch_size=s.temporal_patch_size,
                               merge_size=s.merge_size, min_pixels=s.min_pixels, max_pixels=s.max_pixels,
                               do_sample_frames=False, cap_pixels_per_frame=False)
    out = hf(videos=[it.frames()], return_tensors="pt")
    ours = adapter.pixel_values([it])[0]
    assert tuple(out["video_grid_thw"][0].tolist()) == ours.grid
    assert torch.equal(out["pixel_values_videos"], ours.patches)


def test_the_redis_tier_carries_video_encoder_outputs(tiny_qwen25_dir, clips, tmp_path):
    """Replica b answers a video question replica a answered first, with the video's encoder output
    from Redis (no vision tower run on b), and the same tokens as caches off."""
    from tests.redis_server import RedisServer

    base = on_device(Config(models=(ModelConfig("q", str(tiny_qwen25_dir), default=True),)))
    msgs = [_chat([_video(clips[0])])]

    async def ask(config: Config) -> tuple[str, object]:
        async with Runtime.open(config) as rt:
            c = await rt.chat_completion(msgs, temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
            model = rt.registry.loaded["q"]
            return c.choices[0].text, (model.encoder.items_encoded, model.encoder.shared_hits)

    off = base.replace(encoder_cache={"enabled": False}, kv_cache={"prefix_caching": False})
    want, _ = trio.run(ask, off)
    with RedisServer(tmp_path, None) as server:
        shared = base.replace(kv_cache={"prefix_caching": False}, shared_cache={
            "url": server.url, "lookup_deadline_ms": 3000.0, "secret": "video-replicas-secret", "finish_flush_ms": 0})
        got_a, (encoded_a, _) = trio.run(ask, shared)
        for _ in range(100):  # a's write is in the background: wait until it is in Redis
            if server.client().dbsize():
                break
            trio.run(trio.sleep, 0.05)
        got_b, (encoded_b, shared_hits_b) = trio.run(ask, shared)
    assert got_a == got_b == want
    assert encoded_a == 1 and (encoded_b, shared_hits_b) == (0, 1)

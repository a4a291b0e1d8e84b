"""Scenario 12, video: a second question about the same clip (TTFT warm / cold: the file is neither
decoded nor encoded again), decode + preprocess time per second of video, cache-on output equal to
cache-off output, and the peak memory decoding a long clip keeps within `[video]`'s bounds.

Needs a family that takes video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision: the `bench-qwen`
preset); on another the scenario says so and measures nothing."""

from __future__ import annotations

import time
import tracemalloc

from mmserve.bench.common import SYSTEM_A, SYSTEM_B, assistant, median, ratio, row, system, timed_chat
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_most
from mmserve.config import VideoConfig
from mmserve.errors import UnsupportedParameter
from mmserve.inputs.video import decode_video
from mmserve.models.demo.render_video import Q_VIDEO_COLOR, Q_VIDEO_MOVES, encode_mp4, render_clip, video_data_url

CLIP_SECONDS, CLIP_FPS, CLIP_SIDE = 4, 8, 112
LONG_SECONDS = 60  # the long clip of the memory check (at CLIP_FPS: 480 frames, sampled down to [video] max_frames)


def _user(text: str, url: str | None = None) -> dict:
    parts = [{"type": "video_url", "video_url": {"url": url}}] if url else []
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def _clip(seed: int, seconds: int = CLIP_SECONDS) -> bytes:
    frames = render_clip(("red", "blue", "green")[seed % 3], "circle", True, seed=seed, frames=seconds * CLIP_FPS,
                         size=(CLIP_SIDE, CLIP_SIDE))
    return encode_mp4(frames, fps=CLIP_FPS)


async def _questions(rt, url: str, tokens: int, salt: str) -> dict:
    first = [system(SYSTEM_A), _user(Q_VIDEO_COLOR, url)]
    cold = await timed_chat(rt, first, tokens, salt)
    other = await timed_chat(rt, [system(SYSTEM_B), _user(Q_VIDEO_MOVES, url)], tokens, salt)
    same = await timed_chat(rt, first + [assistant(cold.text), _user(Q_VIDEO_MOVES)], tokens, salt)
    return {"cold_s": cold.ttft, "other_conversation_s": other.ttft, "same_conversation_s": same.ttft,
            "prompt_tokens": cold.prompt_tokens, "texts": [cold.text, other.text, same.text]}


def _decode_rate(b: Bench, data: bytes, seconds: float) -> tuple[float, int, int]:
    """(decode + preprocess seconds per second of video, frames kept, peak traced bytes) of `data`,
    read as the server reads it (the model's own sampling and preprocessing)."""
    from mmserve.models.loading import load_adapter
    from mmserve.models.video_item import VideoItem, VideoSampling

    adapter = b.__dict__.setdefault("_video_adapter", load_adapter("bench-video", b.model_dir, device="cpu"))
    cfg = VideoConfig()
    sampling = VideoSampling(fps=cfg.default_fps)
    tracemalloc.start()
    t0 = time.perf_counter()
    video = decode_video(data, adapter.video_plan(sampling, cfg.max_frames), cfg, "bench")
    item = VideoItem(video.meta, video.indices, video.content, sampling, lambda: video.frames)
    adapter.pixel_values([item])
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return elapsed / seconds, len(video.indices), peak


async def video(b: Bench) -> dict:
    p = b.params
    runs: list[dict] = []
    equal = True
    async with b.runtime() as on, b.runtime(prefix=False, encoder=False, video={"identity_memo_entries": 0}) as off:
        for r in range(p.image_repeats):
            b.note(f"video repeat {r + 1}/{p.image_repeats}")
            url = video_data_url(_clip(r))
            try:
                got = await _questions(on, url, p.answer_tokens, f"video{r}")
            except UnsupportedParameter as e:
                return {"status": "skipped", "reason": e.message, "rows": []}
            ref = await _questions(off, url, p.answer_tokens, f"video{r}")
            equal &= got["texts"] == ref["texts"]
            runs.append({**got, "cache_off": {k: v for k, v in ref.items() if k != "texts"}})
    b.note("video decode rate and peak memory")
    per_second, frames, _ = _decode_rate(b, _clip(7), CLIP_SECONDS)
    _, long_frames, peak = _decode_rate(b, _clip(8, LONG_SECONDS), LONG_SECONDS)
    cfg = VideoConfig()
    bound = cfg.max_total_pixels * 3  # the sampled RGB frames [video] allows one video to hold
    summary = {k: median(r[k] for r in runs) for k in ("cold_s", "other_conversation_s", "same_conversation_s")}
    summary.update(ratio_other_conversation=ratio(summary["other_conversation_s"], summary["cold_s"]),
                   ratio_same_conversation=ratio(summary["same_conversation_s"], summary["cold_s"]),
                   cache_on_equals_off=equal, decode_preprocess_s_per_video_s=per_second, frames_per_clip=frames,
                   long_clip_frames_kept=long_frames, long_clip_peak_bytes=peak, bound_bytes=bound)
    rows = [
        row("12 video", "second question, other conversation: warm / cold TTFT", summary["other_conversation_s"], "s",
            summary["cold_s"], summary["ratio_other_conversation"], "≤ 0.3", at_most(summary["ratio_other_conversation"], 0.3)),
        row("12 video", "second question, same conversation: warm / cold TTFT", summary["same_conversation_s"], "s",
            summary["cold_s"], summary["ratio_same_conversation"], "≤ 0.3", at_most(summary["ratio_same_conversation"], 0.3)),
        row("12 video", f"decode + preprocess per second of video ({CLIP_SIDE}px, {CLIP_FPS} fps)", per_second, "s"),
        row("12 video", "cache-on output == cache-off output", 1.0 if equal else 0.0, "", None, None, "== 1", equal),
        row("12 video", f"peak traced bytes decoding a {LONG_SECONDS} s clip / [video] bound", peak, "B", bound,
            ratio(peak, bound), "≤ 1", at_most(ratio(peak, bound), 1.0)),
    ]
    return {"new_tokens": p.answer_tokens, "clip_seconds": CLIP_SECONDS, "summary": summary, "runs": runs, "rows": rows}

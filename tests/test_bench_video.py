"""`mmserve bench --scenarios video` (opt-in): on a family that takes video it measures the second
question about one clip warm / cold, the decode rate and the peak memory of a long clip, with
cache-on answers equal to cache-off; on one that does not (LLaVA) it says so."""

from __future__ import annotations

from dataclasses import replace

from mmserve.bench import PARAMS, run_bench
from mmserve.cli import _scenario_list


def test_the_video_scenario_on_tiny_qwen(tmp_path):
    report = run_bench(tmp_path, replace(PARAMS["test"], preset="tiny-qwen", scenarios=("video",)), progress=False)
    s = report["scenarios"]["video"]["summary"]
    assert s["cache_on_equals_off"] is True
    assert s["cold_s"] > 0 and s["other_conversation_s"] > 0 and s["decode_preprocess_s_per_video_s"] > 0
    assert s["long_clip_frames_kept"] == 64 and 0 < s["long_clip_peak_bytes"] <= s["bound_bytes"]
    assert {r["metric"].split(":")[0] for r in report["summary"]} >= {"second question, other conversation"}


def test_the_video_scenario_is_opt_in_and_skips_a_family_without_video(tmp_path):
    assert "video" not in PARAMS["full"].scenarios and _scenario_list("video,decode") == ("decode", "video")
    report = run_bench(tmp_path, replace(PARAMS["test"], preset="tiny", scenarios=("video",)), progress=False)
    assert report["scenarios"]["video"]["status"] == "skipped"

"""`mmserve bench --scenarios deterministic` (opt-in, issue 40): the same requests through a
default server and a deterministic one, in turns; each row is the mode's time over the
default's, the median of the rounds' ratios. The servers are checked to run the modes compared."""

from __future__ import annotations

import statistics
from dataclasses import replace

from mmserve.bench import PARAMS, run_bench
from mmserve.cli import _scenario_list


def test_the_deterministic_scenario_compares_the_modes_side_by_side(tmp_path):
    assert "deterministic" not in PARAMS["full"].scenarios
    assert _scenario_list("deterministic,decode") == ("decode", "deterministic")
    params = replace(PARAMS["test"], scenarios=("deterministic",))
    report = run_bench(tmp_path, params, progress=False)
    s = report["scenarios"]["deterministic"]
    assert s["status"] == "ok", s
    assert s["fingerprints"]["default"] is None and s["fingerprints"]["deterministic"].startswith("mmserve-det")
    runs = s["runs"]
    for mode in ("default", "deterministic"):
        assert len(runs[mode]["decode_tps"]) == params.det_rounds and all(x > 0 for x in runs[mode]["decode_tps"])
        assert len(runs[mode]["wall_s@2"]) == params.det_rounds and all(x > 0 for x in runs[mode]["wall_s@2"])
    # the rows: the median of the per-round ratios (the mode's time over the default's)
    want = statistics.median(d / t for d, t in zip(runs["default"]["decode_tps"], runs["deterministic"]["decode_tps"]))
    rows = [r for r in report["summary"] if r["scenario"] == "13 deterministic"]
    assert [r["value"] for r in rows] == [s["cost"]["decode"], s["cost"]["@2"]]
    assert abs(rows[0]["value"] - want) < 1e-12 and rows[0]["target"] == "≤ 1.35"
    assert "single-stream decode" in rows[0]["metric"] and "2 concurrent" in rows[1]["metric"]

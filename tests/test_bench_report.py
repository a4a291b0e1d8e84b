"""The benchmark's plot: one row per target on a scale normalised to it (right of 1 = met, floors
and ceilings alike), what each target is about (ratio, value with a unit, |diff|), the load
warning, and re-rendering a saved report.json."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from mmserve.bench.report import _header_lines, plot, replot, target_rows  # noqa: E402

BASELINE = Path(__file__).resolve().parent.parent / "bench" / "results" / "2026-11-25-quick-before" / "report.json"
PNG = b"\x89PNG\r\n\x1a\n"


def row(metric, value, baseline=None, ratio=None, target=None, ok=None, unit=""):
    return {"scenario": "9 test", "metric": metric, "value": value, "unit": unit, "baseline": baseline,
            "ratio": ratio, "target": target, "ok": ok}


def test_each_target_is_read_as_what_it_bounds():
    rows = target_rows([
        row("floor on a ratio", 96.7, 99.7, 0.97, "≥ 1.0", False, "tok/s"),
        row("ceiling on a ratio", 0.03, 0.15, 0.2, "≤ 0.25", True, "s"),
        row("ceiling on a value with a unit", 14.5, 3.1, 4.6, "< 50 ms", True, "ms"),
        row("ceiling on a difference", 0.907, 0.907, 1.0, "|diff| ≤ 0.05", True),
        row("floor on a value with no baseline", 0.93, None, None, "≥ 0.9", True),
        row("a check", True, None, None, "true", True),
        row("an error, no target", "PeerError: it exited", ok=False),
        row("no target, no verdict", 1.5, 1.0, 1.5),  # not a target: left out
        row("a ratio lost (NaN in report.json)", 3.0, 2.0, None, "≥ 2.5", None),
    ])
    by = {r["label"].split(": ", 1)[1]: r for r in rows}
    assert len(rows) == 8 and "no target, no verdict" not in by
    assert by["floor on a ratio"]["kind"] == "floor" and by["floor on a ratio"]["margin"] == pytest.approx(0.97)
    assert by["ceiling on a ratio"]["kind"] == "ceiling" and by["ceiling on a ratio"]["margin"] == pytest.approx(1.25)
    assert by["ceiling on a value with a unit"]["measured"] == 14.5  # not the ratio to idle
    assert by["ceiling on a value with a unit"]["margin"] == pytest.approx(50 / 14.5)
    assert by["ceiling on a difference"]["measured"] == 0 and by["ceiling on a difference"]["margin"] == math.inf
    assert by["floor on a value with no baseline"]["margin"] == pytest.approx(0.93 / 0.9)
    assert by["a check"]["kind"] == "check" and by["an error, no target"]["kind"] == "failed"
    assert math.isnan(by["a ratio lost (NaN in report.json)"]["margin"])  # n/a, not the value 3.0
    assert "(floor)" in by["floor on a ratio"]["text"] and "(ceiling)" in by["ceiling on a ratio"]["text"]


def test_right_of_the_target_is_met_for_every_row_of_the_baseline_run():
    rows = [r for r in target_rows(json.loads(BASELINE.read_text())["summary"])
            if r["kind"] in ("floor", "ceiling") and not math.isnan(r["margin"])]
    assert len(rows) >= 15
    assert all((r["margin"] >= 1) == r["ok"] for r in rows), [(r["label"], r["margin"], r["ok"]) for r in rows]


def test_load_warning_is_on_the_image_header():
    report = json.loads(BASELINE.read_text())
    lines, warning = _header_lines(report["meta"])
    quiet = copy.deepcopy(report["meta"]) | {"cpu_count": 2, "loadavg_start": [1.0, 1, 1], "loadavg_end": [2.5, 1, 1]}
    lines, warning = _header_lines(quiet)
    assert not warning and "the machine was quiet" in " ".join(lines)
    meta = copy.deepcopy(quiet) | {"thread_probe_end": {"matmul_ms_1_threads": 0.2, "matmul_ms_2_threads": 1.1}}
    lines, warning = _header_lines(meta)
    assert warning and "oversubscribed" in " ".join(lines) and "6x" in " ".join(lines)
    # the probe matmul saw nothing, but other processes kept the 2 CPUs busy (load average 4)
    busy = quiet | {"loadavg_end": [4.0, 3.5, 3.0]}
    lines, warning = _header_lines(busy)
    assert warning and "the machine was busy" in " ".join(lines) and "4.0 on 2 CPUs" in " ".join(lines)


def test_replot_renders_a_saved_report(tmp_path):
    (tmp_path / "report.json").write_text(BASELINE.read_text())
    assert replot(tmp_path) == tmp_path / "report.png"
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG
    assert replot(tmp_path / "report.json", tmp_path / "other.png").read_bytes()[:8] == PNG


def test_plot_without_targets_or_scenarios(tmp_path):
    report = json.loads(BASELINE.read_text())
    report["summary"], report["scenarios"] = [], {}
    plot(report, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:8] == PNG


def test_the_progress_bars_eta_after_the_first_scenario_is_right_within_30_percent():
    """The bar advances by each scenario's weight: after the first scenario its ETA is the rest's
    weight at the first one's pace. Checked against the recorded runs (quick on a CPU, an H200's)."""
    from mmserve.bench.params import KNOWN_SCENARIOS
    from mmserve.bench.run import SCENARIO_WEIGHTS, scenario_weight

    assert set(SCENARIO_WEIGHTS) == set(KNOWN_SCENARIOS)  # a new scenario (opt-in ones too) gets its weight
    results = BASELINE.parent.parent
    for run in ("2026-11-25-quick-before", "2026-11-26-quick-session-after", "2026-11-27-gpu-h200-run3"):
        scenarios = json.loads((results / run / "report.json").read_text())["scenarios"]
        names = list(scenarios)
        first = scenarios[names[0]]["duration_s"]
        predicted = first * sum(scenario_weight(n) for n in names[1:]) / scenario_weight(names[0])
        actual = sum(scenarios[n]["duration_s"] for n in names[1:])
        assert abs(predicted - actual) <= 0.3 * actual, (run, predicted, actual)

"""`mmserve bench` scenarios 9 (engine_overhead: the model's forward a stand-in of fixed duration,
everything else the real runtime) and 10 (absolute: copy bandwidth, weights per decode step,
prefill time per token count), and the report's absolute figures, on the tiny preset."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from mmserve.bench import PARAMS, run_bench
from mmserve.bench.absolute_figures import absolute_figures
from mmserve.bench.device_limits import PrefillTimer, copy_bandwidth, decode_weight_bytes
from mmserve.bench.model import default_model_dir, ensure_model
from mmserve.bench.report import markdown
from mmserve.bench.scenarios.engine import engine_rows, overlap_configurable, window_figures
from mmserve.bench.stand_in import Call, DeviceClockEvent, StandInForward, window_calls
from mmserve.engine.step_sampling import RowSpec, plan_sampling, sample_on_device
from mmserve.generation.sampling import SamplingParams
from mmserve.models.loading import load_adapter

SERIAL, OVERLAP = "stand-in busy, serial", "stand-in busy with overlap"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-engine")
    return ensure_model(default_model_dir(root, "tiny"), "tiny")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_adapter("bench", tiny_dir)


def test_engine_overhead_runs_the_real_runtime_around_the_stand_in(tiny_dir, tmp_path):
    params = replace(PARAMS["test"], scenarios=("engine_overhead", "absolute"))
    report = run_bench(tmp_path, params, model_dir=tiny_dir, progress=False)

    data = json.loads((tmp_path / "report.json").read_text())
    sc = data["scenarios"]["engine_overhead"]
    assert sc["status"] == "ok" and sc["streams"] == params.engine_streams
    serial = sc["variants"]["serial"]
    assert serial["status"] == "ok" and serial["preemptions"] == 0
    # the window: only steps with every stream decoding (one new token each), at least two
    assert serial["steps"] >= 2 and serial["tokens_per_step"] == [params.engine_streams]
    # every step of the window went through the stand-in: the generator counted as many steps
    assert serial["generator_steps"] == serial["steps"]
    # from the stand-in's own clock: its busy time over the span of its calls; each call lasts the
    # nominal duration (the logits are made inside it) and the host's time is what is left
    assert 0 < serial["busy"] <= 1
    assert serial["busy"] == pytest.approx(serial["stand_in_busy_s"] / serial["span_s"])
    assert serial["stand_in_ms_per_step"] == pytest.approx(params.engine_stand_in_ms, rel=0.25)
    assert serial["stand_in_busy_s"] == pytest.approx(serial["steps"] * serial["stand_in_ms_per_step"] / 1000)
    assert serial["idle_ms_per_step"] > 0 and serial["event_loop_ms_per_step"] > 0
    assert serial["stand_in"] == "asynchronous" and serial["loop_busy_ms_per_step"] > 0
    # the serial loop awaits the whole step, its results included: the stand-in's time plus the
    # compute thread's own work, whether the stand-in blocks that thread or runs beside it
    blocking = sc["variants"]["serial, blocking stand-in"]
    assert blocking["status"] == "ok" and blocking["stand_in"] == "blocking"
    for v in (serial, blocking):
        assert v["forward_ms_per_step"] > v["stand_in_ms_per_step"]
        assert v["compute_host_ms_per_step"] == pytest.approx(
            v["forward_ms_per_step"] - v["stand_in_ms_per_step"] - v["late_wake_ms_per_step"])
    # with overlap and the asynchronous stand-in the chain awaits the compute thread's launches alone
    overlap = sc["variants"]["overlap"]
    if overlap["status"] == "ok":
        assert overlap["compute_host_ms_per_step"] == overlap["forward_ms_per_step"]

    rows = {r["metric"]: r for r in data["summary"] if r["scenario"] == "9 engine overhead"}
    assert rows[SERIAL]["value"] == serial["busy"] and rows[SERIAL]["target"] is None
    assert rows[OVERLAP]["target"] == "≥ 0.92"
    if overlap_configurable():  # the overlap scheduler exists: measured, with its verdict
        assert isinstance(rows[OVERLAP]["value"], float) and rows[OVERLAP]["ok"] is not None
    else:  # not faked: no value, no verdict
        assert sc["variants"]["overlap"]["status"] == "not built"
        assert rows[OVERLAP]["value"] == "not built" and rows[OVERLAP]["ok"] is None
    assert any(m.startswith("host time per step, serial") for m in rows)
    assert rows[SERIAL + ", blocking stand-in"]["target"] is None  # the target is on the device-like one

    md = (tmp_path / "report.md").read_text()
    assert f"| 9 engine overhead | {OVERLAP} |" in md and f"| 9 engine overhead | {SERIAL} |" in md
    assert "## Absolute figures" in md and "| prefill of 16 tokens |" in md
    figures = {f["figure"]: f for f in report["absolute"]}
    assert figures["stand-in busy, serial (4.0 ms forward)"]["value"] == serial["busy"]
    ab = data["scenarios"]["absolute"]
    assert [r["tokens"] for r in ab["prefill"]] == list(params.prefill_tokens)
    assert all(r["ms"] > 0 for r in ab["prefill"]) and ab["copy"]["bytes_per_s"] > 0


def test_stand_in_replaces_the_forward_and_gives_it_back(tiny):
    body, head = tiny.language_model, tiny.model.lm_head
    counted = iter(range(100))
    with StandInForward(tiny, 0.02, counters=lambda: (next(counted),)) as stand_in:
        assert tiny.language_model is stand_in.body and tiny.model.lm_head is stand_in.head
        assert tiny.model.get_input_embeddings() is body.get_input_embeddings()  # the real embedding stays
        out = tiny.prefill(tiny.embed([1, 2, 3, 4, 5]))
    assert tiny.language_model is body and tiny.model.lm_head is head
    assert out.logits.shape == (1, tiny.vocab_size) and out.logits.dtype == torch.float32
    assert int(out.logits.argmax()) == stand_in.token_cycle[0]  # an ordinary token wins
    (call,) = stand_in.calls
    assert call.tokens == 5 and call.rows == 1 and call.counters == (0,)
    assert call.end - call.start == pytest.approx(0.02)


def test_asynchronous_stand_in_queues_its_work_and_holds_the_samples_until_it_ends(tiny):
    with StandInForward(tiny, 0.05, asynchronous=True) as stand_in:
        t0 = time.perf_counter()
        tiny.prefill(tiny.embed([1, 2, 3]))
        tiny.prefill(tiny.embed([4, 5]))
        returned = time.perf_counter()
        logits = torch.zeros(1, stand_in.vocab)
        sample = sample_on_device(logits, plan_sampling([RowSpec(0, SamplingParams(temperature=0), None)]))
    first, second = stand_in.calls
    assert returned - t0 < 0.05  # the launches returned at once, as a GPU's do
    assert second.start == pytest.approx(first.end) and second.end - second.start == pytest.approx(0.05)
    # the samples reach the host once the work queued before them ended, not before
    assert isinstance(sample.ready, DeviceClockEvent) and sample.ready.end == second.end
    assert not sample.done()
    sample.unpack()  # waits for the device's clock
    assert time.perf_counter() >= second.end and sample.done()
    # a blocking stand-in's forward takes its time on the calling thread
    with StandInForward(tiny, 0.02) as blocking:
        t0 = time.perf_counter()
        tiny.prefill(tiny.embed([1, 2, 3]))
        assert time.perf_counter() - t0 >= 0.02
        assert sample_on_device(logits, plan_sampling([RowSpec(0, SamplingParams(temperature=0), None)])).ready is None
    assert blocking.calls[0].woke is not None


def test_window_figures_from_the_stand_ins_timestamps():
    # three calls of 4 ms, 6 ms apart (2 ms of host between them); counters (steps, host_s, forward_s)
    calls = [Call(0.000, 0.004, 32, 32, (10, 1.0, 2.0)), Call(0.006, 0.010, 32, 32, (11, 1.002, 2.005)),
             Call(0.012, 0.016, 32, 32, (12, 1.004, 2.010)), Call(0.018, 0.022, 31, 31, (13, 1.006, 2.015))]
    # the window closes after the third call ended; the last call inside is left out (it may be late)
    assert window_calls(calls, 0.0, 0.0205) == calls[:2]
    out = window_figures(calls, 0.0, 0.017, final=(14, 1.008, 2.020))
    assert out["steps"] == 2 and out["span_s"] == pytest.approx(0.010)
    assert out["busy"] == pytest.approx(0.008 / 0.010)
    assert out["idle_ms_per_step"] == pytest.approx(2.0) and out["step_ms"] == pytest.approx(6.0)
    # the generator's split over the same two steps: counters of the first call and of the one after
    assert out["generator_steps"] == 2 and out["event_loop_ms_per_step"] == pytest.approx(2.0)
    assert out["forward_ms_per_step"] == pytest.approx(5.0) and out["compute_host_ms_per_step"] == pytest.approx(1.0)
    assert out["late_wake_ms_per_step"] == 0
    # a sleep that ended late is the stand-in's thread's lateness, not busy time nor the step's host work
    late = [replace(c, woke=c.end + 0.001) for c in calls]
    out = window_figures(late, 0.0, 0.017, final=(14, 1.008, 2.020))
    assert out["busy"] == pytest.approx(0.8) and out["late_wake_ms_per_step"] == pytest.approx(1.0)
    assert out["compute_host_ms_per_step"] == pytest.approx(0.0, abs=1e-9)
    assert window_figures(calls, 0.0, 0.005, final=())["status"] == "no window"
    # the overlap chain with an asynchronous stand-in: the time awaiting the compute thread is its own work;
    # a fourth counter, the event loop's busy time, gives its time a step
    counted = [replace(c, counters=c.counters + (0.5 + 0.003 * i,)) for i, c in enumerate(calls)]
    out = window_figures(counted, 0.0, 0.017, final=(14, 1.008, 2.020, 0.512), launches_only=True)
    assert out["compute_host_ms_per_step"] == pytest.approx(5.0) and out["loop_busy_ms_per_step"] == pytest.approx(3.0)


def test_engine_rows_never_fake_the_overlap():
    serial = {"status": "ok", "busy": 0.4, "idle_ms_per_step": 6.0, "steps": 30, "stand_in_ms_per_step": 4.0}
    rows = engine_rows({"serial": serial, "overlap": {"status": "not built"}}, 32)
    overlap = next(r for r in rows if r["metric"] == OVERLAP)
    assert (overlap["value"], overlap["ok"], overlap["target"]) == ("not built", None, "≥ 0.92")
    measured = engine_rows({"serial": serial, "overlap": dict(serial, busy=0.95)}, 32)
    assert next(r for r in measured if r["metric"] == OVERLAP)["ok"] is True
    failed = engine_rows({"serial": {"status": "no window"}, "overlap": dict(serial, busy=0.5)}, 32)
    assert next(r for r in failed if r["metric"] == SERIAL)["ok"] is False
    assert next(r for r in failed if r["metric"] == OVERLAP)["ok"] is False


def test_prefill_timer_runs_a_real_prefill(tiny):
    timer = PrefillTimer(tiny, 40)
    step = timer.step(37)
    logits = timer.runner.forward(step)
    ref = tiny.prefill(tiny.embed(list(step.ids))).logits
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert timer.time(16, 2)["ms"] > 0


def test_decode_weight_bytes_leave_out_the_embedding_table_and_the_vision_tower(tiny):
    lm = sum(p.numel() * p.element_size() for p in tiny.language_model.parameters())
    embedding = tiny.model.get_input_embeddings().weight
    head = tiny.model.lm_head.weight
    expected = lm - embedding.numel() * embedding.element_size() + head.numel() * head.element_size()
    assert decode_weight_bytes(tiny) == expected
    assert decode_weight_bytes(tiny) < sum(p.numel() * p.element_size() for p in tiny.model.parameters())
    copy = copy_bandwidth("cpu", 4, repeats=2)
    assert copy["bytes"] == 4 << 20 and copy["bytes_per_s"] == pytest.approx(2 * copy["bytes"] / copy["seconds"])


def test_absolute_figures_put_tok_s_against_the_bandwidth_limit():
    scenarios = {
        "decode": {"decode_tps": {"embedded": 100.0, "http": 90.0, "hf": 20.0}},
        "concurrency": {"levels": [{"concurrency": 32, "agg_tps": 900.0}],
                        "embedded": {"concurrency": 32, "agg_tps": 800.0,
                                     "host_share": {"status": "ok", "host_ms_per_step": 2.0, "forward_ms_per_step": 18.0},
                                     "gpu_busy": {"status": "ok", "busy": 0.5}}},
        "absolute": {"copy": {"bytes_per_s": 4e12}, "decode_weight_bytes": 13.5e9,
                     "prefill": [{"tokens": 640, "ms": 40.0}], "prefill_path": "runner, triton backend"},
    }
    f = {x["figure"]: x["value"] for x in absolute_figures(scenarios)}
    assert f["decode limit of one stream (bandwidth / weights)"] == pytest.approx(4e12 / 13.5e9)
    assert f["fraction of the bandwidth limit, one stream"] == pytest.approx(100 * 13.5e9 / 4e12)
    assert f["step time while 32 decode"] == pytest.approx(20.0)
    assert f["fraction of the bandwidth limit while 32 decode (weights only)"] == pytest.approx(13.5e9 / 4e12 / 0.020)
    assert f["GPU busy while 32 decode"] == 0.5 and f["aggregate tok/s @32, HTTP"] == 900.0
    assert f["prefill of 640 tokens"] == 40.0 and f["prefill tok/s at 640 tokens"] == pytest.approx(16000)
    # a run without scenario 10: the figures it has, none made up
    partial = {x["figure"] for x in absolute_figures({"decode": scenarios["decode"]})}
    assert partial == {"decode tok/s, one stream, embedded", "decode tok/s, one stream, http"}
    # old reports (no "absolute" key) render their figures from their scenarios
    md = markdown({"meta": {"params": {"name": "x", "preset": "tiny"}, "model_dir": "m", "torch_threads": 2,
                            "cpu_count": 2, "loadavg_start": None, "loadavg_end": None, "duration_s": 1.0,
                            "torch": "t", "transformers": "t"}, "summary": [],
                   "scenarios": {k: scenarios[k] for k in ("decode", "absolute")}})
    assert "| fraction of the bandwidth limit, one stream | 0.338 |" in md

"""The benchmark's report: report.json (everything), report.md (tables), report.png (charts)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from mmserve.bench.absolute_figures import absolute_figures  # noqa: E402
from mmserve.bench.report_targets import FAIL, _num, _plot_targets, fmt, target_rows  # noqa: E402,F401

COLUMNS = ("scenario", "metric", "mmserve", "baseline", "ratio", "target", "ok")


def write_reports(report: dict, out: Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md", "png": out / "report.png"}
    paths["json"].write_text(json.dumps(_clean(report), indent=2, default=str) + "\n")
    paths["md"].write_text(markdown(report))
    plot(report, paths["png"])
    return paths


def _clean(o):
    """NaN (a ratio with nothing to divide by) as null: report.json stays strict JSON."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


# -- Markdown ------------------------------------------------------------------------------------

def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _summary_cells(r: dict) -> list:
    value = f"{fmt(r['value'])} {r['unit']}".strip() if not isinstance(r["value"], (bool, str)) else r["value"]
    base = f"{fmt(r['baseline'])} {r['unit']}".strip() if isinstance(r["baseline"], float) else r["baseline"]
    return [r["scenario"], r["metric"], value, base, r["ratio"], r["target"], r["ok"]]


def markdown(report: dict) -> str:
    meta = report["meta"]
    parts = [
        f"# mmserve benchmark ({meta['params']['name']}): {_model_title(meta)}",
        f"Model `{meta['model_dir']}` ({_model_title(meta)}), torch threads "
        f"{meta['torch_threads']}, {meta['cpu_count']} CPUs, load average {fmt(meta['loadavg_start'])} at start and "
        f"{fmt(meta['loadavg_end'])} at the end; took {meta['duration_s']:.0f} s. torch {meta['torch']}, "
        f"transformers {meta['transformers']}.",
        _device_line(meta),
        "Every comparison ran side by side in this run: read the ratios; absolute times on a shared machine mean "
        "little. Baselines: raw transformers `generate` (scenarios 1-2; one request after another, and at the "
        "top concurrency level also all of them in one batched call), the same runtime with the cache off "
        "(3-5), the cold first request (4), the bare suffix prefill (3). Greedy decoding, fixed lengths "
        "(min_tokens = max_tokens).",
        *_load_warning(meta),
        *_image_tokens(meta),
        "## Summary",
        table(COLUMNS, [_summary_cells(r) for r in report["summary"]]),
        *_absolute(report),
    ]
    parts += _details(report["scenarios"])
    return "\n\n".join(parts) + "\n"


def _absolute(report: dict) -> list[str]:
    """The absolute figures beside the ratios (`absolute_figures`), where the run has any."""
    figures = report.get("absolute")
    if figures is None:
        figures = absolute_figures(report["scenarios"])
    if not figures:
        return []
    rows = [(f["figure"], f"{fmt(f['value'])} {f['unit']}".strip(), f["source"]) for f in figures]
    return ["## Absolute figures",
            "To compare with other servers' published numbers directly. The bandwidth limit: a decode step reads "
            "the language model's and the output head's weights once, at the copy bandwidth measured in this run "
            "(KV reads come on top).",
            table(("figure", "value", "from scenario"), rows)]


def _device_line(meta: dict) -> str:
    """The device, its name, the dtype and the CUDA build (reports from before they were recorded:
    the CPU, float32)."""
    weights = "random weights drawn at load (no weights file)" if meta.get("random_weights") else "weights from files"
    return (f"Device `{meta.get('device', 'cpu')}` ({meta.get('device_name') or 'unknown'}), dtype "
            f"{meta.get('dtype', 'float32')}, CUDA {meta.get('cuda') or 'none (CPU build)'}; "
            f"{weights}.")


def _model_title(meta: dict) -> str:
    """The family and preset, e.g. Qwen2-VL, preset `bench-qwen` (reports from before the family
    was recorded are LLaVA runs)."""
    preset = meta.get("preset", meta["params"]["preset"])
    where = f"preset `{preset}`" if preset else "a checkpoint not built by the benchmark"
    return f"{meta.get('family', 'LLaVA')}, {where}"


def _image_tokens(meta: dict) -> list[str]:
    """The image tokens over the sizes used, where they vary with the size (Qwen2-VL)."""
    tokens = meta.get("tokens_per_image")
    if not tokens:
        return []
    sizes = ", ".join(f"{size} → {n}" for size, n in tokens.items())
    return [f"Images vary in size (cycled, request by request), so does their token count: tokens per image over "
            f"the sizes used (W x H → tokens): {sizes}; mean {sum(tokens.values()) / len(tokens):.0f}."]


LOAD_WARNING_AT = 3.0  # n-thread / 1-thread time of the probe matmul above which the CPU was oversubscribed


def _thread_slowdown(meta: dict) -> float | None:
    """The worst (start or end) time of the probe matmul with `torch_threads` threads over its time
    with 1: about 1/n on a quiet machine, far above 1 when torch's threads wait for each other."""
    n = meta["torch_threads"]
    worst = None
    for probe in (meta.get("thread_probe_start"), meta.get("thread_probe_end")):
        if probe and n > 1 and probe.get("matmul_ms_1_threads"):
            worst = max(worst or 0.0, probe[f"matmul_ms_{n}_threads"] / probe["matmul_ms_1_threads"])
    return worst


LOADAVG_WARNING_PER_CPU = 1.5  # a 1-minute load average above this many per CPU: other work competed


def _busy_load(meta: dict) -> float | None:
    """The highest 1-minute load average seen (start or end) when it is above
    LOADAVG_WARNING_PER_CPU per CPU, else None. The probe matmul alone misses a machine whose other
    processes leave each of its ops time to finish (0.1 ms): the load average does not."""
    cpus = meta.get("cpu_count") or 0
    seen = [la[0] for la in (meta.get("loadavg_start"), meta.get("loadavg_end")) if la]
    worst = max(seen, default=None)
    return worst if worst is not None and cpus and worst > LOADAVG_WARNING_PER_CPU * cpus else None


def _load_warning(meta: dict) -> list[str]:
    """A note when torch's threads were stalling each other (an oversubscribed CPU), or when other
    processes kept the machine busy (the load average against the CPU count)."""
    n, worst = meta["torch_threads"], _thread_slowdown(meta)
    if worst is None or worst < LOAD_WARNING_AT:
        load = _busy_load(meta)
        if load is None:
            return []
        return [f"**Warning: the machine was busy.** Its load average reached {load:.1f} on {meta['cpu_count']} CPUs "
                "(other processes competed for them): absolute times are inflated and noisy. Prefer ratios, "
                "and rerun on a quiet machine."]
    return [f"**Warning: the CPU was oversubscribed.** A small matmul took up to {worst:.0f}x longer with {n} "
            "torch threads than with 1 (other processes were busy): every op paid for thread synchronisation, "
            "so absolute times are inflated and noisy. Prefer ratios, and rerun on a quiet machine."]


def _details(sc: dict) -> list[str]:
    parts = ["## Details"]
    conc = sc.get("concurrency", {})
    if conc.get("levels"):
        header = ("N", "agg tok/s", "HF agg tok/s", "ratio", "TTFT p50 s", "TTFT p99 s", "HF TTFT p50 s",
                  "HF TTFT p99 s", "wall s")
        rows = [(lv["concurrency"], lv["agg_tps"], lv["hf"]["agg_tps"], lv["ratio_agg_tps"], lv["ttft_p50_s"],
                 lv["ttft_p99_s"], lv["hf"]["ttft_p50_s"], lv["hf"]["ttft_p99_s"], lv["wall_s"]) for lv in conc["levels"]]
        parts += [f"### 2. Concurrency sweep ({conc['new_tokens']} new tokens per request; HF = same requests, "
                  "sequential; HF TTFT = as if all arrived at once)", table(header, rows)]
        parts += _top_level_details(conc)
    mt = sc.get("multiturn", {})
    if mt.get("turns"):
        header = ("turn", "prompt tok", "cached tok", "suffix tok", "TTFT on s", "TTFT off s", "prefill(suffix) s",
                  "on/off", "hit/suffix")
        rows = [(t["turn"], t["prompt_tokens"], t["cached_tokens"], t["suffix_tokens"], t["ttft_on_s"], t["ttft_off_s"],
                 t["prefill_suffix_s"], t["ratio_on_off"], t["ratio_hit_vs_suffix_prefill"]) for t in mt["turns"]]
        parts += [f"### 3. Multi-turn image chat (medians over {mt['conversations']} conversation(s))", table(header, rows)]
    si = sc.get("same_image", {})
    if si.get("summary"):
        header = ("encoder cache", "cold s", "same conv s", "other conv s", "encoder runs (cold/same/other)")
        rows = [(name.split("_")[2], s["cold_s"], s["same_conversation_s"], s["other_conversation_s"],
                 "/".join(str(v) for v in s["encoder_runs"].values())) for name, s in si["summary"].items()]
        parts += ["### 4. Same image, new question", table(header, rows)]
    errors = [(name, r.get("error")) for name, r in sc.items() if r.get("status") == "error"]
    if errors:
        parts += ["### Errors", table(("scenario", "error"), errors)]
    return parts


def _top_level_details(conc: dict) -> list[str]:
    """Scenario 2's top level: batched HF, the embedded run and its KV arena usage."""
    parts = []
    batched = [lv for lv in conc["levels"] if "hf_batched" in lv]
    if batched:
        lv, hb = batched[0], batched[0]["hf_batched"]
        parts += [f"HF `generate`, the same {hb['batch']} requests in one left-padded batch: TTFT {fmt(hb['ttft_s'])} s, "
                  f"wall {fmt(hb['wall_s'])} s, {fmt(hb['agg_tps'])} tok/s; mmserve over HTTP / batched HF: "
                  f"{fmt(lv['ratio_agg_tps_batched'])}."]
    e = conc.get("embedded")
    if e:
        kv, peak = e["kv"], e["kv"]["at_peak"] or {}
        header = ("N", "agg tok/s", "TTFT p50 s", "TTFT p99 s", "samples", "blocks in use (peak)", "tokens held",
                  "MiB in use", "MiB held", "ratio at peak", "worst ratio, all decoding")
        rows = [(e["concurrency"], e["agg_tps"], e["ttft_p50_s"], e["ttft_p99_s"], kv["samples"],
                 peak.get("referenced_blocks"), peak.get("held_tokens"),
                 peak["bytes_in_use"] / 2**20 if peak else None, peak["bytes_held"] / 2**20 if peak else None,
                 peak.get("ratio"), kv["max_ratio_all_decoding"])]
        parts += [f"Embedded run of the top level, KV arena sampled (block size {kv['block_size']}, "
                  f"{kv['block_bytes'] / 2**10:.0f} KiB per block, {kv['num_blocks']} blocks)", table(header, rows)]
    return parts


# -- PNG ------------------------------------------------------------------------------------------
# Top: the decode, concurrency and multi-turn measurements. Below, full width: one row per target,
# every row on the same normalised scale, "margin to the target" (measured / target for a floor,
# target / measured for a ceiling; log scale): 1 is the target itself and right of it always means
# the target is met, so a ratio of 3.8 and a hit-rate gap of 0.00 are both readable. Each row also
# prints what was measured, its target with the kind marked (≥ floor, ≤ ceiling) and pass/fail.



def plot(report: dict, path: Path) -> None:
    sc, meta = report["scenarios"], report["meta"]
    targets = target_rows(report["summary"])
    # the top row only when one of its scenarios ran (`--scenarios replicas`: the targets alone)
    panels = [(draw, sc.get(name) or {}) for draw, name in
              ((_plot_decode, "decode"), (_plot_concurrency, "concurrency"), (_plot_multiturn, "multiturn"))]
    shown = any(d.get("status") == "ok" for _, d in panels)
    top_h, row_h = (3.6 if shown else 0.0), 0.42
    bottom_h = max(1.5, row_h * len(targets) + 1.3)
    lines, warning = _header_lines(meta)
    head_h = 0.55 + 0.19 * len(lines) + (0.25 if warning else 0.2)
    total = head_h + top_h + bottom_h
    fig = plt.figure(figsize=(16, total))
    if shown:
        for i, (draw, data) in enumerate(panels):  # [left, bottom, width, height] in figure fractions
            draw(fig.add_axes([0.05 + i * 0.33, (bottom_h + 0.55) / total, 0.26, (top_h - 0.95) / total]), data)
    ax = fig.add_axes([0.40, 0.75 / total, 0.30, (bottom_h - 1.3) / total if targets else 0.6 / total])
    _plot_targets(fig, ax, targets)
    title = _model_title(meta).replace("`", "")
    fig.text(0.5, 1 - 0.22 / total, f"mmserve benchmark ({meta['params']['name']}; {title}) — every comparison "
             "measured side by side in this run", ha="center", va="center", fontsize=14, weight="bold")
    _plot_load(fig, meta, 1 - (0.5 + (head_h - 0.5) / 2) / total)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _header_lines(meta: dict) -> tuple[list[str], bool]:
    """The load lines under the title, and whether they are a warning: a red warning when the CPU was
    oversubscribed (as in report.md), else one grey line with what was measured."""
    warning = _load_warning(meta)
    slowdown = _thread_slowdown(meta)
    probe = f"; probe matmul {meta['torch_threads']} threads / 1 thread: {slowdown:.2f}x" if slowdown else ""
    facts = (f"{meta.get('device_name') or meta.get('device', 'cpu')}, {meta['cpu_count']} CPUs, "
             f"{meta['torch_threads']} torch threads; load average {fmt(meta.get('loadavg_start'))} at start, "
             f"{fmt(meta.get('loadavg_end'))} at the end{probe}; took {meta.get('duration_s', float('nan')):.0f} s; "
             f"started {meta.get('started', '?')}")
    if warning:
        return textwrap.wrap(warning[0].replace("**", ""), 175) + textwrap.wrap(facts, 175), True
    return textwrap.wrap(facts + " — the machine was quiet (no oversubscription, load average below "
                         f"{LOADAVG_WARNING_PER_CPU:g} per CPU)", 215), False


def _plot_load(fig, meta: dict, y: float) -> None:
    lines, warning = _header_lines(meta)
    if warning:
        fig.text(0.5, y, "\n".join(lines), ha="center", va="center", fontsize=10, color="white", weight="bold",
                 bbox={"facecolor": FAIL, "edgecolor": "none", "pad": 6})
    else:
        fig.text(0.5, y, "\n".join(lines), ha="center", va="center", fontsize=9.5, color="#555555")



def _empty(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _plot_decode(ax, d: dict) -> None:
    if not d.get("decode_tps"):
        return _empty(ax, "1. single-stream decode")
    names = list(d["decode_tps"])
    ax.bar(names, [_num(d["decode_tps"][n]) for n in names], color=["C0", "C1", "C7"][: len(names)])
    ax.set_title(f"1. single-stream decode ({d['new_tokens']} tokens)")
    ax.set_ylabel("decode tokens/s")


def _plot_concurrency(ax, d: dict) -> None:
    if not d.get("levels"):
        return _empty(ax, "2. concurrency sweep")
    n = [lv["concurrency"] for lv in d["levels"]]
    ax.plot(n, [_num(lv["agg_tps"]) for lv in d["levels"]], "o-", label="mmserve HTTP")
    ax.plot(n, [_num(lv["hf"]["agg_tps"]) for lv in d["levels"]], "s--", color="C7", label="HF generate, sequential")
    batched = [lv for lv in d["levels"] if "hf_batched" in lv]
    if batched:
        ax.plot([lv["concurrency"] for lv in batched], [_num(lv["hf_batched"]["agg_tps"]) for lv in batched], "D",
                color="C3", label="HF generate, one batch")
    if d.get("embedded"):
        ax.plot([d["embedded"]["concurrency"]], [_num(d["embedded"]["agg_tps"])], "^", color="C1",
                label="mmserve embedded")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(x) for x in n])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("2. concurrency sweep")
    ax.legend(fontsize=8)


def _plot_multiturn(ax, d: dict) -> None:
    if not d.get("turns"):
        return _empty(ax, "3. multi-turn image chat")
    turns = [t["turn"] for t in d["turns"]]
    for key, label, style in (("ttft_off_s", "TTFT, prefix cache off", "s--"), ("ttft_on_s", "TTFT, prefix cache on", "o-"),
                              ("prefill_suffix_s", "prefill(suffix) only", "^:")):
        ax.plot(turns, [_num(t.get(key)) for t in d["turns"]], style, label=label)
    ax.set_yscale("log")
    ax.set_xticks(turns)
    ax.set_xlabel("turn")
    ax.set_ylabel("seconds")
    ax.set_title("3. multi-turn image chat")
    ax.legend(fontsize=8)


def replot(source: str | Path, png: str | Path | None = None) -> Path:
    """Renders the PNG again from a saved report.json (a results directory or the file itself), into
    `png` (default: report.png beside it): to redraw old runs after the plot changes."""
    source = Path(source)
    path = source / "report.json" if source.is_dir() else source
    report = json.loads(path.read_text())
    out = Path(png) if png else path.with_name("report.png")
    plot(report, out)
    return out


if __name__ == "__main__":  # python -m mmserve.bench.report RESULTS_DIR [OUT.png]
    import sys

    print(replot(*sys.argv[1:3]))

"""The benchmark plot's targets panel: one row per target, each on its margin to the target (log
scale; right of 1 is met), marked floor (≥) or ceiling (≤), coloured pass/fail."""

from __future__ import annotations

import math
import textwrap

from matplotlib import transforms
from matplotlib.patches import Rectangle

PASS, FAIL, UNKNOWN = "#2ca02c", "#d62728", "#9a9a9a"
MARGIN_MIN, MARGIN_MAX = 1 / 8, 8  # the targets panel's x range; margins beyond are drawn at the edge


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v)
    return str(v).replace("|", "\\|")


def _num(v) -> float:
    """A number for plotting: None (NaN in report.json) and non-numbers as NaN."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")



def target_rows(summary: list[dict]) -> list[dict]:
    """One entry per summary row that has a target (or failed without one: an error is a miss):
    {label, kind ("floor", "ceiling", "check", "failed"), measured, target, margin, ok, text}.
    `measured` is what the target is about: the ratio for a bare-number target ("≥ 2.5"), the value
    for a target with a unit ("< 50 ms", "≤ 2 s") or with no ratio, |value - baseline| for a
    "|diff| ≤ x" target. `margin` (right = better): measured / target for a floor, target /
    measured for a ceiling; 1 is the target; NaN where there is none."""
    out = []
    for r in summary:
        target, ok = r.get("target"), r.get("ok")
        if not target and ok is not False:
            continue
        label = f"{r['scenario']}: {r['metric']}"
        entry = {"label": label, "ok": ok, "target": target, "measured": float("nan"), "margin": float("nan")}
        if not target:
            entry.update(kind="failed", text=textwrap.shorten(str(r["value"]), 52, placeholder=" …"))
        elif target.strip() == "true":
            entry.update(kind="check", text=f"{'yes' if r['value'] is True else fmt(r['value'])}   target yes")
        else:
            entry.update(_parse_target(r))
        out.append(entry)
    return out


def _parse_target(r: dict) -> dict:
    words = r["target"].split()
    diff = words[0] == "|diff|"
    if diff:
        words = words[1:]
    op, bound, unit = words[0], float(words[1]), " ".join(words[2:])
    kind = "floor" if op in ("≥", ">") else "ceiling"
    value, baseline, u = _num(r["value"]), _num(r["baseline"]), r.get("unit") or ""
    if diff:
        measured = abs(value - baseline)
        shown = f"|diff| {measured:.3f}  ({_short(value)} vs {_short(baseline)})"
    elif unit or (r.get("ratio") is None and r.get("baseline") is None):  # about the value itself (GPU busy)
        measured = value
        shown = f"{_short(measured)} {unit or u}".strip()
    else:
        measured = _num(r["ratio"])
        shown = _short(measured) + (f"  ({_short(value)} / {_short(baseline)} {u})".replace(" )", ")")
                                    if not (math.isnan(value) or math.isnan(baseline)) else "")
    if math.isnan(measured):
        margin = float("nan")
    elif kind == "floor":
        margin = measured / bound if bound else math.inf
    else:
        margin = bound / measured if measured else math.inf
    return {"kind": kind, "measured": measured, "margin": margin, "text": f"{shown}   target {r['target']}  ({kind})"}


def _short(v: float) -> str:
    if math.isnan(v):
        return "n/a"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _plot_targets(fig, ax, rows: list[dict]) -> None:
    passed = sum(r["ok"] is True for r in rows)
    ax.set_title(f"Targets: {passed} of {len(rows)} met", fontsize=13, weight="bold", loc="left", pad=24,
                 color=PASS if passed == len(rows) else FAIL)
    ax.text(0, 1.005, "the black line is the target; right of it is met (log scale)", transform=ax.transAxes,
            ha="left", va="bottom", fontsize=9, color="#444444")
    if not rows:
        ax.text(0.5, 0.5, "no targets in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    lo, hi = MARGIN_MIN, MARGIN_MAX
    ax.set_xscale("log", base=2)
    ax.set_xlim(lo, hi)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.axvspan(1, hi, color=PASS, alpha=0.08, lw=0)
    ax.axvspan(lo, 1, color=FAIL, alpha=0.08, lw=0)
    ax.axvline(1, color="black", lw=1.5, zorder=3)
    # the columns right of the panel, in figure x and row y
    cols = transforms.blended_transform_factory(fig.transFigure, ax.transData)
    for x, head in ((0.713, "result"), (0.765, "measured"), (0.895, "target")):
        ax.text(x, -0.75, head, transform=cols, ha="left", va="bottom", fontsize=9, color="#444444", clip_on=False)
    for i, r in enumerate(rows):
        if i % 2 == 0:  # stripes across labels, bars and columns, to follow a row
            fig.patches.append(Rectangle((0.005, i - 0.5), 0.99, 1, transform=cols, color="black", alpha=0.04,
                                         lw=0, zorder=0))
        color = PASS if r["ok"] is True else FAIL if r["ok"] is False else UNKNOWN
        m = r["margin"]
        if r["kind"] in ("floor", "ceiling") and not math.isnan(m):
            shown = min(max(m, lo), hi)
            ax.barh(i, max(shown, 1) - min(shown, 1), left=min(shown, 1), height=0.56, color=color, zorder=2)
            if m != shown:  # beyond the panel: an arrow at the edge
                ax.plot(shown, i, ">" if m > hi else "<", color=color, ms=10, zorder=4, clip_on=False)
            else:  # the measured point, visible even a hair from the target
                ax.plot(shown, i, "o", color=color, ms=6, markeredgecolor="black", markeredgewidth=0.7, zorder=4)
            # the kind of target: ≥ a floor, ≤ a ceiling
            ax.text(lo * 1.06, i, "≥ floor" if r["kind"] == "floor" else "≤ ceiling", ha="left", va="center",
                    fontsize=9, weight="bold", color="#333333", zorder=5)
        else:  # a yes/no check, an error, or nothing to compare (n/a)
            ax.plot(1, i, "o", color=color, ms=11, zorder=5, markeredgecolor="black")
        mark = "✓ pass" if r["ok"] is True else "✗ FAIL" if r["ok"] is False else "? n/a"
        ax.text(0.713, i, mark, transform=cols, ha="left", va="center", fontsize=10, color=color, weight="bold")
        measured, _, target = r["text"].partition("   target ")
        ax.text(0.765, i, measured, transform=cols, ha="left", va="center", fontsize=9.5)
        ax.text(0.895, i, target, transform=cols, ha="left", va="center", fontsize=9.5)
    ticks = [lo * 2 ** k for k in range(int(round(math.log2(hi / lo))) + 1)]
    ax.set_xticks(ticks, [_tick(t) for t in ticks])
    ax.minorticks_off()
    ax.set_yticks(range(len(rows)), [textwrap.fill(r["label"], 66, max_lines=2, placeholder=" …") for r in rows],
                  fontsize=9, linespacing=1.0)
    ax.tick_params(axis="y", length=0)
    for tick, r in zip(ax.get_yticklabels(), rows):
        tick.set_color(FAIL if r["ok"] is False else "black")
    ax.set_xlabel("margin to the target: measured / target for a floor (≥), target / measured for a ceiling (≤)",
                  fontsize=9)


def _tick(t: float) -> str:
    if t == 1:
        return "1\ntarget"
    return f"{t:g}×" if t > 1 else f"1/{1 / t:g}"

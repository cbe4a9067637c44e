"""The HTML reports' figures: matplotlib (the optional `report` extra) under one style, drawn to
inline SVG; the trade-off, step-breakdown, per-stage, heat-map, predicted-vs-measured and
convergence plots, and the Pareto front they mark."""
from __future__ import annotations

import io
import math
import re
from typing import Sequence

from advisor.catalog.specs import SpecError

__all__ = ["INSTALL", "STEP_LABELS", "ReportDependencyError", "wrap_label", "require", "styled", "new_figure", "svg", "pareto_front",
           "fig_tradeoff", "fig_breakdown", "fig_stages", "fig_heatmaps", "fig_pred_vs_meas", "fig_convergence"]

INSTALL = "pip install 'advisor[report]'"

# the colours of the step-time components (matplotlib's tab20, a colour-blind-aware palette)
STEP_LABELS = {"gemm_s": "GEMM", "attention_s": "attention", "memory_bound_s": "memory-bound",
               "recompute_s": "recompute", "tp_comm_s": "TP comm", "cp_comm_s": "CP comm",
               "ep_comm_s": "EP comm", "pp_p2p_s": "PP send/recv", "layer_overhead_s": "layer overhead",
               "pipeline_bubble_s": "pipeline bubble", "dp_comm_exposed_s": "DP comm (exposed)",
               "optimizer_s": "optimizer", "step_overhead_s": "step overhead"}


class ReportDependencyError(SpecError):
    """The HTML report's plotting library is not installed."""


def require() -> None:
    """Fail in one line, before any work, when matplotlib (the `report` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportDependencyError(f"the HTML report needs matplotlib: {INSTALL}") from None


_RC = {"svg.fonttype": "none", "svg.hashsalt": "advisor", "font.size": 9, "axes.grid": True,
       "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8,
       "legend.frameon": False}


def styled(fn):
    """Build the figure under the report's matplotlib style (legends and grids read it when made)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        require()
        import matplotlib

        with matplotlib.rc_context(_RC):
            return fn(*a, **kw)

    return wrapper


def new_figure(w: float, h: float, rows: int = 1, cols: int = 1, **kw):
    require()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes



def svg(fig, prefix: str) -> str:
    """The figure as an inline <svg> element; its ids are prefixed so that several figures share a page."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    s = buf.getvalue()
    s = s[s.index("<svg"):]
    s = re.sub(r'id="([^"]+)"', rf'id="{prefix}-\1"', s)
    s = re.sub(r'(xlink:href|href)="#([^"]+)"', rf'\1="#{prefix}-\2"', s)
    return re.sub(r"url\(#([^)]+)\)", rf"url(#{prefix}-\1)", s)


def wrap_label(label: str, width: int = 30) -> str:
    """'#3 TP1·PP4·DP64·...' on lines of at most `width` characters, broken after a '·' or a space."""
    lines, cur = [], ""
    for tok in re.split(r"(?<=[· ])", label):
        if cur and len(cur) + len(tok) > width:
            lines.append(cur.rstrip(" "))
            cur = ""
        cur += tok
    return "\n".join(lines + [cur])


def pareto_front(cost: Sequence[float], gain: Sequence[float]) -> list[int]:
    """Indices of the points no other point beats on both (lower cost, higher gain), by cost."""
    order = sorted(range(len(cost)), key=lambda i: (cost[i], -gain[i]))
    front, best = [], -math.inf
    for i in order:
        if gain[i] > best:
            front.append(i)
            best = gain[i]
    return front


@styled
def fig_tradeoff(points: list[dict], marked: list[dict], cap_w: float | None, what: str):
    """tokens/s/GPU against peak power and against energy per token; the Pareto front of each is
    a line; `marked` points (ranked layouts, the front of a study) carry their label."""
    fig, axes = new_figure(11, 4.2, 1, 2)
    for ax, key, xlabel in ((axes[0][0], "peak_power_w", "peak power, W per GPU"),
                            (axes[0][1], "energy_j_per_token", "energy, J per token")):
        pts = [q for q in points if q.get(key) is not None and q.get("tps") is not None]
        xs, ys = [q[key] for q in pts], [q["tps"] for q in pts]
        if not pts:
            ax.text(0.5, 0.5, f"no {xlabel.split(',')[0]} recorded", ha="center", va="center", transform=ax.transAxes)
        ax.scatter(xs, ys, s=10, color="#9aa0a6", alpha=0.6, linewidths=0, label=f"{what} ({len(pts)})")
        front = pareto_front(xs, ys)
        if front:
            ax.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="#e8710a", ms=4, lw=1.4,
                    drawstyle="steps-post", label=f"Pareto front ({len(front)})")
        for q in marked:
            if q.get(key) is None:
                continue
            ax.scatter([q[key]], [q["tps"]], s=46, color="#1a73e8", edgecolors="white", zorder=5)
            ax.annotate(q["label"], (q[key], q["tps"]), textcoords="offset points", xytext=(5, 4),
                        fontsize=8, color="#1a73e8")
        if key == "peak_power_w" and cap_w:
            ax.axvline(cap_w, color="#b00020", ls=":", lw=1)
            ax.annotate(f"cap {cap_w:.0f} W", (cap_w, 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -10), textcoords="offset points", color="#b00020", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens/s per GPU")
        if pts:
            ax.legend(loc="lower right")
    return fig


@styled
def fig_breakdown(items: list[tuple[str, dict, float]]):
    """Stacked step time of each (label, breakdown, step_time_s): the components add up to the
    model's step time; a tick marks the prediction's step time where calibration moved it."""
    keys = [k for k in STEP_LABELS if any(b.get(k) for _, b, _ in items)]
    fig, axes = new_figure(11, 0.5 * len(items) + 1.9)
    ax = axes[0][0]
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    ylabels = [lab for lab, _, _ in items]
    y = list(range(len(items)))[::-1]
    left = [0.0] * len(items)
    for j, k in enumerate(keys):
        vals = [b.get(k, 0.0) or 0.0 for _, b, _ in items]
        ax.barh(y, vals, left=left, color=cmap(list(STEP_LABELS).index(k) % 20), label=STEP_LABELS[k], height=0.62)
        left = [a + v for a, v in zip(left, vals)]
    shown = False
    for yi, (total, (_, _, step)) in zip(y, zip(left, items)):
        if step and abs(step / total - 1) > 0.01:
            ax.plot([step, step], [yi - 0.4, yi + 0.4], color="black", lw=2,
                    label=None if shown else "predicted step time (calibrated)")
            shown = True
    ax.set_yticks(y, ylabels)
    ax.set_xlabel("seconds per step (slowest pipeline stage, all microbatches)")
    fig.legend(loc="outside lower center", ncol=7)
    return fig


def _stage_ticks(stages: int, panels: int) -> list[str]:
    every = max(1, math.ceil(stages * panels / 40))  # about 40 labels across the figure
    return [str(i) if i % every == 0 else "" for i in range(stages)]


@styled
def fig_stages(items: list[dict], capacity_gib: float, usable_gib: float | None, cap_w: float | None):
    """Per pipeline stage, for each item {label, memory, power_mean, power_peak, mean_w}: memory
    against the GPU's capacity (top row) and power against the cap (bottom row, where known)."""
    n = len(items)
    has_power = any(it.get("power_mean") for it in items)
    rows = 2 if has_power else 1
    fig, axes = new_figure(max(6.0, 2.3 * n), 2.5 * rows + 0.6, rows, n, sharey="row")
    for j, it in enumerate(items):
        ax = axes[0][j]
        mem = it["memory"]
        x = list(range(len(mem)))
        colors = ["#b00020" if usable_gib and m > usable_gib else "#1a73e8" for m in mem]
        ax.bar(x, mem, color=colors, width=0.7)
        ax.axhline(capacity_gib, color="#b00020", lw=1.2, label=f"capacity {capacity_gib:.0f} GiB")
        if usable_gib:
            ax.axhline(usable_gib, color="#b00020", lw=1, ls="--", label=f"usable {usable_gib:.1f} GiB")
        ax.set_title(wrap_label(it["label"], 34 if n < 4 else 26), fontsize=8)
        ax.set_xticks(x, _stage_ticks(len(x), n))
        if j == 0:
            ax.set_ylabel("memory, GiB per GPU")
        if has_power:
            pa = axes[1][j]
            pm, pk = it.get("power_mean") or [], it.get("power_peak") or []
            if pm:
                pa.bar(x, pm, color="#e8710a", width=0.7, label="mean power")
                pa.plot(x, pk, "_", color="#5f6368", ms=min(12.0, 90.0 / len(x)), mew=2, label="peak power")
            if it.get("demand"):
                pa.plot(x, it["demand"], "o", mfc="none", color="#1d1d1f", ms=5, label="mean demand without a cap")
            if cap_w:
                pa.axhline(cap_w, color="#b00020", lw=1.2, label=f"cap {cap_w:.0f} W")
            if it.get("mean_w"):
                pa.axhline(it["mean_w"], color="#1d1d1f", lw=1, ls=":", label="layout mean")
            pa.set_xticks(x, _stage_ticks(len(x), n))
            pa.set_xlabel("pipeline stage")
            if j == 0:
                pa.set_ylabel("power, W per GPU")
        else:
            ax.set_xlabel("pipeline stage")
    handles, labels = [], []
    for a in axes[:, 0]:
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    fig.legend(handles, labels, loc="outside lower center", ncol=6 if n > 2 else 3)
    return fig


@styled
def fig_heatmaps(panels: list[tuple[str, list[list[float]], list[list[str]]]], nodes: Sequence[str], unit: str = "°C"):
    """One heat map per (title, values[node][slot], labels[node][slot]) on a shared colour scale."""
    import numpy as np

    slots = max(len(v[0]) for _, v, _ in panels)
    fig, axes = new_figure(min(12.0, 1.1 * slots * len(panels) + 2.5), 0.9 * len(nodes) + 1.6, 1, len(panels))
    lo = min(min(min(r) for r in v) for _, v, _ in panels)
    hi = max(max(max(r) for r in v) for _, v, _ in panels)
    im = None
    for ax, (title, vals, labels) in zip(axes[0], panels):
        im = ax.imshow(np.array(vals), cmap="coolwarm", vmin=lo, vmax=hi if hi > lo else lo + 1, aspect="auto")
        for n, row in enumerate(labels):
            for g, lab in enumerate(row):
                ax.text(g, n, lab, ha="center", va="center", fontsize=7.5, color="black")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(vals[0])))
        ax.set_yticks(range(len(vals)), list(nodes))
        ax.set_xlabel("GPU slot (CUDA index, PCI order)")
        ax.grid(False)
    axes[0][0].set_ylabel("node")
    fig.colorbar(im, ax=list(axes[0]), label=f"predicted temperature, {unit}", shrink=0.9)
    return fig


@styled
def fig_pred_vs_meas(panels: list[dict]):
    """Predicted against measured per target {title, measured, predicted, lo, hi, note}: the
    points, their intervals as error bars, and y = x."""
    n = len(panels)
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = new_figure(10, 3.9 * rows, rows, cols)
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        if k >= n:
            ax.set_visible(False)
            continue
        pnl = panels[k]
        y, p = pnl["measured"], pnl["predicted"]
        lo, hi = pnl.get("lo"), pnl.get("hi")
        inside = [lo is None or (a <= m <= b) for m, a, b in zip(y, lo or y, hi or y)]
        for ok, color, lab in ((True, "#1a73e8", "inside the interval"), (False, "#b00020", "outside")):
            idx = [i for i, v in enumerate(inside) if v == ok]
            if not idx:
                continue
            if lo is not None:
                ax.errorbar([y[i] for i in idx], [p[i] for i in idx],
                            yerr=[[p[i] - lo[i] for i in idx], [hi[i] - p[i] for i in idx]],
                            fmt="o", ms=4, color=color, ecolor=color, elinewidth=0.8, alpha=0.8, capsize=2,
                            label=f"{lab} ({len(idx)})")
            else:
                ax.scatter([y[i] for i in idx], [p[i] for i in idx], s=16, color=color, label=f"{len(idx)} rows")
        span = [v for v in list(y) + list(p) + list(lo or []) + list(hi or []) if math.isfinite(v)]
        a, b = min(span), max(span)
        pad = (b - a) * 0.05 or 1.0
        ax.plot([a - pad, b + pad], [a - pad, b + pad], color="#5f6368", lw=1, ls="--", label="predicted = measured")
        ax.set_xlabel(f"measured {pnl['title']}")
        ax.set_ylabel(f"predicted {pnl['title']}")
        ax.set_title(pnl.get("note", ""), fontsize=8.5)
        ax.legend(loc="upper left")
    return fig


@styled
def fig_convergence(rows: list[dict], objective_label: str):
    """Best measured tokens/s so far against the trial number, every measured trial, and the trials
    that did not measure (OOM, failed, refused) on the axis."""
    fig, axes = new_figure(11, 4.0, 1, 2)
    ax, bx = axes[0][0], axes[0][1]
    ok = [r for r in rows if r["kind"] == "measured"]
    ax.scatter([r["trial"] for r in ok], [r["tps"] for r in ok], s=16, color="#9aa0a6",
               label=f"measured ({len(ok)})", zorder=3)
    best, xs, ys = -math.inf, [], []
    for r in sorted(rows, key=lambda r: r["trial"]):
        if r["kind"] == "measured" and r["feasible"] and r["tps"] > best:
            best = r["tps"]
        if best > -math.inf:
            xs.append(r["trial"])
            ys.append(best)
    if xs:
        ax.plot(xs, ys, drawstyle="steps-post", color="#1a73e8", lw=2, label="best feasible so far")
    top = max([r["tps"] for r in ok] or [1.0])
    styles = {"oom": ("v", "#8e24aa", "OOM"), "failed": ("x", "#b00020", "failed / timed out"),
              "refused": ("s", "#5f6368", "refused by the runner")}
    for kind, (marker, color, lab) in styles.items():
        sel = [r for r in rows if r["kind"] == kind]
        if sel:
            ax.scatter([r["trial"] for r in sel], [0.0] * len(sel), marker=marker, color=color, s=36,
                       label=f"{lab} ({len(sel)})", zorder=4, clip_on=False)
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel("trial")
    ax.set_ylabel("measured tokens/s per GPU")
    ax.legend(loc="lower right")
    # how far the predictions of the study sat from its measurements
    pred = [r for r in ok if r.get("predicted")]
    if pred:
        bx.scatter([r["tps"] for r in pred], [r["predicted"] for r in pred], s=18, color="#1a73e8",
                   label=f"measured trials ({len(pred)})")
        span = [r["tps"] for r in pred] + [r["predicted"] for r in pred]
        bx.plot([min(span), max(span)], [min(span), max(span)], color="#5f6368", ls="--", lw=1,
                label="predicted = measured")
        bx.legend(loc="upper left")
    bx.set_xlabel("measured tokens/s per GPU")
    bx.set_ylabel("predicted tokens/s per GPU (the study's)")
    return fig

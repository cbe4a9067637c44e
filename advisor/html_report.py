"""Self-contained HTML reports with plots: `--html FILE` on recommend, predict, tune, place and fit,
and `advisor report STUDY|DATASET`.

One file that opens offline: the plots are static SVG drawn by matplotlib and inlined into the
page (no script, no font or CDN fetch; the only script is the copy button's few lines). Why
matplotlib and SVG (docs/report.md): it is the best-kept plotting library in Python, it needs no
JavaScript runtime, so a report of llama3-70b on h100x64 with every feasible layout plotted is
a few hundred KB instead of the 3-5 MB of an embedded plotly.js, it renders at once, prints, and
can be pasted into a design doc as it is. matplotlib is an optional extra (`advisor[report]`);
the core imports and answers `recommend` without it.

Every number comes from the objects the CLI prints (RecommendResult / Prediction / placement
Plan / the Optuna study and its records / Calibration), formatted by the same functions as the
terminal tables where there is one (advisor.report: its tables, pareto_cells, plan_rows,
format_fit_report).
"""
from __future__ import annotations

import datetime
import html
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from advisor.catalog.specs import SpecError

INSTALL = "pip install 'advisor[report]'"
# the colours of the step-time components (matplotlib's tab20, a colour-blind-aware palette)
STEP_LABELS = {"gemm_s": "GEMM", "attention_s": "attention", "memory_bound_s": "memory-bound",
               "recompute_s": "recompute", "tp_comm_s": "TP comm", "cp_comm_s": "CP comm",
               "ep_comm_s": "EP comm", "pp_p2p_s": "PP send/recv", "layer_overhead_s": "layer overhead",
               "pipeline_bubble_s": "pipeline bubble", "dp_comm_exposed_s": "DP comm (exposed)",
               "optimizer_s": "optimizer", "step_overhead_s": "step overhead"}
FIT_TARGETS = {"tokens_per_s_per_gpu": ("tokens/s/GPU", 1.0), "memory_gib_per_gpu": ("memory, GiB/GPU", 1.0),
               "mean_power_w": ("mean power, W/GPU", 1.0), "peak_power_w": ("peak power, W/GPU", 1.0)}
FAILED = ("oom", "timeout", "crash", "killed", "skipped", "fail")


class ReportDependencyError(SpecError):
    """The HTML report's plotting library is not installed."""


def require() -> None:
    """Fail in one line, before any work, when matplotlib (the `report` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportDependencyError(f"the HTML report needs matplotlib: {INSTALL}") from None


# ------------------------------------------------------------------------------------------------
# the page
# ------------------------------------------------------------------------------------------------

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#1d1d1f;margin:0;background:#fff}
main{max-width:1180px;margin:0 auto;padding:18px 24px 48px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.meta{color:#666;font-size:12px}.note{color:#444}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;margin:6px 0}
th,td{padding:3px 9px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th{background:#f6f6f8;font-weight:600}td.l:last-child{white-space:normal;min-width:280px}.tbl{overflow-x:auto}td.l,th.l{text-align:left}tr.bad td{color:#b00020}
figure.plot{margin:10px 0 18px}figure.plot svg{max-width:100%;height:auto;display:block}
figcaption{color:#555;font-size:12.5px;max-width:1000px}
pre{background:#f6f6f8;padding:8px 10px;overflow-x:auto;font-size:12px;white-space:pre-wrap;word-break:break-all;margin:4px 0}
pre.text{white-space:pre;word-break:normal}
.args{margin:8px 0 14px}.args b{font-size:13px}
summary{cursor:pointer;color:#1a73e8;margin:6px 0}
button.copy{font-size:12px;padding:2px 10px;margin-left:8px;cursor:pointer}
"""

# copy a <pre> to the clipboard: the Clipboard API where the page is a secure context (file:// is in
# Chromium), else a selected textarea and execCommand
SCRIPT = """
function advisorCopy(b){var t=document.getElementById(b.dataset.target).textContent;
function done(){b.textContent='copied';setTimeout(function(){b.textContent='copy'},1500)}
function old(){var a=document.createElement('textarea');a.value=t;document.body.appendChild(a);a.select();
try{document.execCommand('copy')}finally{a.remove()}done()}
if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(t).then(done,old)}else{old()}}
"""


def esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


class Page:
    """An HTML document built section by section; `html()` is the whole file."""

    def __init__(self, title: str, kind: str, command: str | None = None):
        self.title, self.kind = title, kind
        self.parts: list[str] = []
        self.figures = 0
        self.codes = 0
        self.command = command if command is not None else _command_line()

    def h2(self, text: str) -> None:
        self.parts.append(f"<h2>{esc(text)}</h2>")

    def p(self, text: str, cls: str = "note") -> None:
        self.parts.append(f'<p class="{cls}">{esc(text)}</p>')

    def table(self, columns: Sequence[tuple[str, str]] | Sequence[str], rows: Sequence[Sequence[str]],
              bad: Sequence[bool] = (), cls: str = "", copy: tuple[str, Sequence[str]] | None = None) -> None:
        """`copy`: (header, one text per row): a last column of copy buttons, the texts folded below."""
        cols = [(c, "right") if isinstance(c, str) else c for c in columns]
        ids = [self._code_id() for _ in rows] if copy else []

        def cell(tag: str, v: str, just: str) -> str:
            return f'<{tag}{" class=l" if just == "left" else ""}>{esc(v)}</{tag}>'

        extra = cell("th", copy[0], "left") if copy else ""
        out = [f'<div class="tbl"><table class="{cls}"><thead><tr>' + "".join(cell("th", c, j) for c, j in cols)
               + extra + "</tr></thead><tbody>"]
        for i, row in enumerate(rows):
            mark = ' class="bad"' if i < len(bad) and bad[i] else ""
            button = f"<td class=l>{_copy_button(ids[i])}</td>" if copy else ""
            out.append(f"<tr{mark}>" + "".join(cell("td", v, j) for v, (_, j) in zip(row, cols)) + button + "</tr>")
        out.append("</tbody></table></div>")
        if copy:
            out.append(f"<details><summary>{esc(copy[0])}</summary>"
                       + "".join(f'<pre id="{cid}">{esc(t)}</pre>' for cid, t in zip(ids, copy[1])) + "</details>")
        self.parts.append("".join(out))

    def _code_id(self) -> str:
        self.codes += 1
        return f"code-{self.codes}"

    def code(self, label: str, text: str) -> str:
        """A block of text to paste, with a copy button; returns the block's element id."""
        cid = self._code_id()
        self.parts.append(f'<div class="args"><b>{esc(label)}</b>{_copy_button(cid)}<pre id="{cid}">{esc(text)}</pre></div>')
        return cid

    def ul(self, items: Sequence[str], summary: str | None = None) -> None:
        """A list; with `summary`, folded under it (click to open)."""
        ul = '<ul class="note">' + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"
        self.parts.append(f"<details><summary>{esc(summary)}</summary>{ul}</details>" if summary else ul)

    def text(self, text: str) -> None:
        self.parts.append(f'<pre class="text">{esc(text)}</pre>')

    def figure(self, fig, name: str, caption: str) -> None:
        self.figures += 1
        svg = _svg(fig, f"f{self.figures}")
        self.parts.append(f'<figure class="plot" id="plot-{esc(name)}" data-plot="{esc(name)}">{svg}'
                          f"<figcaption>{esc(caption)}</figcaption></figure>")

    def html(self) -> str:
        from advisor import __version__

        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = f" — <code>{esc(self.command)}</code>" if self.command else ""
        return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width,initial-scale=1">'
                f'<meta name="generator" content="advisor {esc(__version__)}">'
                f"<title>{esc(self.title)}</title><style>{CSS}</style></head>\n"
                f'<body data-report="{esc(self.kind)}"><main><h1>{esc(self.title)}</h1>'
                f'<p class="meta">advisor {esc(__version__)} {self.kind} report, {now}{cmd}</p>\n'
                + "\n".join(self.parts) + f"\n</main><script>{SCRIPT}</script></body></html>\n")


def _copy_button(target: str) -> str:
    return (f'<button class="copy" type="button" data-target="{target}" onclick="advisorCopy(this)">'
            f"copy</button>")


def _command_line() -> str:
    """The advisor command line that made the report ('' when it was not the CLI)."""
    argv0 = Path(sys.argv[0]) if sys.argv else Path()
    if argv0.name == "advisor" or (argv0.name == "__main__.py" and argv0.parent.name == "advisor"):
        import shlex

        return "advisor " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return ""


def save(path: str | Path, page: Page) -> Path:
    """Write the report and say so on stderr (stdout may be --json)."""
    p = write(path, page)
    print(f"wrote {p} ({p.stat().st_size / 1024:.0f} KiB, {page.figures} plots)", file=sys.stderr)
    return p


def write(path: str | Path, page: Page) -> Path:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(page.html(), encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot write the HTML report {p}: {e.strerror or e}") from None
    return p


# ------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------

_RC = {"svg.fonttype": "none", "svg.hashsalt": "advisor", "font.size": 9, "axes.grid": True,
       "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8,
       "legend.frameon": False}


def _styled(fn):
    """Build the figure under the report's matplotlib style (legends and grids read it when made)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        require()
        import matplotlib

        with matplotlib.rc_context(_RC):
            return fn(*a, **kw)

    return wrapper


def _figure(w: float, h: float, rows: int = 1, cols: int = 1, **kw):
    require()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes



def _svg(fig, prefix: str) -> str:
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


def pareto_front(cost: Sequence[float], gain: Sequence[float]) -> list[int]:
    """Indices of the points no other point beats on both (lower cost, higher gain), by cost."""
    order = sorted(range(len(cost)), key=lambda i: (cost[i], -gain[i]))
    front, best = [], -math.inf
    for i in order:
        if gain[i] > best:
            front.append(i)
            best = gain[i]
    return front


@_styled
def fig_tradeoff(points: list[dict], marked: list[dict], cap_w: float | None, what: str):
    """tokens/s/GPU against peak power and against energy per token; the Pareto front of each is
    a line; `marked` points (ranked layouts, the front of a study) carry their label."""
    fig, axes = _figure(11, 4.2, 1, 2)
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


@_styled
def fig_breakdown(items: list[tuple[str, dict, float]]):
    """Stacked step time of each (label, breakdown, step_time_s): the components add up to the
    model's step time; a tick marks the prediction's step time where calibration moved it."""
    keys = [k for k in STEP_LABELS if any(b.get(k) for _, b, _ in items)]
    fig, axes = _figure(11, 0.5 * len(items) + 1.9)
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


@_styled
def fig_stages(items: list[dict], capacity_gib: float, usable_gib: float | None, cap_w: float | None):
    """Per pipeline stage, for each item {label, memory, power_mean, power_peak, mean_w}: memory
    against the GPU's capacity (top row) and power against the cap (bottom row, where known)."""
    n = len(items)
    has_power = any(it.get("power_mean") for it in items)
    rows = 2 if has_power else 1
    fig, axes = _figure(max(6.0, 2.3 * n), 2.5 * rows + 0.6, rows, n, sharey="row")
    for j, it in enumerate(items):
        ax = axes[0][j]
        mem = it["memory"]
        x = list(range(len(mem)))
        colors = ["#b00020" if usable_gib and m > usable_gib else "#1a73e8" for m in mem]
        ax.bar(x, mem, color=colors, width=0.7)
        ax.axhline(capacity_gib, color="#b00020", lw=1.2, label=f"capacity {capacity_gib:.0f} GiB")
        if usable_gib:
            ax.axhline(usable_gib, color="#b00020", lw=1, ls="--", label=f"usable {usable_gib:.1f} GiB")
        ax.set_title(_wrap_label(it["label"], 34 if n < 4 else 26), fontsize=8)
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


@_styled
def fig_heatmaps(panels: list[tuple[str, list[list[float]], list[list[str]]]], nodes: Sequence[str], unit: str = "°C"):
    """One heat map per (title, values[node][slot], labels[node][slot]) on a shared colour scale."""
    import numpy as np

    slots = max(len(v[0]) for _, v, _ in panels)
    fig, axes = _figure(min(12.0, 1.1 * slots * len(panels) + 2.5), 0.9 * len(nodes) + 1.6, 1, len(panels))
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


@_styled
def fig_pred_vs_meas(panels: list[dict]):
    """Predicted against measured per target {title, measured, predicted, lo, hi, note}: the
    points, their intervals as error bars, and y = x."""
    n = len(panels)
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = _figure(10, 3.9 * rows, rows, cols)
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


@_styled
def fig_convergence(rows: list[dict], objective_label: str):
    """Best measured tokens/s so far against the trial number, every measured trial, and the trials
    that did not measure (OOM, failed, refused) on the axis."""
    fig, axes = _figure(11, 4.0, 1, 2)
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


# ------------------------------------------------------------------------------------------------
# recommend / predict
# ------------------------------------------------------------------------------------------------

def _stage_items(m, c, configs: list[tuple[str, Any, Any]], consts) -> list[dict]:
    """memory and power per stage of each (label, cfg, prediction): the prediction's own
    (prediction.power["stages"], the same models.power evaluation as its mean power); placement's
    stage heat for a prediction that has none."""
    from advisor.placement import stage_heat

    out = []
    for label, cfg, p in configs:
        st = (getattr(p, "power", None) or {}).get("stages")
        if st:
            mean, peak, demand = ([s[k] for s in st] for k in ("mean_power_w", "peak_power_w", "demand_w"))
        else:
            heats = stage_heat(m, c, cfg, consts)
            mean, peak, demand = ([getattr(h, k) for h in heats] for k in ("mean_power_w", "peak_power_w", "demand_mean_w"))
        out.append({"label": label, "memory": list(p.memory_per_stage_gib), "power_mean": mean, "power_peak": peak,
                    "demand": demand, "mean_w": p.mean_power_w})
    return out


def _power_constants(cal):
    """The constants of the level a calibration uses for mean power (the analytical model's when it
    kept that level, or without a calibration): the per-stage power is priced with them."""
    from advisor.models.constants import DEFAULT

    if cal is None or cal.targets.get("mean_power_w", {}).get("mode") == "analytical":
        return DEFAULT
    return cal.constants


def _wrap_label(label: str, width: int = 30) -> str:
    """'#3 TP1·PP4·DP64·...' on lines of at most `width` characters, broken after a '·' or a space."""
    lines, cur = [], ""
    for tok in re.split(r"(?<=[· ])", label):
        if cur and len(cur) + len(tok) > width:
            lines.append(cur.rstrip(" "))
            cur = ""
        cur += tok
    return "\n".join(lines + [cur])


def _label(rank: int | str, cfg) -> str:
    from advisor.report import layout_text

    return f"#{rank} {layout_text(cfg)} mbs{cfg.mbs}" + ("" if cfg.recompute == "none" else f" {cfg.recompute[:3]}")


def recommend_page(res, command: str | None = None) -> Page:
    from advisor.models.constants import DEFAULT
    from advisor.report import RECOMMEND_COLUMNS, recommendation_cells

    wl, c, m = res.workload, res.cluster, res.model
    page = Page(f"{m.name} on {c.name}: recommended layouts", "recommend", command)
    cal = res.calibrated_with
    page.p(f"{c.num_nodes}×{c.gpus_per_node} {c.gpu.name} ({c.gpu.memory_gib:.0f} GiB, cap {c.power_cap_w:.0f} W); "
           f"seq {wl.seq}, global batch {wl.gbs} sequences, {wl.precision}; objective {res.objective}. "
           f"{res.candidates_evaluated} legal layouts, {res.feasible} fit in memory, ranked in {res.elapsed_s:.2f} s; "
           f"stack {res.stack}; "
           + (f"profile {res.profile} ({Path(res.calibration).name}), 80% intervals" if res.calibration
              else "analytical model, no profile"))
    if res.domain_note:
        page.p(f"note: {res.domain_note}")
    page.h2("Ranked layouts")
    page.table(RECOMMEND_COLUMNS, [recommendation_cells(r) for r in res.recommendations],
               copy=("Megatron args", [r.megatron_args for r in res.recommendations]))
    items = []
    for r in res.recommendations:
        line = f"#{r.rank}: {r.reason}"
        if getattr(r.prediction, "intervals", None):
            from advisor.models.calibrate import format_intervals

            line += f". {format_intervals(r.prediction)}"
        items.append(line)
    page.ul(items, "why each layout" + (" and its 80% intervals" if res.calibration else ""))
    if res.compared:  # --compare: the layouts placed next to #1, as the terminal prints them
        from advisor.report import layout_text as lay

        page.table([("compared layout", "left"), "mbs", ("recompute", "left"), "tok/s/GPU", "of #1", "rank",
                    ("why", "left")],
                   [[lay(x.config), str(x.config.mbs), x.config.recompute, f"{x.prediction.tokens_per_s_per_gpu:,.0f}",
                     f"{x.ratio_to_top:.3f}", f"{x.rank} of {x.of}" if x.rank is not None else "does not fit", x.why]
                    for x in res.compared])

    # every feasible layout at the level the ranked ones are shown (calibrated: rescored in full)
    pop = list(res.candidates)
    if cal is not None and pop:
        pop = cal.rescore(m, c, pop, with_constants=True)
    ranked = {r.config.key(): r for r in res.recommendations}
    pts = [{"tps": p.tokens_per_s_per_gpu, "peak_power_w": p.peak_power_w, "energy_j_per_token": p.energy_j_per_token}
           for cfg, p in pop if cfg.key() not in ranked]
    marked = [{"label": f"#{r.rank}", "tps": r.prediction.tokens_per_s_per_gpu, "peak_power_w": r.prediction.peak_power_w,
               "energy_j_per_token": r.prediction.energy_j_per_token} for r in res.recommendations]
    marked += [{"label": f"compared {k + 1}", "tps": x.prediction.tokens_per_s_per_gpu,
                "peak_power_w": x.prediction.peak_power_w, "energy_j_per_token": x.prediction.energy_j_per_token}
               for k, x in enumerate(res.compared) if x.prediction.feasible]
    page.h2("Throughput against power and energy")
    page.figure(fig_tradeoff(pts + marked, marked, c.power_cap_w, "feasible layouts"), "tradeoff",
                f"Every layout that fits in memory ({len(pop)}; {'calibrated predictions' if cal else 'analytical model'})"
                f": tokens/s per GPU against the instantaneous peak power per GPU and against energy per token. "
                f"The orange line is the Pareto front (nothing is both faster and lower on the x axis); blue are the "
                f"ranked layouts.")
    page.h2("Where the step time goes")
    page.figure(fig_breakdown([(_label(r.rank, r.config), r.prediction.breakdown, r.prediction.step_time_s)
                               for r in res.recommendations]), "breakdown",
                "Step time of the ranked layouts by component (seconds per step on the slowest pipeline stage, "
                "summed over its microbatches, plus the bubble, exposed data-parallel traffic, optimizer and "
                "fixed overheads).")
    consts = _power_constants(cal)
    usable = c.gpu.memory_gib * (cal.screening_constants if cal is not None else DEFAULT).memory_usable_fraction
    page.h2("Memory and power per pipeline stage")
    page.figure(fig_stages(_stage_items(m, c, [(_label(r.rank, r.config), r.config, r.prediction)
                                               for r in res.recommendations], consts),
                           c.gpu.memory_gib, usable, c.power_cap_w), "stages",
                "Top: memory per GPU of each pipeline stage (the prediction's) against the GPU's capacity and the "
                "usable part the ranking allows. Bottom: mean (bars) and peak (ticks) power per GPU of each stage "
                "under the cap, and the mean it would draw without a cap (circles): the per-stage model of "
                "'advisor place', with the constants of the level the prediction uses for mean power; the dotted "
                "line is the layout's predicted mean power.")
    return page


def predict_page(model: str, cluster: str, cfg, p, power_cap_w: float | None = None, sets: Sequence[str] = (),
                 command: str | None = None) -> Page:
    from advisor.api import resolve
    from advisor.models.constants import DEFAULT
    from advisor.report import layout_text, prediction_rows

    m, c = resolve(model, cluster, power_cap_w)
    if sets:
        from advisor.models.calibrate import apply_overrides

        m, c, _ = apply_overrides(m, c, {}, sets)
    page = Page(f"{m.name} on {c.name}: {layout_text(cfg)}", "predict", command)
    page.p(f"{c.num_nodes}×{c.gpus_per_node} {c.gpu.name} ({c.gpu.memory_gib:.0f} GiB, cap {c.power_cap_w:.0f} W)"
           + (f", what-if: {', '.join(sets)}" if sets else "")
           + f"; mbs {cfg.mbs}, gbs {cfg.gbs}, seq {cfg.seq}, {cfg.precision}, recompute {cfg.recompute}")
    if not p.feasible:
        page.p(f"does not fit: {p.reason}", "note bad")
    page.h2("Prediction")
    page.table([("what", "left"), ("value", "right")], prediction_rows(p))
    if getattr(p, "intervals", None):
        from advisor.models.calibrate import format_intervals

        page.p(format_intervals(p))
    page.code("Megatron args", _megatron_args(m, cfg))
    page.h2("Where the step time goes")
    page.figure(fig_breakdown([(layout_text(cfg), p.breakdown, p.step_time_s)]), "breakdown",
                "Step time by component (seconds per step on the slowest pipeline stage, summed over its "
                "microbatches, plus the bubble, exposed data-parallel traffic, optimizer and fixed overheads).")
    used = getattr(p, "calibration", None)  # a calibrated prediction names its file
    consts = DEFAULT
    if used and used.get("file"):
        from advisor.models.calibrate import resolve_calibration

        consts = _power_constants(resolve_calibration(used["file"]))
    page.h2("Memory and power per pipeline stage")
    page.figure(fig_stages(_stage_items(m, c, [(layout_text(cfg), cfg, p)], consts), c.gpu.memory_gib,
                           c.gpu.memory_gib * consts.memory_usable_fraction, c.power_cap_w), "stages",
                "Memory per GPU of each pipeline stage against the GPU's capacity; mean (bars) and peak (ticks) "
                "power per GPU of each stage under the cap (the analytical per-stage model).")
    return page


def _megatron_args(m, cfg) -> str:
    from advisor.api import megatron_args

    return megatron_args(m, cfg)


# ------------------------------------------------------------------------------------------------
# place
# ------------------------------------------------------------------------------------------------

def place_page(plan, model: str, cluster, command: str | None = None) -> Page:
    from advisor.report import PLAN_COLUMNS, plan_rows, plan_title

    c = cluster
    page = Page(plan_title(plan, model, c.name), "place", command)
    page.p(f"{'APPLIED' if plan.applied else 'NOT APPLIED'}: {plan.reason}")
    page.table(PLAN_COLUMNS, plan_rows(plan))
    page.code("environment per node", "\n".join(
        f"{name}: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={plan.cuda_visible_devices(n)}"
        for n, name in enumerate(plan.node_names)))
    gpn = len(plan.gpus[0])
    per_stage = plan.cfg.tp * plan.cfg.cp * plan.cfg.dp

    def panel(title: str, pl) -> tuple[str, list[list[float]], list[list[str]]]:
        labels = [[""] * gpn for _ in plan.node_names]
        for n, row in enumerate(pl.gpus):
            for r, g in enumerate(row):
                labels[n][g] = f"S{(n * gpn + r) // per_stage}\n{pl.temps[n][g]:.0f}°C\n{pl.powers[n][g]:.0f} W"
        return title, [list(map(float, t)) for t in pl.temps], labels

    best = plan.candidate or plan.identity
    page.h2("Stages on the node's slots")
    page.figure(fig_heatmaps([panel(f"identity (step {plan.step_identity_s:.3f} s)", plan.identity),
                              panel(("planned, applied" if plan.applied else "best candidate, not applied")
                                    + f" (step {best.step_s:.3f} s)", best)], plan.node_names), "placement",
                "Each GPU slot of each node (CUDA index in PCI order): the pipeline stage it runs, its predicted "
                "steady temperature and power. Left: local rank r on GPU r; right: the planner's placement.")
    page.h2("Power and memory per pipeline stage")
    page.figure(fig_stages([{"label": f"{plan.cfg.key()}", "memory": [h.memory_gib for h in plan.heats],
                             "power_mean": [h.mean_power_w for h in plan.heats],
                             "power_peak": [h.peak_power_w for h in plan.heats],
                             "demand": [h.demand_mean_w for h in plan.heats]}],
                           c.gpu.memory_gib, None, c.power_cap_w), "stages",
                "The stage heat the plan prices: memory per GPU of each stage against the GPU's capacity; mean "
                "(bars) and peak (ticks) power per GPU under the cap on a nominal slot.")
    return page


# ------------------------------------------------------------------------------------------------
# studies
# ------------------------------------------------------------------------------------------------

def _feasible(t) -> bool:
    cons = t.system_attrs.get("constraints")
    if cons is None:
        cons = [v for k, v in t.system_attrs.items() if k.startswith("constraints:")]
    return all(v <= 0 for v in cons)


def study_page(storage: str, study_name: str | None = None, command: str | None = None) -> Page:
    import optuna

    from advisor.report import pareto_cells, pareto_columns
    from advisor.report import layout_text
    from advisor.catalog.specs import TrainConfig
    from advisor.study import OBJECTIVES, study_pareto
    from advisor.study_storage import dig, open_study_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = open_study_storage(storage)
    names = [s.study_name for s in st.get_all_studies()]
    if study_name is None:
        if len(names) != 1:
            raise SpecError(f"{storage}: {len(names)} studies ({', '.join(names) or 'none'}); pick one with --study-name")
        study_name = names[0]
    elif study_name not in names:
        raise SpecError(f"{storage}: no study named {study_name!r} (studies: {', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=study_name, storage=st)
    ua = study.user_attrs
    objective = ua.get("objective", "power")
    obj = OBJECTIVES.get(objective, "peak_power_w")
    obj_label = "peak power, W per GPU" if obj == "peak_power_w" else "energy, J per token"
    rows, table, bad = [], [], []
    for t in study.trials:
        a = t.user_attrs
        status = a.get("status")
        cfg = a.get("layout")
        layout = layout_text(TrainConfig.from_dict(cfg)) + f" mbs{cfg['mbs']} {cfg['recompute']}" if cfg else "-"
        dup = a.get("duplicate_of")
        own = a.get("record") is not None and dup is None
        if dup is not None:
            kind, note = "duplicate", f"duplicate of trial {dup} (not run again)"
        elif t.state.name == "FAIL":
            kind, note = "failed", "driver died while it ran" + ("; enqueued again" if a.get("stale") else "")
        elif status == "ok" and own:
            kind, note = "measured", a.get("values_from") or ""
        elif status == "oom":
            kind, note = "oom", a.get("error") or "out of memory"
        elif status == "refused":
            kind, note = "refused", a.get("error") or ""
        elif status in FAILED:
            kind, note = "failed", a.get("error") or status
        else:
            kind, note = t.state.name.lower(), a.get("error") or ""
        if a.get("retry_of") is not None:
            note = f"retry of trial {a['retry_of']}; " + note
        tps = t.values[0] if t.values and kind == "measured" else None
        cost = t.values[1] if t.values and kind == "measured" else None
        rec = a.get("record") if kind == "measured" else None
        rows.append({"trial": t.number, "kind": kind, "tps": tps, "cost": cost, "feasible": _feasible(t),
                     "predicted": dig(a, "predicted", "tokens_per_s_per_gpu"),
                     "peak_power_w": dig(rec, "telemetry", "peak_power_w"),
                     "energy_j_per_token": dig(rec, "telemetry", "energy_per_token_j")})
        table.append([str(t.number), t.state.name.lower(), status or "-", layout,
                      f"{tps:,.0f}" if tps is not None else "-",
                      (f"{cost:.0f}" if obj == "peak_power_w" else f"{cost:.3f}") if cost is not None else "-", note])
        bad.append(kind in ("failed", "oom"))
    front = study_pareto(study, obj)
    title = f"study {study_name}"
    page = Page(title, "study", command)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    page.p(f"{ua.get('model', '?')} on {ua.get('cluster', '?')}: seq {ua.get('seq', '?')}, gbs {ua.get('gbs', '?')}, "
           f"{ua.get('precision', '?')}; objectives: max tokens/s/GPU, min {obj_label}; runner {ua.get('runner', '?')}. "
           f"{len(rows)} trials: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
           + f". Storage: {Path(storage).name if '://' not in storage else storage.split('://')[0] + '://...'}")
    page.h2("Pareto front")
    page.table(pareto_columns(objective), [pareto_cells(r, objective) for r in front])
    page.h2("Convergence")
    page.figure(fig_convergence(rows, obj_label), "convergence",
                "Left: best feasible measured tokens/s per GPU so far against the trial number; grey points are "
                "every measured trial; trials that did not measure sit on the axis (OOM, failed or timed out, "
                "refused by the runner). Duplicates of a measured layout are not run again and not shown. "
                "Right: the study's prediction against the measurement of each measured trial.")
    pts = [r for r in rows if r["kind"] == "measured"]
    by_trial = {r["trial"]: r for r in rows}
    marked = [{**by_trial[r["trial"]], "label": f"t{r['trial']}"} for r in front]
    page.h2("Throughput against power and energy")
    page.figure(fig_tradeoff(pts, marked, None, "measured trials"), "tradeoff",
                "Every measured trial, with the peak power and energy per token its telemetry recorded; the orange "
                "line is the front of these points on each plot, blue (labelled by trial) the study's Pareto front "
                f"on its objectives (tokens/s/GPU and {obj_label}; feasible trials only: memory, power and run "
                "constraints).")
    page.h2("Trials")
    page.table([("trial", "right"), ("state", "left"), ("status", "left"), ("layout", "left"),
                ("tok/s/GPU", "right"), ("peak W" if obj == "peak_power_w" else "J/token", "right"), ("note", "left")],
               table, bad)
    return page


# ------------------------------------------------------------------------------------------------
# fit / dataset
# ------------------------------------------------------------------------------------------------

def _oof_panel(cal, t: str) -> dict | None:
    """Out-of-fold predictions of the level a calibration uses for target t, with its 80% band."""
    import numpy as np

    from advisor.models.calibrate import apply_residual

    o, y = cal.oof["levels"][t], np.asarray(cal.oof["y"][t], dtype=float)
    spec = cal.targets[t]
    iv = spec["interval"]
    if iv.get("type") == "gp_sd":
        base = o["calibrated"]
        half = iv["k"] * np.maximum(o["sd"], iv.get("sd_floor", 0.0))
        v, lo, hi = (apply_residual(t, base, o["mu"]), apply_residual(t, base, o["mu"] - half),
                     apply_residual(t, base, o["mu"] + half))
    else:
        base = o[spec["mode"]]
        v, lo, hi = base, apply_residual(t, base, iv["lo"]), apply_residual(t, base, iv["hi"])
    ok = np.isfinite(y) & np.isfinite(v) & np.isfinite(lo) & np.isfinite(hi)
    if not ok.any():
        return None
    lo, hi = np.minimum(lo, hi), np.maximum(lo, hi)
    row = cal.cv["targets"][t]
    return {"title": FIT_TARGETS[t][0], "measured": y[ok].tolist(), "predicted": v[ok].tolist(),
            "lo": lo[ok].tolist(), "hi": hi[ok].tolist(),
            "note": f"{spec['mode']} level: {row['metric']} {row[spec['mode']]['error']:.2f} out of fold"}


def fit_page(cal, ds, command: str | None = None) -> Page:
    from advisor.report import format_fit_report

    page = Page("calibration fit", "fit", command)
    page.p(f"data: {ds.summary()}")
    page.text(format_fit_report(cal))
    panels = [p for p in (_oof_panel(cal, t) for t in FIT_TARGETS) if p]
    page.h2("Predicted against measured, out of fold")
    page.figure(fig_pred_vs_meas(panels), "fit",
                f"Each point is a measurement predicted by the fold that did not train on its model shape "
                f"({cal.cv.get('scheme', '')}), at the level the calibration uses for the target; bars are the 80% "
                f"intervals, whose width comes from these same out-of-fold residuals (so about 80% fall inside by "
                f"construction).")
    return page


def dataset_page(paths: Sequence[str], calibration: Any = "default", stack: str | None = None,
                 command: str | None = None) -> Page:
    import hashlib

    import numpy as np

    from advisor.api import load_calibration
    from advisor.models import predict
    from advisor.models import dataset as dataset_mod
    from advisor.report import layout_text

    ds = dataset_mod.load(paths)
    if not ds.records:
        raise SpecError(f"{', '.join(paths)}: no usable measurement ({len(ds.rejected)} rejected)")
    cal = load_calibration(calibration, stack)
    page = Page(f"measurements: {', '.join(Path(p).name for p in paths)}", "dataset", command)
    page.p(f"data: {ds.summary()}")
    if cal is not None:
        mine = {hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}
        seen = set((cal.trained_on.get("sha256") or {}).values())
        overlap = "in sample: the calibration was fitted on this data" if mine & seen else \
            "out of sample: the calibration was not fitted on this data"
        page.p(f"predictions: calibration {Path(cal.source).name} ({overlap}); 80% intervals")
        preds = [cal.predict(r.model, r.cluster, r.cfg, check_legal=False) for r in ds.records]
    else:
        page.p("predictions: the analytical model (no calibration, no intervals)")
        preds = [predict(r.model, r.cluster, r.cfg, check_legal=False) for r in ds.records]
    panels, cov = [], []
    for t, (title, _) in FIT_TARGETS.items():
        idx = [i for i, r in enumerate(ds.records) if math.isfinite(r.y[t])]
        if not idx:
            continue
        y = [ds.records[i].y[t] for i in idx]
        v = [getattr(preds[i], t) for i in idx]
        pnl = {"title": title, "measured": y, "predicted": v}
        err = float(np.mean([abs(a / b - 1) for a, b in zip(v, y)]) * 100)
        if cal is not None:
            pnl["lo"] = [preds[i].intervals[t][0] for i in idx]
            pnl["hi"] = [preds[i].intervals[t][1] for i in idx]
            inside = sum(lo <= m <= hi for m, lo, hi in zip(y, pnl["lo"], pnl["hi"]))
            cov.append([title, str(len(idx)), f"{err:.1f}%", f"{inside}/{len(idx)} ({inside / len(idx):.0%})"])
        else:
            cov.append([title, str(len(idx)), f"{err:.1f}%", "-"])
        pnl["note"] = f"MAPE {err:.1f}% over {len(idx)} rows"
        panels.append(pnl)
    page.h2("Predicted against measured")
    page.table([("target", "left"), ("rows", "right"), ("MAPE", "right"), ("inside the 80% interval", "right")], cov)
    page.figure(fig_pred_vs_meas(panels), "dataset",
                "Each usable measurement against its prediction" + (" with the calibration's 80% interval" if cal else "")
                + ". Red points fall outside their interval.")
    page.h2("Measurements")
    rows = []
    for r, p in zip(ds.records, preds):
        y = r.y
        rows.append([r.source, r.model.name, r.cluster.name, layout_text(r.cfg), str(r.cfg.mbs), r.cfg.recompute,
                     f"{y['tokens_per_s_per_gpu']:,.0f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                     f"{y['memory_gib_per_gpu']:.1f}" if math.isfinite(y["memory_gib_per_gpu"]) else "-",
                     f"{p.memory_gib_per_gpu:.1f}",
                     f"{y['mean_power_w']:.0f}" if math.isfinite(y["mean_power_w"]) else "-", f"{p.mean_power_w:.0f}"])
    page.table([("source", "left"), ("model", "left"), ("cluster", "left"), ("layout", "left"), "mbs",
                ("recompute", "left"), "tok/s/GPU measured", "predicted", "GiB measured", "predicted",
                "mean W measured", "predicted"], rows)
    if ds.rejected:
        page.text("\n".join(ds.rejected[:50]))
    return page


def input_kind(path: str) -> str:
    """'study' (an Optuna journal file or an RDB URL) or 'dataset' (measurement JSONL)."""
    if "://" in path:
        return "study"
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{path}: no such file")
    with p.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    break
                if isinstance(first, dict) and "op_code" in first:
                    return "study"
                if isinstance(first, dict) and ("schema" in first or "config" in first):
                    return "dataset"
                break
    raise SpecError(f"{path}: neither an Optuna journal (advisor tune --storage) nor measurement JSONL")


# the figure helpers, public for report pages built in other modules (advisor.plan_html)
styled, new_figure = _styled, _figure

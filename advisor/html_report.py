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
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from advisor.catalog.specs import SpecError
from advisor.html_figures import (INSTALL, STEP_LABELS, ReportDependencyError, fig_breakdown,  # noqa: F401
                                  fig_convergence, fig_heatmaps, fig_pred_vs_meas, fig_stages, fig_tradeoff,
                                  new_figure, pareto_front, require, styled, svg)

FIT_TARGETS = {"tokens_per_s_per_gpu": ("tokens/s/GPU", 1.0), "memory_gib_per_gpu": ("memory, GiB/GPU", 1.0),
               "mean_power_w": ("mean power, W/GPU", 1.0), "peak_power_w": ("peak power, W/GPU", 1.0)}
FAILED = ("oom", "timeout", "crash", "killed", "skipped", "fail")


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
        markup = svg(fig, f"f{self.figures}")
        self.parts.append(f'<figure class="plot" id="plot-{esc(name)}" data-plot="{esc(name)}">{markup}'
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
    usable = (cal.screening_constants if cal is not None else DEFAULT).usable_memory_gib(c.gpu.memory_gib)
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
        from advisor.models.overrides import apply_overrides

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
                           consts.usable_memory_gib(c.gpu.memory_gib), c.power_cap_w), "stages",
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


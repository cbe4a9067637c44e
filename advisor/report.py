"""Human-readable reports (rich tables). JSON output lives with each command."""
from __future__ import annotations

import os
import shutil

from rich.console import Console
from rich.table import Table

from advisor.catalog import TrainConfig
from advisor.models import Prediction
from advisor.models.memory_band import fit_line


def make_console() -> Console:
    """A console as wide as the terminal (or $COLUMNS when set, as for a terminal), and 140
    columns when output goes to a file or pipe without $COLUMNS."""
    if os.isatty(1):
        return Console()
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return Console(width=int(columns))
    return Console(width=max(140, shutil.get_terminal_size((140, 24)).columns))


def print_text(console: Console, text: str) -> None:
    """Plain text (no markup), wrapped at spaces to the console's width."""
    console.print(text, markup=False, highlight=False, overflow="fold")


def print_command(console: Console, args: str) -> None:
    """A command line (Megatron args) that still pastes into a shell: wrapped between
    arguments, each line ending in ' \\' but the last; a flag stays with its value."""
    words = args.split(" ")
    groups: list[str] = []
    for w in words:
        if groups and not w.startswith("-") and groups[-1].startswith("-") and " " not in groups[-1]:
            groups[-1] += " " + w
        else:
            groups.append(w)
    lines, cur = [], ""
    for g in groups:
        if cur and len(cur) + 1 + len(g) + 2 > console.width:
            lines.append(cur)
            cur = g
        else:
            cur = f"{cur} {g}" if cur else g
    lines.append(cur)
    console.print(" \\\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def layout_text(cfg: TrainConfig) -> str:
    s = f"TP{cfg.tp}·PP{cfg.pp}·DP{cfg.dp}"
    if cfg.cp > 1:
        s += f"·CP{cfg.cp}"
    if cfg.ep > 1:
        s += f"·EP{cfg.ep}"
    if cfg.etp > 1:
        s += f"·ETP{cfg.etp}"
    if cfg.vp > 1:
        s += f"·VP{cfg.vp}"
    if cfg.pp_first_layers or cfg.pp_last_layers:
        s += f"·split{cfg.pp_first_layers or '-'}/{cfg.pp_last_layers or '-'}"
    if cfg.account_for_embedding or cfg.account_for_loss:
        s += "·acc" + "E" * cfg.account_for_embedding + "L" * cfg.account_for_loss
    if cfg.pipeline_layout:
        s += f"·layout {cfg.pipeline_layout}"
    if cfg.fsdp:
        s += "·FSDP"
    if cfg.cpu_offload_layers:
        s += f"·offload {cfg.cpu_offload_layers}L"
    return s


# the ranked table's columns (header, justification) and cells: the terminal and the HTML report
RECOMMEND_COLUMNS = (("#", "right"), ("layout", "left"), ("mbs", "right"), ("recomp", "left"),
                     ("tok/s/GPU", "right"), ("MFU", "right"), ("GiB", "right"), ("cap W", "right"),
                     ("MHz", "right"), ("peak W", "right"), ("mean W", "right"), ("throttled", "right"),
                     ("J/tok", "right"))
# step-time components of Prediction.breakdown, in seconds per step; they add up to the step time
STEP_KEYS = ("gemm_s", "attention_s", "memory_bound_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s",
             "pp_p2p_s", "layer_overhead_s", "pipeline_bubble_s", "dp_comm_exposed_s", "optimizer_s",
             "step_overhead_s")
STEP_LABELS = {"layer_overhead_s": "per-layer overhead", "step_overhead_s": "per-step overhead"}


# columns left out, in this order, until the ranked table fits a narrow terminal (rank, layout,
# mbs, recompute, speed, memory and throttle always stay)
NARROW_DROP = ("cap W", "MHz", "mean W", "peak W", "J/tok", "MFU")


def fitting_columns(headers: list[str], rows: list[list[str]], width: int, drop: tuple[str, ...],
                    gap: int = 2) -> list[int]:
    """Indices of the columns kept so that the table (cells `gap` apart, no outer padding) fits
    `width`: the columns of `drop` go first, in its order, until it does."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    keep = list(range(len(headers)))
    for name in drop:
        if sum(widths[i] for i in keep) + gap * (len(keep) - 1) <= width:
            break
        keep.remove(headers.index(name))
    return keep


def recommendation_cells(r) -> list[str]:
    p = r.prediction
    return [str(r.rank), layout_text(r.config), str(r.config.mbs), r.config.recompute[:4],
            f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.mfu * 100:.1f}%", f"{p.memory_gib_per_gpu:.1f}",
            f"{r.power_cap_w:.0f}", _mhz(p), f"{p.peak_power_w:.0f}", f"{p.mean_power_w:.0f}", throttled(p),
            f"{p.energy_j_per_token:.3f}"]


def throttled(p: Prediction) -> str:
    """The one throttle figure the terminal shows: the share of the time the power cap holds the
    clock down (NVML's power-cap clock-event reason), the quantity measured, calibrated and given
    intervals ('throttled 94%-100%'); the ranking's 0..1 risk score stays in --json only."""
    return f"{p.throttle_fraction:.0%}"


def _mhz(p: Prediction) -> str:
    """The SM clock the cap holds on the critical stage (a fraction of the maximum when the
    catalog has no maximum clock for the GPU)."""
    return f"{p.sm_clock_mhz:,.0f}" if p.sm_clock_mhz else f"{p.clock_ratio:.0%}"


def _cap_point(d: dict) -> str:
    return (f"{d['power_cap_w']:.0f} W: {d['energy_j_per_token']:.3f} J/token ({-d['energy_saved_pct']:+.1f}%), "
            f"step {d['step_time_change_pct']:+.1f}%")


def cap_line(sweep: dict, objective: str = "energy") -> str:
    """The chosen cap against the cluster's cap, from a models.power.CapSweep.to_dict()."""
    key = "min_energy" if objective == "energy" else "min_energy_within_5pct"
    ref = sweep["at_cluster_cap"]
    return (f"{_cap_point(sweep[key])} vs {ref['power_cap_w']:.0f} W ({ref['energy_j_per_token']:.3f} J/token)"
            f"; tried {len(sweep['curve'])} caps {sweep['curve'][0]['power_cap_w']:.0f}-{sweep['curve'][-1]['power_cap_w']:.0f} W")


def stage_caps_line(sc: dict) -> str:
    """Per-stage caps, from a models.power.StageCaps.to_dict()."""
    return (f"{', '.join(f'{v:.0f}' for v in sc['caps_w'])} W for stages 0..{len(sc['caps_w']) - 1}: "
            f"{-sc['energy_saved_pct']:+.1f}% energy, step {sc['step_time_change_pct']:+.2f}% (stages off the critical path)")


def print_recommendations(res, console: Console | None = None) -> None:
    console = console or make_console()
    wl = res.workload
    c = res.cluster
    console.print(
        f"[bold]{res.model.name}[/] on [bold]{c.name}[/] ({c.num_nodes}×{c.gpus_per_node} {c.gpu.name}, "
        f"cap {c.power_cap_w:.0f} W) — seq {wl.seq}, gbs {wl.gbs}, {wl.precision}, objective {res.objective}")
    how = (f"profile {res.profile}: {os.path.basename(res.calibration)}" if res.calibration
           else "analytical model, no profile")
    ranked = len(res.rank_scores)
    console.print(f"{res.candidates_evaluated} legal layouts, {res.feasible} fit in memory, {ranked} ranked "
                  f"(the other {res.feasible - ranked}: a heavier recompute of a layout that fits with a lighter "
                  f"one) in {res.elapsed_s:.2f} s (stack {res.stack}; {how})")
    rows = [recommendation_cells(r) for r in res.recommendations]
    keep = fitting_columns([c for c, _ in RECOMMEND_COLUMNS], rows, console.width, NARROW_DROP)
    if res.left_out.get("line"):
        console.print(res.left_out["line"])
    t = Table(show_lines=False, pad_edge=False, box=None)
    for i in keep:
        col, just = RECOMMEND_COLUMNS[i]
        # the layout is never cut: folded onto a second line only if even the narrowest table is too wide
        t.add_column(col, justify=just, no_wrap=col != "layout", overflow="fold")
    for cells in rows:
        t.add_row(*(cells[i] for i in keep))
    console.print(t)
    dropped = [RECOMMEND_COLUMNS[i][0] for i in range(len(RECOMMEND_COLUMNS)) if i not in keep]
    if dropped:
        print_text(console, f"({console.width} columns: {', '.join(dropped)} left out; a wider terminal "
                            f"or --json shows them)")
    best = res.recommendations[0]
    if best.power_caps:
        console.print(f"[bold]#1 power cap:[/] {cap_line(best.power_caps, res.objective)}")
    if best.stage_caps:
        console.print(f"[bold]#1 per-stage caps:[/] {stage_caps_line(best.stage_caps)}")
    if best.memory:
        console.print(f"[bold]#1 memory:[/] {fit_line(best.memory)}", highlight=False)
    console.print(f"[bold]#1 why:[/] {best.reason}")
    console.print("[bold]#1 Megatron args:[/]")
    print_command(console, best.megatron_args)
    from advisor.runners.megatron_args import launch_env

    env = launch_env(best.config)
    if env:  # torch's allocator settings the layout's memory prediction assumes (TrainConfig.expandable_segments)
        console.print("[bold]#1 environment:[/] " + " ".join(f"{k}={v}" for k, v in env.items()),
                      soft_wrap=True, highlight=False)
    for note in best.megatron_notes:
        console.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)


def print_prediction(model: str, cluster: str, cfg: TrainConfig, p: Prediction, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(f"[bold]{model}[/] on [bold]{cluster}[/]: {layout_text(cfg)}, mbs {cfg.mbs}, gbs {cfg.gbs}, "
                  f"seq {cfg.seq}, {cfg.precision}, recompute {cfg.recompute}")
    if not p.feasible:
        console.print(f"[red]does not fit:[/] {p.reason}")
    t = Table(show_header=False)
    t.add_column("what", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    for k, v in prediction_rows(p):
        t.add_row(k, v)
    console.print(t)


def prediction_rows(p: Prediction) -> list[tuple[str, str]]:
    """(what, value with its unit) of one prediction: the terminal and the HTML report."""
    rows = [
        ("tokens/s/GPU", f"{p.tokens_per_s_per_gpu:,.0f}"),
        ("step time", f"{p.step_time_s:.3f} s"),
        ("MFU", f"{p.mfu * 100:.1f}%"),
        ("memory (fullest stage)", f"{p.memory_gib_per_gpu:.1f} GiB"),
        ("memory per stage", ", ".join(f"{m:.1f}" for m in p.memory_per_stage_gib) + " GiB"),
        ("peak / mean power", f"{p.peak_power_w:.0f} / {p.mean_power_w:.0f} W"),
        ("SM clock (critical stage)", f"{_mhz(p)} MHz" if p.sm_clock_mhz else f"{_mhz(p)} of the maximum"),
        ("throttled (power cap)", f"{throttled(p)}: {p.throttle_reason}"),
        ("steady temperature", f"{p.steady_temp_c:.0f} °C"),
        ("energy", f"{p.energy_j_per_token:.3f} J/token"),
        ("pipeline bubble", f"{p.bubble_fraction * 100:.1f}%"),
    ]
    caps = getattr(p, "power_caps", None) or {}
    if caps.get("sweep"):
        sw = caps["sweep"]
        rows.append(("least J/token", _cap_point(sw["min_energy"])))
        rows.append(("least J/token, step within 5%", _cap_point(sw["min_energy_within_5pct"])))
    if caps.get("stage_caps"):
        rows.append(("per-stage caps", stage_caps_line(caps["stage_caps"])))
    bd = p.breakdown
    for k in STEP_KEYS:  # every term, so that they add up to the step time (as the HTML chart's)
        if bd.get(k):
            rows.append((f"  {STEP_LABELS.get(k, k[:-2].replace('_', ' '))}", f"{bd[k]:.3f} s"))
    return rows


def print_comparison(x, console: Console | None = None) -> None:
    """One compared layout next to #1 (advisor.api.Comparison)."""
    console = console or make_console()
    p = x.prediction
    where = f"rank {x.rank} of {x.of} ranked" if x.rank is not None else "does not fit in memory"
    console.print(f"[bold]compared[/] {layout_text(x.config)} mbs {x.config.mbs} {x.config.recompute}: "
                  f"{p.tokens_per_s_per_gpu:,.0f} tok/s/GPU = {x.ratio_to_top:.3f} of #1 ({where})")
    print_text(console, f"  {x.why}")


PLAN_COLUMNS = ("stage", "layers", "demand W", "node", "GPUs (PCI order)", "°C identity", "°C planned", "slowdown")


def plan_rows(p) -> list[list[str]]:
    """One row per (stage, node) of a placement plan, in PLAN_COLUMNS: the terminal and the HTML report."""
    run = p.candidate if p.applied else p.identity
    gpn = len(p.gpus[0])
    per_stage = p.cfg.tp * p.cfg.cp * p.cfg.dp
    names = p.node_names
    rows = []
    for row in p.stage_map():
        s, n = row["stage"], names.index(row["node"])
        h = p.heats[s]
        ranks = [r for r in range(gpn) if (n * gpn + r) // per_stage == s]
        ident = [p.identity.temps[n][r] for r in ranks]  # identity: local rank r on GPU r
        planned = [run.temps[n][g] for g in row["gpus"]]
        rows.append([str(s), str(h.layers), f"{h.demand_mean_w:.0f}", row["node"], ",".join(map(str, row["gpus"])),
                     f"{max(ident):.0f}", f"{max(planned):.0f}", f"{run.stage_slowdown[s]:.3f}"])
    return rows


def plan_title(p, model: str, cluster: str) -> str:
    """The plan's title, its layout spelled as every other command spells it (TP·PP·DP..., mbs,
    recompute): the terminal and the HTML report."""
    return f"placement of {model} {layout_text(p.cfg)} mbs {p.cfg.mbs} {p.cfg.recompute} on {cluster}"


def pareto_columns(objective: str) -> tuple[tuple[str, str], ...]:
    """(header, justification) of the Pareto table of a study: the terminal and the HTML report."""
    obj = "peak W" if objective == "power" else "J/token"
    return (("trial", "right"), ("layout", "left"), ("mbs", "right"), ("recomp", "left"),
            ("tok/s/GPU", "right"), (obj, "right"), ("mean W", "right"), ("GiB", "right"),
            ("predicted tok/s/GPU", "right"))


def pareto_cells(r: dict, objective: str) -> list[str]:
    """One row of study_pareto() as the cells of pareto_columns()."""
    key = "peak_power_w" if objective == "power" else "energy_j_per_token"
    c = TrainConfig.from_dict(r["config"])
    v = r[key]
    return [str(r["trial"]), layout_text(c), str(c.mbs), c.recompute[:4], f"{r['tokens_per_s_per_gpu']:,.0f}",
            f"{v:.0f}" if key == "peak_power_w" else f"{v:.3f}",
            f"{r['mean_power_w']:.0f}" if r.get("mean_power_w") else "-",
            f"{r['memory_gib']:.1f}" if r.get("memory_gib") else "-",
            f"{r['predicted_tokens_per_s_per_gpu']:,.0f}" if r.get("predicted_tokens_per_s_per_gpu") else "-"]


def format_fit_report(cal) -> str:
    """The CV table and the fitted constants of a calibration, as text: `advisor fit` and its HTML report."""
    from advisor.models.calibrate import FIT_BOUNDS, MODES
    from advisor.models.constants import DEFAULT

    cv = cal.cv
    lines = [f"cross-validation: {cv['scheme']}, {cv['level']:.0%} intervals from out-of-fold residuals",
             f"{'target':22s} {'n':>4s} {'metric':7s} " + " ".join(f"{m + ' err/R2':>22s}" for m in MODES)
             + "  used"]
    for t, row in cv["targets"].items():
        cells = []
        for m in MODES:
            e, r = row[m]["error"], row[m]["r2"]
            cells.append(f"{e:10.2f} / {r:7.3f}    " if e == e else f"{'-':>22s}")
        lines.append(f"{t:22s} {row['n']:4d} {row['metric']:7s} " + " ".join(f"{c:>22s}" for c in cells)
                     + f"  {row['chosen']}" + (f" ({row['why']})" if row["chosen"] == "analytical" else ""))
    lines.append("constants (default -> fitted):")
    for k in FIT_BOUNDS:
        a, b = getattr(DEFAULT, k), getattr(cal.constants, k)
        mark = "" if abs(b / a - 1) < 0.01 else "  *"
        lines.append(f"  {k:24s} {a:12.5g} -> {b:12.5g}{mark}")
    if cal.fit_info.get("at_bound"):
        lines.append(f"  at their bounds: {', '.join(cal.fit_info['at_bound'])}")
    return "\n".join(lines)

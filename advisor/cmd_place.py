"""`advisor place`, `advisor launch` and `advisor thermal-profile`: thermal-aware placement."""
from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from advisor.options import (CP, MBS, PP, TP, VP, Cluster, Gbs, Html, Model, PowerCap, Precision, Recompute, Seq,
                             SequenceParallel)

_PROFILE_HELP = "slot profile JSON (advisor thermal-profile); one per node in node-rank order, or one for all"


def register(app: typer.Typer) -> None:
    app.command("place")(place_cmd)
    app.command("launch", context_settings={"allow_interspersed_args": False})(launch_cmd)
    app.command("thermal-profile")(thermal_profile_cmd)


def _layout_values(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def place_cmd(
    model: Model,
    cluster: Cluster,
    profile: List[str] = typer.Option(..., "--profile", "-p", help=_PROFILE_HELP),
    tp: TP = 1,
    pp: PP = 1,
    vp: VP = 1,
    cp: CP = 1,
    mbs: MBS = 1,
    gbs: Gbs = None,
    seq: Seq = None,
    precision: Precision = "bf16",
    recompute: Recompute = "none",
    sequence_parallel: SequenceParallel = None,
    power_cap: PowerCap = None,
    margin: float = typer.Option(0.5, "--margin", help="apply only when the predicted gain is at least this many %"),
    uneven: bool = typer.Option(False, "--uneven", help="also move layers between stages when it pays (adds pipeline_layout)"),
    leak_per_c: Optional[float] = typer.Option(None, "--leak-per-c", help="capped slowdown per °C (default 0.003)"),
    as_json: bool = typer.Option(False, "--json", help="the plan as one JSON object"),
    html: Html = None,
) -> None:
    """Plan which physical GPU runs each pipeline stage: heavy stages to cooler slots, when it pays."""
    from advisor.api import layout_from_flags, resolve
    from advisor.placement import ThrottleCurve, node_profiles, plan

    if html:
        from advisor import html_report

        html_report.require()

    m, c = resolve(model, cluster, power_cap)
    cfg = layout_from_flags(m, c, _layout_values(tp=tp, pp=pp, vp=vp, cp=cp, mbs=mbs, gbs=gbs, seq=seq,
                                                 precision=precision, recompute=recompute,
                                                 sequence_parallel=sequence_parallel))
    profs = node_profiles(profile, c.num_nodes)
    curve = ThrottleCurve() if leak_per_c is None else ThrottleCurve(leak_per_c=leak_per_c)
    p = plan(m, c, cfg, profs, margin_pct=margin, uneven=uneven, curve=curve)
    if as_json:
        json.dump(p.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_plan(p, m.name, c.name)
    if html:
        html_report.save(html, html_report.place_page(p, m.name, c))


def _print_plan(p, model: str, cluster: str) -> None:
    from advisor.report import PLAN_COLUMNS, make_console, plan_rows, plan_title
    from rich.table import Table

    t = Table(title=plan_title(p, model, cluster))
    for col in PLAN_COLUMNS:
        t.add_column(col)
    for row in plan_rows(p):
        t.add_row(*row)
    names = p.node_names
    con = make_console()
    con.print(t)
    con.print(f"{'APPLIED' if p.applied else 'NOT APPLIED'}: {p.reason}")
    for n, name in enumerate(names):
        con.print(f"  {name}: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={p.cuda_visible_devices(n)}")
    if p.slurm_gpu_bind:
        con.print(f"  srun --gpu-bind={p.slurm_gpu_bind}")
    if p.uneven_requested:
        k = p.layer_counts
        con.print(f"  pipeline layout (layers per stage): {k}")
        if len(set(k[1:-1])) <= 1 and len(set(k)) > 1:
            con.print(f"  Megatron: --decoder-first-pipeline-num-layers {k[0]} --decoder-last-pipeline-num-layers {k[-1]}")
        elif len(set(k)) > 1:
            con.print("  Megatron: this split needs --pipeline-model-parallel-layout (first/last overrides cannot express it)")


def launch_cmd(
    cmd: List[str] = typer.Argument(None, help="the command to run, after --"),
    profile: Optional[List[str]] = typer.Option(None, "--profile", "-p", help=_PROFILE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m"),
    cluster: Optional[str] = typer.Option(None, "--cluster", "-c"),
    tp: Optional[str] = typer.Option(None, "--tp"),
    pp: Optional[str] = typer.Option(None, "--pp"),
    vp: Optional[str] = typer.Option(None, "--vp"),
    cp: Optional[str] = typer.Option(None, "--cp"),
    mbs: Optional[str] = typer.Option(None, "--mbs"),
    gbs: Optional[str] = typer.Option(None, "--gbs"),
    seq: Optional[str] = typer.Option(None, "--seq"),
    recompute: Optional[str] = typer.Option(None, "--recompute"),
    power_cap: Optional[str] = typer.Option(None, "--power-cap"),
    margin: Optional[str] = typer.Option(None, "--margin"),
    node_rank: Optional[str] = typer.Option(None, "--node-rank", help="default: NODE_RANK, GROUP_RANK or SLURM_NODEID, else 0"),
    trust_profile: bool = typer.Option(False, "--trust-profile", help="skip checking the profile against this node's GPUs (NVML)"),
    apply_power_caps: bool = typer.Option(False, "--apply-power-caps", help="set the per-stage power caps of the plan on this node's GPUs with nvidia-smi -pl (a dry run that lists the commands unless --no-dry-run)"),
    dry_run: bool = typer.Option(True, "--dry-run/--no-dry-run", help="with --apply-power-caps: only list the nvidia-smi commands (default)"),
) -> None:
    """Run COMMAND with CUDA_DEVICE_ORDER=PCI_BUS_ID and this node's planned CUDA_VISIBLE_DEVICES.

    Example: advisor launch -p node.json -m llama3-70b -c h200x16 --tp 4 --pp 4 -- torchrun ...
    If anything goes wrong with the placement, COMMAND runs unchanged after one warning line.
    --apply-power-caps: the stages off the critical path get the lower caps of the plan
    (advisor place --json: stage_caps), by nvidia-smi -pl per GPU; listed only, unless --no-dry-run.
    """
    from advisor.placement.launch import exec_placed

    if not cmd:
        raise typer.BadParameter("give the command to run after --, e.g. -- torchrun --nproc-per-node 8 train.py")

    def compute():
        from advisor.api import layout_from_flags, resolve
        from advisor.placement import PlacementSkipped, node_profiles, placement_env, plan

        if not profile:
            raise PlacementSkipped("no --profile given")
        if not model or not cluster:
            raise PlacementSkipped("--model and --cluster are needed to plan the placement")
        m, c = resolve(model, cluster, float(power_cap) if power_cap else None)
        ints = {k: int(v) for k, v in dict(tp=tp, pp=pp, vp=vp, cp=cp, mbs=mbs, gbs=gbs, seq=seq).items() if v}
        cfg = layout_from_flags(m, c, _layout_values(recompute=recompute, **ints))
        profs = node_profiles(profile, c.num_nodes)
        p = plan(m, c, cfg, profs, margin_pct=float(margin) if margin else 0.5)
        env, note = placement_env(p, profs, node=node_rank, verify=not trust_profile)
        if apply_power_caps:
            from advisor.placement.launch import apply_power_caps as apply, power_cap_commands

            note += "; " + apply(power_cap_commands(p, profs, node=node_rank), dry_run=dry_run)
        return env, note

    exec_placed(cmd, compute)


def thermal_profile_cmd(
    seconds: float = typer.Option(300.0, "--seconds", help="burn duration; temperatures settle in ~60 s"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="profile JSON to write (default profile-<host>.json)"),
    node: Optional[str] = typer.Option(None, "--node", help="node name (default: the hostname)"),
    idle: float = typer.Option(15.0, "--idle", help="idle seconds recorded before the burn"),
    cool: float = typer.Option(30.0, "--cool", help="seconds recorded after the burn"),
    rate: float = typer.Option(2.0, "--rate", help="telemetry samples per second"),
    from_trace: Optional[str] = typer.Option(None, "--from-trace", help="fit a recorded telemetry trace (*.trace.json.gz: a burn or a whole measurement batch) instead of measuring; no GPU needed"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Measure every GPU slot of this node: the same GEMM burn on all GPUs at once, then fit
    T = ambient + c_per_w · P per slot. Needs NVML and torch with CUDA (not with --from-trace)."""
    import socket

    if from_trace is not None:
        from advisor.cli import fail
        from advisor.placement.profile import profile_from_trace
        from advisor.runners.telemetry import Trace

        try:
            trace = Trace.load(from_trace)
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"cannot read trace {from_trace}: {e}")
        prof = profile_from_trace(trace, node)
        name = prof.node
        path = out or f"profile-{name}.json"
    else:
        from advisor.placement.measure import measure_profile

        name = node or socket.gethostname()
        path = out or f"profile-{name}.json"
        prof = measure_profile(seconds, name, idle_s=idle, cool_s=cool, rate_hz=rate, trace_out=path + ".trace.json.gz")
    prof.save(path)
    if as_json:
        json.dump(prof.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    from advisor.report import make_console
    from rich.table import Table

    t = Table(title=f"slot profile of {prof.node} -> {path}")
    for col in ("index", "uuid", "PCI", "ambient °C", "°C/W", "°C at 700 W", "TFLOP/s", "speed", "throttled"):
        t.add_column(col)
    def num(v, fmt):  # a trace fit has no burn numbers
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for g in prof.cuda_order():
        e = g.extra
        t.add_row(str(g.index), g.uuid, g.pci_bus_id, f"{g.ambient_c:.1f}", f"{g.c_per_w:.4f}", f"{g.temp_c(700):.1f}",
                  num(e.get("gemm_tflops"), ".1f"), num(e.get("speed_at_cap"), ".4f"),
                  num(e.get("throttle_fraction"), ".2f"))
    make_console().print(t)

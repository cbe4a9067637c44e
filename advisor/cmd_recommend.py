"""`advisor recommend` and `advisor predict`."""
from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from advisor.options import (CP, EP, ETP, MBS, PP, TP, AccountForEmbedding, AccountForLoss, AsJson, Cluster,
                             CpuOffloadLayers,
                             Fp8Recipe, Gbs, Html, Model, OptCluster, OptModel, OptVP, PipelineLayout, PowerCap,
                             PowerCaps, PPFirstLayers, PPLastLayers, Precision, Recompute, Seq, SequenceParallel, Stack,
                             calibration_default)


CAL_HELP = ("'default' (the --stack's shipped profile), a calibration file from 'advisor fit', or 'none' "
            "(analytical model only); a profile adds 80% intervals [default: advisor.api.DEFAULT_CALIBRATION]")
SET_HELP = "what-if KEY=VALUE, repeatable: gpu=h200, nodes=16, gpus=32, power_cap=500, mbs=4, seq=8192, layers=40, ..."


def register(app: typer.Typer) -> None:
    app.command("recommend")(recommend_cmd)
    app.command("predict")(predict_cmd)


def recommend_cmd(
    model: Model,
    cluster: Cluster,
    seq: Seq = None,
    gbs: Gbs = None,
    precision: Precision = "bf16",
    fp8_recipe: Fp8Recipe = "delayed",
    top: int = typer.Option(5, "--top", help="how many layouts to show"),
    objective: str = typer.Option("throughput", "--objective", help="throughput, energy (the cap with the least J/token) or balanced (the least J/token within 5% of the fastest step); energy and balanced choose the power cap with the layout"),
    power_cap: PowerCap = None,
    power_caps: PowerCaps = None,
    calibration: Optional[str] = typer.Option(None, "--calibration", help=CAL_HELP, callback=calibration_default),
    stack: Stack = None,
    sets: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    compare: Optional[List[str]] = typer.Option(
        None, "--compare", help="another layout to place next to #1, e.g. 'tp=4,pp=4,cp=2,vp=5,mbs=1' "
                                "(repeatable): its ratio to #1, its rank and where the time differs"),
    memory_margin: Optional[float] = typer.Option(
        None, "--memory-margin", help="share of the GPU's memory a layout's memory upper bound must leave free "
                                      "[default: the profile's memory_margin_gib, 4 GiB, as a share: 0.050 of an H100, 0.022 of a GB200]"),
    as_json: AsJson = False,
    html: Html = None,
) -> None:
    """Rank the layouts of MODEL on CLUSTER: speed, memory, power, throttle risk, Megatron args."""
    from advisor.api import recommend

    if html:
        from advisor import html_report

        html_report.require()

    from advisor.api import compare as compare_layout

    check_power_caps(model, cluster, power_cap, sets, power_caps, objective)
    layouts = [parse_layout(x) for x in compare or ()]
    res = recommend(model, cluster, seq=seq, gbs=gbs, precision=precision, fp8_recipe=fp8_recipe, top=top,
                    objective=objective,
                    power_cap_w=power_cap, calibration=calibration, overrides=sets or (), stack=stack,
                    power_caps=power_caps, memory_margin=memory_margin)
    res.compared = [compare_layout(res, v, calibration) for v in layouts]
    if as_json:
        from advisor.validate import finite_json

        json.dump(finite_json(res.to_dict()), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from advisor import report  # rich tables only when printed

        console = report.make_console()
        report.print_recommendations(res, console)
        first = res.recommendations[0].prediction if res.recommendations else None
        if getattr(first, "intervals", None):
            from advisor.models.calibrate import format_intervals

            report.print_text(console, "#1 " + format_intervals(first))
        for w in res.warnings:  # one line each, as every warning
            typer.echo(f"warning: {w}")
        if res.domain_note:
            typer.echo(f"note: {res.domain_note}")
        for x in res.compared:
            report.print_comparison(x, console)
    if html:
        html_report.save(html, html_report.recommend_page(res))


def check_power_caps(model: str, cluster: str, power_cap: float | None, sets, power_caps: str | None,
                     objective: str) -> None:
    """--power-caps before any ranking, whatever the objective: LO:HI:STEP, every cap settable on
    the GPU of the cluster (after its --set what-ifs: gpu=b200 changes the range). Only energy and
    balanced choose a cap from the grid; throughput ranks at one cap (--power-cap, default the TDP)
    and would ignore it, so with throughput the flag is refused as a conflict naming both."""
    if power_caps is None:
        return
    from advisor.api import resolve
    from advisor.catalog import SpecError
    from advisor.models.overrides import apply_overrides
    from advisor.models.power import cap_grid
    from advisor.validate import InputError

    m, c = resolve(model, cluster, power_cap)
    if sets:
        m, c, _ = apply_overrides(m, c, {}, sets)
    try:
        cap_grid(c.gpu, power_caps)
    except SpecError as e:
        msg = str(e)
        raise InputError(msg if msg.startswith("--power-caps") else f"--power-caps {power_caps}: {msg}") from None
    if objective == "throughput":
        raise InputError("--power-caps and --objective throughput conflict: throughput ranks every layout at one "
                         "cap (--power-cap, default the TDP); --objective energy or balanced chooses each "
                         "layout's cap from --power-caps")


_LAYOUT_INT = ("tp", "pp", "cp", "ep", "etp", "vp", "mbs", "pp_first_layers", "pp_last_layers", "cpu_offload_layers")


_COMPARE_BOOLS = ("sequence_parallel", "tp_comm_overlap", "distributed_optimizer", "account_for_embedding",
                  "account_for_loss", "moe_pad_to_capacity", "moe_a2a_overlap", "moe_shared_expert_overlap",
                  "moe_router_fusion", "moe_permute_fusion", "fsdp")
_COMPARE_NAMES = ("recompute", "moe_dispatcher", "moe_router")


def parse_layout(text: str) -> dict:
    """'tp=4,pp=4,cp=2,vp=5,mbs=1,recompute=selective' -> layout values (one-line error if bad).
    A pipeline layout (it may hold commas) comes last: '...,pipeline_layout=Et|(tt|)*30L'."""
    from advisor.catalog import SpecError

    out: dict = {}
    for key in ("pipeline_layout=", "pipeline-layout="):
        if key in text:
            text, _, layout = text.partition(key)
            out["pipeline_layout"] = layout.strip()
    for part in filter(None, (x.strip() for x in text.split(","))):
        k, sep, v = part.partition("=")
        k = k.strip().replace("-", "_")
        if not sep or not v.strip():
            raise SpecError(f"--compare {text!r}: expected KEY=VALUE pairs separated by commas")
        if k in _LAYOUT_INT:
            try:
                out[k] = int(v)
            except ValueError:
                raise SpecError(f"--compare {k}={v}: not an integer") from None
        elif k in _COMPARE_NAMES:
            out[k] = v.strip()
        elif k == "moe_capacity_factor":
            try:
                out[k] = float(v)
            except ValueError:
                raise SpecError(f"--compare {k}={v}: not a number") from None
        elif k in _COMPARE_BOOLS:
            out[k] = v.strip().lower() in ("1", "true", "on", "yes")
        else:
            from advisor.catalog.errors import did_you_mean

            known = _LAYOUT_INT + _COMPARE_NAMES + ("moe_capacity_factor",) + _COMPARE_BOOLS + ("pipeline_layout",)
            raise SpecError(f"--compare {k}: unknown key{did_you_mean(k, known)} (known: "
                            f"{', '.join(_LAYOUT_INT + ('recompute',))}, account_for_embedding, account_for_loss, "
                            f"pipeline_layout last)")
    if not out:
        raise SpecError("--compare needs a layout, e.g. 'tp=4,pp=4,cp=2,vp=5,mbs=1'")
    return out


def predict_cmd(
    model: OptModel = None,
    cluster: OptCluster = None,
    tp: TP = 1,
    pp: PP = 1,
    pp_first_layers: PPFirstLayers = None,
    pp_last_layers: PPLastLayers = None,
    account_for_embedding: AccountForEmbedding = False,
    account_for_loss: AccountForLoss = False,
    pipeline_layout: PipelineLayout = None,
    cp: CP = 1,
    ep: EP = 1,
    etp: ETP = 1,
    vp: OptVP = None,
    mbs: MBS = 1,
    gbs: Gbs = None,
    seq: Seq = None,
    precision: Precision = "bf16",
    fp8_recipe: Fp8Recipe = "delayed",
    recompute: Recompute = "none",
    sequence_parallel: SequenceParallel = None,
    distributed_optimizer: Optional[bool] = typer.Option(None, "--distributed-optimizer/--no-distributed-optimizer"),
    cpu_offload_layers: CpuOffloadLayers = None,
    fsdp: Optional[bool] = typer.Option(None, "--fsdp/--no-fsdp", help="Megatron FSDP (optim_grads_params: weights, "
                                        "gradients and optimizer states sharded over DP)"),
    power_cap: PowerCap = None,
    power_caps: PowerCaps = None,
    calibration: Optional[str] = typer.Option(None, "--calibration", help=CAL_HELP, callback=calibration_default),
    stack: Stack = None,
    sets: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    batch: Optional[str] = typer.Option(None, "--batch", help="JSONL file of layouts ('-' = stdin); one JSON line out per line in"),
    as_json: AsJson = False,
    html: Html = None,
) -> None:
    """Predict one layout (DP is derived), or a batch of them with --batch FILE.jsonl (the
    flags given with it are every line's defaults; a line's own keys win)."""
    from advisor.api import predict_batch, predict_layout

    values = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vp=vp, mbs=mbs, gbs=gbs, seq=seq, precision=precision,
                  fp8_recipe=fp8_recipe, recompute=recompute, sequence_parallel=sequence_parallel,
                  distributed_optimizer=distributed_optimizer, fsdp=fsdp, pp_first_layers=pp_first_layers,
                  pp_last_layers=pp_last_layers, account_for_embedding=account_for_embedding,
                  account_for_loss=account_for_loss, pipeline_layout=pipeline_layout,
                  cpu_offload_layers=cpu_offload_layers)

    if html:
        from advisor import html_report

        if batch is not None:
            raise typer.BadParameter("--html reports one layout; it does not go with --batch")
        html_report.require()

    if batch is not None:
        from advisor import validate

        given = validate.given_params()
        defaults = {k: v for k, v in dict(values, model=model, cluster=cluster, power_cap_w=power_cap).items()
                    if k in given or (k == "power_cap_w" and "power_cap" in given)}
        stream = sys.stdin if batch == "-" else open(batch, encoding="utf-8", errors="replace")
        # a file is read and predicted in blocks of lines (one array evaluation per model and
        # cluster); a pipe or terminal line by line, so that a caller that writes a line and waits
        # for its answer gets it
        import os
        import stat

        try:
            regular = stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
        except (OSError, ValueError, AttributeError):
            regular = False
        with stream:
            for row in predict_batch(stream, calibration=calibration, overrides=sets or (), stack=stack,
                                     defaults=defaults, chunk=4096 if regular else 1):
                sys.stdout.write(validate.dumps(row) + "\n")
                sys.stdout.flush()
        return
    if model is None or cluster is None:
        from advisor.cli import fail

        fail("--model and --cluster are required (or give --batch FILE)")
    cfg, p = predict_layout(model, cluster, values, power_cap_w=power_cap, calibration=calibration,
                            overrides=sets or (), stack=stack, power_caps=power_caps, energy_caps=True)
    raw_cluster = cluster
    if sets:  # say what the what-if changed
        cluster = f"{cluster} (what-if: {', '.join(sets)})"
    if as_json:
        from advisor.models.profiles import get_stack
        from advisor.validate import finite_json

        profile = (getattr(p, "calibration", None) or {}).get("profile")
        json.dump(finite_json({"model": model, "cluster": cluster, "stack": get_stack(stack).name, "profile": profile,
                               "config": cfg.to_dict(), "prediction": p.to_dict()}), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from advisor import report

        console = report.make_console()
        report.print_prediction(model, cluster, cfg, p, console)
        if getattr(p, "intervals", None):
            from advisor.models.calibrate import format_intervals

            report.print_text(console, format_intervals(p))
    if html:
        html_report.save(html, html_report.predict_page(model, raw_cluster, cfg, p, power_cap, sets or ()))

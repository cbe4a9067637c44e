"""`advisor plan`: GPUs, layout, power cap, days, energy and goodput of a whole training run."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from advisor.options import AsJson, Html, PowerCaps, Precision, Seq, Stack, calibration_default


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)


def plan_cmd(
    model: str = typer.Option(..., "--model", "-m", help="catalog name (see 'advisor catalog models') or a HF config.json"),
    tokens: str = typer.Option(..., "--tokens", help="training tokens, e.g. 15T, 15.6e12, 900B"),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="wall-clock limit, e.g. 60d, 1440h: the pick is the least energy that meets it"),
    budget: Optional[str] = typer.Option(None, "--budget", help="energy limit (GPU energy), e.g. 2.5GWh, 900MWh: without --deadline the pick is the fewest days within it"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU:N (exactly N), GPU:<=N (whole nodes up to N) or GPU [default: h100:<=16384, or the --cluster's size]"),
    cluster: Optional[str] = typer.Option(None, "--cluster", "-c", help="the node type: a catalog cluster, a YAML file (with storage_bw_gbs) or <gpu>x<n>; its size is the limit unless --gpus is given"),
    max_gbs_tokens: Optional[str] = typer.Option(None, "--max-gbs-tokens", help="the largest global batch in tokens, e.g. 16M [default: the model's published batch, else 16M]"),
    seq: Seq = None,
    precision: Precision = "bf16",
    failures: Optional[float] = typer.Option(None, "--failures-per-gpu-hour", help="failure rate [default: 1.97e-5, Llama 3 paper: 419 in 54 days on 16,384 H100]"),
    restart_min: Optional[float] = typer.Option(None, "--restart-min", help="fixed part of a restart in minutes, besides reading the checkpoint [default: 10, an assumption]"),
    storage_bw: Optional[float] = typer.Option(None, "--storage-bw", help="checkpoint storage bandwidth, GB/s aggregate [default: the cluster YAML's storage_bw_gbs, else 2000]"),
    gpu_hour_price: Optional[float] = typer.Option(None, "--gpu-hour-price", help="price of one GPU-hour: adds the cost"),
    power_caps: PowerCaps = None,
    calibration: Optional[str] = typer.Option(None, "--calibration", help="'default', a calibration file or 'none'", callback=calibration_default),
    stack: Stack = None,
    as_json: AsJson = False,
    html: Html = None,
) -> None:
    """Plan a training run: for each cluster size, recommend's layouts and power caps, the goodput
    under failures (checkpoint interval by Young / Daly), days, GPU-hours, energy and cost; the
    Pareto set of days vs energy vs GPUs and the pick that meets the deadline / budget."""
    from advisor import validate
    from advisor.models import goodput as gp
    from advisor.plan import PlanOptions, plan, text_lines

    if html:
        from advisor import html_report

        html_report.require()
    gpu, n, exact = validate.gpus_spec("--gpus", gpus) if gpus else (None, 0, False)
    if gpu is None and not cluster:
        gpu = "h100"
    if cluster and gpu is None:
        from advisor.catalog import load_cluster

        gpu = load_cluster(cluster).gpu.name
    o = PlanOptions(
        tokens=validate.tokens("--tokens", tokens), gpu=gpu, max_gpus=n, exact=exact, cluster=cluster,
        deadline_s=validate.duration_s("--deadline", deadline) if deadline else None,
        budget_j=validate.energy_j("--budget", budget) if budget else None,
        max_gbs_tokens=validate.tokens("--max-gbs-tokens", max_gbs_tokens) if max_gbs_tokens else None,
        seq=seq, precision=precision,
        failures_per_gpu_hour=gp.DEFAULT_FAILURES_PER_GPU_HOUR if failures is None else failures,
        restart_s=gp.DEFAULT_RESTART_S if restart_min is None else restart_min * 60.0,
        storage_bw_gbs=storage_bw, gpu_hour_price=gpu_hour_price, power_caps=power_caps,
        calibration=calibration, stack=stack)
    if power_caps is not None:  # a bad grid: one line before the sweep
        from advisor.models.power import cap_grid
        from advisor.plan import base_cluster

        try:
            cap_grid(base_cluster(o).gpu, power_caps)
        except validate.SpecError as e:
            msg = str(e)
            raise validate.InputError(msg if msg.startswith("--power-caps") else f"--power-caps {power_caps}: {msg}") from None
    res = plan(model, o)
    if as_json:
        json.dump(validate.finite_json(res.to_dict()), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for line in text_lines(res):
            typer.echo(line)
    if html:
        from advisor import html_report
        from advisor.plan_html import plan_page

        html_report.save(html, plan_page(res))

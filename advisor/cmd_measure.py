"""`advisor measure`: train a layout for real with megatron-core on the local GPUs and record
step time, memory, power and throttling (one record per trial, ``advisor.measurement/1``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from advisor.options import Command, CommandEnv, ExitGrace, LogParser, StepRegex


def register(app: typer.Typer) -> None:
    app.command("measure")(measure_cmd)


def measure_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="catalog name or HF config.json"),
    layers: Optional[int] = typer.Option(None, "--layers", help="proxy with this many layers"),
    tp: int = typer.Option(1, "--tp"), pp: int = typer.Option(1, "--pp"),
    vp: int = typer.Option(1, "--vp"), ep: int = typer.Option(1, "--ep"),
    etp: int = typer.Option(1, "--etp"), cp: int = typer.Option(1, "--cp"),
    dp: Optional[int] = typer.Option(None, "--dp", help="default: GPUs / (tp*pp*cp)"),
    mbs: int = typer.Option(1, "--mbs"),
    gbs: Optional[int] = typer.Option(None, "--gbs", help="default: 8 microbatches (8*mbs*dp)"),
    seq: int = typer.Option(4096, "--seq"),
    recompute: str = typer.Option("none", "--recompute", help="none, selective or full"),
    precision: str = typer.Option("bf16", "--precision"),
    stack: str = typer.Option("local", "--stack", help="local (megatron-core's local layers) or te (Transformer Engine layer spec: SP, CP, FP8; needs TE installed); with --runner command, the stack your command runs (its records say it)"),
    fp8_recipe: str = typer.Option("delayed", "--fp8-recipe", help="te stack, --precision fp8: delayed or tensorwise (current scaling)"),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel/--no-sequence-parallel"),
    distributed_optimizer: bool = typer.Option(True, "--distributed-optimizer/--no-distributed-optimizer"),
    overlap_grad_reduce: bool = typer.Option(True, "--overlap-grad-reduce/--no-overlap-grad-reduce"),
    overlap_param_gather: bool = typer.Option(True, "--overlap-param-gather/--no-overlap-param-gather"),
    steps: int = typer.Option(10, "--steps", help="measured steps (after warmup)"),
    warmup: int = typer.Option(3, "--warmup"),
    min_seconds: float = typer.Option(0.0, "--min-seconds", help="stretch the measured steps to this many seconds"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the record (single run) as JSON here"),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="append records to this JSONL"),
    batch: Optional[Path] = typer.Option(None, "--batch", help="JSONL of configs, run in one torchrun"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs to use (default: all local)"),
    timeout: float = typer.Option(300.0, "--timeout", help="kill the run after this many seconds without progress"),
    telemetry_hz: float = typer.Option(20.0, "--telemetry-hz", help="0 = no telemetry"),
    trace_dir: Optional[Path] = typer.Option(None, "--trace-dir", help="save traces of entries with save_trace here"),
    save_trace: bool = typer.Option(False, "--save-trace", help="single run: save its trace in --trace-dir"),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="start no new job after this"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="worker files (default: beside --dataset until the batch is settled, else a temp dir)"),
    salvage: bool = typer.Option(False, "--salvage", help="only record the jobs of batches on --dataset whose launcher died (SIGKILL), then exit"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the jobs and the torchrun command, run nothing"),
    runner: str = typer.Option("megatron", "--runner", help="megatron (the built-in megatron-core runner) or command (your own training command: --command)"),
    command: Command = None, parser: LogParser = "auto", step_regex: StepRegex = None,
    env: CommandEnv = None, exit_grace: ExitGrace = 30.0,
) -> None:
    """Measure one layout (--model ...) or a batch (--batch configs.jsonl) on the local GPUs."""
    from advisor.cli import fail
    from advisor.runners import measure as M
    from advisor.runners.megatron_args import megatron_lm_args_string

    if salvage:
        if dataset is None:
            fail("--salvage needs --dataset (the JSONL whose pending batches to settle)")
        recs = M.salvage_runs(dataset)
        for rec in recs:
            _print_record(rec)
        print(f"salvaged {len(recs)} record(s) into {dataset}", file=sys.stderr)
        return
    if (model is None) == (batch is None):
        fail("give either --model or --batch")
    if batch is not None and dataset is None and not dry_run:
        fail("--batch needs --dataset (the JSONL the records are appended to)")
    world = gpus
    if world is None and not dry_run:
        world = M.local_gpu_count()
        if world == 0:
            fail("no NVIDIA GPU found (nvidia-smi -L lists none); measuring needs GPUs")
    if batch is not None:
        entries = M.load_batch(batch, world)
    else:
        entries = [M.make_entry(model, world, layers=layers, steps=steps, warmup=warmup,
                                min_seconds=min_seconds, save_trace=save_trace, stack=stack, fp8_recipe=fp8_recipe,
                                tp=tp, pp=pp, vp=vp, ep=ep, etp=etp, cp=cp, dp=dp, mbs=mbs, gbs=gbs,
                                seq=seq, recompute=recompute, precision=precision,
                                sequence_parallel=sequence_parallel,
                                distributed_optimizer=distributed_optimizer,
                                overlap_grad_reduce=overlap_grad_reduce,
                                overlap_param_gather=overlap_param_gather)]
    spec = _command_spec(runner, command, parser, step_regex, env, exit_grace, entries, world)
    if batch is None:
        if entries[0].refused and not dry_run:
            rec = M.assemble_record(entries[0], "refused", entries[0].refused, {}, None)
            if out:
                out.write_text(json.dumps(rec, indent=1) + "\n")
            if dataset:
                M.append_jsonl(dataset, rec)
            fail(f"refused: {entries[0].refused}")
    if dry_run and spec is not None:
        from advisor.runners.command import dry_run_lines

        for line in dry_run_lines(entries, spec, world or max(e.config.world_size for e in entries)):
            print(json.dumps(line))
        return
    if dry_run:
        nproc = world or max(e.config.world_size for e in entries)
        for i, e in enumerate(entries):
            print(json.dumps({"id": e.id, "model": e.model.name, "config": e.config.key(),
                              "refused": e.refused,
                              "stack": e.stack,
                              "megatron_lm_args": None if e.refused else megatron_lm_args_string(e.model, e.config, runner=e.stack == "local")}))
        print(" ".join(M.torchrun_command(nproc, run_dir or "RUN_DIR")))
        return
    if spec is None:  # the built-in runner, checked here: a refused layout or a dry run needs no torch
        from advisor.validate import megatron_runner

        megatron_runner("advisor measure (--runner megatron)", "--runner command measures your own training command")
        if any(e.stack == "te" and not e.refused for e in entries) and not M.te_available():
            fail(M.TE_MISSING)
    n_run = sum(1 for e in entries if not e.refused)
    print(f"measuring {n_run} job(s) on {world} GPU(s), {len(entries) - n_run} refused", file=sys.stderr)
    if spec is not None:
        from functools import partial

        from advisor.runners.command import run_batch as run_command_batch

        run = partial(run_command_batch, spec=spec)
    else:
        run = M.run_batch
    records = run(entries, dataset, world, run_dir=run_dir, timeout=timeout,
                  telemetry_hz=telemetry_hz, trace_dir=trace_dir, max_seconds=max_seconds,
                  on_record=_print_record)
    if out and records:
        out.write_text(json.dumps(records[0] if batch is None else records, indent=1) + "\n")
    if batch is None and records and records[0]["status"] != "ok":
        raise typer.Exit(1)


def _command_spec(runner, command, parser, step_regex, env, exit_grace, entries, world):
    """--runner command: the validated command (its refusal rules replace the built-in runner's);
    None for the built-in runner."""
    from advisor.cli import fail

    if runner == "megatron":
        if command is not None:
            fail("--command needs --runner command")
        return None
    if runner != "command":
        fail(f"--runner must be megatron or command, got {runner!r}")
    if not command:
        fail("--runner command needs --command 'your training command ... {megatron_args}'")
    from advisor.runners import command as C

    spec = C.CommandSpec.from_dict(C.spec_options(command, parser, step_regex, env, exit_grace))
    for e in entries:
        e.refused = C.refusal_reason(e.model, e.config, world)
    return spec


def _print_record(rec: dict) -> None:
    thr = rec.get("throughput") or {}
    mem = rec.get("memory") or {}
    tel = rec.get("telemetry") or {}
    parts = [rec["status"], rec["model"]["name"], _key(rec["config"])]
    if thr:
        parts.append(f"{thr['tokens_per_s']:.0f} tok/s")
        if thr.get("mfu"):
            parts.append(f"MFU {thr['mfu']:.3f}")
    if mem.get("max_gib") is not None:
        parts.append(f"{mem['max_gib']:.1f} GiB")
    if tel.get("mean_power_w"):
        parts.append(f"{tel['mean_power_w']:.0f} W")
    if rec.get("error"):
        parts.append(rec["error"][:160])
    print("  ".join(parts), flush=True)


def _key(c: dict) -> str:
    return (f"tp{c['tp']} pp{c['pp']} dp{c['dp']} vp{c['vp']} ep{c['ep']} mbs{c['mbs']} "
            f"gbs{c['gbs']} seq{c['seq']} {c['recompute']}")

"""`advisor tune`: an Optuna study whose trials measure layouts (on Ray), resumable."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from advisor.options import (Cluster, Command, CommandEnv, ExitGrace, Gbs, Html, LogParser, Model, Precision,
                             Seq, StepRegex, calibration_default)

CAL_HELP = ("what the study predicts with (seeds' ranking, each trial's 'predicted', the surrogate sampler's "
            "prior): a calibration file from 'advisor fit', 'default' (the packaged one, if any) or 'none' "
            "(analytical model only); --runner simulate stays the analytical model plus noise either way "
            "[default: advisor.api.DEFAULT_CALIBRATION, now 'default']")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_cmd)


def tune_cmd(
    model: Model,
    cluster: Cluster,
    seq: Seq = None,
    gbs: Gbs = None,
    precision: Precision = "bf16",
    layers: Optional[int] = typer.Option(None, "--layers", help="measure a proxy of the model with this many layers"),
    trials: int = typer.Option(24, "--trials", help="measurements to launch in the whole study (a resumed study goes on to this total)"),
    batch: int = typer.Option(1, "--batch", help="trials launched together as one job: one torchrun measures them one after another (start-up paid once per job)"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="stop launching trials after this many seconds"),
    trial_timeout: float = typer.Option(900.0, "--trial-timeout", help="a trial running longer is cancelled and recorded as timeout"),
    runner: str = typer.Option("megatron", "--runner", help="megatron (GPUs, megatron-core), command (your own training command: --command) or simulate (analytical model + noise)"),
    objective: str = typer.Option("power", "--objective", help="second objective to minimize: power (peak W) or energy (J/token)"),
    storage: Optional[str] = typer.Option(None, "--storage", help="journal file (default ./advisor-studies.journal) or an RDB URL (postgresql://...)"),
    study_name: Optional[str] = typer.Option(None, "--study-name", help="default: <model>@<cluster>-seq..-gbs..-<precision>-<objective>-<runner>"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster address (default: a local Ray); 'inline' runs trials in this process without Ray"),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="JSONL the records are appended to (default data/measurements/tune-<study>.jsonl)"),
    top_k: int = typer.Option(4, "--top-k", help="top layouts of the prediction (see --calibration) enqueued first"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampler seed"),
    sampler: str = typer.Option("tpe", "--sampler", help="tpe (Optuna's default) or surrogate (active learning: expected improvement of a GP on the measurements, the --calibration prediction as its prior)"),
    power_cap: Optional[float] = typer.Option(None, "--power-cap", help="per-GPU power cap in W (default: the GPU's TDP)"),
    stack: str = typer.Option("local", "--stack", help="megatron runner's software stack: local (megatron-core's local layers) or te (Transformer Engine: SP, CP, FP8; needs TE installed); with --runner command, the stack your command runs (its records say it); also the profile the study predicts with"),
    calibration: Optional[str] = typer.Option(None, "--calibration", help=CAL_HELP, callback=calibration_default),
    steps: int = typer.Option(10, "--steps", help="megatron: measured steps per trial"),
    warmup: int = typer.Option(3, "--warmup", help="megatron: warm-up steps per trial"),
    sigma: float = typer.Option(0.03, "--sim-sigma", help="simulate: log-normal sigma of the step-time noise"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan (space, pruned, enqueued) and run nothing"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    html: Html = None,
    command: Command = None, parser: LogParser = "auto", step_regex: StepRegex = None,
    env: CommandEnv = None, exit_grace: ExitGrace = 30.0,
) -> None:
    """Search layouts of MODEL on CLUSTER by measuring them: multi-objective Optuna study (tokens/s/GPU
    vs peak power or energy), trials as Ray tasks, resumable storage, Pareto front at the end."""
    from advisor.cli import fail
    from advisor.runners.simulate import options_from_env
    from advisor.study import INTERRUPTED, TuneSettings, make_plan, run_study

    opts = {"sigma": sigma, **options_from_env()} if runner == "simulate" else {"steps": steps, "warmup": warmup}
    if runner == "command" or command is not None:
        from advisor.runners.command import spec_options

        if runner != "command":
            fail("--command needs --runner command")
        if not command:
            fail("--runner command needs --command 'your training command ... {megatron_args}'")
        opts["command"] = spec_options(command, parser, step_regex, env, exit_grace)
    s = TuneSettings(model=model, cluster=cluster, seq=seq, gbs=gbs, precision=precision, layers=layers,
                     trials=trials, batch=batch, timeout_s=timeout, trial_timeout_s=trial_timeout, runner=runner,
                     objective=objective, storage=storage, study_name=study_name, ray_address=ray_address,
                     dataset=dataset, top_k=top_k, seed=seed, sampler=sampler, power_cap_w=power_cap, runner_options=opts,
                     calibration=calibration, stack=stack)
    if html:
        from advisor import html_report

        if dry_run:
            raise typer.BadParameter("--html reports a study's trials; a --dry-run runs none")
        html_report.require()
    plan = make_plan(s)  # a bad option or calibration file is one error line, before the progress bar
    from advisor.validate import study_paths

    study_paths(plan.storage, plan.dataset)  # before Ray starts (run_study checks them again)
    if dry_run:
        if as_json:
            json.dump({**plan.to_dict(), "dry_run": True}, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            _print_plan(plan)
        return
    if runner == "megatron" and stack == "te" and ray_address in (None, "inline"):
        from advisor.runners.measure import TE_MISSING, te_available

        if not te_available():  # the trials run on this machine: say so before Ray starts
            fail(TE_MISSING)
    from advisor.runners.ray_exec import make_executor

    executor = make_executor(ray_address, s.kill_grace_s)  # Ray's start-up problems: one line, before the bar
    stop, handlers = _stop_on_signals()
    try:
        with _Progress(s.runner, enabled=not as_json) as progress:
            res = run_study(s, progress=progress.update, plan=plan, executor=executor, stop=stop)
    finally:
        _restore(handlers)
    if res.stopped == INTERRUPTED:
        if as_json:
            from advisor.validate import finite_json

            json.dump(finite_json(res.to_dict()), sys.stdout, indent=1, default=str)
            sys.stdout.write("\n")
        import shlex

        typer.echo(f"interrupted: {res.measured} of {plan.settings.trials} trials saved (study {plan.study_name!r} "
                   f"in {plan.storage}, records in {plan.dataset}); resume with: "
                   f"{shlex.join(['advisor', *sys.argv[1:]])}", err=True)
        raise typer.Exit(130)
    if as_json:
        from advisor.validate import finite_json

        json.dump(finite_json(res.to_dict()), sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        _print_result(res)
    if html:
        html_report.save(html, html_report.study_page(plan.storage, plan.study_name))
    if res.broken:  # every trial of the last few failed: the set-up is broken, say so and exit 1
        fail(f"the study stopped: {res.stopped}; its records are in {plan.dataset}", code=1)


def _stop_on_signals():
    """(event, previous handlers): the first SIGINT / SIGTERM sets the event, so that the study
    stops launching, writes what came back and marks the trials in flight interrupted; the
    handlers are then the previous ones again, so a second signal stops the driver at once."""
    import signal
    import threading

    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        stop.set()
        _restore(previous)

    for sig in previous:
        signal.signal(sig, handler)
    return stop, previous


def _restore(handlers: dict) -> None:
    import signal

    for sig, h in handlers.items():
        signal.signal(sig, h)


def _sim_label(runner: str) -> str:
    return " (simulated)" if runner == "simulate" else ""


def _print_plan(plan) -> None:
    from advisor.report import layout_text, make_console

    d = plan.to_dict()
    con = make_console()
    sp = d["space"]
    con.print(f"[bold]plan{_sim_label(plan.settings.runner)}[/]: study [bold]{plan.study_name}[/] in {plan.storage}")
    con.print(f"{plan.model.name} on {plan.cluster.name}: seq {plan.workload.seq}, gbs {plan.workload.gbs}, "
              f"{plan.workload.precision}; objectives: max tokens/s/GPU, min {plan.settings.objective}; "
              f"runner {plan.settings.runner}; {plan.cluster.world_size} GPUs per trial")
    con.print(f"space: {sp['layouts']} legal layouts; pruned by memory (never launched): {sp['pruned_by_memory']}; "
              f"refused by the runner: {sp['refused_by_runner']}; runnable: {sp['runnable']}")
    if sp.get("left_out"):
        con.print(sp["left_out"] + " (never sampled)")
    con.print("params: " + "; ".join(f"{k} {v}" for k, v in sp["params"].items()))
    con.print(f"trials to measure: {plan.settings.trials}, {plan.settings.batch} per launch; dataset: {plan.dataset}")
    con.print(_calibration_line(plan), markup=False, highlight=False, soft_wrap=True)
    what = "analytical" if plan.calibration is None else "calibrated"
    con.print(f"enqueued first ({what} top-{len(plan.enqueue)}):")
    for c in plan.enqueue:
        con.print(f"  {layout_text(c)} mbs{c.mbs} {c.recompute}", markup=False, highlight=False)


def _calibration_line(plan) -> str:
    from advisor.study import calibration_label

    info = plan.calibration_info
    line = f"predictions (seeds, 'predicted', surrogate prior): {calibration_label(info)}"
    if info.get("levels"):
        line += " (" + ", ".join(f"{t} {m}" for t, m in info["levels"].items()) + ")"
    if plan.settings.runner == "simulate":
        line += "; simulated measurements: the analytical model + noise, whatever the calibration"
    return line


def _print_result(res) -> None:
    from rich.table import Table

    from advisor.report import make_console, pareto_cells, pareto_columns

    plan = res.plan
    con = make_console()
    t = Table(title=f"Pareto front{_sim_label(plan.settings.runner)}: {plan.study_name}", box=None, pad_edge=False)
    for col, just in pareto_columns(plan.settings.objective):
        t.add_column(col, justify=just, no_wrap=True)
    for r in res.pareto:
        t.add_row(*pareto_cells(r, plan.settings.objective))
    con.print(t)
    con.print(_calibration_line(plan), markup=False, highlight=False, soft_wrap=True)
    mine, made = plan.calibration_info, res.study_calibration
    if not made or (made.get("file"), made.get("sha256")) != (mine.get("file"), mine.get("sha256")):
        from advisor.study import calibration_label

        con.print(f"the study's seeds were ranked with: {calibration_label(res.study_calibration)}",
                  markup=False, highlight=False)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(res.counts.items()))
    con.print(f"{res.measured} measured ({res.launched_here} by this driver) in {res.elapsed_s:.0f} s; "
              f"stopped: {res.stopped}; trials: {counts}")
    con.print(f"records: {plan.dataset}; dashboard: optuna-dashboard {plan.storage}", markup=False, highlight=False)


class _Progress:
    """A rich progress bar on stderr with the best layout so far."""

    def __init__(self, runner: str, enabled: bool):
        self.enabled, self.runner = enabled, runner
        self.p = self.task = None

    def __enter__(self):
        return self

    def _start(self) -> None:
        """The bar appears with the study's first report, so that anything refused while the
        study opens stays one error line."""
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.p = Progress(TextColumn("[bold]tune" + _sim_label(self.runner)), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("{task.description}"),
                              console=Console(stderr=True), transient=False)
            self.p.start()
            self.task = self.p.add_task("starting", total=None)

    def update(self, e: dict) -> None:
        if self.p is None:
            self._start()
        if self.p is None:
            return
        b = e.get("best")
        desc = "no feasible measurement yet"
        if b:
            second = (f"{b['peak_power_w']:.0f} W" if "peak_power_w" in b else f"{b['energy_j_per_token']:.3f} J/tok")
            desc = f"best {b['tokens_per_s_per_gpu']:,.0f} tok/s/GPU at {second} (trial {b['trial']})"
        self.p.update(self.task, completed=e["measured"], total=e["target"], description=desc)

    def __exit__(self, *exc) -> None:
        if self.p is not None:
            self.p.stop()

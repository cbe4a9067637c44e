"""The command runner: measure a layout by running the user's own training command (Megatron-LM,
NeMo 2, Megatron-Bridge, or any script) for a bounded number of iterations and reading its log.

A command is a template; each trial substitutes its layout (``PLACEHOLDERS``), runs the result
with ``bash -c`` under a guard (``runners/command_guard.py``: nothing the command starts outlives
the launcher), and parses what the job prints (stdout and stderr, one log per trial):

* ``megatron`` (Megatron-LM, and Megatron-Bridge, whose training log keeps Megatron-LM's format):
  ``iteration N/M | ... | elapsed time per iteration (ms): X | throughput per GPU (TFLOP/s/GPU): Y``
  and the memory report ``[Rank R] (after N iterations) memory (MB) | allocated: .. | max
  allocated: .. | reserved: .. | max reserved: ..``;
* ``nemo`` (NeMo 2's progress lines): ``global_step: N | ... | train_step_timing in s: X`` (or the
  Lightning bar's ``global_step=N ... train_step_timing in s=X``, one step per distinct N);
* ``--step-regex``: any other log; a regex with a named group ``s`` or ``ms`` (the step time)
  and optionally ``iter``;
* a JSON line per step appended by the job to the file named by ``$ADVISOR_STEP_FILE``:
  ``{"step_time_s": 0.81}`` (or ``step_time_ms``), or ``{"t": <unix time after the step>}``
  (the first ``t`` is the start), optionally ``"rank"``, ``"peak_allocated_gib"``,
  ``"peak_reserved_gib"``.

``auto`` (the default) reads Megatron and NeMo lines and the step file. The first ``warmup``
iterations are warm-up, the next ``steps`` are measured; once the job has done them it gets
``exit_grace_s`` to exit by itself (checkpoint saves at the end of ``--train-iters`` and the like)
before the runner stops it. Everything else is the built-in runner's (``runners/measure.py``):
the telemetry sampler over the trial's GPUs, the record schema (``advisor.measurement/1``, plus
``runner: command`` and a ``command`` block with the command line, its exit status and the tail of
its log), the watchdog (no output before the first step / no new step after it for ``timeout`` s:
``timeout``), failures classified from the log (``oom`` / ``crash`` / ``timeout`` / ``killed``),
the time budget, records appended to the dataset the moment a trial ends, and salvage: the
trial logs wait beside the dataset until the batch is settled, so a launcher killed with SIGKILL
loses nothing the job printed (``salvage_run_dir``).

Multi-node (Ray): every node rank runs the same template with its ``{node_rank}``; the records of
the node ranks are merged (``merge_node_records``): steps from the node whose log has them
(Megatron-LM prints on the last rank), memory from every rank that reported it, telemetry of
every node that parsed steps.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig
from advisor.runners import measure as M
from advisor.runners import megatron_args as MA
from advisor.runners.follow import EventFollower, LineFollower, tail
from advisor.runners.proctree import install_signal_handlers, restore_signal_handlers
from advisor.runners.command_log import (GIB_PER_MB, LogParser, Step, bounds_from_steps, classify,  # noqa: F401
                                          parse_text)
from advisor.runners.records import jsonable
from advisor.runners.parent_watch import preexec_die_with_parent
from advisor.search_spaces.layout import layout_refusal

GUARD = Path(__file__).with_name("command_guard.py")
STEP_FILE_ENV = "ADVISOR_STEP_FILE"
PARSERS = ("auto", "megatron", "nemo", "regex", "json")
LOG_TAIL_CHARS = 4000

PLACEHOLDERS = {
    "megatron_args": "the layout as Megatron-LM arguments (layout_args) plus --train-iters {iters} "
                     "--log-interval 1 --log-throughput --eval-iters 0 --eval-interval {iters}",
    "megatron_model_args": "the model's architecture as Megatron-LM arguments (shape, GQA, "
                           "activation, vocabulary, MoE / MLA): for scripts that do not fix the model",
    "nemo_overrides": "the layout as NeMo 2 recipe overrides (trainer.strategy.*, data.*, "
                      "model.config.recompute_*, trainer.max_steps={iters}, ...)",
    "bridge_overrides": "the layout as Megatron-Bridge ConfigContainer overrides (model.*, train.*, "
                        "ddp.*, train.train_iters={iters}, logger.log_interval=1)",
    "env": "KEY=VALUE assignments of the trial's environment (ADVISOR_* and --env), shell-quoted",
    "iters": "warmup + steps: the iterations the job must run",
    "tp": "", "pp": "", "vp": "", "cp": "", "ep": "", "etp": "", "dp": "", "mbs": "", "gbs": "",
    "seq": "", "recompute": "none, selective or full", "precision": "bf16 or fp8",
    "world_size": "GPUs of the trial", "nproc_per_node": "GPUs of the trial on this node",
    "nnodes": "nodes of the trial", "node_rank": "this node's rank (0 on one node)",
    "master_addr": "rendezvous address (127.0.0.1 on one node)",
    "master_port": "rendezvous port (a free port per trial on one node)",
    "trial_id": "the record's id", "run_dir": "the trial's folder (logs)",
    "step_file": "the path of $ADVISOR_STEP_FILE",
}
_PLACEHOLDER = re.compile(r"(?<![$\\{])\{([A-Za-z_][A-Za-z0-9_]*)\}(?!\})")


# ------------------------------------------------------------------------------ the command
@dataclass
class CommandSpec:
    """What the user gave: the command template and how to read its log."""

    template: str
    parser: str = "auto"
    step_regex: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra variables (templates too)
    cwd: str | None = None
    exit_grace_s: float = 30.0
    shell: str = "bash"

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not self.template.strip():
            raise SpecError("--command is empty")
        if self.step_regex and self.parser == "auto":
            self.parser = "regex"
        if self.parser not in PARSERS:
            raise SpecError(f"--parser must be one of {', '.join(PARSERS)}, got {self.parser!r}")
        if self.parser == "regex":
            if not self.step_regex:
                raise SpecError("--parser regex needs --step-regex")
            try:
                rx = re.compile(self.step_regex)
            except re.error as e:
                raise SpecError(f"--step-regex does not compile: {e}") from None
            if not {"s", "ms"} & set(rx.groupindex):
                raise SpecError("--step-regex needs a named group (?P<s>...) or (?P<ms>...) for the step time")
        for text in [self.template, *self.env.values()]:
            unknown = sorted({n for n in _PLACEHOLDER.findall(text)} - set(PLACEHOLDERS))
            if unknown:
                raise SpecError(f"unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)} in "
                                f"{text[:80]!r}; known: {', '.join(sorted(PLACEHOLDERS))} "
                                "(write {{ and }} for literal braces)")
        for k in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise SpecError(f"--env: {k!r} is not a variable name")
        if not self.exit_grace_s >= 0:
            raise SpecError(f"exit grace must be >= 0 s, got {self.exit_grace_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CommandSpec":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def parse_env_options(items: list[str] | None) -> dict[str, str]:
    """--env NAME=VALUE (repeatable) -> {NAME: VALUE}."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SpecError(f"--env expects NAME=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v
    return out


def spec_options(command: str, parser: str = "auto", step_regex: str | None = None,
                 env: list[str] | None = None, exit_grace_s: float = 30.0,
                 cwd: str | None = None) -> dict[str, Any]:
    """The runner options of `advisor measure/tune --runner command` (validated: bad input is a
    SpecError, one line)."""
    return CommandSpec(command, parser, step_regex, parse_env_options(env), cwd, exit_grace_s).to_dict()


@dataclass
class NodeInfo:
    """Where this launcher sits in a trial."""

    nproc: int  # GPUs of the trial on this node
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def nemo_overrides(cfg: TrainConfig, iters: int) -> list[str]:
    """NeMo 2 recipe overrides (`nemo llm pretrain --factory ... KEY=VALUE`, NeMo-Run syntax)."""
    c = MA.effective_config(cfg)
    rec = MA.recompute_overrides(c, "model.config.")
    return [
        f"trainer.strategy.tensor_model_parallel_size={c.tp}",
        f"trainer.strategy.pipeline_model_parallel_size={c.pp}",
        f"trainer.strategy.virtual_pipeline_model_parallel_size={c.vp if c.vp > 1 else None}",
        f"trainer.strategy.context_parallel_size={c.cp}",
        f"trainer.strategy.expert_model_parallel_size={c.ep}",
        f"trainer.strategy.expert_tensor_parallel_size={c.etp}",
        f"trainer.strategy.sequence_parallel={c.sequence_parallel}",
        f"trainer.strategy.ddp.overlap_grad_reduce={c.overlap_grad_reduce}",
        f"trainer.strategy.ddp.overlap_param_gather={c.overlap_param_gather}",
        f"optim.config.use_distributed_optimizer={c.distributed_optimizer}",
        f"data.micro_batch_size={c.mbs}", f"data.global_batch_size={c.gbs}", f"data.seq_length={c.seq}",
        f"model.config.seq_length={c.seq}",
        f"trainer.max_steps={iters}", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
        f"trainer.val_check_interval={iters}",
    ] + rec + MA.offload_overrides(c, "model.config.")


def bridge_overrides(cfg: TrainConfig, iters: int) -> list[str]:
    """Megatron-Bridge ConfigContainer overrides (Hydra / OmegaConf `key=value` of its recipes)."""
    c = MA.effective_config(cfg)
    rec = MA.recompute_overrides(c, "model.")
    b = lambda v: "true" if v else "false"  # noqa: E731
    return [
        f"model.tensor_model_parallel_size={c.tp}", f"model.pipeline_model_parallel_size={c.pp}",
        f"model.virtual_pipeline_model_parallel_size={c.vp if c.vp > 1 else 'null'}",
        f"model.context_parallel_size={c.cp}", f"model.expert_model_parallel_size={c.ep}",
        f"model.expert_tensor_parallel_size={c.etp}", f"model.sequence_parallel={b(c.sequence_parallel)}",
        f"model.seq_length={c.seq}", f"dataset.sequence_length={c.seq}",
        f"train.micro_batch_size={c.mbs}", f"train.global_batch_size={c.gbs}", f"train.train_iters={iters}",
        f"ddp.use_distributed_optimizer={b(c.distributed_optimizer)}",
        f"optimizer.use_distributed_optimizer={b(c.distributed_optimizer)}",
        f"ddp.overlap_grad_reduce={b(c.overlap_grad_reduce)}", f"ddp.overlap_param_gather={b(c.overlap_param_gather)}",
        "logger.log_interval=1", "train.eval_iters=0",
    ] + rec + MA.offload_overrides(c, "model.") + bridge_fsdp_overrides(c)


def bridge_fsdp_overrides(cfg: TrainConfig) -> list[str]:
    """Megatron FSDP (TrainConfig.fsdp) as Megatron-Bridge overrides, the DDP fields its performance
    scripts' set_megatron_fsdp_overrides sets (its ddp config is megatron-core's
    DistributedDataParallelConfig): use_megatron_fsdp, the optim_grads_params sharding strategy, and
    average_in_collective off ("not supported with Megatron FSDP")."""
    return (["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params",
             "ddp.average_in_collective=false"] if cfg.fsdp else [])


def placeholder_values(model: ModelSpec, cfg: TrainConfig, iters: int, node: NodeInfo, trial_id: str,
                       run_dir: Path, step_file: Path) -> dict[str, str]:
    c = MA.effective_config(cfg)
    # --eval-interval: megatron-core 0.19.2 leaves it None and sizes its datasets with
    # train_iters // eval_interval even when --eval-iters 0 turns evaluation off
    mega = MA.layout_args(c) + ["--train-iters", str(iters), "--log-interval", "1", "--log-throughput",
                                "--eval-iters", "0", "--eval-interval", str(iters)]
    return {
        "megatron_args": shlex.join(mega), "megatron_model_args": shlex.join(MA.model_args(model, c)),
        "nemo_overrides": shlex.join(nemo_overrides(c, iters)),
        "bridge_overrides": shlex.join(bridge_overrides(c, iters)),
        "iters": str(iters), "tp": str(c.tp), "pp": str(c.pp), "vp": str(c.vp), "cp": str(c.cp),
        "ep": str(c.ep), "etp": str(c.etp), "dp": str(c.dp), "mbs": str(c.mbs), "gbs": str(c.gbs),
        "seq": str(c.seq), "recompute": c.recompute, "precision": c.precision,
        "world_size": str(c.world_size), "nproc_per_node": str(node.nproc), "nnodes": str(node.nnodes),
        "node_rank": str(node.node_rank), "master_addr": node.master_addr,
        "master_port": str(node.master_port), "trial_id": trial_id, "run_dir": str(run_dir),
        "step_file": str(step_file),
    }


def render(template: str, values: Mapping[str, str]) -> str:
    """Substitute the known {placeholders}; {{ and }} stand for literal braces; ${VAR} is the
    shell's."""
    out = _PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), template)
    return out.replace("{{", "{").replace("}}", "}")


def trial_env(spec: CommandSpec, values: Mapping[str, str], cfg: TrainConfig) -> dict[str, str]:
    """The variables every trial's command gets: ADVISOR_* (layout and files), --env (rendered),
    and CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP > 1 (Megatron-LM asserts it before Blackwell)
    unless the environment sets it, or the layout runs Megatron FSDP (validate_args asserts it is
    not 1 then, and only warns about TP / CP with it)."""
    env = {f"ADVISOR_{k.upper()}": values[k] for k in (
        "tp", "pp", "vp", "cp", "ep", "etp", "dp", "mbs", "gbs", "seq", "recompute", "precision", "iters",
        "world_size", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "trial_id")}
    env[STEP_FILE_ENV] = values["step_file"]
    env["ADVISOR_MEGATRON_ARGS"] = values["megatron_args"]
    env["ADVISOR_NEMO_OVERRIDES"] = values["nemo_overrides"]
    env["ADVISOR_BRIDGE_OVERRIDES"] = values["bridge_overrides"]
    if (cfg.tp > 1 or cfg.cp > 1) and not cfg.fsdp and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env.update({k: render(v, values) for k, v in spec.env.items()})
    return env


def env_assignments(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def build_command(spec: CommandSpec, model: ModelSpec, cfg: TrainConfig, iters: int, node: NodeInfo,
                  trial_id: str, run_dir: Path, step_file: Path) -> tuple[str, dict[str, str]]:
    """(the command line, the variables added to its environment) of one trial."""
    values = placeholder_values(model, cfg, iters, node, trial_id, run_dir, step_file)
    env = trial_env(spec, values, cfg)
    values["env"] = env_assignments(env)
    return render(spec.template, values), env


# ------------------------------------------------------------------------------ the runner
def megatron_stage(global_rank: int, cfg: TrainConfig) -> int:
    """The pipeline stage of a rank in Megatron's default order (tp-cp-ep-dp-pp: PP outermost)."""
    return global_rank // max(1, cfg.world_size // cfg.pp)


def visible_devices(devices: list[Any]) -> list[Any]:
    """The backend's devices this process may use (CUDA_VISIBLE_DEVICES by index or UUID, in
    PCI bus order like NVML's), in CUDA order."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None or cvd.strip() in ("", "all"):
        return list(devices)
    out = []
    for tok in (x.strip() for x in cvd.split(",") if x.strip()):
        if tok.isdigit():
            out += [d for d in devices if d.index == int(tok)]
        else:
            out += [d for d in devices if d.uuid.startswith(tok)]
    return out


@dataclass
class _Trial:
    index: int
    log: Path
    step_file: Path
    command: str = ""
    env: dict[str, str] = field(default_factory=dict)
    launched_at: float | None = None
    parser: LogParser | None = None
    lines: LineFollower | None = None
    step_lines: Any = None  # follow.EventFollower of the step file
    n_lines: int = 0


class CommandRunner(M.BatchRunner):
    """Runs entries one after another, each by launching the user's command (see the module
    docstring). Same guarantees as BatchRunner: one record per trial it launched, appended the
    moment the trial ends; the launcher's own stops are ``killed``; nothing is lost to SIGKILL."""

    def __init__(self, entries: list[M.Entry], dataset: str | Path | None, spec: CommandSpec,
                 node: NodeInfo, **kw: Any):
        super().__init__(entries, dataset, node.nproc, **kw)
        self.spec, self.node = spec, node
        self.uuids: list[tuple[str, str | None, str]] = []  # (uuid, PCI bus id, name) per local rank
        self.salvaged_from: str | None = None  # the run folder a salvage reads (records say so)

    # -- records -------------------------------------------------------------------------------
    def _ranks(self, cfg: TrainConfig, memory: Mapping[int, Mapping[str, float]]) -> dict[int, dict[str, Any]]:
        """Per global rank of this node: identity (GPU r of this node for local rank r), stage
        (Megatron's default rank order) and the memory its log reported."""
        out = {}
        base = self.node.node_rank * self.node.nproc
        for lr in range(self.node.nproc):
            r = base + lr
            u = self.uuids[lr] if lr < len(self.uuids) else None
            out[r] = {"hello": {"uuid": u[0] if u else None, "pci_bus_id": u[1] if u else None,
                                "gpu_name": u[2] if u else None},
                      "built": {"stage": megatron_stage(r, cfg)}}
            if r in memory:
                out[r]["done"] = dict(memory[r])
        for r, mem in memory.items():  # ranks of other nodes that this log reported
            out.setdefault(r, {"built": {"stage": megatron_stage(r, cfg)}}).setdefault("done", dict(mem))
        return out

    def _settle(self, entry: M.Entry, tr: _Trial, status: str, error: str | None, rc: int | None,
                stopped: str | None) -> None:
        p = tr.parser or LogParser(self.spec.parser, self.spec.step_regex)
        bounds = bounds_from_steps(p.steps)
        st = M.JobState(ranks=self._ranks(entry.config, p.memory), bounds=bounds or [],
                         started_at=tr.launched_at, torchrun_started=tr.launched_at, first_in_torchrun=True)
        self._extra = command_block(self.spec, tr, rc, stopped, p, entry)
        self._record(entry, st, status, error)

    def _emit(self, rec: dict[str, Any]) -> None:
        extra = getattr(self, "_extra", None)
        if extra is not None:
            finish_record(rec, extra, self.node)
            self._extra = None
        if self.salvaged_from is not None:  # before it is appended: the dataset's copy says so too
            rec["salvaged_from"] = self.salvaged_from
        super()._emit(rec)

    # -- the batch -----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        runnable = []
        for e in self.entries:
            if e.refused:
                self._extra = {"runner": "command", "template": self.spec.template}
                self._record(e, None, "refused", e.refused)
            else:
                runnable.append(e)
        if not runnable:
            return self.records
        if self.dataset is not None:
            M.salvage_runs(self.dataset)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        import psutil

        me = psutil.Process()
        (self.run_dir / "entries.json").write_text(json.dumps(
            {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname(), "nproc": self.nproc,
             "runner": "command", "command": self.spec.to_dict(), "node": asdict(self.node),
             "entries": [M.entry_to_dict(e) for e in runnable]}, default=jsonable))
        self._start_telemetry()
        if self.backend is not None:
            try:
                self.uuids = [(d.uuid, d.pci_bus_id, d.name) for d in visible_devices(self.backend.devices())]
                if self.uuids:
                    self.env.setdefault("gpu_name", self.uuids[0][2])
            except Exception:  # noqa: BLE001 - identity is a nicety, never a failure
                self.uuids = []
        self.env.setdefault("hostname", socket.gethostname())
        self.t_begin = time.time()
        old = install_signal_handlers()
        trial: tuple[M.Entry, _Trial] | None = None
        try:
            timeouts = 0
            for i, e in enumerate(runnable):
                if self._budget_spent():
                    left = runnable[i:]
                    self._log_line(f"time budget of {self.max_seconds:g} s spent: {len(left)} trial(s) not "
                                   f"started, not recorded: {', '.join(x.id for x in left)}")
                    break
                if timeouts >= 2:
                    for x in runnable[i:]:
                        self._extra = {"runner": "command", "template": self.spec.template}
                        self._record(x, None, "skipped", "not run: batch aborted after 2 consecutive timeouts")
                    break
                tr = _Trial(i, self.run_dir / f"trial{i}.log", self.run_dir / f"trial{i}.steps.jsonl")
                trial = (e, tr)
                status = self._run_trial(e, tr)
                trial = None
                timeouts = timeouts + 1 if status == "timeout" else 0
        except KeyboardInterrupt:
            self._kill("interrupted")
            if trial is not None:
                e, tr = trial
                self._drain_trial(tr)
                n = _measured(tr, e)
                self._settle(e, tr, "killed", f"interrupted after {n} measured step(s); partial steps kept",
                             self.proc.returncode if self.proc else None, "interrupted")
            self._settled()
            raise
        finally:
            restore_signal_handlers(old)
            self._stop_telemetry()
        self._settled()
        return self.records

    def _launch(self, e: M.Entry, tr: _Trial) -> None:
        node = self.node
        if node.master_port is None:
            node = NodeInfo(node.nproc, node.node_rank, node.nnodes, node.master_addr, _free_port())
        iters = e.warmup + e.steps
        tr.command, tr.env = build_command(self.spec, e.model, e.config, iters, node, e.id, self.run_dir, tr.step_file)
        # NVLS off and PCI bus order, as for the built-in runner; OMP threads stay the job's own
        env = {**os.environ, **{k: v for k, v in M.CHILD_ENV.items() if k != "OMP_NUM_THREADS"}, **tr.env}
        (self.run_dir / f"trial{tr.index}.json").write_text(json.dumps(
            {"id": e.id, "command": tr.command, "env": tr.env, "launched_at": time.time()}))
        self.kill_reason = None
        tr.launched_at = time.time()
        with open(tr.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [self.python or sys.executable, str(GUARD), "--", self.spec.shell, "-c", tr.command],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.spec.cwd or None, start_new_session=True, preexec_fn=preexec_die_with_parent())
        self._log_line(f"trial {tr.index} ({e.config.key()}): {tr.command[:300]}")

    def _drain_trial(self, tr: _Trial) -> bool:
        """Read what the job printed since the last call. Progress? A new iteration, or before the
        first one (start-up: imports, model build, data) any new line."""
        if tr.parser is None:
            tr.parser = LogParser(self.spec.parser, self.spec.step_regex)
            tr.lines, tr.step_lines = LineFollower(tr.log), EventFollower(tr.step_file)
        n0 = len(tr.parser.steps)
        now = time.time()
        lines = tr.lines.read()
        if self.proc is not None and self.proc.poll() is not None:
            lines += tr.lines.rest()
        for ln in lines:
            tr.parser.feed_line(ln, now)
        for obj in tr.step_lines.read():
            tr.parser.feed_json(obj, now)
        tr.n_lines += len(lines)
        return len(tr.parser.steps) > n0 or (not tr.parser.steps and bool(lines))

    def _run_trial(self, e: M.Entry, tr: _Trial) -> str:
        """Launch one trial, watch it, record it; its status."""
        self._launch(e, tr)
        need = e.warmup + e.steps
        progress, enough_at, stopped = time.time(), None, None
        while True:
            rc = self.proc.poll()
            if self._drain_trial(tr):
                progress = time.time()
            if rc is not None:
                break
            now = time.time()
            if enough_at is None and len(tr.parser.steps) >= need:
                enough_at = now
            if enough_at is not None and now - enough_at > self.spec.exit_grace_s:
                stopped = "done"
                self._kill("done")
                break
            if now - progress > self.timeout:
                stopped = "timeout"
                self._kill("timeout")
                break
            if self._budget_spent() and enough_at is None:
                stopped = "budget"
                self._kill("budget")
                break
            time.sleep(0.1)
        rc = self.proc.wait()
        self._drain_trial(tr)
        status, error = self._outcome_of(e, tr, rc, stopped)
        self._settle(e, tr, status, error, rc, stopped)
        self._log_line(f"trial {tr.index} {status}" + (f": {error}" if error else ""))
        return status

    def _outcome_of(self, e: M.Entry, tr: _Trial, rc: int, stopped: str | None) -> tuple[str, str | None]:
        n = _measured(tr, e)
        got = len(tr.parser.steps)
        if stopped == "done" or (got >= e.warmup + e.steps and rc == 0):
            return "ok", None
        if stopped == "timeout":
            what = "no output" if not got else "no new step"
            return "timeout", f"{what} for {self.timeout:.0f} s after {got} iteration(s); the job was stopped"
        if stopped == "budget":
            return "killed", (f"cut by the time budget ({self.max_seconds:g} s) after {n} measured step(s); "
                              "the job was stopped, partial steps kept")
        status, reason = classify(tail(tr.log), rc)
        if status == "ok":  # exit 0 before enough steps
            if self.node.nnodes > 1 and not got:
                return "ok", None  # Megatron-LM prints on the last rank: another node has the steps
            if n >= 1:
                return "ok", f"the job exited after {got} of {e.warmup + e.steps} iterations; {n} measured"
            what = f"parser {self.spec.parser!r}" + (f" ({self.spec.step_regex!r})" if self.spec.step_regex else "")
            return "crash", (f"the job exited (code {rc}) after {got} iteration line(s), {e.warmup + 1} needed: "
                             f"did its log lines match the {what}? (see command.log_tail)")
        return status, reason


def _measured(tr: _Trial, e: M.Entry) -> int:
    return max(0, len(tr.parser.steps if tr.parser else []) - e.warmup)


def command_block(spec: CommandSpec, tr: _Trial, rc: int | None, stopped: str | None, p: LogParser,
                  entry: M.Entry) -> dict[str, Any]:
    measured = [s.tflops for s in p.steps[entry.warmup:] if s.tflops is not None]
    return {"runner": "command", "template": spec.template, "line": tr.command,
            "env": {k: v for k, v in tr.env.items() if k in spec.env or (
                k.startswith("ADVISOR_") and not k.endswith(("_ARGS", "_OVERRIDES")))},
            "parser": spec.parser, "step_regex": spec.step_regex, "exit_status": rc,
            "stopped_by_runner": stopped, "iterations_parsed": len(p.steps),
            "reported_tflops_per_gpu": (sorted(measured)[len(measured) // 2] if measured else None),
            "memory_reported_ranks": sorted(p.memory), "log_path": str(tr.log),
            "log_tail": tail(tr.log, n=LOG_TAIL_CHARS)}


def finish_record(rec: dict[str, Any], extra: Mapping[str, Any], node: NodeInfo) -> None:
    """The command runner's additions to an assembled record."""
    rec["runner"] = "command"
    rec["simulated"] = False
    if "line" in extra:
        rec["command"] = {k: v for k, v in extra.items() if k not in ("runner", "reported_tflops_per_gpu")}
        if rec.get("throughput") and extra.get("reported_tflops_per_gpu") is not None:
            rec["throughput"]["reported_tflops_per_gpu"] = extra["reported_tflops_per_gpu"]
    else:
        rec["command"] = {"template": extra.get("template")}
    rec["cluster"]["num_nodes"] = node.nnodes
    rec["cluster"]["gpus_per_node"] = node.nproc
    if node.nnodes > 1:
        rec["node_rank"] = node.node_rank
    rec["env"] = {k: v for k, v in rec["env"].items() if v is not None}
    if rec.get("memory"):
        rec["memory"]["source"] = "log"


# -------------------------------------------------------------------------------- salvage
def salvage_run_dir(run_dir: Path, dataset: str | Path, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Records for the trials of a command batch whose launcher died: parsed from the trial logs
    (and step files) it left, for every trial that was launched and has no record yet."""
    entries = [M.entry_from_dict(d) for d in meta["entries"]]
    spec = CommandSpec.from_dict(meta["command"])
    node = NodeInfo(**meta.get("node", {"nproc": meta.get("nproc", 1)}))
    done = {r.get("id") for r in M.read_jsonl(dataset)} if Path(dataset).is_file() else set()
    runner = CommandRunner([], None, spec, node, run_dir=run_dir, telemetry="off")
    runner.salvaged_from = str(run_dir)
    out = []
    for i, e in enumerate(entries):
        info_path = run_dir / f"trial{i}.json"
        if e.id in done or not info_path.is_file():
            continue
        info = json.loads(info_path.read_text())
        tr = _Trial(i, run_dir / f"trial{i}.log", run_dir / f"trial{i}.steps.jsonl", info.get("command", ""),
                    info.get("env", {}), info.get("launched_at"))
        mtime = max((p.stat().st_mtime for p in (tr.log, tr.step_file) if p.exists()), default=time.time())
        tr.parser = parse_text(tail(tr.log, n=50_000_000), spec.parser, spec.step_regex, t=mtime)
        if tr.step_file.exists():
            for obj in M.read_jsonl(tr.step_file):
                tr.parser.feed_json(obj, mtime)
        n = _measured(tr, e)
        if len(tr.parser.steps) >= e.warmup + e.steps:
            status, error = "ok", None
        else:
            st, why = classify(tail(tr.log), None)
            status, error = (st, why) if st in ("oom", "crash", "timeout") else (
                "killed", f"the launcher died (SIGKILL?) after {n} measured step(s); steps kept from the job's log")
        runner.records = []
        runner.dataset = dataset
        runner._settle(e, tr, status, error, None, "launcher died")
        out.append(runner.records[-1])
    return out


# ---------------------------------------------------------------------------- multi-node
def merge_node_records(per_node: list[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One record per trial from the records of every node rank of a multi-node trial."""
    per_node = sorted(per_node, key=lambda x: x[0])
    out = []
    for k, rec0 in enumerate(per_node[0][1]):
        recs = [(n, rs[k]) for n, rs in per_node if k < len(rs)]

        def measured(r):
            return ((r.get("steps") or {}).get("measured") or 0)

        best = max(recs, key=lambda nr: (measured(nr[1]), -nr[0]))[1]
        rec = json.loads(json.dumps(best))
        rec.pop("node_rank", None)
        # Status: the node with the steps decides when it measured (the other nodes' ends may be
        # the consequence of its runner stopping the job); otherwise the first node-level failure.
        if not (rec.get("status") == "ok" and measured(rec)):
            bad = [r for _, r in recs if r.get("status") in ("oom", "crash", "timeout", "killed")]
            if bad:
                worst = next((r for r in bad if r["status"] == "oom"), bad[0])
                rec["status"], rec["error"] = worst["status"], f"node {worst.get('node_rank')}: {worst.get('error')}"
            elif not measured(rec):
                rec["status"], rec["error"] = "crash", "no node's log had iteration lines"
        rec["rank_map"] = sorted({rm["rank"]: rm for _, r in recs for rm in r.get("rank_map") or []}.values(),
                                 key=lambda rm: rm["rank"])
        mems = [r["memory"] for _, r in recs if r.get("memory")]
        if mems:
            n = max(len(m["peak_allocated_gib_per_rank"]) for m in mems)
            alloc = [next((m["peak_allocated_gib_per_rank"][i] for m in mems
                           if i < len(m["peak_allocated_gib_per_rank"]) and m["peak_allocated_gib_per_rank"][i] is not None), None)
                     for i in range(n)]
            rec["memory"] = {**mems[0], "peak_allocated_gib_per_rank": alloc,
                             "max_gib": max((a for a in alloc if a is not None), default=None)}
        tels = [(n, r["telemetry"]) for n, r in recs if r.get("telemetry")]
        if len(tels) > 1:
            rec["telemetry"] = _merge_telemetry([t for _, t in tels], rec)
        rec["command"] = {**(rec.get("command") or {}),
                          "nodes": [{"node_rank": n, "exit_status": (r.get("command") or {}).get("exit_status"),
                                     "status": r.get("status"), "log_tail": (r.get("command") or {}).get("log_tail")}
                                    for n, r in recs]}
        out.append(rec)
    return out


def _merge_telemetry(tels: list[dict[str, Any]], rec: dict[str, Any]) -> dict[str, Any]:
    per_gpu = {u: d for t in tels for u, d in (t.get("per_gpu") or {}).items()}
    mp = [d["mean_power_w"] for d in per_gpu.values() if d.get("mean_power_w") is not None]
    pk = [d["peak_power_w"] for d in per_gpu.values() if d.get("peak_power_w") is not None]
    en = [d["energy_j"] for d in per_gpu.values() if d.get("energy_j") is not None]
    steps = rec.get("steps") or {}
    tokens = (rec["config"]["gbs"] * rec["config"]["seq"] * steps.get("measured", 0)) or None
    energy = sum(en) if len(en) == len(per_gpu) and en else None
    return {**tels[0], "per_gpu": per_gpu, "per_stage": [s for t in tels for s in t.get("per_stage") or []],
            "mean_power_w": sum(mp) / len(mp) if mp else None, "total_mean_power_w": sum(mp) if mp else None,
            "peak_power_w": max(pk) if pk else None, "energy_j": energy,
            "energy_per_token_j": energy / tokens if energy is not None and tokens else None,
            "nodes": len(tels)}


# ----------------------------------------------------------------------------- entry point
def execute_command(model: ModelSpec, cluster, cfgs: list[TrainConfig], timeout_s: float,
                    options: Mapping[str, Any], node_rank: int = 0, nnodes: int = 1,
                    rendezvous: tuple[str, int] | None = None,
                    ids: list[str] | None = None) -> list[dict[str, Any]]:
    """ray_exec.execute for runner "command": this node's launcher of each trial; returns its
    records (every node rank returns its own; merge_node_records makes one per trial)."""
    o = dict(options)
    if "command" not in o:
        raise SpecError("the command runner needs a command (--command)")
    spec = CommandSpec.from_dict(o["command"])
    if cluster.num_nodes > 1 and nnodes == 1:
        raise SpecError(f"a trial on {cluster.num_nodes} nodes needs one launcher per node: run it on Ray "
                        "(--ray-address), not inline")
    node = NodeInfo(cluster.gpus_per_node if nnodes > 1 else cfgs[0].world_size, node_rank, nnodes,
                    *(rendezvous if rendezvous else ("127.0.0.1", None)))
    stack = o.get("stack")  # the stack the user says the command runs (tune's --stack); None: not named
    entries = [M.make_entry(model, cfg.world_size, steps=int(o.get("steps", 10)), warmup=int(o.get("warmup", 3)),
                            id=(ids[k] if ids else None), stack=stack or "local", **cfg.to_dict())
               for k, cfg in enumerate(cfgs)]
    for e, cfg in zip(entries, cfgs):  # the user's stack decides what runs: legality only
        e.refused = refusal_reason(model, cfg, cluster.world_size)
        e.stack = stack  # what its records say
    # Multi-node: no spool (a node's record is only part of the trial's; the driver merges them),
    # so a driver killed in the middle of a multi-node job retries its trials (the resume rule).
    spool = o.get("spool") if nnodes == 1 else None
    runner = CommandRunner(entries, spool, spec, node,
                           timeout=float(o.get("progress_timeout_s", min(timeout_s, 600.0))),
                           telemetry_hz=float(o.get("telemetry_hz", 20.0)))
    by_id = {r["id"]: r for r in runner.run()}  # refusals are recorded first: back in the layouts' order
    return [by_id[e.id] for e in entries if e.id in by_id]


# What the command runner refuses: only what is not a legal layout (the user's stack may have
# Transformer Engine, FP8, context parallelism), and a world size that is not the trial's.
refusal_reason = layout_refusal


def run_batch(entries: list[M.Entry], dataset: str | Path | None, nproc: int, *, spec: CommandSpec,
              **kw: Any) -> list[dict[str, Any]]:
    """`advisor measure --runner command`: the entries one after another on this node."""
    for e in entries:
        if e.config.world_size != nproc:
            e.refused = e.refused or f"world size {nproc} != tp*pp*cp*dp = {e.config.world_size}"
    return CommandRunner(entries, dataset, spec, NodeInfo(nproc), **kw).run()


def dry_run_lines(entries: list[M.Entry], spec: CommandSpec, nproc: int) -> list[dict[str, Any]]:
    """`advisor measure --runner command --dry-run`: each trial's command line, nothing run."""
    out = []
    for e in entries:
        line, env = (None, None) if e.refused else build_command(
            spec, e.model, e.config, e.warmup + e.steps, NodeInfo(nproc, master_port=29500), e.id,
            Path("RUN_DIR"), Path("RUN_DIR/trial.steps.jsonl"))
        out.append({"id": e.id, "model": e.model.name, "config": e.config.key(), "refused": e.refused,
                    "command": line, "env": env})
    return out

"""Running trials: one function that measures a layout with a named runner, and two executors
that call it — inline (in this process, one at a time; no Ray) and on Ray.

On Ray each trial is a task holding the GPUs its layout needs: ``num_gpus = world size`` on one
node, or, when the cluster spans nodes, a placement group of one bundle per node
(``{"GPU": gpus_per_node, "CPU": 1}``, a bundle always sits on one node; STRICT_SPREAD puts each
on its own node) with one task per bundle. The node ranks rendezvous through Ray: a small task on
bundle 0 returns its node's IP and a free port, handed to every rank as ``master_addr`` /
``master_port``. Trials past their time are cancelled (KeyboardInterrupt first, so the runner can
kill its torchrun; Ray raises it between Python bytecodes, so a runner polling in short sleeps
sees it at once and one blocked in a long C call only when the call returns; then force-killed
``kill_grace_s`` later) and come back as ``timeout``
records; a task that raises or whose worker dies comes back as a ``crash`` record.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.runners.simulate import new_record

RUNNERS = ("simulate", "megatron")


def prepare(runner: str, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """The layout as `runner` will run it, and why it cannot run it (None when it can)."""
    if runner == "simulate":
        return cfg, None
    if runner != "megatron":
        raise ValueError(f"unknown runner {runner!r}")
    from advisor.runners import megatron_args as MA

    # No Transformer Engine on our machines: sequence parallelism is off in every measured layout.
    cfg = MA.effective_config(cfg.replace(sequence_parallel=False))
    if cluster.num_nodes > 1:
        return cfg, "the megatron runner measures on one node (torchrun --standalone)"
    return cfg, MA.refusal_reason(model, cfg, cluster.world_size)


def execute(runner: str, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, timeout_s: float,
            options: Mapping[str, Any], node_rank: int = 0, nnodes: int = 1,
            rendezvous: tuple[str, int] | None = None) -> dict[str, Any] | None:
    """Measure `cfg` once with `runner` (on node `node_rank` of `nnodes`); the record, or None on
    node ranks > 0. Runs wherever it is called: in the driver (inline) or in a Ray task."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if runner == "simulate":
        from advisor.runners.simulate import run_trial

        return run_trial(model, cluster, cfg, timeout_s=timeout_s, options=options, node_rank=node_rank)
    from advisor.runners import measure as M

    o = dict(options)
    entry = M.make_entry(model, cfg.world_size, steps=int(o.get("steps", 10)), warmup=int(o.get("warmup", 3)),
                         **cfg.to_dict())
    records = M.run_batch([entry], dataset=None, nproc=cfg.world_size,
                          timeout=float(o.get("progress_timeout_s", min(timeout_s, 300.0))),
                          telemetry_hz=float(o.get("telemetry_hz", 20.0)))
    if not records:
        return new_record(model, cluster, cfg, "crash", "the runner returned no record", runner)
    rec = dict(records[0])
    rec.setdefault("runner", runner)
    rec.setdefault("simulated", False)
    return rec


def _failure(job: "Job", status: str, error: str) -> dict[str, Any]:
    return new_record(job.model, job.cluster, job.cfg, status, error, job.runner)


@dataclass
class Job:
    tag: Any  # the caller's handle (the Optuna trial)
    runner: str
    model: ModelSpec
    cluster: ClusterSpec
    cfg: TrainConfig
    timeout_s: float
    options: Mapping[str, Any]
    started: float = field(default_factory=time.time)
    refs: list = field(default_factory=list)
    pg: Any = None
    cancelled_at: float | None = None  # when its deadline passed and it was cancelled
    aborted: bool = False  # a node rank failed and the others were stopped
    result: dict | None = None


class InlineExecutor:
    """Runs each trial in this process, when submitted. No timeouts, no concurrency."""

    name = "inline"

    def __init__(self) -> None:
        self._done: list[Job] = []

    def slots(self, cluster: ClusterSpec) -> int:
        return 1

    def submit(self, job: Job) -> Job:
        try:
            job.result = execute(job.runner, job.model, job.cluster, job.cfg, job.timeout_s, job.options)
        except Exception as e:  # noqa: BLE001 - a crashing trial is a result
            job.result = _failure(job, "crash", f"{type(e).__name__}: {e}")
        self._done.append(job)
        return job

    def wait(self, timeout: float) -> list[Job]:
        done, self._done = self._done, []
        return done

    def shutdown(self) -> None:
        pass


def _remote_fns():
    import ray

    @ray.remote(max_retries=0)
    def run_rank(runner, model, cluster, cfg, timeout_s, options, node_rank, nnodes, rendezvous):
        ctx = ray.get_runtime_context()
        rec = execute(runner, model, cluster, cfg, timeout_s, options, node_rank, nnodes, rendezvous)
        where = {"node_rank": node_rank, "node_ip": ray.util.get_node_ip_address(),
                 "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                 "master": list(rendezvous) if rendezvous else None}
        return rec, where

    @ray.remote(num_cpus=0, max_retries=0)
    def rendezvous_point():
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    return run_rank, rendezvous_point


class RayExecutor:
    """Trials as Ray tasks holding their GPUs; see the module docstring."""

    name = "ray"

    def __init__(self, address: str | None = None, kill_grace_s: float = 30.0) -> None:
        import ray

        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                     include_dashboard=False if address is None else None)
        self.kill_grace_s = kill_grace_s
        self.jobs: list[Job] = []
        self._run_rank, self._rendezvous = _remote_fns()

    def slots(self, cluster: ClusterSpec) -> int:
        """How many trials of `cluster`'s size fit on the Ray cluster at once."""
        gpus = [n["Resources"].get("GPU", 0) for n in self.ray.nodes() if n.get("Alive")]
        if cluster.num_nodes == 1:
            return int(sum(g // cluster.world_size for g in gpus))
        return sum(1 for g in gpus if g >= cluster.gpus_per_node) // cluster.num_nodes

    def submit(self, job: Job) -> Job:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as PGS

        c = job.cluster
        args = (job.runner, job.model, c, job.cfg, job.timeout_s, dict(job.options))
        if c.num_nodes == 1:
            job.refs = [self._run_rank.options(num_gpus=c.world_size, num_cpus=1).remote(*args, 0, 1, None)]
        else:
            job.pg = placement_group([{"GPU": c.gpus_per_node, "CPU": 1}] * c.num_nodes, strategy="STRICT_SPREAD")
            rdv = self._rendezvous.options(scheduling_strategy=PGS(job.pg, placement_group_bundle_index=0)).remote()
            job.refs = [self._run_rank.options(num_gpus=c.gpus_per_node, num_cpus=1,
                                               scheduling_strategy=PGS(job.pg, placement_group_bundle_index=i)
                                               ).remote(*args, i, c.num_nodes, rdv)
                        for i in range(c.num_nodes)]
        job.started = time.time()
        self.jobs.append(job)
        return job

    def wait(self, timeout: float) -> list[Job]:
        """Jobs finished (or given up) within `timeout` seconds, with their records."""
        pending = [r for j in self.jobs for r in j.refs]
        if pending:
            self.ray.wait(pending, num_returns=1, timeout=timeout)
        now, done = time.time(), []
        for job in list(self.jobs):
            ready, not_ready = self.ray.wait(job.refs, num_returns=len(job.refs), timeout=0)
            if not_ready:
                self._enforce_deadline(job, now)
                failed = [r for r in ready if self._error(r)]
                if failed and not job.aborted:  # one node rank failed: stop the others
                    job.aborted = True
                    for r in not_ready:
                        self.ray.cancel(r, force=True)
                continue
            job.result = self._collect(job)
            self.jobs.remove(job)
            if job.pg is not None:
                self.ray.util.remove_placement_group(job.pg)
            done.append(job)
        return done

    def _error(self, ref) -> Exception | None:
        try:
            self.ray.get(ref, timeout=0)
            return None
        except Exception as e:  # noqa: BLE001
            return e

    def _enforce_deadline(self, job: Job, now: float) -> None:
        if job.cancelled_at is None and now - job.started > job.timeout_s:
            job.cancelled_at = now
            for r in job.refs:
                self.ray.cancel(r, force=False)  # KeyboardInterrupt: the runner kills its torchrun
        elif job.cancelled_at is not None and now - job.cancelled_at > self.kill_grace_s:
            for r in job.refs:
                self.ray.cancel(r, force=True)

    def _collect(self, job: Job) -> dict[str, Any]:
        rec, where, errors = None, [], []
        for ref in job.refs:
            try:
                r, w = self.ray.get(ref)
                where.append(w)
                rec = r if w["node_rank"] == 0 else rec
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        timed_out = job.cancelled_at is not None
        if errors or rec is None:
            e = errors[0] if errors else None
            if timed_out and (e is None or isinstance(e, (self.ray.exceptions.TaskCancelledError,
                                                            self.ray.exceptions.WorkerCrashedError))):
                rec = _failure(job, "timeout", f"no result after {job.timeout_s:.0f} s; the trial was cancelled")
            else:
                rec = _failure(job, "crash", _describe(e))
        if job.cancelled_at is not None and rec.get("status") == "killed":
            rec["status"] = "timeout"
        rec["placement"] = sorted(where, key=lambda w: w["node_rank"])
        return rec

    def shutdown(self) -> None:
        for job in self.jobs:
            for r in job.refs:
                self.ray.cancel(r, force=True)
            if job.pg is not None:
                self.ray.util.remove_placement_group(job.pg)
        self.jobs = []


def _describe(e: Exception | None) -> str:
    if e is None:
        return "the trial returned no record"
    cause = getattr(e, "cause", None)
    if cause is not None and not isinstance(cause, type(e)):
        return f"{type(cause).__name__}: {cause}"
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else ""
    return f"{type(e).__name__}: {last}"[:500] if last else type(e).__name__


def make_executor(address: str | None, kill_grace_s: float = 30.0):
    """'inline' / 'none': no Ray; otherwise Ray at `address` (None: Ray's own search, else a new
    local instance)."""
    if address in ("inline", "none"):
        return InlineExecutor()
    return RayExecutor(address, kill_grace_s)



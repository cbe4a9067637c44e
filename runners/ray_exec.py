"""Running trials: one function that measures layouts with a named runner, and two executors
that call it — inline (in this process, one at a time; no Ray) and on Ray.

A job is one launch of one or more trials of the same cluster size: with the megatron runner a
job of several trials is ONE torchrun that measures them one after another (start-up and imports
are paid once; a crash or hang costs only its own trial, see ``runners/measure.py``), and each
trial still gets its own record.

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

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.runners.simulate import new_record
from advisor.search_spaces.layout import layout_refusal

RUNNERS = ("simulate", "megatron", "command")


def cpu_only(runner: str, options: Mapping[str, Any] | None = None) -> bool:
    """Simulated trials ask Ray for one CPU and no GPU (a CPU-only machine runs them with the
    default Ray), unless options["hold_gpus"] (ADVISOR_SIM_HOLD_GPUS=1) makes them hold the GPUs
    a real trial would, to rehearse GPU placement on a Ray cluster of fake GPUs."""
    return runner == "simulate" and not (options or {}).get("hold_gpus")


def prepare(runner: str, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig,
            stack: str = "local") -> tuple[TrainConfig, str | None]:
    """The layout as `runner` will run it, and why it cannot run it (None when it can). `stack`:
    the megatron runner's ("local": megatron-core's local layers; "te": Transformer Engine)."""
    if runner in ("simulate", "command"):  # the model / the user's own stack: only legality (multi-node through Ray)
        return cfg, layout_refusal(model, cfg, cluster.world_size)
    if runner != "megatron":
        raise ValueError(f"unknown runner {runner!r}")
    from advisor.runners import megatron_args as MA

    if stack == "te":
        # TE runs sequence parallelism; TP communication overlap (userbuffers) it does not run here
        # nor gradient_accumulation_fusion (apex's output-layer kernel is missing on its machines)
        cfg = MA.runner_config(cfg.replace(tp_comm_overlap=False, gradient_accumulation_fusion=False))
    else:  # without Transformer Engine sequence parallelism is off in every measured layout
        cfg = MA.effective_config(cfg.replace(sequence_parallel=False))
    if cluster.num_nodes > 1:
        return cfg, "the megatron runner measures on one node (torchrun --standalone)"
    return cfg, MA.refusal_reason(model, cfg, cluster.world_size, stack)


def execute(runner: str, model: ModelSpec, cluster: ClusterSpec, cfgs: list[TrainConfig], timeout_s: float,
            options: Mapping[str, Any], node_rank: int = 0, nnodes: int = 1,
            rendezvous: tuple[str, int] | None = None,
            ids: list[str] | None = None) -> list[dict[str, Any]] | None:
    """Measure each of `cfgs` once with `runner` (on node `node_rank` of `nnodes`): one record
    per layout, in order, or None on node ranks > 0. `timeout_s` is one trial's; `ids` name the
    records (random when not given). Runs wherever it is called: in the driver (inline) or in a
    Ray task.

    ``options["spool"]`` (megatron runner): a JSONL file each record is appended to as soon as
    its trial ends, so a driver killed in the middle of a job finds the trials already done."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if runner == "simulate":
        from advisor.runners.simulate import run_trial

        recs = []
        for cfg in cfgs:  # like the megatron runner: a trial that raises costs only itself
            try:
                recs.append(run_trial(model, cluster, cfg, timeout_s=timeout_s, options=options, node_rank=node_rank))
            except Exception as e:  # noqa: BLE001 - a crashing trial is a result
                recs.append(new_record(model, cluster, cfg, "crash", f"{type(e).__name__}: {e}", runner))
        if node_rank:
            return None
        for rec, i in zip(recs, ids or []):
            rec["id"] = i
        return recs
    if runner == "command":  # every node rank returns its records (merged by the executor)
        from advisor.runners.command import execute_command

        return execute_command(model, cluster, cfgs, timeout_s, options, node_rank, nnodes, rendezvous, ids)
    from advisor.runners import measure as M

    o = dict(options)
    entries = [M.make_entry(model, cfg.world_size, steps=int(o.get("steps", 10)), warmup=int(o.get("warmup", 3)),
                            id=(ids[k] if ids else None), stack=o.get("stack", "local"), **cfg.to_dict())
               for k, cfg in enumerate(cfgs)]
    records = M.run_batch(entries, dataset=o.get("spool"), nproc=cfgs[0].world_size,
                          timeout=float(o.get("progress_timeout_s", min(timeout_s, 300.0))),
                          telemetry_hz=float(o.get("telemetry_hz", 20.0)))
    by_id = {r.get("id"): r for r in records}
    out = []
    for e, cfg in zip(entries, cfgs):
        rec = by_id.get(e.id)
        if rec is None:
            rec = new_record(model, cluster, cfg, "crash", "the runner returned no record", runner)
            rec["id"] = e.id
        rec = dict(rec)
        rec.setdefault("runner", runner)
        rec.setdefault("simulated", False)
        out.append(rec)
    return out


def failure_records(job: "Job", status: str, error: str) -> list[dict[str, Any]]:
    recs = [new_record(job.model, job.cluster, cfg, status, error, job.runner) for cfg in job.cfgs]
    for rec, i in zip(recs, job.ids or []):
        rec["id"] = i
    return recs


@dataclass
class Job:
    """One launch: the layouts `cfgs` (one trial each, tagged by `tags`) measured one after
    another on the same GPUs. `results` gets one record per layout, in order."""

    tags: list[Any]  # the caller's handles (the Optuna trials), one per layout
    runner: str
    model: ModelSpec
    cluster: ClusterSpec
    cfgs: list[TrainConfig]
    timeout_s: float  # one trial's; the job may take len(cfgs) times that
    options: Mapping[str, Any]
    ids: list[str] | None = None  # the records' ids, one per layout (random when None)
    started: float = field(default_factory=time.time)
    refs: list = field(default_factory=list)
    pg: Any = None
    cancelled_at: float | None = None  # when its deadline passed and it was cancelled
    aborted: bool = False  # a node rank failed and the others were stopped
    results: list[dict] | None = None

    def __post_init__(self) -> None:
        n = len(self.cfgs)
        if not n or len(self.tags) != n or (self.ids is not None and len(self.ids) != n):
            raise ValueError(f"a job needs one tag (and id) per layout: {len(self.tags)} tags, "
                             f"{len(self.ids or [])} ids, {n} layouts")

    @property
    def deadline_s(self) -> float:
        """The whole job's wall time: one trial's timeout per layout."""
        return self.timeout_s * len(self.cfgs)


class InlineExecutor:
    """Runs each trial in this process, when submitted. No timeouts, no concurrency."""

    name = "inline"

    def __init__(self) -> None:
        self._done: list[Job] = []

    def slots(self, cluster: ClusterSpec, cpu_only: bool = False) -> int:
        return 1

    def submit(self, job: Job) -> Job:
        try:
            job.results = execute(job.runner, job.model, job.cluster, job.cfgs, job.timeout_s, job.options,
                                  ids=job.ids)
        except Exception as e:  # noqa: BLE001 - a crashing trial is a result
            job.results = failure_records(job, "crash", f"{type(e).__name__}: {e}")
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
    def run_rank(runner, model, cluster, cfgs, timeout_s, options, node_rank, nnodes, rendezvous, ids):
        ctx = ray.get_runtime_context()
        recs = execute(runner, model, cluster, cfgs, timeout_s, options, node_rank, nnodes, rendezvous, ids)
        where = {"node_rank": node_rank, "node_ip": ray.util.get_node_ip_address(),
                 "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                 "master": list(rendezvous) if rendezvous else None}
        return recs, where

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
        start_ray(address)
        self.kill_grace_s = kill_grace_s
        self.jobs: list[Job] = []
        self._run_rank, self._rendezvous = _remote_fns()

    def slots(self, cluster: ClusterSpec, cpu_only: bool = False) -> int:
        """How many trials of `cluster`'s size fit on the Ray cluster at once (`cpu_only`: one
        CPU each)."""
        alive = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
        if cpu_only:
            return int(sum(r.get("CPU", 0) for r in alive))
        gpus = [r.get("GPU", 0) for r in alive]
        if cluster.num_nodes == 1:
            return int(sum(g // cluster.world_size for g in gpus))
        return sum(1 for g in gpus if g >= cluster.gpus_per_node) // cluster.num_nodes

    def submit(self, job: Job) -> Job:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as PGS

        c = job.cluster
        args = (job.runner, job.model, c, job.cfgs, job.timeout_s, dict(job.options))
        if cpu_only(job.runner, job.options):  # one task on one CPU, whatever the cluster's size
            job.refs = [self._run_rank.options(num_gpus=0, num_cpus=1).remote(*args, 0, 1, None, job.ids)]
        elif c.num_nodes == 1:
            job.refs = [self._run_rank.options(num_gpus=c.world_size, num_cpus=1).remote(*args, 0, 1, None, job.ids)]
        else:
            job.pg = placement_group([{"GPU": c.gpus_per_node, "CPU": 1}] * c.num_nodes, strategy="STRICT_SPREAD")
            rdv = self._rendezvous.options(scheduling_strategy=PGS(job.pg, placement_group_bundle_index=0)).remote()
            job.refs = [self._run_rank.options(num_gpus=c.gpus_per_node, num_cpus=1,
                                               scheduling_strategy=PGS(job.pg, placement_group_bundle_index=i)
                                               ).remote(*args, i, c.num_nodes, rdv, job.ids)
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
            job.results = self._collect(job)
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
        if job.cancelled_at is None and now - job.started > job.deadline_s:
            job.cancelled_at = now
            for r in job.refs:
                self.ray.cancel(r, force=False)  # KeyboardInterrupt: the runner kills its torchrun
        elif job.cancelled_at is not None and now - job.cancelled_at > self.kill_grace_s:
            for r in job.refs:
                self.ray.cancel(r, force=True)

    def _collect(self, job: Job) -> list[dict[str, Any]]:
        recs, where, errors, by_node = None, [], [], []
        for ref in job.refs:
            try:
                r, w = self.ray.get(ref)
                where.append(w)
                recs = r if w["node_rank"] == 0 else recs
                if r is not None:
                    by_node.append((w["node_rank"], r))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if job.runner == "command" and len(by_node) > 1 and not errors:
            from advisor.runners.command import merge_node_records

            recs = merge_node_records(by_node)
        timed_out = job.cancelled_at is not None
        if errors or recs is None:
            e = errors[0] if errors else None
            if timed_out and (e is None or isinstance(e, (self.ray.exceptions.TaskCancelledError,
                                                            self.ray.exceptions.WorkerCrashedError))):
                recs = failure_records(job, "timeout", f"no result after {job.deadline_s:.0f} s; the trial was cancelled")
            else:
                recs = failure_records(job, "crash", _describe(e))
        placement = sorted(where, key=lambda w: w["node_rank"])
        for rec in recs:
            if timed_out and rec.get("status") == "killed":
                rec["status"] = "timeout"
            rec["placement"] = placement
        return recs

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


class RayStartError(SpecError):
    """Ray did not start or could not be reached; the message says how to fix it."""


def _ray_token_available() -> bool:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(path)


def start_ray(address: str | None) -> None:
    """ray.init (a new local Ray when `address` is None), or one RayStartError line saying what
    to do. Connecting to a cluster (`ray start`): Ray >= 2.52 clusters ask for a token, which a
    driver sends only with RAY_AUTH_MODE=token; when that is unset and a token is at hand
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, where `ray start` puts it), it is
    set, as Ray's own CLI does. Ray's C++ client logs its connection retries on stderr: they are
    kept from the terminal and read for the cause."""
    import sys
    import tempfile

    import ray

    if ray.is_initialized():
        return
    remote = address is not None
    if remote:
        _check_reachable(address)
    if remote and "RAY_AUTH_MODE" not in os.environ and _ray_token_available():
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray read its config at import: have it read the mode again (what ray's CLI does)
            from ray._raylet import Config

            Config.initialize("")
        except Exception:  # noqa: BLE001 - an older Ray without token authentication
            pass
    kw = dict(address=address, logging_level="ERROR", log_to_driver=False,
              include_dashboard=False if address is None else None)
    if not remote:
        try:
            ray.init(**kw)
            return
        except Exception as e:  # noqa: BLE001 - one line for the user
            raise RayStartError(_ray_start_message(address, e, "")) from None
    err, text = None, ""
    with tempfile.TemporaryFile() as cap:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(cap.fileno(), 2)
        try:
            ray.init(**kw)
        except Exception as e:  # noqa: BLE001
            err = e
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        if err is not None:
            cap.seek(0)
            text = cap.read().decode(errors="replace")
    if err is not None:
        raise RayStartError(_ray_start_message(address, err, text)) from None


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """A host:port (or ray://host:port) address must accept a TCP connection: Ray itself retries
    an unreachable address for many minutes."""
    import socket

    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", a bare host: Ray resolves it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise RayStartError(_ray_start_message(address, ConnectionError(why), "")) from None


def _ray_start_message(address: str | None, e: Exception, log: str) -> str:
    where = f"Ray at {address}" if address else "a local Ray"
    said = " ".join(str(e).split())[:200]
    if "InvalidAuthToken" in log or "Unauthenticated" in log or type(e).__name__ == "AuthenticationError":
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            return (f"{where} refused this driver's token: copy the head node's ~/.ray/auth_token here "
                    f"(or set RAY_AUTH_TOKEN to it)")
        return (f"{where} asks for a token (Ray token authentication): copy the head node's "
                f"~/.ray/auth_token here (or set RAY_AUTH_TOKEN) and export RAY_AUTH_MODE=token")
    if isinstance(e, ConnectionError):
        return (f"cannot reach {where} ({said}): check the address ('ray status' on the head node), "
                f"or leave out --ray-address for a local Ray, or give --ray-address inline to run trials without Ray")
    return (f"{where} did not start ({type(e).__name__}: {said}); --ray-address inline runs trials "
            f"without Ray")


def make_executor(address: str | None, kill_grace_s: float = 30.0):
    """'inline' / 'none': no Ray; otherwise Ray at `address` (None: Ray's own search, else a new
    local instance)."""
    if address in ("inline", "none"):
        return InlineExecutor()
    return RayExecutor(address, kill_grace_s)



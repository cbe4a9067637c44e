"""Measure layouts for real: the launcher side of the megatron-core trial runner (no torch here).

``run_batch(entries, ...)`` resolves each entry (model, layers, TrainConfig keys), refuses what
megatron-core without Transformer Engine cannot run, writes the runnable jobs to a run directory
and starts ONE ``torchrun`` whose workers (``megatron_worker.py``) loop over them. The launcher
samples telemetry over all local GPUs for the whole batch, follows the workers' event files,
and as soon as a job is complete assembles its record (``advisor.measurement/1``) and appends it
to the dataset (append + flush + fsync). A watchdog kills the torchrun process group when no
event arrives for ``timeout`` seconds (NCCL hang): the job is recorded as ``timeout`` and the
batch restarts at the next job; so do OOMs and crashes that take a multi-GPU worker down (a
one-GPU worker survives them in-process and goes on). The time budget (``max_seconds``) is
watched all along, not only between torchruns: no job starts once it is spent. Every job the
workers started gets exactly one record; what a worker reported (``oom`` / ``crash``) decides
the status even if torchrun is killed afterwards, and the launcher's own kills (interrupt,
budget) give ``killed`` with the steps done, never a ``crash`` classified from the log.
torchrun runs in a session of its own with ``PR_SET_PDEATHSIG`` (Linux): it ends with the
launcher even when the launcher is SIGKILLed, and each worker arms ``PR_SET_PDEATHSIG`` (SIGKILL)
itself: no worker outlives its torchrun, whatever killed it (``runners/parent_watch.py``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from advisor.catalog.specs import SpecError
from advisor.runners.parent_watch import preexec_die_with_parent
from advisor.runners.follow import EventFollower, file_size, tail
from advisor.runners.jobs import (GPU_PEAK_FALLBACK_TFLOPS, HELLO_ENV, RUN_KEYS, RUNNER_ENV, Entry, assemble_record,
                                  entry_from_dict, entry_from_line, entry_to_dict, gpu_catalog_name, job_for,
                                  make_entry, step_windows, telemetry_block)
from advisor.runners.proctree import descendants, install_signal_handlers, kill_all, restore_signal_handlers
from advisor.runners.records import (SCHEMA, STATUSES, ERROR_LINE, append_jsonl, classify_failure, finite, jsonable,
                                     read_jsonl)
from advisor.runners.salvage import pending_root, salvage_run_dir, salvage_runs

log = logging.getLogger(__name__)

# What other modules and tests import from here (much of it defined in records, jobs, follow,
# proctree and salvage, and re-exported).
__all__ = [
    "SCHEMA", "STATUSES", "WORKER", "RUNNER_ENV", "HELLO_ENV", "CHILD_ENV", "RUN_KEYS", "TE_CHILD_ENV",
    "TE_MISSING", "GPU_PEAK_FALLBACK_TFLOPS", "append_jsonl", "read_jsonl", "jsonable", "finite",
    "ERROR_LINE", "classify_failure", "Entry", "make_entry", "entry_from_line", "job_for", "torchrun_command",
    "gpu_catalog_name", "step_windows", "assemble_record", "telemetry_block", "EventFollower", "JobState",
    "BatchRunner", "job_timing", "file_size", "tail", "pending_root", "entry_to_dict", "entry_from_dict",
    "salvage_run_dir", "salvage_runs", "STACK_SIGNAL", "dump_worker_stacks", "parse_stack_dump",
    "stack_summary", "descendants", "kill_all", "install_signal_handlers", "restore_signal_handlers",
    "local_gpu_count", "te_available", "run_batch", "load_batch",
]

WORKER = Path(__file__).with_name("megatron_worker.py")
# Kept set in the workers too (KINDS.md: NVLink multicast off on shared hosts).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
             "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "4"}
# Set for a batch with a Transformer Engine job: one CUDA work queue, so TP / SP communication is
# issued in program order (Megatron-LM asserts it for sequence parallelism; NVIDIA's recipes set it).
TE_CHILD_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
TE_MISSING = ("Transformer Engine is not installed here, so the te stack cannot run: "
              "pip install 'advisor[gpu,te]' (or see docs/measurement.md for bringing TE to a "
              "machine without a package index)")


def torchrun_command(nproc: int, run_dir: str | Path, start: int = 0,
                     python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", "0",
            str(WORKER), str(run_dir), str(start)]  # positional: torchrun abbreviates --options


@dataclass
class JobState:
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    bounds: list[float] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # (status, error) from a worker event
    recorded: bool = False
    started_at: float | None = None  # worker clock of its first `start` event
    log_offset: int = 0  # its output in the torchrun log starts at or after this byte
    torchrun_started: float | None = None  # when the launcher started the torchrun that ran it
    first_in_torchrun: bool = False  # no job ran before it in that torchrun
    stacks: dict[str, list[str]] | None = None  # where each rank was when the watchdog fired


class BatchRunner:
    """Runs entries in one torchrun (restarting after failures); see the module docstring.

    Guarantees: every job the workers started gets exactly one record; a worker's own ``oom`` /
    ``crash`` event decides its job's status even if torchrun is killed afterwards; a job cut by
    the launcher itself (interrupt, time budget) is ``killed`` with the steps it completed, never
    ``crash``; jobs the time budget kept from starting get no record (the log names them).

    ``max_seconds``: no job starts after that many seconds; the one in flight finishes, then
    torchrun is stopped (a job the workers begin after the budget ran out is stopped at once:
    no record if it completed no step, else ``killed``). ``failure_grace_s``: after a rank
    reports a failure, how long torchrun may live on without the workers going on to the next
    job before the launcher kills it (the other ranks may hang in a collective)."""

    def __init__(self, entries: list[Entry], dataset: str | Path | None, nproc: int,
                 run_dir: str | Path | None = None, timeout: float = 300.0,
                 telemetry_hz: float = 20.0, trace_dir: str | Path | None = None,
                 max_seconds: float | None = None, on_record: Callable[[dict], None] | None = None,
                 python: str | None = None, telemetry: str = "auto", failure_grace_s: float = 30.0):
        self.entries, self.dataset, self.nproc = entries, dataset, nproc
        # With a dataset, the worker files live beside it until the batch is settled: if the
        # launcher is SIGKILLed, the next batch on that dataset (or `advisor measure --salvage`)
        # turns what the workers wrote into records (salvage_runs).
        self._pending = run_dir is None and dataset is not None
        if self._pending:
            run_dir = pending_root(dataset) / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="advisor-measure-"))
        self.timeout, self.telemetry_hz, self.max_seconds = timeout, telemetry_hz, max_seconds
        self.failure_grace_s = failure_grace_s
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.on_record, self.python, self.telemetry = on_record, python, telemetry
        self.records: list[dict[str, Any]] = []
        self.sampler = None
        self.backend = None
        self.env: dict[str, Any] = {}
        self.hello: dict[int, dict[str, Any]] = {}
        self.proc: subprocess.Popen | None = None
        self.kill_reason: str | None = None  # why the launcher stopped the current torchrun
        self.t_begin = time.time()
        self._drain: Callable[[], None] | None = None

    # -- records -------------------------------------------------------------------------------
    def _emit(self, rec: dict[str, Any]) -> None:
        if self.dataset:
            append_jsonl(self.dataset, rec)
        self.records.append(rec)
        if self.on_record:
            self.on_record(rec)

    def _record(self, entry: Entry, st: JobState | None, status: str, error: str | None) -> None:
        if st is not None:
            if st.recorded:
                return
            st.recorded = True
        ranks = {r: dict(v) for r, v in (st.ranks if st else {}).items()}
        for r, h in self.hello.items():
            ranks.setdefault(r, {}).setdefault("hello", h)
        bounds = st.bounds if st else None
        trace, trace_path = None, None
        if self.sampler is not None and bounds and len(bounds) > entry.warmup + 1:
            trace = self._trace_between(bounds[0] - 1.0, bounds[-1] + 1.0)
            if entry.save_trace and self.trace_dir is not None and trace is not None:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                p = self.trace_dir / f"{entry.id}.trace.json.gz"
                trace.windows.extend(step_windows(bounds, entry.warmup))
                trace.save(p)
                trace_path = str(p)
        try:
            rec = assemble_record(entry, status, error, ranks, bounds, trace, self.env,
                                  gpus_per_node=self.nproc, trace_path=trace_path)
        except Exception as e:  # never lose a measurement to a bug in summarising it
            log.exception("assembling the record of %s failed", entry.id)
            rec = assemble_record(entry, status, f"{error or ''} [record assembly: {e}]".strip(),
                                  ranks, bounds, None, self.env, gpus_per_node=self.nproc)
        if st is not None and st.stacks:
            rec["hang_stacks"] = st.stacks
        if st is not None and st.torchrun_started is not None:
            rec["timing"] = job_timing(st.torchrun_started, st.first_in_torchrun, st.started_at,
                                       bounds[0] if bounds else None, time.time())
        self._emit(rec)

    def _trace_between(self, t0: float, t1: float):
        try:
            return self.sampler.snapshot(t0, t1)
        except Exception as e:  # telemetry must not cost the record
            log.warning("telemetry snapshot failed: %s", e)
            return None

    # -- telemetry -----------------------------------------------------------------------------
    def _start_telemetry(self) -> None:
        if self.telemetry == "off" or self.telemetry_hz <= 0:
            from advisor.runners.telemetry_nvml import driver_version

            self.env["driver"] = driver_version()  # still recorded without telemetry
            return
        try:
            from advisor.runners.telemetry import Sampler, open_backend
            t = self.telemetry
            self.backend = open_backend(t) if isinstance(t, str) else t  # or a backend object
            if self.backend is None:
                return
            self.env["driver"] = getattr(self.backend, "driver_version", None)
            self.sampler = Sampler(self.backend, None, rate_hz=self.telemetry_hz).start()
        except Exception as e:
            log.warning("telemetry unavailable: %s", e)
            self.sampler = None

    def _stop_telemetry(self):
        if self.sampler is not None:
            try:
                return self.sampler.stop()
            except Exception:
                return None

    # -- time budget ---------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        return self.t_begin + self.max_seconds if self.max_seconds else None

    def _budget_spent(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    # -- the batch -----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        runnable = []
        for e in self.entries:
            if e.refused:
                self._record(e, None, "refused", e.refused)
            else:
                runnable.append(e)
        if not runnable:
            return self.records
        if self.dataset is not None:
            salvage_runs(self.dataset)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = psutil.Process()
        (self.run_dir / "entries.json").write_text(json.dumps(
            {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname(), "nproc": self.nproc,
             "entries": [entry_to_dict(e) for e in runnable]}, default=jsonable))
        with open(self.run_dir / "jobs.jsonl", "w", encoding="utf-8") as f:
            for i, e in enumerate(runnable):
                f.write(json.dumps(job_for(e, i)) + "\n")
        self._start_telemetry()
        self.t_begin = time.time()
        states = [JobState() for _ in runnable]
        start, attempt, consecutive_timeouts = 0, 0, 0
        old_handlers = install_signal_handlers()
        try:
            while start < len(runnable) and not self._budget_spent():
                nxt, timed_out = self._attempt(runnable, states, start, attempt)
                attempt += 1
                consecutive_timeouts = consecutive_timeouts + 1 if timed_out else 0
                if consecutive_timeouts >= 2 and nxt < len(runnable):
                    for i in range(nxt, len(runnable)):
                        self._record(runnable[i], states[i], "skipped",
                                     "not run: batch aborted after 2 consecutive timeouts")
                    nxt = len(runnable)
                start = nxt
            if start < len(runnable):  # only the time budget stops the loop early
                left = runnable[start:]
                msg = (f"time budget of {self.max_seconds:g} s spent after "
                       f"{time.time() - self.t_begin:.0f} s: {len(left)} job(s) not started, "
                       f"not recorded: {', '.join(e.id for e in left)}")
                log.warning(msg)
                self._log_line(msg)
        except KeyboardInterrupt:
            self._kill("interrupted")
            if self._drain is not None:
                try:
                    self._drain()  # what the workers wrote before they were stopped
                except Exception:
                    log.exception("reading the last events failed")
            for i, e in enumerate(runnable):
                st = states[i]
                if not st.recorded and (st.ranks or st.bounds):
                    if st.failure:
                        self._record(e, st, *st.failure)
                    else:
                        self._record(e, st, "killed", f"interrupted after {_steps_done(st)} step(s); "
                                                      "partial steps kept")
            self._settled()
            raise
        finally:
            self._drain = None
            restore_signal_handlers(old_handlers)
            full = self._stop_telemetry()
            if full is not None and self.trace_dir is not None and os.environ.get("ADVISOR_SAVE_FULL_TRACE"):
                full.save(self.trace_dir / f"batch-{int(self.t_begin)}.trace.json.gz")
        for i, e in enumerate(runnable):  # safety net: nothing the workers reported is dropped
            st = states[i]
            if not st.recorded and (st.ranks or st.bounds):
                log.error("job %d (%s) had no outcome; recording it", i, e.id)
                self._record(e, st, *(st.failure or ("crash", "the launcher lost track of this job")))
        self._settled()
        return self.records

    def _settled(self) -> None:
        """Every job has its record in the dataset: the pending worker files can go."""
        if self._pending:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            try:
                self.run_dir.parent.rmdir()  # the last pending batch of this dataset
            except OSError:
                pass

    def _attempt(self, runnable: list[Entry], states: list[JobState], start: int,
                 attempt: int) -> tuple[int, bool]:
        """One torchrun from job `start`; records every job it started and returns (the first
        job it did not start, timed out?)."""
        log_path = self.run_dir / f"attempt{attempt}.log"
        followers = {r: EventFollower(self.run_dir / f"rank{r}.jsonl") for r in range(self.nproc)}
        for f in followers.values():  # skip what earlier attempts wrote
            f.read()
        env = dict(os.environ, **CHILD_ENV)
        if any(e.stack == "te" for e in runnable):
            env.update(TE_CHILD_ENV)
        cmd = torchrun_command(self.nproc, self.run_dir, start, self.python)
        self.kill_reason = None
        launched_at = time.time()
        with open(log_path, "ab") as logf:
            # A session of its own: a terminal's Ctrl-C reaches the launcher only, which then
            # stops torchrun and records what was measured. PR_SET_PDEATHSIG: torchrun still
            # goes if the launcher is SIGKILLed.
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=preexec_die_with_parent())
        s: dict[str, Any] = {"current": None, "failed": None, "batch_done": False, "seen": False,
                             "progress": time.time(), "start": start, "log_mark": 0,
                             "torchrun_started": launched_at}

        def drain() -> None:
            # A job first seen in this drain began after the previous drain read the event
            # files, so its output in the log starts after the size measured then: failures are
            # classified from there on, not from an earlier job's (recovered) error messages.
            mark = file_size(log_path)
            for r, fol in followers.items():
                for evt in fol.read():
                    s["progress"], s["seen"] = time.time(), True
                    self._consume(r, evt, runnable, states, s)
            s["log_mark"] = mark
            cur = s["current"]
            for i in range(start, start if cur is None else cur):  # failures a 1-GPU worker survived
                if states[i].failure and not states[i].recorded:
                    self._record(runnable[i], states[i], *states[i].failure)

        self._drain = drain
        timed_out = False
        while True:
            rc = self.proc.poll()
            drain()
            if rc is not None:
                break
            now = time.time()
            failed = s["failed"]
            if failed and failed[0] == s["current"] and now - failed[1] > self.failure_grace_s:
                # A rank failed and the workers did not go on (a 1-GPU worker recovers and goes
                # on to the next job): the other ranks may hang in a collective.
                self._log_line(f"job {failed[0]} failed {self.failure_grace_s:g} s ago and the "
                               f"workers did not go on: stopping torchrun")
                self._kill("failure")
                break
            if now - s["progress"] > self.timeout:
                timed_out = True
                if s["current"] is not None:
                    states[s["current"]].stacks = dump_worker_stacks(self.proc.pid, self.run_dir)
                self._kill("timeout")
                break
            if self._budget_spent():
                i = s["current"]
                st = states[i] if i is not None else None
                in_flight = (st is not None and not st.recorded and st.failure is None
                             and st.started_at is not None and st.started_at <= self.deadline)
                if not in_flight:  # no job may start any more
                    self._kill("budget")
                    break
            time.sleep(0.2)
        rc = self.proc.wait()
        drain()
        self._drain = None
        if not s["seen"]:  # the workers never started: the same would happen to every job
            if self.kill_reason == "budget":
                return start, False
            status, reason = classify_failure(tail(log_path), rc)
            reason = f"workers did not start: {reason or f'exit code {rc}'}"
            for i in range(start, len(runnable)):
                self._record(runnable[i], states[i], "crash", reason)
            return len(runnable), False
        cur = s["current"]
        if cur is None:  # the workers said hello but began no job
            if self.kill_reason == "budget":
                return start, False
            cur = start
        for i in range(start, cur + 1):
            st = states[i]
            if st.recorded:
                continue
            if (i == cur and self.kill_reason == "budget" and st.failure is None
                    and len(st.bounds) < 2 and (st.started_at is None or st.started_at > self.deadline)):
                # Begun after the budget ran out and stopped before its first step: not run.
                states[i] = JobState()
                return i, False
            self._record(runnable[i], st, *self._outcome(runnable[i], i == cur, st, rc, log_path))
        if s["batch_done"] and rc == 0:
            return len(runnable), False
        return cur + 1, timed_out

    def _outcome(self, entry: Entry, in_flight: bool, st: JobState, rc: int | None,
                 log_path: Path) -> tuple[str, str]:
        """(status, error) of a started job that has no record when its torchrun ended."""
        if st.failure:  # what the worker itself reported wins, whatever happened afterwards
            return st.failure
        n = _steps_done(st)
        if self.kill_reason == "timeout" and in_flight:
            where = "; ".join(f"rank {r} in {stack_summary(fr)}" for r, fr in sorted(
                (st.stacks or {}).items(), key=lambda kv: int(kv[0])) if fr)
            return "timeout", (f"no progress for {self.timeout:.0f} s (NCCL hang?); process group killed"
                               + (f"; {where}" if where else ""))
        if self.kill_reason == "budget":
            return "killed", (f"cut by the time budget ({self.max_seconds:g} s) after {n} step(s); "
                              "torchrun stopped by the launcher, partial steps kept")
        if self.kill_reason is not None:
            return "killed", f"torchrun stopped by the launcher ({self.kill_reason}) after {n} step(s)"
        if not in_flight:
            missing = [r for r in range(entry.config.world_size) if "done" not in st.ranks.get(r, {})]
            return "crash", f"the workers went on without reporting this job's outcome (ranks {missing})"
        status, reason = classify_failure(tail(log_path, start=st.log_offset), rc)
        if status == "ok":
            status, reason = "crash", f"workers exited (code {rc}) before finishing the job"
        return status, reason

    def _consume(self, r: int, evt: dict[str, Any], runnable: list[Entry],
                 states: list[JobState], s: dict[str, Any]) -> None:
        kind, i = evt.get("ev"), evt.get("cfg")
        if kind == "hello":
            self.hello[r] = evt
            for k in HELLO_ENV:
                self.env.setdefault(k, evt.get(k))
            return
        if kind == "batch_done":
            s["batch_done"] = True
            return
        if i is None or not s["start"] <= i < len(states):  # (a late event of an earlier torchrun)
            return
        st = states[i]
        if s["current"] is None or i > s["current"]:
            s["current"] = i
            st.log_offset = s["log_mark"]
        if kind == "start":
            t = evt.get("t", time.time())
            st.started_at = t if st.started_at is None else min(st.started_at, t)
            if st.torchrun_started is None:
                st.torchrun_started = s["torchrun_started"]
                st.first_in_torchrun = i == s["start"]
        if kind == "step":
            if r == 0:
                st.bounds.append(evt["tt"])
            return
        st.ranks.setdefault(r, {})[kind] = evt
        if kind in ("oom", "crash") and st.failure is None:
            st.failure = (kind, evt.get("error"))
            if s["failed"] is None or i > s["failed"][0]:
                s["failed"] = (i, time.time())
            self._log_line(f"job {i} {kind} on rank {r}: {evt.get('error')}")
        if kind == "done" and all("done" in st.ranks.get(q, {})
                                  for q in range(runnable[i].config.world_size)):
            self._record(runnable[i], st, "ok", None)
            self._log_line(f"job {i} ok: {runnable[i].model.name} {runnable[i].config.key()}")

    def _kill(self, reason: str) -> None:
        """Stop torchrun and its workers (they run in sessions of their own) and wait until
        they are gone, so that no event arrives after the jobs are settled."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        self.kill_reason = self.kill_reason or reason
        tree = descendants(p.pid)
        try:
            os.killpg(p.pid, signal.SIGTERM)  # torchrun passes it on to its workers
            p.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        kill_all(tree)

    def _log_line(self, msg: str) -> None:
        print(f"[measure] {msg}", file=sys.stderr, flush=True)


def job_timing(torchrun_started: float, first: bool, job_started: float | None, first_step: float | None,
               end: float) -> dict[str, Any]:
    """Where a job's wall time went (s): `startup_s` (torchrun launch to the job's start: process
    launch, imports, NCCL init; only for the first job of a torchrun), `build_s` (job start to its
    first step boundary: model, optimizer, data), `run_s` (first step boundary to its record)."""
    def gap(a, b):
        return round(b - a, 3) if a is not None and b is not None else None

    return {"torchrun_started": torchrun_started, "first_in_torchrun": first,
            "startup_s": gap(torchrun_started, job_started) if first else None,
            "build_s": gap(job_started, first_step), "run_s": gap(first_step, end)}


def _steps_done(st: JobState) -> int:
    return max(0, len(st.bounds) - 1)


# ------------------------------------------------------------------------------- processes
# The workers dump every thread's Python stack (faulthandler) into rank<R>.stacks on this signal.
STACK_SIGNAL = signal.SIGUSR1
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def dump_worker_stacks(torchrun_pid: int, run_dir: Path, wait_s: float = 2.0) -> dict[str, list[str]]:
    """Ask the workers under torchrun where they are: {rank: frames of its main thread, innermost
    first, as "func (file.py:line)"}. Only the worker processes get the signal (torchrun's agent
    would die of it)."""
    marks = {p: file_size(p) for p in Path(run_dir).glob("rank*.stacks")}
    sent = 0
    try:
        procs = [psutil.Process(torchrun_pid)] + descendants(torchrun_pid)
    except psutil.Error:
        return {}
    for p in procs:
        try:
            if any(Path(a).name == WORKER.name for a in p.cmdline()[:3]):
                p.send_signal(STACK_SIGNAL)
                sent += 1
        except psutil.Error:
            pass
    if not sent:
        return {}
    time.sleep(wait_s)
    out = {}
    for p in sorted(Path(run_dir).glob("rank*.stacks")):
        frames = parse_stack_dump(tail(p, start=marks.get(p, 0)))
        if frames:
            out[p.stem.removeprefix("rank")] = frames
    return out


def parse_stack_dump(text: str, keep: int = 12) -> list[str]:
    """The main thread's frames from a faulthandler dump (the "Current thread" block: the signal
    runs on the main thread), innermost first."""
    blocks, cur = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            cur = (line.startswith("Current"), [])
            blocks.append(cur)
        elif cur is not None and (m := _FRAME.match(line)):
            cur[1].append(f"{m['func']} ({Path(m['file']).name}:{m['line']})")
    main = [b for b in blocks if b[0]] or blocks
    return main[-1][1][:keep] if main else []


def stack_summary(frames: list[str], depth: int = 3) -> str:
    """The innermost frames of one rank, for an error line."""
    return " < ".join(frames[:depth])


# ------------------------------------------------------------------------------ GPU discovery
def local_gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() not in ("", "all"):
        return len([x for x in cvd.split(",") if x.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return 0


def te_available() -> bool:
    """Can this Python import Transformer Engine's PyTorch API (without importing it)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


def run_batch(entries: list[Entry], dataset: str | Path | None, nproc: int, **kw: Any) -> list[dict[str, Any]]:
    te_ok = None
    for e in entries:
        if not e.refused and e.config.world_size != nproc:
            e.refused = f"world size {nproc} != tp*pp*cp*dp = {e.config.world_size}"
        if not e.refused and e.stack == "te":
            te_ok = te_available() if te_ok is None else te_ok
            if not te_ok:
                e.refused = TE_MISSING
    return BatchRunner(entries, dataset, nproc, **kw).run()


def load_batch(path: str | Path, world_size: int | None) -> list[Entry]:
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                entries.append(entry_from_line(json.loads(line), world_size))
            except json.JSONDecodeError as e:
                raise SpecError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            except SpecError as e:
                raise SpecError(f"{path}:{n}: {e}") from None
    return entries

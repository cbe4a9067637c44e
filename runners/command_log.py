"""Reading a training command's output: its iterations, the job's own TFLOP/s and memory reports
(Megatron-LM, NeMo 2, a regex, JSON step lines), step boundaries, and the failure it names."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from advisor.runners.records import ERROR_LINE, classify_failure

__all__ = ["GIB_PER_MB", "Step", "LogParser", "parse_text", "classify", "bounds_from_steps"]

GIB_PER_MB = 1 / 1024.0  # Megatron's "memory (MB)" is MiB


_MEGATRON_STEP = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.]+)")
_MEGATRON_TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.]+)")
_MEGATRON_MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
    r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")
_NEMO_STEP = re.compile(r"global_step\s*[:=]\s*([0-9.]+).*?train_step_timing in s\s*[:=]\s*([0-9.]+)")


@dataclass
class Step:
    seconds: float  # one iteration's time
    t: float  # when the line was read (unix)
    iteration: int | None = None
    tflops: float | None = None  # what the job itself reported


class LogParser:
    """Turns the job's log lines (and step-file JSON lines) into iterations and memory reports."""

    def __init__(self, kind: str = "auto", step_regex: str | None = None):
        self.kind = kind
        self.rx = re.compile(step_regex) if step_regex else None
        self.steps: list[Step] = []
        self.memory: dict[int, dict[str, float]] = {}  # rank -> peak_allocated_gib, peak_reserved_gib
        self._last_iter: int | None = None
        self._last_t: float | None = None  # step file: the previous boundary

    def _add(self, seconds: float, t: float, iteration: int | None, tflops: float | None = None) -> None:
        if iteration is not None and self._last_iter is not None:
            if iteration <= self._last_iter:
                return  # a repeated line (a progress bar redrawn, a second rank printing it)
            n = iteration - self._last_iter  # a log interval > 1: its average, once per iteration
        else:
            n = 1
        if iteration is not None:
            self._last_iter = iteration
        self.steps += [Step(seconds, t, iteration, tflops)] * n

    def feed_line(self, line: str, t: float) -> None:
        if self.kind in ("auto", "megatron"):
            m = _MEGATRON_STEP.search(line)
            if m:
                tf = _MEGATRON_TFLOPS.search(line)
                self._add(float(m.group(2)) / 1000.0, t, int(m.group(1)), float(tf.group(1)) if tf else None)
                return
            m = _MEGATRON_MEMORY.search(line)
            if m:
                self.memory[int(m.group(1))] = {"peak_allocated_gib": float(m.group(4)) * GIB_PER_MB,
                                                "peak_reserved_gib": float(m.group(6)) * GIB_PER_MB,
                                                "after_iterations": int(m.group(2))}
                return
        if self.kind in ("auto", "nemo"):
            m = _NEMO_STEP.search(line)
            if m:
                self._add(float(m.group(2)), t, int(float(m.group(1))))
                return
        if self.kind == "regex" and self.rx is not None:
            m = self.rx.search(line)
            if m:
                g = m.groupdict()
                sec = float(g["s"]) if g.get("s") is not None else float(g["ms"]) / 1000.0
                it = g.get("iter")
                self._add(sec, t, int(float(it)) if it is not None else None)

    def feed_json(self, obj: Mapping[str, Any], t: float) -> None:
        """One line of the step file (read in every parser mode)."""
        if not isinstance(obj, Mapping):
            return
        rank = obj.get("rank", 0)
        if obj.get("peak_allocated_gib") is not None and isinstance(rank, int):
            self.memory[rank] = {"peak_allocated_gib": float(obj["peak_allocated_gib"]),
                                 "peak_reserved_gib": float(obj.get("peak_reserved_gib") or obj["peak_allocated_gib"])}
        it = obj.get("step")
        it = int(it) if isinstance(it, (int, float)) else None
        if obj.get("step_time_s") is not None:
            self._add(float(obj["step_time_s"]), float(obj.get("t", t)), it)
        elif obj.get("step_time_ms") is not None:
            self._add(float(obj["step_time_ms"]) / 1000.0, float(obj.get("t", t)), it)
        elif obj.get("t") is not None:
            tt = float(obj["t"])
            if self._last_t is not None:
                self._add(tt - self._last_t, tt, it)
            self._last_t = tt


def parse_text(text: str, kind: str = "auto", step_regex: str | None = None, t: float = 0.0) -> LogParser:
    """A whole log at once (tests, salvage)."""
    p = LogParser(kind, step_regex)
    for line in re.split(r"[\r\n]", text):
        p.feed_line(line, t)
    return p


_LAUNCHER_ERRORS = ("ChildFailedError",)  # torchrun's own report of a failed worker
_ERROR_LOG_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:ERROR|FATAL|CRITICAL)\b.*$", re.M)


def classify(text: str, rc: int | None) -> tuple[str, str]:
    """measure.classify_failure, but a failure reported through torchrun's ChildFailedError names
    the worker's own error line (a Python exception, else the last ERROR log line)."""
    status, reason = classify_failure(text, rc)
    if status == "crash" and any(w in reason for w in _LAUNCHER_ERRORS):
        errors = [e for e in ERROR_LINE.findall(text) if not any(w in e[1] for w in _LAUNCHER_ERRORS)]
        if errors:
            _, name, _, msg = errors[-1]
            return status, f"{name}: {msg.strip()[:300]}"
        logged = _ERROR_LOG_LINE.findall(text)
        if logged:
            return status, logged[-1].strip()[:300]
    return status, reason


def bounds_from_steps(steps: list[Step]) -> list[float] | None:
    """Step boundaries (unix) from iteration times, anchored at the time the last step was read:
    bounds[k+1] - bounds[k] is iteration k's own time, so assemble_record's step times are the
    job's own numbers and the telemetry window is the measured iterations (to within the
    launcher's 0.1 s poll)."""
    if not steps:
        return None
    b = [steps[-1].t]
    for s in reversed(steps):
        b.append(b[-1] - s.seconds)
    return b[::-1]

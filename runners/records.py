"""Measurement records: the schema, the JSONL files they live in (durable appends, tolerant reads),
strict-JSON values, and the status of a failed run read from its log."""
from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path
from typing import Any, Mapping

__all__ = ["SCHEMA", "STATUSES", "append_jsonl", "read_jsonl", "jsonable", "finite", "ERROR_LINE", "classify_failure"]

SCHEMA = "advisor.measurement/1"
STATUSES = ("ok", "oom", "timeout", "crash", "refused", "killed", "skipped")  # skipped: never ran


# ------------------------------------------------------------------------------------- JSONL
def append_jsonl(path: str | Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line durably. If an earlier write was cut off (no trailing newline), start
    on a fresh line so the new record stays readable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, separators=(",", ":"), allow_nan=False, default=jsonable) + "\n"
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete JSON objects of a JSONL file; cut-off or garbled lines are skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def jsonable(v: Any) -> Any:
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def finite(x: Any) -> Any:
    """NaN / inf -> None, recursively (records are strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


# ------------------------------------------------------------------------- failure classification
_PATTERNS: list[tuple[str, str, re.Pattern]] = [
    ("oom", "CUDA out of memory", re.compile(
        r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|"
        r"CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|Failed to CUDA calloc|"
        r"NCCL.*(Cuda failure|cuda failure).*out of memory)", re.I)),
    ("timeout", "NCCL collective timed out (watchdog)", re.compile(
        r"(Watchdog caught collective operation timeout|collective operation timeout|"
        r"ProcessGroupNCCL.*(timeout|timed out)|NCCL.*(Timeout|timed out)|"
        r"Timed out waiting|DistStoreError.*[Tt]imeout|heartbeat monitor.*(timeout|timed out))", re.I)),
    ("crash", "segmentation fault", re.compile(
        r"(Segmentation fault|SIGSEGV|Signal 11 |signal 11\b|core dumped)", re.I)),
    ("crash", "CUDA illegal memory access", re.compile(
        r"(illegal memory access|cudaErrorIllegalAddress|misaligned address|device-side assert)", re.I)),
    ("crash", "NCCL error", re.compile(
        r"(NCCL error|ncclUnhandledCudaError|ncclSystemError|ncclInternalError|ncclInvalidUsage|"
        r"ncclRemoteError|DistBackendError)", re.I)),
    ("crash", "killed by SIGKILL (host out of memory?)", re.compile(
        r"(Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|Killed$)", re.I | re.M)),
]
# torchrun's agent got a signal (its own workers' failures show up as exit codes instead)
_SIGNAL_EXCEPTION = re.compile(r"SignalException: Process (\d+) got signal: (\d+)")
ERROR_LINE = re.compile(r"^\s*(\[rank\d+\]:\s*)?([A-Za-z_.]*(Error|Exception)[A-Za-z_.]*):\s*(.+)$", re.M)


def classify_failure(log_text: str, returncode: int | None) -> tuple[str, str]:
    """(status, reason) from a run's captured output and exit code. status is one of
    ok, oom, timeout, crash, killed (torchrun itself was sent a signal, by someone other than
    the launcher: the launcher's own kills are never classified from the log); reason is one
    line (the most telling log line)."""
    text = log_text or ""
    for status, what, pat in _PATTERNS:
        m = pat.search(text)
        if m:
            line = text[text.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0].strip()
            line = re.sub(r"^\[rank\d+\]:\s*", "", line)
            return status, f"{what}: {line[:300]}" if line else what
    m = _SIGNAL_EXCEPTION.search(text)
    if m:
        num = int(m.group(2))
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = "?"
        return "killed", (f"torchrun (pid {m.group(1)}) was stopped by signal {num} ({name}) from "
                          "outside the launcher")
    if returncode in (-11, 139):
        return "crash", "segmentation fault (signal 11)"
    if returncode in (-9, 137):
        return "crash", "killed by SIGKILL (host out of memory?)"
    if returncode in (0, None) and "Traceback" not in text:
        return "ok", ""
    errors = ERROR_LINE.findall(text)
    if errors:
        _, name, _, msg = errors[-1]
        return "crash", f"{name}: {msg.strip()[:300]}"
    tail = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return "crash", f"exit code {returncode}" + (f": {tail[-1][:300]}" if tail else "")

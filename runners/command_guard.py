"""Runs a user's training command so that nothing it starts outlives the launcher.

    python runners/command_guard.py -- bash -c 'torchrun ... pretrain_gpt.py ...'

The command runner (``runners/command.py``) starts this guard in a session of its own with
``PR_SET_PDEATHSIG`` (SIGTERM). The guard makes itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``): whatever the command starts (torchrun, its workers, a data loader,
a background helper) stays in the guard's process tree even when its own parent exits. On SIGTERM
or SIGINT (the launcher stopping the trial, or the launcher dying) and when the command's main
process exits, it stops every process left in that tree: SIGTERM, then SIGKILL after ``GRACE_S``.
It exits with the command's exit code (128 + N for a command killed by signal N, as a shell
reports it). Standard library plus psutil (a core dependency of the advisor); no ``advisor`` import.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from parent_watch import load_prctl  # beside this file (sys.path[0] when run as a script)
from proctree import alive, send

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = float(os.environ.get("ADVISOR_GUARD_GRACE_S", "10"))


def stop_tree(grace_s: float = GRACE_S) -> None:
    """SIGTERM every descendant, SIGKILL those left after grace_s, reap them all."""
    procs = psutil.Process().children(recursive=True)
    send(procs, "terminate")
    t0 = time.time()
    while time.time() - t0 < grace_s:
        _reap()
        procs = [p for p in procs if alive(p)]
        if not procs:
            return
        time.sleep(0.1)
    send(psutil.Process().children(recursive=True) + procs, "kill")
    t0 = time.time()
    while time.time() - t0 < 5 and psutil.Process().children(recursive=True):
        _reap()
        time.sleep(0.05)


def _reap() -> dict[int, int]:
    """Collect every exited child (orphans reparented to us included): {pid: wait status}."""
    out = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out[pid] = status


def exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: command_guard.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    prctl = load_prctl()
    if prctl:
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(argv)
    status = None
    while status is None:
        if stop["signal"] is not None:
            stop_tree()
            return 128 + stop["signal"]
        reaped = _reap()
        status = reaped.get(child.pid)
        if status is None:
            time.sleep(0.05)
    child.returncode = exit_code(status)  # reaped here; keep Popen from waiting on it again
    stop_tree()  # whatever the command left running (a background helper, an orphaned worker)
    return exit_code(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

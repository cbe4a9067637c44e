"""Processes: the live descendants of a process, killing a tree and waiting until it is gone, and
SIGTERM / SIGINT as KeyboardInterrupt while a launcher runs. Standard library plus psutil, no
``advisor`` import: ``command_guard.py`` imports it as a script's sibling."""
from __future__ import annotations

import logging
import signal
import time

import psutil

log = logging.getLogger(__name__)

__all__ = ["descendants", "alive", "send", "kill_all", "install_signal_handlers", "restore_signal_handlers"]


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of pid (psutil remembers each one's start time, so a recycled pid is
    never mistaken for it)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def send(procs: list[psutil.Process], action: str) -> None:
    """`action` ("terminate": SIGTERM, "kill": SIGKILL) to each process; one already gone is skipped."""
    for p in procs:
        try:
            getattr(p, action)()
        except psutil.Error:
            pass


def kill_all(procs: list[psutil.Process], wait_s: float = 10.0) -> None:
    """SIGKILL the processes still alive and wait until they are gone (a zombie counts as gone:
    its parent may be dead and nobody may reap it)."""
    left = [p for p in procs if alive(p)]
    send(left, "kill")
    t0 = time.time()
    while left and time.time() - t0 < wait_s:
        left = [p for p in left if alive(p)]
        if left:
            time.sleep(0.05)
    if left:
        log.warning("processes %s survived SIGKILL", [p.pid for p in left])


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def install_signal_handlers():
    old = {}
    try:
        for s in (signal.SIGTERM, signal.SIGINT):
            old[s] = signal.signal(s, _raise_interrupt)
    except ValueError:  # not the main thread
        pass
    return old


def restore_signal_handlers(old) -> None:
    for s, h in old.items():
        signal.signal(s, h)

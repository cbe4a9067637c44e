"""Processes that must not outlive the process that started them (Linux: PR_SET_PDEATHSIG).

A measurement leaves GPU memory held by nobody if a torchrun worker survives its torchrun, or
torchrun survives the launcher: the next job on those GPUs then runs out of memory. Both ends
use this module, which imports nothing beyond the standard library (the torchrun workers import
it as a sibling module, without the ``advisor`` package):

* ``preexec_die_with_parent(sig)``: a ``preexec_fn`` for ``subprocess.Popen`` (the launcher
  starting torchrun);
* ``die_with_parent(sig)``: called by a process about itself, first thing (a torchrun worker).

The kernel sends ``sig`` when the parent *thread* that forked the child exits, so start children
from a thread that lives as long as they should (torchrun's agent starts its workers from its
main thread). Elsewhere than Linux both are no-ops (None / False).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable

__all__ = ["PR_SET_PDEATHSIG", "load_prctl", "preexec_die_with_parent", "die_with_parent"]

PR_SET_PDEATHSIG = 1
_prctl: Any = None


def load_prctl():
    global _prctl
    if _prctl is None:
        _prctl = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).prctl
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
                _prctl = fn
            except (OSError, AttributeError):
                pass
    return _prctl


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets `sig` when this process dies, even by SIGKILL. Everything
    is resolved before the fork; the child only makes two system calls."""
    prctl = load_prctl()
    if not prctl:
        return None
    parent, sig = os.getpid(), int(sig)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl: nobody will signal us
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Make this process get `sig` when its parent dies (default SIGKILL: a worker stuck in a
    collective cannot run a Python handler). `parent` is the pid the caller knows as its parent
    (default: the current one); if that parent is already gone, the signal comes at once.
    True when armed."""
    prctl = load_prctl()
    if not prctl:
        return False
    parent = os.getppid() if parent is None else parent
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), int(sig))
    return True

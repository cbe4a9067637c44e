"""Helpers shared by the test modules (pytest puts tests/ on sys.path: `from support import ...`)."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """A script of bench/ as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pid_alive(pid: int) -> bool:
    """Running and not a zombie (a zombie's parent may be dead and nobody may reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """True once pid is gone (or a zombie), False if it still runs after timeout_s."""
    t0 = time.time()
    while pid_alive(pid) and time.time() - t0 < timeout_s:
        time.sleep(0.05)
    return not pid_alive(pid)

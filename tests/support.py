"""Helpers shared by the test modules (pytest puts tests/ on sys.path: `from support import ...`)."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

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


def assert_dies_with_parent(parent: subprocess.Popen, get_child: Callable[[], int], alive_msg: str | None = None,
                            gone_msg: str | None = None, settle_s: float = 0.0) -> None:
    """SIGKILL `parent` (no handler, no clean-up: as Ray or the OOM killer do) and assert that the
    process get_child() names goes with it. Neither is left running, whatever happens."""
    child = None
    try:
        child = get_child()
        time.sleep(settle_s)
        assert pid_alive(child), alive_msg
        parent.kill()
        parent.wait(10)
        assert wait_gone(child), gone_msg
    finally:
        parent.kill()
        parent.wait()
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


def run_tiny_pair(tmp_path, monkeypatch, ids: tuple[str, str], **run_keys) -> dict:
    """Two 2-layer jobs through the measure launcher and tests/data/measure/fake_worker.py on 2
    ranks, the first with `run_keys` (a run key under test), the second without: {id: record}."""
    import sys

    from advisor.catalog.specs import ModelSpec
    from advisor.runners import measure as M

    data = ROOT / "tests" / "data" / "measure"

    def cmd(nproc, run_dir, start=0, python=None):
        return [sys.executable, str(data / "fake_worker.py"), str(run_dir), str(start), str(nproc)]
    monkeypatch.setattr(M, "torchrun_command", cmd)
    monkeypatch.setattr(M, "WORKER", data / "fake_worker.py")
    tiny = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                     vocab_size=256)
    es = [M.make_entry(tiny, 2, mbs=1, gbs=4, warmup=1, steps=2, **run_keys),
          M.make_entry(tiny, 2, mbs=1, gbs=4, warmup=1, steps=2)]
    es[0].id, es[1].id = ids
    ds = tmp_path / "out.jsonl"
    M.run_batch(es, ds, 2, run_dir=tmp_path / "run", timeout=20.0, telemetry="off")
    return {r["id"]: r for r in M.read_jsonl(ds)}

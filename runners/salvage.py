"""Salvage: batches whose launcher died (SIGKILL, power loss) wait beside their dataset
(``<dataset>.runs/``); their records are built from what the workers left and appended."""
from __future__ import annotations

import importlib
import json
import logging
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Mapping

import psutil

from advisor.runners.jobs import HELLO_ENV, assemble_record, entry_from_dict
from advisor.runners.records import append_jsonl, read_jsonl

log = logging.getLogger(__name__)

__all__ = ["pending_root", "salvage_run_dir", "salvage_runs", "RUNNER_SALVAGE"]

# Batches of other runners, by the `runner` of their entries.json: (module, function(run_dir,
# dataset, meta)). Looked up by name when such a batch is found: the command runner builds on
# the megatron runner's launcher, so this module cannot import it.
RUNNER_SALVAGE = {"command": ("advisor.runners.command", "salvage_run_dir")}

def pending_root(dataset: str | Path) -> Path:
    """Where the worker files of batches appending to `dataset` wait until they are settled."""
    return Path(f"{dataset}.runs")


def _owner_alive(meta: Mapping[str, Any]) -> bool:
    """Is the launcher that wrote this batch still running? A batch of another host (a shared
    file system) counts as alive: its process cannot be checked from here."""
    if meta.get("host", socket.gethostname()) != socket.gethostname():
        return True
    try:
        p = psutil.Process(int(meta["pid"]))
        return abs(p.create_time() - float(meta["create_time"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def salvage_run_dir(run_dir: str | Path, dataset: str | Path) -> list[dict[str, Any]]:
    """Records for the jobs of a batch whose launcher died without settling them (SIGKILL, power
    loss): built from the workers' event files, appended to `dataset`, for every job that
    started and has no record there yet. No telemetry (it lived in the launcher). Returns them."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "entries.json").read_text(encoding="utf-8"))
    entries = [entry_from_dict(d) for d in meta["entries"]]
    done = {r.get("id") for r in read_jsonl(dataset)} if Path(dataset).is_file() else set()
    ranks: dict[int, dict[int, dict[str, Any]]] = {}
    bounds: dict[int, list[float]] = {}
    env: dict[str, Any] = {}
    for f in sorted(run_dir.glob("rank*.jsonl")):
        r = int(f.stem.removeprefix("rank"))
        hello = None
        for evt in read_jsonl(f):
            kind, i = evt.get("ev"), evt.get("cfg")
            if kind == "hello":
                hello = evt
                for k in HELLO_ENV:
                    env.setdefault(k, evt.get(k))
                continue
            if not isinstance(i, int) or not 0 <= i < len(entries):
                continue
            per = ranks.setdefault(i, {}).setdefault(r, {})
            if hello is not None:
                per.setdefault("hello", hello)
            if kind == "step":
                if r == 0:
                    bounds.setdefault(i, []).append(evt["tt"])
            elif kind:
                per[kind] = evt
    out = []
    for i, e in enumerate(entries):
        if e.id in done or i not in ranks:
            continue  # recorded before the launcher died, or never started
        rs, b = ranks[i], bounds.get(i)
        failed = next(((k, ev.get("error")) for ev_r in rs.values() for k, ev in ev_r.items()
                       if k in ("oom", "crash")), None)
        n = max(0, len(b or []) - 1 - e.warmup)
        if failed:
            status, error = failed
        elif all("done" in rs.get(q, {}) for q in range(e.config.world_size)):
            status, error = "ok", None
        else:
            status, error = "killed", (f"the launcher died (SIGKILL?) after {n} measured step(s); "
                                       "steps kept from the workers' event files")
        rec = assemble_record(e, status, error, rs, b, None, env, gpus_per_node=meta.get("nproc"))
        rec["salvaged_from"] = str(run_dir)
        append_jsonl(dataset, rec)
        out.append(rec)
    return out


def salvage_runs(dataset: str | Path) -> list[dict[str, Any]]:
    """Settle every batch left pending beside `dataset` by a launcher that died (see
    salvage_run_dir); batches whose launcher still runs are left alone."""
    root = pending_root(dataset)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            meta = json.loads((d / "entries.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None
            if time.time() - d.stat().st_mtime < 3600:
                continue  # being created by a launcher right now, or unreadable: not ours to drop
        if meta is not None and _owner_alive(meta):
            continue
        if meta is not None:
            if meta.get("runner") in RUNNER_SALVAGE:  # the command runner's batches: trial logs
                module, name = RUNNER_SALVAGE[meta["runner"]]
                recs = getattr(importlib.import_module(module), name)(d, dataset, meta)
            else:
                recs = salvage_run_dir(d, dataset)
            if recs:
                log.warning("salvaged %d record(s) of a batch whose launcher died: %s", len(recs), d)
            out += recs
        shutil.rmtree(d, ignore_errors=True)
    try:
        root.rmdir()
    except OSError:
        pass
    return out

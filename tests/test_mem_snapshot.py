"""The allocator's state at a step's peaks, replayed from torch's memory history (issue #27,
runners/mem_snapshot.py): synthetic snapshots in the format of torch.cuda.memory._snapshot()."""
from __future__ import annotations

import json

import pytest

from advisor.catalog.specs import SpecError
from advisor.runners import measure as M
from advisor.runners.mem_snapshot import GIB, site, summarize
from support import run_tiny_pair

MIB = 2 ** 20
MEGA = [{"filename": "/x/torch/autograd/function.py", "line": 5, "name": "apply"},
        {"filename": "/x/megatron/core/transformer/moe/token_dispatcher.py", "line": 321, "name": "dispatch"}]


def seg(addr, size, blocks, expandable=False):
    return {"address": addr, "total_size": size, "is_expandable": expandable,
            "blocks": [{"address": a, "size": n, "state": "active_allocated"} for a, n in blocks]}


def test_site_names_megatron_else_first_frame_outside_torch():
    assert site(MEGA) == "token_dispatcher.py:321 dispatch"
    assert site([{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "f"},
                 {"filename": "/w/bench/run.py", "line": 9, "name": "main"}]) == "run.py:9 main"
    assert site([]) == "?" and site(None) == "?"


def test_replay_finds_both_peaks_and_splits_the_cache():
    # before: segment A (20 MiB) holds a 4 MiB weight; nothing else
    before = {"segments": [seg(0, 20 * MIB, [(0, 4 * MIB)])], "device_traces": [[{"action": "snapshot"}]]}
    t = [{"action": "snapshot"},
         {"action": "alloc", "addr": 4 * MIB, "size": 8 * MIB, "frames": MEGA},        # 12 live
         {"action": "segment_alloc", "addr": 100 * MIB, "size": 30 * MIB},             # reserved 50
         {"action": "alloc", "addr": 100 * MIB, "size": 30 * MIB, "frames": MEGA[:1]},  # 42 live: allocated peak
         {"action": "free_requested", "addr": 100 * MIB, "size": 30 * MIB},            # 12
         {"action": "free_completed", "addr": 100 * MIB, "size": 30 * MIB},
         {"action": "segment_alloc", "addr": 200 * MIB, "size": 40 * MIB},             # reserved 90: its peak
         {"action": "alloc", "addr": 200 * MIB, "size": 2 * MIB, "frames": MEGA},      # 14
         {"action": "segment_free", "addr": 100 * MIB, "size": 30 * MIB},              # reserved 60
         {"action": "free_requested", "addr": 4 * MIB, "size": 8 * MIB}]               # 6 at the end, 8 pending
    out = summarize(before, {"device_traces": [t]})
    a, r, e = out["at_allocated_peak"], out["at_reserved_peak"], out["at_end"]
    assert out["events"] == 9 and not out["expandable"] and out["ooms"] == 0
    assert a["allocated_gib"] * GIB == 42 * MIB and a["reserved_gib"] * GIB == 50 * MIB
    assert a["stranded_gib"] * GIB == 8 * MIB and a["releasable_gib"] == 0  # A: 20 - 12 live; B full
    assert a["sites"][0] == {"site": "function.py:5 apply", "gib": 30 * MIB / GIB, "blocks": 1}
    assert a["sites"][1]["site"] == "token_dispatcher.py:321 dispatch"
    assert a["live_before_step_gib"] * GIB == 4 * MIB
    # the reserved peak: A (12 live of 20), B (30, empty: releasable), C (40, nothing live yet)
    assert r["reserved_gib"] * GIB == 90 * MIB and r["allocated_gib"] * GIB == 12 * MIB
    assert r["stranded_gib"] * GIB == 8 * MIB and r["releasable_gib"] * GIB == 70 * MIB
    assert r["cache_gib"] * GIB == 78 * MIB and r["segments"] == 3 and r["segments_with_live_blocks"] == 1
    # the end: A holds the weight and the 8 MiB block another stream still uses (8 cached there),
    # C a 2 MiB block (38 stranded with it)
    assert e["allocated_gib"] * GIB == 6 * MIB and e["pending_free_gib"] * GIB == 8 * MIB
    assert e["stranded_gib"] * GIB == (8 + 38) * MIB
    json.dumps(out, allow_nan=False)


def test_expandable_segments_are_not_split():
    before = {"segments": [seg(0, 20 * MIB, [(0, 2 * MIB)], expandable=True)]}
    t = [{"action": "segment_map", "addr": 20 * MIB, "size": 20 * MIB},
         {"action": "alloc", "addr": 20 * MIB, "size": 10 * MIB, "frames": MEGA}]
    out = summarize(before, {"device_traces": [t]})
    assert out["expandable"]
    p = out["at_allocated_peak"]
    assert p["reserved_gib"] * GIB == 40 * MIB and p["cache_gib"] * GIB == 28 * MIB
    assert p["stranded_gib"] == 0 and p["releasable_gib"] == 0


def test_snapshot_key_reaches_the_job_and_the_record(tmp_path, monkeypatch):
    e = M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "memory_snapshot_steps": 1}, 4)
    assert M.job_for(e, 0)["memory_snapshot_steps"] == 1
    assert M.entry_from_dict(M.entry_to_dict(e)).memory_snapshot_steps == 1
    assert "memory_snapshot_steps" not in M.job_for(M.entry_from_line({"model": "llama3-8b", "layers": 2,
                                                                       "dp": 4, "mbs": 1}, 4), 0)
    for bad in (-1, True, 1.5):
        with pytest.raises(SpecError, match="memory_snapshot_steps"):
            M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "memory_snapshot_steps": bad}, 4)

    by_id = run_tiny_pair(tmp_path, monkeypatch, ("snap", "plain"), memory_snapshot_steps=1)
    snap = by_id["snap"]["memory_snapshot"]
    assert set(snap) == {"0", "1"} and snap["0"]["at_allocated_peak"]["allocated_gib"] * GIB == 3 * MIB
    assert "memory_snapshot" not in by_id["plain"]

"""The per-phase memory summary of the GPU worker (runners/mem_probe.py) with fake allocator
numbers, and how a record carries it (runners/jobs.py)."""
import json

import pytest

from advisor.catalog.specs import ModelSpec
from advisor.runners import measure as M
from advisor.runners.mem_probe import GIB, per_stage, point, summarize


def _pt(alloc, max_alloc, resv, max_resv, retries=0, ooms=0, inactive=0, device=None):
    p = {"allocated": alloc * GIB, "max_allocated": max_alloc * GIB, "reserved": resv * GIB,
         "max_reserved": max_resv * GIB, "num_alloc_retries": retries, "num_ooms": ooms,
         "inactive_split_bytes.all.current": 0, "inactive_split_bytes.all.peak": inactive * GIB}
    if device is not None:
        p["device_used"] = device * GIB
    return p


POINTS = {"start": _pt(0, 0, 0, 0, retries=5, device=1.25),
          "built": _pt(20, 20, 22, 22, retries=5),
          "step_start": _pt(44, 60, 66, 66, retries=6),
          "forward_backward": _pt(45, 61.5, 66, 70, retries=8, inactive=3.0),
          "optimizer": _pt(44, 52, 66, 70, retries=8, inactive=1.0, device=72.5)}


def test_summary_takes_the_phase_peaks_not_their_sum():
    s = summarize(POINTS)
    assert s["built_gib"] == 20 and s["static_gib"] == 44
    assert s["forward_backward_peak_gib"] == 61.5 and s["forward_backward_transient_gib"] == 17.5
    assert s["optimizer_peak_gib"] == 52 and s["optimizer_transient_gib"] == 8
    assert s["peak_gib"] == 61.5 and s["peak_phase"] == "forward_backward"
    assert s["reserved_peak_gib"] == 70 and s["reserved_over_peak_gib"] == 8.5
    assert s["inactive_split_peak_gib"] == 3.0
    assert s["device_used_gib"] == 72.5 and s["outside_allocator_gib"] == 6.5
    assert s["outside_start_gib"] == 1.25
    assert s["num_alloc_retries"] == 3 and s["num_ooms"] == 0  # since the job's start
    json.dumps(s, allow_nan=False)


def test_summary_optimizer_peak_and_no_device_reading():
    pts = dict(POINTS, optimizer=_pt(44, 63, 66, 70, retries=8), start=_pt(0, 0, 0, 0, retries=5))
    s = summarize(pts)
    assert s["peak_phase"] == "optimizer" and s["peak_gib"] == 63
    assert s["device_used_gib"] is None and s["outside_allocator_gib"] is None
    assert s["outside_start_gib"] is None


def test_point_reads_the_allocator_and_the_device():
    class FakeCuda:
        def memory_stats(self):
            return {"num_alloc_retries": 2, "num_ooms": 1, "inactive_split_bytes.all.peak": 7}

        def memory_allocated(self):
            return 10

        def max_memory_allocated(self):
            return 30

        def memory_reserved(self):
            return 40

        def max_memory_reserved(self):
            return 50

        def mem_get_info(self):
            return 100, 180

    p = point(FakeCuda(), device=True)
    assert (p["allocated"], p["max_allocated"], p["reserved"], p["max_reserved"]) == (10, 30, 40, 50)
    assert p["num_alloc_retries"] == 2 and p["num_ooms"] == 1 and p["device_used"] == 80
    assert p["inactive_split_bytes.all.peak"] == 7 and p["inactive_split_bytes.all.current"] == 0
    assert "device_used" not in point(FakeCuda())


def test_per_stage_keeps_the_largest_rank_of_each_stage():
    ranks = {0: {"stage": 0, "memory_phases": {"peak_gib": 50.0}},
             1: {"stage": 0, "memory_phases": {"peak_gib": 52.0}},
             2: {"stage": 1, "memory_phases": {"peak_gib": 61.0}},
             3: {"stage": 1, "memory_phases": None}}
    got = per_stage(ranks)
    assert [(g["stage"], g["rank"], g["peak_gib"]) for g in got] == [(0, 1, 52.0), (1, 2, 61.0)]
    assert per_stage({0: {"stage": 0, "memory_phases": None}}) is None


def test_record_carries_memory_phases_and_the_oom_phase():
    tiny = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                     num_attention_heads=8, num_query_groups=2, vocab_size=1000)
    e = M.make_entry(tiny, 2, mbs=1, gbs=2, pp=2)
    s = summarize(POINTS)
    ranks = {r: {"hello": {"uuid": f"GPU-{r}", "pci_bus_id": None, "gpu_name": "NVIDIA H100"},
                 "built": {"stage": r, "tp_rank": 0, "dp_rank": 0},
                 "done": {"peak_allocated_gib": 60.0 + r, "peak_reserved_gib": 70.0,
                          "memory_phases": dict(s, peak_gib=s["peak_gib"] + r)}} for r in range(2)}
    rec = M.assemble_record(e, "ok", None, ranks, [0.0, 1.0, 2.0], None)
    assert [(p["stage"], p["rank"]) for p in rec["memory_phases"]] == [(0, 0), (1, 1)]
    assert rec["memory_phases"][1]["peak_gib"] == pytest.approx(62.5)
    ranks[1] = {"built": {"stage": 1}, "oom": {"peak_allocated_gib": 79.0, "allocated_gib": 70.0,
                                               "phase": "steps", "num_alloc_retries": 3, "error": "x"}}
    del ranks[0]["done"]
    rec = M.assemble_record(e, "oom", "CUDA out of memory", ranks, None, None)
    assert rec["memory"]["at_failure"]["1"] == {"peak_allocated_gib": 79.0, "allocated_gib": 70.0,
                                                "phase": "steps", "num_alloc_retries": 3}
    assert "memory_phases" not in rec

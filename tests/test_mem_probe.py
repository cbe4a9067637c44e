"""The per-phase memory summary of the GPU worker (runners/mem_probe.py) with fake allocator
numbers, and how a record carries it (runners/jobs.py)."""
import json

import pytest

from advisor.catalog.specs import ModelSpec
from advisor.runners import measure as M
from advisor.runners.mem_probe import GIB, per_stage, point, summarize
from support import run_tiny_pair


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


# ------------------------------------------------------------------------ allocator pressure
class FakeCuda:
    """torch.cuda as pressure_plan / pressure_result read it."""

    def __init__(self, total, free, reserved, allocated, max_allocated, max_reserved=0.0, retries=0):
        self.total, self.free, self.reserved, self.allocated = total, free, reserved, allocated
        self.max_alloc, self.max_resv, self.retries = max_allocated, max_reserved, retries

    def mem_get_info(self):
        return self.free * GIB, self.total * GIB

    def memory_reserved(self):
        return self.reserved * GIB

    def memory_allocated(self):
        return self.allocated * GIB

    def max_memory_allocated(self):
        return self.max_alloc * GIB

    def max_memory_reserved(self):
        return self.max_resv * GIB

    def memory_stats(self):
        return {"num_alloc_retries": self.retries}


def test_pressure_plan_leaves_the_peak_plus_headroom():
    from advisor.runners.mem_probe import pressure_plan, pressure_result
    # 80 GiB device, 20 free: used 60 = 52 reserved + 8 outside; peak allocated 45 (7 cached beyond it)
    cuda = FakeCuda(total=80, free=20, reserved=52, allocated=30, max_allocated=45, retries=3)
    plan = pressure_plan(cuda, 1.0)
    assert plan["outside_gib"] == pytest.approx(8.0)
    assert plan["ballast_gib"] == pytest.approx(80 - 8 - 46)  # what is left: peak 45 + 1 headroom
    assert plan["retries_before"] == 3 and plan["headroom_gib"] == 1.0
    # more headroom than the device has: no ballast
    assert pressure_plan(FakeCuda(80, 1, 70, 60, 70), 20.0)["ballast_gib"] == 0.0
    # the steps beside a 26 GiB ballast: their own peaks with the ballast taken out
    cuda.max_alloc, cuda.max_resv, cuda.retries = 26 + 44.5, 26 + 45.5, 5
    res = pressure_result(cuda, plan, 26 * GIB)
    assert res["steps_peak_allocated_gib"] == pytest.approx(44.5)
    assert res["steps_peak_reserved_gib"] == pytest.approx(45.5)
    assert res["retries"] == 2 and res["ballast_gib"] == plan["ballast_gib"]
    json.dumps(res, allow_nan=False)


def test_pressure_key_reaches_the_job_and_the_record(tmp_path, monkeypatch):
    from advisor.catalog.specs import SpecError

    e = M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "gbs": 8,
                           "pressure_headroom_gib": 1.5}, 4)
    assert e.pressure_headroom_gib == 1.5 and M.job_for(e, 0)["pressure_headroom_gib"] == 1.5
    assert M.entry_from_dict(M.entry_to_dict(e)).pressure_headroom_gib == 1.5
    assert "pressure_headroom_gib" not in M.job_for(M.entry_from_line({"model": "llama3-8b", "layers": 2,
                                                                       "dp": 4, "mbs": 1}, 4), 0)
    for bad in (-1, True, "1", 5000):
        with pytest.raises(SpecError, match="pressure_headroom_gib"):
            M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "pressure_headroom_gib": bad}, 4)
    with pytest.raises(SpecError, match="warmup >= 1"):
        M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "warmup": 0,
                           "pressure_headroom_gib": 1.0}, 4)

    by_id = run_tiny_pair(tmp_path, monkeypatch, ("pressed", "plain"), pressure_headroom_gib=1.0)
    assert by_id["pressed"]["status"] == "ok"
    assert by_id["pressed"]["pressure"]["0"] == {"headroom_gib": 1.0, "ballast_gib": 60.0, "retries": 2}
    assert set(by_id["pressed"]["pressure"]) == {"0", "1"} and "pressure" not in by_id["plain"]

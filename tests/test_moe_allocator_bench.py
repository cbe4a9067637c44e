"""bench/moe_allocator.py: the te MoE stages' measured reserved-but-unallocated memory against the
parts of models/allocator_memory.py's MoE term."""
from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from advisor.models.calibrate import resolve_calibration
from advisor.models.memory import stage_memory
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]


def test_one_constant_loao_recovers_a_proportional_term_and_scores_the_held_out_architecture():
    mod = load_bench("moe_allocator")
    F = np.array([1.0, 2.0, 3.0, 4.0])
    arch = np.array(["a", "a", "b", "b"])
    k, mae = mod.one_constant_loao(2.0 * F, F, arch)
    assert k == pytest.approx(2.0) and mae == pytest.approx(0.0, abs=1e-12)
    y = np.array([1.0, 2.0, 6.0, 8.0])  # architecture b twice a's constant
    k, mae = mod.one_constant_loao(y, F, arch)
    held_a = np.abs(y[:2] - 2.0 * F[:2])  # a held out: k fitted on b alone, 2
    held_b = np.abs(y[2:] - 1.0 * F[2:])  # b held out: k fitted on a alone, 1
    assert mae == pytest.approx(np.concatenate([held_a, held_b]).mean())
    assert k == pytest.approx(float(F @ y / (F @ F)))


def test_te_moe_stages_carry_the_shipped_term_and_its_parts():
    mod = load_bench("moe_allocator")
    st = mod.stage_rows(sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl"))), "te")
    assert len(st) >= 29 and all(s["cfg"].ep > 1 for s in st)
    c = resolve_calibration("default", "te").screening_constants
    for s in st:
        assert s["rank_min"] <= s["measured"] and s["load"] >= 1.0 and s["b"] > 0 and s["L"] >= 1
        sm = stage_memory(s["model_spec"], s["cfg"], c)[s["stage"]]
        assert s["R"] == pytest.approx(sm.reserved_free_gib, abs=1e-9)
    # the layout the campaign ran three times (te-mix-ep-00, -call2, -call3): over 1 GiB apart
    rep = {rid: (n, lo, hi) for rid, n, lo, hi in mod.repeat_spread(st)}
    n, lo, hi = rep["te-mix-ep-00"]
    assert n == 3 and hi - lo > 1.0


def test_toy_allocator_reuses_splits_and_strands_like_torchs_caching_allocator():
    toy = load_bench("allocator_toy")
    MIB = toy.MIB
    a = toy.CachingAllocator()
    x = a.malloc(100 * MIB + 1)  # rounded up to 102 MiB, a segment of its own
    assert a.reserved == a.allocated == 102 * MIB
    a.free(x)
    y = a.malloc(60 * MIB)  # served by the cached 102 MiB block, split: 42 MiB free beside it
    assert a.reserved == 102 * MIB and a.allocated == 60 * MIB
    z = a.malloc(50 * MIB)  # larger than the 42 MiB remainder: a new segment, the remainder stays reserved
    assert a.reserved == 152 * MIB and a.allocated == 110 * MIB
    a.free(y)
    a.free(z)
    assert a.allocated == 0 and a.reserved == 152 * MIB
    w = a.malloc(102 * MIB)  # the split block merged back with its free neighbour: reused whole
    assert a.reserved == 152 * MIB and a.allocated == 102 * MIB and w is not None
    assert a.malloc(MIB) is None  # the small pool is not modelled


def test_toy_moe_step_strands_memory_only_when_the_routing_changes_buffer_sizes():
    toy = load_bench("allocator_toy")
    shape = dict(h=1024, f=4096, experts=8, top_k=2, layers=4, tokens=2048, vocab=8000, microbatches=2, steps=3)
    al0, fixed = toy.moe_step_stranded(**shape, cv=0.0)
    al1, routed = toy.moe_step_stranded(**shape, cv=0.3)
    assert al0 > 0 and fixed < 0.05 * al0
    assert routed > fixed + 0.05 * al0


def test_pipeline_with_the_shipped_form_is_memory_edges_check_and_restores_the_model():
    import advisor.models.memory as MM

    mod = load_bench("moe_allocator")
    paths = sorted(glob.glob(str(ROOT / "data/measurements/*.jsonl")))
    shipped = MM.reserved_free_gib
    r = mod.pipeline(paths, None, None)
    assert MM.reserved_free_gib is shipped
    edge = load_bench("memory_edge")
    rs = edge.rows(paths)
    ok = [x for x in rs if x["status"] == "ok"]
    want = edge.loao([x for x in ok if x["stack"] == "te"], edge.expandable_spread(ok))["moe"]["mape_loao_pct"]
    assert r["mape"][("te", "moe")] == pytest.approx(want, abs=1e-9)
    assert r["oom"] == sum(x["status"] == "oom" for x in rs) and r["oom_fit"] == 0
    # a form with the MoE part off (k 0) predicts less reserved memory for the te MoE runs: its MAPE differs
    assert mod.pipeline(paths, None, {"te": 0.0})["mape"][("te", "moe")] != pytest.approx(want, abs=1e-6)
    # the shipped form through the L^p replacement (p 0.5) with the shipped constants: the same check
    assert mod.pipeline(paths, 0.5, None)["mape"][("te", "moe")] == pytest.approx(want, abs=1e-9)

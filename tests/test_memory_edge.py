"""Issue #27: rank only what the stack's runner can run; a memory interval and a margin."""
from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from advisor.api import default_workload, recommend
from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.models import DEFAULT
from advisor.models import memory_band as MB
from advisor.models.memory import stage_memory
from advisor.models.outside_memory import outside_allocator_arrays, outside_allocator_gib
from advisor.runners import megatron_args as MA
from advisor.search_spaces.columns import enumerate_columns
from advisor.search_spaces.runnable import refusal, refused
from advisor.search_spaces.space import SpaceOptions

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def memory_edge_rows():
    """bench/memory_edge.py as a module and its rows of every record in data/measurements/."""
    spec = importlib.util.spec_from_file_location("memory_edge", ROOT / "bench" / "memory_edge.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, mod.rows(sorted(str(p) for p in (ROOT / "data" / "measurements").glob("*.jsonl")))


def test_rule_per_layout_and_on_columns_agree():
    m, c = load_model("qwen3-30b-a3b"), load_cluster("h100x32")
    L = enumerate_columns(m, c, default_workload(m, c), SpaceOptions(sequence_parallel=False))
    for stack in ("local", "te"):
        bad, counts = refused(m, L, stack)
        per_row = [refusal(m, L.config(i), stack) is not None for i in range(len(L))]
        assert bad.tolist() == per_row
        assert sum(counts.values()) == int(bad.sum())
    assert refused(m, L, "local")[0].any() and not refused(m, L, "te")[0].any()


def test_runner_refuses_with_the_shared_rule():
    moe = load_model("qwen3-30b-a3b")
    cfg = TrainConfig(tp=2, dp=2, mbs=1, gbs=8)
    assert MA.refusal_reason(moe, cfg) == refusal(moe, cfg, "local")
    assert "MoE with tp > 1" in MA.refusal_reason(moe, cfg)
    # the TE runner runs MoE with TP when sequence parallelism is on (megatron-core needs it)
    assert "sequence parallelism" in MA.refusal_reason(moe, cfg, stack="te")
    assert MA.refusal_reason(moe, cfg.replace(sequence_parallel=True), stack="te") is None
    cp = TrainConfig(cp=2, dp=2, mbs=1, gbs=8)
    assert "context parallelism" in MA.refusal_reason(load_model("llama3-8b"), cp)


def test_local_recommend_ranks_only_runnable_layouts():
    m = load_model("qwen3-30b-a3b")
    res = recommend(m, "h100x32", stack="local", top=10)
    assert res.left_out["count"] > 0 and "cannot run" in res.left_out["line"]
    for r in res.recommendations:
        assert MA.refusal_reason(m, r.config, 32) is None, r.config.key()
    te = recommend(m, "h100x32", stack="te", top=3)
    assert te.left_out["count"] == 0 and te.left_out["line"] == ""


def test_memory_fit_of_the_top_layout_and_the_margin():
    res = recommend("llama3-8b", "h100x4", stack="local", top=3)
    mf = res.recommendations[0].memory
    lo, hi = mf["interval_gib"]
    # the interval is the band on the allocator's part plus the memory outside the allocator once
    assert lo < hi <= mf["usable_gib"]
    b = MB.band("local", False)
    cfg = res.recommendations[0].config
    m = load_model("llama3-8b")
    k = mf["tightest_stage"]
    assert mf["outside_gib"] == pytest.approx(outside_allocator_gib(m, cfg, k))
    assert 7.0 < mf["outside_gib"] < 11.0
    p = res.recommendations[0].prediction
    rf = mf["band"]["reserved_free_gib"]
    assert not cfg.expandable_segments and not mf["band"]["expandable_segments"]  # the local stack's default
    periodic = MB.periodic_layout(m, cfg)
    assert mf["band"]["periodic_schedule"] == periodic
    assert (lo, hi) == pytest.approx(b.interval(p.memory_per_stage_gib[k], mf["outside_gib"], rf, False, periodic))
    # the band on the allocated part, the reserved-but-unallocated term with its own spread, outside once
    rlo, rhi = b.reserved_free_interval(rf, False, periodic)
    assert mf["band"]["reserved_free_interval_gib"] == pytest.approx([rlo, rhi])
    assert lo == pytest.approx((p.memory_per_stage_gib[k] - rf) * b.lo + b.add_lo_gib + rlo + mf["outside_gib"])
    assert mf["headroom_gib"] == pytest.approx(mf["usable_gib"] - hi)
    wider = recommend("llama3-8b", "h100x4", stack="local", top=3, memory_margin=0.15)
    assert wider.feasible < res.feasible
    assert all(r.memory["interval_gib"][1] <= 0.85 * 79.65 + 1e-9 for r in wider.recommendations)
    with pytest.raises(SpecError):
        recommend("llama3-8b", "h100x4", stack="local", memory_margin=float("nan"))


def test_default_margin_is_a_fixed_amount_on_every_gpu():
    """The default margin leaves Constants.memory_margin_gib free on any GPU (a share of the HBM would
    be 9 GiB on a GB200): the usable memory is the driver-reported capacity less 4 GiB."""
    assert DEFAULT.memory_margin_gib == 4.0
    for gpu, driver_mib in (("h100", 81559), ("b200", 183359), ("gb200", 189471), ("b300", 275040),
                            ("gb300", 284208)):
        gib = load_cluster(f"{gpu}x8").gpu.memory_gib
        assert gib == pytest.approx(driver_mib / 1024, abs=0.01), gpu  # nvidia-smi's total, as torch sees it
        assert MB.usable_gib(gib, MB.default_margin(DEFAULT.memory_margin_gib, gib)) == pytest.approx(gib - 4.0)
    res = recommend("llama3-70b", "gb200x64", precision="fp8", top=1)
    assert res.recommendations[0].memory["usable_gib"] == pytest.approx(185.03 - 4.0)


def test_te_band_is_fitted_on_te_runs_and_the_outside_term_matches_the_oom_messages():
    mod, rs = memory_edge_rows()
    for stack in ("local", "te"):
        for moe in (False, True):
            b = MB.band(stack, moe)
            assert b.stack == stack and f"{stack} stack" in b.source
            assert json.loads(MB.BAND_FILE.read_text())["stacks"][stack][b.kind]["n"] >= 18
            assert b.interval(50.0, 8.0, 2.0, False)[1] == pytest.approx(
                b.hi * 48.0 + b.add_hi_gib + max(b.rf_hi_scale * 2.0 + b.rf_hi_gib, 2.0) + 8.0)
            # expandable segments: a periodic layout, the spread of the periodic runs that had them on;
            # any other, the expandable-off line at its own expandable-off term (2.0 GiB here)
            ehi = b.rf_expandable_periodic[1]
            assert b.interval(50.0, 8.0, 0.44, True, True, 2.0)[1] == pytest.approx(
                b.hi * 49.56 + b.add_hi_gib + 0.44 + ehi + 8.0)
            assert b.interval(50.0, 8.0, 0.44, True, False, 2.0)[1] == pytest.approx(
                b.hi * 49.56 + b.add_hi_gib + max(b.rf_hi_scale * 2.0 + b.rf_hi_gib, 2.0) + 8.0)
            # session 27's stack runs (expandable segments on, DP only): up to 1.35 GiB over R; session
            # 32's H200 runs at micro-batch 16 (8-16 GiB blocks): up to 3.41
            assert ehi < 3.5 and ehi < b.rf_hi_scale * 2.0 + b.rf_hi_gib
            # a periodic schedule is bounded by the narrower of its own lines and the pooled ones
            R = np.linspace(0.5, 20.0, 40)
            assert np.all(b.reserved_free_interval(R, False, True)[1] <= b.reserved_free_interval(R, False, False)[1])
            assert np.all(b.reserved_free_interval(R, False, True)[1] >= R)
    # the physical term against what each OOM message says the process held outside torch's
    # allocator (in use less reserved): within 0.7 GiB of 7.7-9.5 GiB
    oom = [r for r in rs if r["outside"] is not None]
    assert len(oom) >= 20
    for r in oom:
        assert abs(r["outside"] - r["outside_pred"]) < 0.7, r["id"]


def test_megatron_communicators_solve_and_stage_records():
    """The two per-communicator constants are the least-squares solution of the megatron-core
    micro-benchmark (4 layouts x 4 ranks, 20 or 19 groups each), and the term is within 0.6 GiB of
    every stage record's outside_allocator_gib."""
    spec = importlib.util.spec_from_file_location("memory_edge", ROOT / "bench" / "memory_edge.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = mod.solve_communicators()
    assert s["single_gib"] == pytest.approx(DEFAULT.nccl_comm_single_gib, abs=0.005)
    assert s["comm_gib"] == pytest.approx(DEFAULT.nccl_comm_gib, abs=0.005)
    assert len(s["rows"]) == 16 and {r[2] + r[3] for r in s["rows"]} == {19, 20}
    assert all(abs(meas - fit) < 0.02 for *_, meas, fit in s["rows"])
    rs = mod.rows(sorted(str(p) for p in (ROOT / "data" / "measurements").glob("*.jsonl")))
    n = 0
    for r in rs:
        for ph in r["phases"]:
            k = r["cfg"]
            pred = float(outside_allocator_arrays(k.tp, k.pp, k.cp, k.dp, k.ep, k.etp, ph["stage"], r["moe"],
                                                  k.precision != "bf16"))
            assert abs(ph["outside_allocator_gib"] - pred) < 0.6, (r["id"], ph["stage"])
            n += 1
    assert n >= 19


def test_outside_term_per_stage():
    """The first stage holds both embedding groups, a middle one neither: with PP 4 the term is
    largest on stage 0 and smallest in the middle, and StageMemory carries it beside total_gib."""
    m = load_model("llama3-8b")
    cfg = TrainConfig(pp=4, dp=2, mbs=1, gbs=64, seq=4096)
    sm = stage_memory(m, cfg)
    out = [s.outside_gib for s in sm]
    assert out[0] > out[3] > out[1] == out[2]
    assert out[0] == pytest.approx(outside_allocator_gib(m, cfg))
    assert all(s.device_gib == pytest.approx(s.total_gib + s.outside_gib) for s in sm)


def test_the_band_keeps_the_form_with_the_smaller_held_out_error():
    """Affine (measured = b A + a: a few GiB that do not scale with the prediction) where it beats
    the ratio band leave-one-architecture-out, else the ratio; the reserved-but-unallocated part a line
    in the predicted R of the form (constant / ratio / affine) that holds the most runs leave-one-
    architecture-out; the interval holds every fitted run, and its reserved part each run's measured
    reserved-but-unallocated memory."""
    mod, rs = memory_edge_rows()
    fitted = mod.fit(rs)["stacks"]
    forms, rf_forms = set(), set()
    for stack, s in fitted.items():
        for kind in MB.CLASSES:
            k = s[kind]
            best = min(k["mape_loao_ratio_pct"], k["mape_loao_affine_pct"])
            assert k["mape_loao_pct"] == pytest.approx(best if k["form"] == "affine" else k["mape_loao_ratio_pct"])
            if k["form"] == "affine":
                assert k["lo"] == k["hi"] > 0 and k["add_lo_gib"] < k["add_hi_gib"]
            else:
                assert k["add_lo_gib"] == k["add_hi_gib"] == 0.0
            forms.add(k["form"])
            # the reserved-but-unallocated part: the form that holds the most held-out runs
            for part in (k, k["periodic"]):
                assert part["rf_form"] == mod.choose_reserved_form(part["rf_loao"])
                assert all(part["rf_loao"][part["rf_form"]]["covered"] >= v["covered"] for v in part["rf_loao"].values())
                rf_forms.add(part["rf_form"])
            assert (b_ := MB.band(stack, kind == "moe")).rf_periodic is None or k["periodic"]["used"]
            assert k["periodic"]["used"] == (k["periodic"]["architectures"] >= 2)
            assert k["periodic"]["n"] == sum(1 for r in rs if r["stack"] == stack and r["status"] == "ok" and not r["x"]
                                             and r["periodic"] and bool(r["moe"]) == (kind == "moe"))
            b = MB.band(stack, kind == "moe")
            assert (b.rf_hi_scale, b.rf_hi_gib) == pytest.approx((k["rf_hi_scale"], k["rf_hi_gib"]))
            if k["rf_form"] == "ratio":  # a layout freeing small blocks is charged less than one freeing large
                small, large = (float(b.reserved_free_interval(v, False)[1]) - v for v in (2.0, 8.0))
                assert b.rf_hi_gib == b.rf_lo_gib == 0.0 and large > small > 0.0
            for r in rs:
                if r["stack"] == stack and r["status"] == "ok" and bool(r["moe"]) == (kind == "moe"):
                    cfg = r["cfg"]
                    routing = r["moe"] and (cfg.ep > 1 or not cfg.moe_grouped_gemm or cfg.precision != "bf16") \
                        and not cfg.moe_pad_to_capacity
                    assert r["periodic"] == (cfg.pp == 1 and cfg.cp == 1 and not routing), r["id"]
                    lo, hi = b.interval(r["predicted"], r["outside_pred"], r["rf"], r["x"], r["periodic"], r["rf_off"])
                    # the interval holds the allocator's measured peak plus the outside memory
                    assert lo - 1e-6 <= r["measured"] + r["outside_pred"] <= hi + 1e-6, r["id"]
                    rlo, rhi = b.reserved_free_interval(r["rf"], r["x"], r["periodic"], r["rf_off"])
                    assert rlo - 1e-6 <= r["measured"] - r["measured_alloc"] <= rhi + 1e-6, r["id"]
    # which form wins is the data's (today: the ratio band for the allocated part of every class since
    # the final norm's tensors joined the loss stage's; reserved free: ratio on the local stack,
    # constant on te)
    assert forms <= {"ratio", "affine"} and "ratio" in rf_forms and rf_forms <= {"constant", "ratio", "affine"}


def test_fits_on_arrays_is_fits_on_floats():
    b = MB.band("local", True)
    x = np.linspace(40, 80, 41)
    out = np.linspace(7, 10, 41)
    rf = np.linspace(0.5, 6, 41)
    xs = np.arange(41) % 2 == 0
    per = np.arange(41) % 3 == 0
    b = MB.band("te", False)  # its periodic lines differ from the pooled ones
    assert MB.fits(x, out, rf, xs, b, 79.65, 0.05, per).tolist() == [
        bool(MB.fits(float(v), float(o), float(f), bool(e), b, 79.65, 0.05, bool(p)))
        for v, o, f, e, p in zip(x, out, rf, xs, per)]


def test_no_oom_record_is_predicted_to_fit():
    mod, rs = memory_edge_rows()
    oom = [r for r in rs if r["status"] == "oom"]
    assert len(oom) >= 8
    for r in oom:
        assert not MB.fits(r["predicted"], r["outside_pred"], r["rf"], r["x"], MB.band(r["stack"], r["moe"]),
                           r["gpu_gib"], 0.05, r["periodic"], r["rf_off"]), r["id"]
    # the shipped band is what the command makes of the data
    shipped, fitted = json.loads(MB.BAND_FILE.read_text())["stacks"], mod.fit(rs)["stacks"]
    for stack in ("local", "te"):
        for kind in MB.CLASSES:
            for part in (lambda d: d, lambda d: d["periodic"]):
                got, want = part(shipped[stack][kind]), part(fitted[stack][kind])
                assert [got[k] for k in ("rf_hi_scale", "rf_hi_gib", "rf_lo_scale", "rf_lo_gib")] == pytest.approx(
                    [want[k] for k in ("rf_hi_scale", "rf_hi_gib", "rf_lo_scale", "rf_lo_gib")])
    assert shipped["local"]["moe"]["hi"] == pytest.approx(fitted["local"]["moe"]["hi"])


def test_cli_margin_and_left_out_line():
    run = [sys.executable, "-m", "advisor", "recommend", "--model", "qwen3-30b-a3b", "--cluster", "h100x32",
           "--stack", "local", "--top", "2"]
    r = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "left out" in r.stdout and "#1 memory:" in r.stdout and "headroom" in r.stdout
    bad = subprocess.run(run + ["--memory-margin", "-0.1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --memory-margin")


def test_tune_megatron_never_samples_a_refused_layout(tmp_path):
    from advisor.study import TuneSettings, make_plan

    s = TuneSettings(model="qwen3-30b-a3b", cluster="h100x4", layers=2, runner="megatron", trials=4,
                     storage=str(tmp_path / "s.journal"), dataset=str(tmp_path / "s.jsonl"), calibration=None)
    plan = make_plan(s)
    assert "MoE with TP > 1" in plan.left_out
    assert plan.layouts and all(refusal(plan.model, c, "local") is None for c in plan.layouts)
    assert plan.to_dict()["space"]["left_out"] == plan.left_out


def test_each_stage_is_bounded_with_its_own_outside_term():
    """recommend's screen (models.memory_band.band_upper_many) and memory_fit take, per pipeline stage, the
    band on that stage's allocator peak plus that stage's own memory outside the allocator: a middle
    stage holds fewer communicators than the first, so pairing the fullest stage with the first
    stage's outside term over-states the bound when the fullest stage is not the first."""
    from advisor.models.memory_band import band_upper_many
    from advisor.models.vectorized import Layouts

    m = load_model("llama3-70b")
    cfgs = [TrainConfig(tp=4, pp=8, dp=2, vp=5, mbs=1, gbs=128, seq=8192, precision="fp8"),
            TrainConfig(tp=8, pp=1, dp=16, mbs=1, gbs=128, seq=8192),
            TrainConfig(tp=8, pp=1, dp=16, mbs=4, gbs=128, seq=8192)]
    b = MB.band("te", False)
    peak, upper, tight, outside = band_upper_many(m, Layouts.of(m, cfgs), b, DEFAULT)
    for i, cfg in enumerate(cfgs):
        sms = stage_memory(m, cfg, DEFAULT)
        periodic = MB.periodic_layout(m, cfg)
        assert periodic == (cfg.pp == 1)
        per = [b.interval(sm.total_gib, sm.outside_gib, sm.reserved_free_gib, cfg.expandable_segments, periodic)[1]
               for sm in sms]
        pooled = [b.interval(sm.total_gib, sm.outside_gib, sm.reserved_free_gib, cfg.expandable_segments)[1]
                  for sm in sms]
        assert max(per) <= max(pooled) + 1e-9
        if i == 2:  # the periodic line is the narrower one at this R (2.4 GiB)
            assert max(per) < max(pooled) - 1.0
        assert upper[i] == pytest.approx(max(per)) and peak[i] == pytest.approx(max(sm.total_gib for sm in sms))
        k = int(np.argmax(per))
        assert (tight[i], outside[i]) == pytest.approx((sms[k].total_gib, sms[k].outside_gib))
        mf = MB.memory_fit(peak[i], [sm.total_gib for sm in sms], [sm.outside_gib for sm in sms],
                           [sm.reserved_free_gib for sm in sms], cfg.expandable_segments, b, 80.0, 0.05, periodic)
        assert mf["interval_gib"][1] == pytest.approx(max(per)) and mf["tightest_stage"] == k
    outs = [sm.outside_gib for sm in stage_memory(m, cfgs[0], DEFAULT)]
    assert outs[0] > min(outs)  # the first stage holds more communicators than a middle one


def test_reserved_envelope_forms():
    """The affine envelope lies over every point with a slope >= 0 and is no looser than the constant
    one; the ratio form has no intercept."""
    mod, _ = memory_edge_rows()
    R = np.array([1.0, 2.0, 4.0, 8.0])
    M = np.array([1.5, 2.0, 6.0, 9.0])
    e = mod.reserved_envelope(R, M, "affine")
    assert np.all(M <= e["rf_hi_scale"] * R + e["rf_hi_gib"] + 1e-9) and e["rf_hi_scale"] >= 0
    assert np.all(M >= e["rf_lo_scale"] * R + e["rf_lo_gib"] - 1e-9) and e["rf_lo_scale"] >= 0
    c = mod.reserved_envelope(R, M, "constant")
    assert (e["rf_hi_scale"] * R + e["rf_hi_gib"]).sum() <= (R + c["rf_hi_gib"]).sum() + 1e-9
    r = mod.reserved_envelope(R, M, "ratio")
    assert r["rf_hi_gib"] == r["rf_lo_gib"] == 0.0 and r["rf_hi_scale"] == pytest.approx(1.5)


def test_expandable_segments_spread_follows_the_schedule():
    """With expandable segments on, a periodic layout strands little (R + the periodic runs' range,
    under 3.5 GiB over R: 0.2 until session 27's DP runs at 41-69 GiB, 1.35 with them, 3.4 with session 32's H200 runs at
    micro-batch 16), a pipeline-interleaved or CP layout up to the expandable-off line
    at its own R_off: every run with them on lies inside its interval, and the pooled form (every
    layout R + the largest residual, 6.2 GiB for GPT-3 PP2 VP16's) fails the periodic bound."""
    mod, rs = memory_edge_rows()
    on = [r for r in rs if r["status"] == "ok" and r["x"]]
    assert len(on) >= 9 and {r["periodic"] for r in on} == {True, False}
    for r in on:
        b = MB.band(r["stack"], r["moe"])
        lo, hi = b.reserved_free_interval(r["rf"], True, r["periodic"], r["rf_off"])
        assert lo - 1e-9 <= r["measured"] - r["measured_alloc"] <= hi + 1e-9, r["id"]
        pooled = r["rf"] + b.rf_hi_expandable_gib
        if r["periodic"]:
            assert hi - r["rf"] < 3.5 and pooled - r["rf"] > 5.0, r["id"]  # the pooled form: wider still
        else:  # never under what a periodic layout gets, and the expandable-off line at R_off
            assert hi >= r["rf"] + b.rf_expandable_periodic[1]
            assert hi == pytest.approx(max(b.reserved_free_interval(r["rf_off"], False, False)[1], r["rf"]))
    # the shipped expandable block is what the command makes of the data
    got = json.loads(MB.BAND_FILE.read_text())["stacks"]["te"]["expandable"]["periodic"]
    want = mod.fit(rs)["stacks"]["te"]["expandable"]["periodic"]
    assert [got["rf_lo_gib"], got["rf_hi_gib"], got["used"]] == pytest.approx([want["rf_lo_gib"], want["rf_hi_gib"], True])
    # one stage, through StageMemory: the expandable-off term rides along and bounds a CP layout
    m = load_model("llama3-8b")
    cfg = TrainConfig(tp=1, pp=1, dp=2, cp=2, mbs=8, gbs=32, seq=4096, expandable_segments=True)
    sm = max(stage_memory(m, cfg, DEFAULT), key=lambda s: s.total_gib)
    assert sm.reserved_free_off_gib > sm.reserved_free_gib
    off = max(stage_memory(m, cfg.replace(expandable_segments=False), DEFAULT), key=lambda s: s.total_gib)
    assert sm.reserved_free_off_gib == pytest.approx(off.reserved_free_gib)


def test_learned_sinks_with_cp_are_refused_on_every_stack():
    """Transformer Engine runs a learned-sink softmax under CP only over cp_comm_type a2a, which the
    advisor neither prints (p2p / all_gather) nor prices: every stack leaves gpt-oss with CP > 1 out,
    per layout, on columns and in the runner, and keeps CP 1 and models without sinks."""
    from advisor.search_spaces.runnable import left_out_line

    oss = load_model("gpt-oss-120b").with_layers(4)
    cp2 = TrainConfig(cp=2, dp=4, ep=8, mbs=1, gbs=32, seq=8192)
    assert "cp_comm_type a2a" in refusal(oss, cp2, "te")
    assert refusal(oss, cp2, "local") is not None  # the local stack's own CP rule comes first
    assert refusal(oss, cp2.replace(cp=1, dp=8), "te") is None
    assert refusal(load_model("llama3-8b"), TrainConfig(cp=2, dp=4, gbs=32), "te") is None
    assert "cp_comm_type a2a" in MA.refusal_reason(oss, cp2, stack="te")
    c = load_cluster("h100x64")
    L = enumerate_columns(oss, c, default_workload(oss, c), SpaceOptions())
    bad, counts = refused(oss, L, "te")
    cps = np.array([L.config(i).cp for i in range(len(L))])
    assert (cps > 1).any() and bad.tolist() == (cps > 1).tolist() and counts == {"sinks_cp": int((cps > 1).sum())}
    assert left_out_line("te", counts).startswith(f"left out {counts['sinks_cp']:,} layout(s) the te stack cannot run")
    assert "the local stack's runner cannot run" in left_out_line("local", {"cp": 3, "sinks_cp": 1})

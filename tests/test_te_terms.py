"""The te profile's terms checked on our Transformer Engine runs (issue #22 item 3): the runner's
settings as layout fields, SP / CP / TP-overlap communication, the NCCL fit, the refit's
leave-one-architecture-out numbers and the benches that print them."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.models import profile_fit as F
from advisor.models.calibrate import resolve_calibration
from advisor.models.constants import DEFAULT
from advisor.models.dataset import load
from advisor.models.profiles import apply_layout_defaults
from advisor.models.step_time import collective_time, group_link, stage_times
from advisor.runners import megatron_args as MA
from support import ROOT, load_bench

TE_RUNS = ROOT / "data/measurements/h100x4-te.jsonl"


@pytest.fixture(scope="module")
def l8b():
    return dataclasses.replace(load_model("llama3-8b"), num_layers=8), load_cluster("h100x4")


def _st(model, cluster, c=DEFAULT, **kw):
    return stage_times(model, cluster, TrainConfig(**{"gbs": 32, "seq": 4096, **kw}), c)[0]


def test_unfused_gradient_accumulation_costs_its_bytes_per_parameter_and_the_te_stack_fuses(l8b):
    model, cluster = l8b
    lay = dict(dp=4, mbs=1)
    fused = _st(model, cluster, gradient_accumulation_fusion=True, **lay).memory_bound_s
    d = {b: _st(model, cluster, DEFAULT.replace(grad_accum_bytes_per_param=b), **lay).memory_bound_s - fused
         for b in (5.0, 10.0)}
    assert d[5.0] > 0 and math.isclose(d[10.0], 2 * d[5.0], rel_tol=1e-9)  # linear in the bytes
    fused10 = _st(model, cluster, DEFAULT.replace(grad_accum_bytes_per_param=10.0),
                  gradient_accumulation_fusion=True, **lay).memory_bound_s
    assert math.isclose(fused10, fused, rel_tol=1e-12)  # fused: no separate add
    cfg = apply_layout_defaults(TrainConfig(tp=2, dp=2, sequence_parallel=True), "te")
    assert cfg.gradient_accumulation_fusion and cfg.tp_comm_overlap
    assert not apply_layout_defaults(TrainConfig(), "local").gradient_accumulation_fusion
    why = MA.refusal_reason(model, TrainConfig(dp=4, gbs=32, gradient_accumulation_fusion=True), stack="te")
    assert why and "apex" in why
    with pytest.raises(SpecError):
        TrainConfig(gradient_accumulation_fusion="yes")


def test_records_are_predicted_with_the_settings_they_ran():
    ds = load([str(TE_RUNS)])
    recs = {r.id: r for r in ds.records}
    assert recs["te-l8b-fp8cs-22"].cfg.fp8_recipe == "tensorwise"  # written beside the config
    assert recs["te-l8b-fp8-17"].cfg.fp8_recipe == "delayed"
    assert not any(r.cfg.gradient_accumulation_fusion or r.cfg.tp_comm_overlap for r in ds.records)


def test_sequence_parallel_regather_and_fp8_all_gather(l8b):
    model, cluster = l8b
    lay = dict(tp=2, dp=2, mbs=2, sequence_parallel=True)
    link = group_link(cluster, 1, 2, DEFAULT)
    T, h = 4096 * 2, model.hidden_size
    ag = collective_time("all_gather", T * h * 2, 2, link.bw_gbs, link.latency)
    hidden = _st(model, cluster, DEFAULT.replace(sp_regather_exposed=0.0), **lay).tp_comm_s
    shown = _st(model, cluster, DEFAULT.replace(sp_regather_exposed=1.0), **lay).tp_comm_s
    per_layer = (shown - hidden) / 8  # 8 layers; the step doubles the forward-equivalent entry
    assert math.isclose(per_layer, 2 * ag, rel_tol=1e-9)
    bf16 = _st(model, cluster, **lay).tp_comm_s
    fp8 = _st(model, cluster, precision="fp8", **lay).tp_comm_s
    ag8 = collective_time("all_gather", T * h * 1, 2, link.bw_gbs, link.latency)
    # the inputs' forward gather and backward re-gather travel in FP8 (1 B): 2 (1 + exposed) per layer
    assert math.isclose((bf16 - fp8) / 8, 2 * (1 + DEFAULT.sp_regather_exposed) * (ag - ag8), rel_tol=1e-9)


def test_context_parallel_ring_chunks_merges_and_exposed_transfer(l8b):
    model, cluster = l8b
    c = DEFAULT
    dp = _st(model, cluster, dp=4, mbs=1)
    cp = _st(model, cluster, dp=2, cp=2, mbs=2)  # the same 4096 tokens per GPU
    sat = lambda n: n / (n + c.attention_half_tokens)  # noqa: E731
    assert math.isclose(cp.attention_s / dp.attention_s, sat(4096) / sat(2048), rel_tol=1e-9)
    q = model.num_attention_heads * model.head_dim
    merges = 2 * c.cp_step_passes * 4096 * q * 4.0 / (cluster.gpu.hbm_bandwidth_gbs * 1e9 * c.hbm_efficiency)
    assert math.isclose(cp.memory_bound_s - dp.memory_bound_s, 8 * merges, rel_tol=1e-6)
    slow = _st(model, cluster, c.replace(nvlink_efficiency=0.05), dp=2, cp=2, mbs=2)
    assert slow.cp_comm_s > 0 and cp.cp_comm_s < slow.cp_comm_s  # the transfer shows once it outlasts a step


def test_tp_overlap_hides_at_most_all_but_the_last_reduce_scatter_chunk(l8b):
    model, _ = l8b
    cluster = load_cluster("h100x8")
    c = DEFAULT.replace(tp_overlap_fraction=1.0)
    for tp in (2, 4):  # stage 0 of two: its layers' TP communication only (no loss all-reduce)
        lay = dict(tp=tp, pp=2, dp=4 // tp, mbs=1, sequence_parallel=True)
        off = _st(model, cluster, c, **lay).tp_comm_s
        on = _st(model, cluster, c, tp_comm_overlap=True, **lay).tp_comm_s
        assert math.isclose(on / off, 0.5 / tp, rel_tol=1e-9)


def test_nccl_fit_and_isolating_runs_bench(capsys):
    bench = load_bench("te_terms")
    fits = bench.nccl_fits(bench.nccl_rows(bench.NCCL))
    ag2, ag4 = fits[("all_gather", 2)], fits[("all_gather", 4)]
    assert 230 < ag2["bus_gbs"] < 280 and 290 < ag4["bus_gbs"] < 335  # NCCL busbw 260 / 312 at 1 GiB
    assert 40e-6 < ag2["alpha_s"] < 100e-6
    assert all(abs(e) < 0.25 for (op, n), f in fits.items() if op in ("all_gather", "reduce_scatter")
               for b, e in f["err"] if b >= 1 << 24)
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "half MiB" in out and "SP on vs off" in out and "mean |error| of the ratios" in out


def test_refit_is_physical_and_holds_out_of_sample_on_our_runs():
    cal = resolve_calibration("te")
    fitted = F.on_vm(cal).constants  # the host issue costs as fitted on our runs (shipped at 0)
    for name, (lo, hi) in F.TE_FIT.items():
        assert lo <= getattr(fitted, name) <= hi, name
    assert cal.trained_on["n_te_runs"] >= 60
    loao = cal.cv["leave_one_architecture_out"]
    for arch in ("llama3-8b", "llama3-70b"):
        assert loao["te_runs_by_group"][arch]["mape"] < 5.0, arch
    assert loao["overall"]["mape"] < 8.0 and cal.cv["leave_one_source_out"]["te_runs"]["mape"] < 8.0
    fitp = load_bench("fit_profiles")
    rows = fitp.te_run_rows()
    assert math.isclose(sum(x.weight for x in rows), len({(x.run.model_key, x.cfg.key()) for x in rows}))
    # nemotron4-15b's runs (session 23) are in the data; the shipped profile was fitted before them
    assert {F.architecture(x) for x in rows} == {"llama3-8b", "llama3-70b", "gpt3", "nemotron"}


def test_recommend_check_prints_each_measured_group(capsys):
    bench = load_bench("te_recommend_check")
    assert bench.main(["--top", "60"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b[8L]" in out and "runner" in out and "group(s) below 97%" in out
    line = next(x for x in out.splitlines() if x.startswith("llama3-8b[8L]") and " 32 bf16" in x and "runner" in x)
    assert "100.0%" in line


def test_te_check_json_free_of_surprises():
    # the shipped profile's json carries the leave-one-architecture-out block readably
    d = json.loads(Path(ROOT / "models/data/te_calibration.json").read_text())
    assert "leave_one_architecture_out" in d["cv"] and d["constants"]["cp_step_passes"] > 0


def test_te_check_pairs_name_their_machines():
    # bench/te_check.py's FP8 / BF16 pairs say whether both runs had the same four GPUs (NVML
    # UUIDs): llama3-8b DP4 mbs2 ran both on session 22's first machine; the CP2 DP2 mbs4 pair's
    # FP8 run came from a later call on other GPUs
    bench = load_bench("te_check")
    tel = bench.telemetry([TE_RUNS])
    assert tel["te-l8b-dp-01"]["gpus"] == tel["te-l8b-fp8-16-call2"]["gpus"]
    assert tel["te-l8b-cp-04"]["gpus"] != tel["te-l8b-fp8-19"]["gpus"]
    assert 1400 < tel["te-l8b-dp-01"]["clock"] < 1550 and 99.0 < tel["te-l8b-dp-01"]["util"] <= 100.0
    row = {"id": "te-l8b-dp-01", "clock_pred": 1590.0}
    assert bench.pair_detail(row, {"id": "te-l8b-fp8-16-call2", "clock_pred": 1693.0}, tel).startswith("same GPUs")
    assert bench.pair_detail(row, {"id": "te-l8b-fp8-19", "clock_pred": 1700.0}, tel).startswith("other GPUs")
    assert bench.pair_detail(row, {"id": "no-such-run", "clock_pred": 1.0}, tel) == "telemetry missing"

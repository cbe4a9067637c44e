"""Stage heat (against advisor.models), the thermal throttle model, the assignment (optimal against
brute force on small instances) and the plan's decision rule."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.models.memory import stage_memory
from advisor.models.step_time import stage_times, step_time
from advisor.placement import (LayerCosts, Planner, ThrottleCurve, load_profile, node_profiles, plan,
                               profile_from_dict, slot_effect, stage_heat)
from advisor.placement.assign import Geometry
from advisor.search_spaces.layout import IllegalLayout
from support import load_bench

ROOT = Path(__file__).resolve().parents[1]
BURN_PROFILE = ROOT / "data" / "profiles" / "h200x4-burn.json"


def profile(slots, node="n"):
    return profile_from_dict({"node": node, "gpus": [
        {"index": i, "uuid": f"GPU-t-{node}-{i}", "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
         "ambient_c": float(a), "c_per_w": float(c)} for i, (a, c) in enumerate(slots)]})


def random_slots(rng, n, ordered=False):
    amb = rng.uniform(25, 50, n)
    c = rng.uniform(0.03, 0.065, n)
    if ordered:  # every slot hotter than the previous at every power (then sorted TP groups are optimal)
        amb, c = np.sort(amb), np.sort(c)
        perm = rng.permutation(n)
        amb, c = amb[perm], c[perm]
    return list(zip(amb, c))


# ---------------------------------------------------------------------------------- stage heat
@pytest.mark.parametrize("model,cluster,cfg", [
    ("llama3-70b", "h200x16", TrainConfig(tp=4, pp=4, dp=1, gbs=128, seq=8192, sequence_parallel=True)),
    ("mixtral-8x7b", "h100x16", TrainConfig(tp=2, pp=4, dp=2, ep=2, vp=2, gbs=64, seq=4096)),
    ("deepseek-v3", "h200x256", TrainConfig(tp=2, pp=8, dp=16, ep=8, gbs=512, seq=4096, pp_first_layers=5,
                                            pp_last_layers=8, recompute="full")),
])
def test_layer_costs_reproduce_the_models_exactly(model, cluster, cfg):
    m, c = load_model(model), load_cluster(cluster)
    lc = LayerCosts(m, c, cfg)
    counts = lc.default_counts()
    mine, ref = lc.stage_times(counts), stage_times(m, c, cfg)
    for a, b in zip(mine, ref):
        assert a.total_s == pytest.approx(b.total_s, rel=1e-12)
        assert a.forward_s == pytest.approx(b.forward_s, rel=1e-12)
        assert a.gemm_utilization == pytest.approx(b.gemm_utilization, abs=0.01)
    assert lc.step(mine) == pytest.approx(step_time(m, c, cfg).step_time_s, rel=1e-12)
    assert lc.memory_gib(counts) == pytest.approx([s.total_gib for s in stage_memory(m, cfg)], rel=1e-12)


def test_stage_heat_ranks_stages():
    m, c = load_model("llama3-8b"), load_cluster("h200x4")
    cfg = TrainConfig(tp=1, pp=4, dp=1, gbs=64, seq=8192)
    heat = stage_heat(m, c, cfg)
    assert [h.stage for h in heat] == [0, 1, 2, 3] and [h.layers for h in heat] == [8] * 4
    assert max(heat, key=lambda h: h.demand_mean_w).stage == 3        # output layer + loss
    assert max(heat, key=lambda h: h.time_per_microbatch_s).stage == 3
    assert max(heat, key=lambda h: h.memory_gib).stage == 0           # embedding + pp in-flight microbatches
    for h in heat:
        assert 0 < h.busy_fraction <= 1 and h.mean_power_w <= c.power_cap_w + 1e-9 <= h.peak_power_w
    lighter = stage_heat(m, c, cfg, layer_counts=[8, 9, 8, 7])
    assert lighter[3].demand_mean_w < heat[3].demand_mean_w
    assert lighter[1].time_per_microbatch_s > heat[1].time_per_microbatch_s
    with pytest.raises(IllegalLayout):
        LayerCosts(m, c, cfg).stage_times([8, 8, 8])


# ------------------------------------------------------------------------------- throttle model
def test_slot_effect_leakage_and_thermal_limit():
    m, c = load_model("llama3-70b"), load_cluster("h200x4")
    cfg = TrainConfig(tp=1, pp=4, dp=1, gbs=64, seq=4096, recompute="full")
    h = stage_heat(m, c, cfg)[3]  # demands more than the 700 W cap
    cool, hot = profile([(33.5, 0.041), (34.4, 0.050)]).gpus  # measured slots 2 and 3
    e_cool, e_hot = slot_effect(h, cool, c), slot_effect(h, hot, c)
    # the limiter holds the stage's compute at the cap; its step mean is lower (fill and drain waits)
    assert e_cool.limit == e_hot.limit == "power cap" and 600 < min(e_hot.power_w, e_cool.power_w)
    assert max(e_hot.power_w, e_cool.power_w) <= 700
    assert e_hot.temp_c - e_cool.temp_c == pytest.approx(0.9 + 0.050 * e_hot.power_w - 0.041 * e_cool.power_w)
    ratio = e_hot.slowdown / e_cool.slowdown  # FACTS.md: 2.1% fewer TFLOP/s, 7 °C hotter
    assert ratio == pytest.approx(1 + 0.003 * (e_hot.temp_c - e_cool.temp_c), rel=0.01)
    no_leak = ThrottleCurve(leak_per_c=0.0)
    assert slot_effect(h, hot, c, no_leak).slowdown == pytest.approx(slot_effect(h, cool, c, no_leak).slowdown)
    scorching = profile([(55.0, 0.06)]).gpus[0]  # 97 °C at 700 W: held at 87 °C
    e = slot_effect(h, scorching, c)
    assert e.limit == "thermal" and e.temp_c == pytest.approx(87.0, abs=0.1) and e.slowdown > e_hot.slowdown
    heats = stage_heat(m, c, TrainConfig(tp=1, pp=4, dp=1, gbs=64, seq=4096, recompute="full"),
                       layer_counts=[23, 23, 23, 11])
    light, heavy = heats[3], heats[0]
    # the light stage's compute bursts (~0.5 s) outlast the limiter's ~30 ms window: they are held
    # at the cap like the heavy stages' (its mean power is far below it), but it waits for the
    # heavy stages anyway, so its stretched time stays off the critical path
    e_light, e_heavy = slot_effect(light, hot, c), slot_effect(heavy, hot, c)
    assert e_light.limit == "power cap" and e_light.power_w < 500
    assert light.compute_s * e_light.slowdown + light.comm_s < heavy.compute_s * e_heavy.slowdown + heavy.comm_s


def test_geometry_follows_megatron_rank_order():
    c = load_cluster("h200x16")
    g = Geometry.of(TrainConfig(tp=2, pp=4, dp=2), c)
    assert [g.stage_of(r) for r in range(16)] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert g.units(0) == [0, 0, 1, 1] and g.units(1) == [2, 2, 3, 3]
    with pytest.raises(SpecError, match="does not divide"):
        Geometry.of(TrainConfig(tp=4, pp=1, dp=3), load_cluster("h200x6x2"))


# ------------------------------------------------------------------------------- assignment
def brute_force(a) -> float:
    geo = a.geo
    perms = list(itertools.permutations(range(geo.gpus_per_node)))
    return min(a.evaluate([list(p) for p in combo]).step_s for combo in itertools.product(perms, repeat=geo.num_nodes))


INSTANCES = [  # (model, cluster, cfg, ordered slots)
    ("llama3-8b", "h200x4", TrainConfig(tp=1, pp=4, dp=1, gbs=64, seq=8192), False),
    ("llama3-8b", "h200x4x2", TrainConfig(tp=1, pp=8, dp=1, gbs=64, seq=8192), False),
    ("llama3-8b", "h200x4", TrainConfig(tp=2, pp=2, dp=1, gbs=64, seq=8192, sequence_parallel=True), True),
    ("llama3-8b", "h200x4x2", TrainConfig(tp=2, pp=4, dp=1, gbs=64, seq=8192, sequence_parallel=True), True),
    ("llama3-70b", "h200x4", TrainConfig(tp=1, pp=4, dp=1, gbs=64, seq=4096, recompute="full"), False),
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("model,cluster,cfg,ordered", INSTANCES)
def test_assignment_is_optimal_against_brute_force(model, cluster, cfg, ordered, seed):
    m, c = load_model(model), load_cluster(cluster)
    rng = np.random.default_rng(seed)
    profs = [profile(random_slots(rng, c.gpus_per_node, ordered), f"n{i}") for i in range(c.num_nodes)]
    a = Planner(m, c, cfg, profs).assigner(LayerCosts(m, c, cfg).default_counts())
    best = a.optimize()
    assert best.step_s <= a.identity().step_s + 1e-12
    assert best.step_s == pytest.approx(brute_force(a), rel=2e-5)
    for row in best.gpus:  # a permutation of the node's GPUs
        assert sorted(row) == list(range(c.gpus_per_node))


def test_brute_force_8_gpus_tp1():
    m, c = load_model("llama3-8b"), load_cluster("h200x8")
    cfg = TrainConfig(tp=1, pp=8, dp=1, gbs=64, seq=8192)
    prof = profile(random_slots(np.random.default_rng(7), 8))
    a = Planner(m, c, cfg, [prof]).assigner([4] * 8)
    assert a.optimize().step_s == pytest.approx(brute_force(a), rel=2e-5)


# ------------------------------------------------------------------------------- decision rule
LLAMA70_TP1 = ("llama3-70b", "h200x4", TrainConfig(tp=1, pp=4, dp=1, gbs=64, seq=4096, recompute="full"))


def test_identity_when_all_slots_are_equal():
    p = plan(*LLAMA70_TP1, [profile([(35.0, 0.045)] * 4)], uneven=True)
    assert not p.applied and "same thermal profile" in p.reason
    assert p.gpus == [[0, 1, 2, 3]] and p.predicted_gain_pct == pytest.approx(0.0, abs=1e-9)
    assert p.layer_counts == [20] * 4
    j = p.to_json()
    assert j["nodes"] == [{"node": "n", "cuda_visible_devices": "0,1,2,3"}] and j["slurm_gpu_bind"] == "map_gpu:0,1,2,3"


def test_identity_below_margin_says_why():
    slots = [(35.0, 0.045), (35.0, 0.0452), (35.1, 0.045), (35.0, 0.0451)]
    p = plan(*LLAMA70_TP1, [profile(slots)])
    assert not p.applied and "below the 0.5% margin" in p.reason and p.gpus == [[0, 1, 2, 3]]
    assert 0 <= p.predicted_gain_pct < 0.5
    p0 = plan(*LLAMA70_TP1, [profile(slots)], margin_pct=0.0)
    assert p0.applied or p0.predicted_gain_pct == 0.0


def test_heavy_stage_goes_to_a_cool_slot_on_the_measured_h200_box():
    p = plan(*LLAMA70_TP1, [load_profile(BURN_PROFILE)])
    assert p.applied and p.predicted_gain_pct > 1.0
    stage3 = [s for s in p.to_json()["stages"] if s["stage"] == 3][0]
    assert stage3["gpus"][0] in (1, 2)  # the measured cool slots
    assert p.step_planned_s < p.step_identity_s


def test_slot_speeds_take_the_measured_silicon_speed_without_its_temperature():
    from advisor.placement.assign import slot_speeds

    c = load_cluster("h200x4")
    same = [(35.0, 0.045)] * 4
    prof = profile(same)
    assert slot_speeds(prof.cuda_order(), c) == [1.0] * 4  # nothing measured: no silicon term
    for g, v in zip(prof.gpus, (1.0, 0.99, 0.99, 0.98)):
        g.extra.update(speed_at_cap=v, load_power_w=700.0)
    sp = slot_speeds(prof.cuda_order(), c)
    assert np.mean(sp) == pytest.approx(1.0) and sp[0] / sp[3] == pytest.approx(1.0 / 0.98)
    # the same measured speed on a slot 10 °C hotter: faster silicon, slowed by its heat
    hot = profile([(35.0, 0.045), (45.0, 0.045)])
    for g in hot.gpus:
        g.extra.update(speed_at_cap=1.0, load_power_w=700.0)
    cool_sp, hot_sp = slot_speeds(hot.cuda_order(), c)
    assert hot_sp > cool_sp
    assert hot_sp / cool_sp == pytest.approx(1 + ThrottleCurve().leak_per_c * 10 / (1 + ThrottleCurve().leak_per_c
                                             * (35 + 0.045 * 700 - ThrottleCurve().ref_temp_c)), rel=1e-3)


def test_planner_predicts_the_measured_placed_vs_identity_gain():
    # data/placement: llama3-8b TP1 PP4 on 4 x H200, profiled by `advisor thermal-profile`, then
    # measured in identity order and placed by the plan (`bash bench/device_session.sh placement`).
    import json

    d = ROOT / "data" / "placement"
    runs = [json.loads(line) for line in (d / "h200x4-placement-runs.jsonl").read_text().splitlines()]
    identity, placed = (r["steps"]["median_s"] for r in runs)
    measured = (identity / placed - 1) * 100
    assert measured == pytest.approx(0.86, abs=0.01)
    cfg = TrainConfig(tp=1, pp=4, dp=1, mbs=1, gbs=32, seq=4096)
    p = plan("llama3-8b", "h200x4", cfg, [load_profile(d / "h200x4-profile.json")])
    stage_gpu = {s["stage"]: s["gpus"][0] for s in p.to_json()["stages"]}
    assert p.applied and stage_gpu[3] == 0  # the last (output-layer) stage on the fastest slot, as run
    # Temperature alone predicted +0.22% (declined at the 0.5% margin); with each slot's measured
    # speed under the cap the prediction is within 0.3 points of the measurement.
    assert abs(p.predicted_gain_pct - measured) < 0.3


def test_paper_cases_planner_gains_on_llama_and_declines_gpt3_split():
    sim = load_bench("thermal_sim")
    hgx = sim.hgx8()
    label, model, cluster, cfg, _ = sim.CASES[0]  # Llama3-70B PP4
    p = plan(model, cluster, cfg, [hgx], uneven=True)
    # with DVFS (a thermally held GPU loses ~half its clock drop in time) placing the heavy stages
    # on the cool front row already gives the paper's +4%; its 21/19 split adds nothing more
    assert p.applied and p.predicted_gain_pct > 4.0
    pl = Planner(load_model(model), load_cluster(cluster), cfg, node_profiles([hgx], 4))
    paper = pl.assigner([21, 19, 21, 19]).identity()
    assert pl.assigner(p.layer_counts).optimize().step_s <= paper.step_s
    label, model, cluster, cfg, _ = sim.CASES[1]  # GPT3-175B PP8 TP4
    p = plan(model, cluster, cfg, [hgx], uneven=True)
    assert p.layer_counts == [12] * 8  # the 11/13 split does not pay
    pl = Planner(load_model(model), load_cluster(cluster), cfg, node_profiles([hgx], 4))
    naive = pl.assigner(sim.alternating(96, 8)).identity()
    assert naive.step_s > pl.assigner([12] * 8).identity().step_s  # the paper's split loses
    label, model, cluster, cfg, _ = sim.CASES[2]  # GPT3-175B PP8 TP8: a stage fills a node
    p = plan(model, cluster, cfg, [hgx], uneven=True)
    assert not p.applied and p.layer_counts == [12] * 8


def test_profile_count_and_size_must_match_cluster():
    from advisor.placement import ProfileError

    with pytest.raises(ProfileError, match="2 profiles for 1 nodes"):
        plan(*LLAMA70_TP1, [profile([(35, 0.04)] * 4, "a"), profile([(35, 0.04)] * 4, "b")])
    with pytest.raises(SpecError, match="has 2 GPUs but the cluster has 4 per node"):
        plan(*LLAMA70_TP1, [profile([(35, 0.04)] * 2)])
    with pytest.raises(IllegalLayout):
        plan("llama3-70b", "h200x4", TrainConfig(tp=1, pp=3, dp=1, gbs=64), [profile([(35, 0.04)] * 4)])


def test_stage_heat_ranks_measured_pipeline_stages():
    """The GPUs measured each stage's mean power (32 trials with PP > 1 on 4xH200): the model
    names the hottest stage of every one. With the shipped calibration's constants (its GEMM
    efficiency: the TE-free runner's GEMMs draw less than the analytical defaults' saturating ones)
    it is within 2.7% per stage on the campaign and 5.6% over all trials; the analytical defaults
    over-predict the waiting stages (7.9%). The PP4 trials with 4-8 microbatches at mbs >= 4 (hang
    probe, GQA A/B) are the worst (middle stages measured below the prediction)."""
    import glob

    from advisor.models.calibrate import resolve_calibration

    mod = load_bench("stage_heat_check")
    c = resolve_calibration("local").constants
    rows, skipped = mod.rows_from(sorted(glob.glob(str(ROOT / "data" / "measurements" / "*.jsonl"))), c)
    s = mod.summarize(rows)
    assert s["trials"] >= 32 and skipped == 0
    assert s["hottest_stage_right"] == s["trials"]
    assert s["stage_power_mape_pct"] < 7.0 and s["spread_corr"] > 0.9
    campaign, _ = mod.rows_from([str(ROOT / "data" / "measurements" / "h200x4-campaign.jsonl")], c)
    assert mod.summarize(campaign)["stage_power_mape_pct"] < 3.0
    default_rows, _ = mod.rows_from(sorted(glob.glob(str(ROOT / "data" / "measurements" / "*.jsonl"))))
    assert mod.summarize(default_rows)["hottest_stage_right"] == s["trials"]

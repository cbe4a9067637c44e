"""Physics of the MoE model (models/moe.py), the committed MoE measurements against it, and the
per-term breakdown that `predict --json` shows."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from advisor.catalog import load_cluster, load_model
from advisor.catalog.specs import TrainConfig
from advisor.models import DEFAULT, moe, predict
from advisor.models.memory import stage_memory
from advisor.models.step_time import collective_time, gemm_time, group_link

ROOT = Path(__file__).resolve().parent.parent
DS = load_model("deepseek-v3")
QWEN = load_model("qwen3-30b-a3b")
MIXTRAL = load_model("mixtral-8x7b")


def layer(model, cfg, cluster="h100x256", c=DEFAULT):
    cl = load_cluster(cluster)
    peak, hbm = cl.gpu.bf16_tflops * 1e12, cl.gpu.hbm_bandwidth_gbs * 1e9

    def rate(m, k, n, linear=True):
        return gemm_time(m, k, n, peak, hbm, c, c.gemm_efficiency_max)
    ep_link = group_link(cl, cfg.etp, cfg.ep, c)
    etp_link = group_link(cl, 1, cfg.etp, c)
    return moe.moe_layer_time(model, cfg, cl, c, rate, ep_link, etp_link, collective_time)


def cfg(**kw):
    base = dict(dp=64, mbs=1, gbs=512, seq=4096)
    base.update(kw)
    return TrainConfig(**base)


def test_dispatch_is_free_without_ep_and_grows_across_nodes():
    assert layer(QWEN, cfg(ep=1)).dispatch == 0.0
    inside = layer(QWEN, cfg(ep=8)).dispatch  # 8 GPUs: one NVLink node
    across = layer(QWEN, cfg(ep=16)).dispatch  # 16 GPUs: two nodes, the network
    assert 0 < inside < across
    assert layer(QWEN, cfg(ep=64)).dispatch > across  # more of the traffic leaves the node


def test_allgather_beats_alltoall_only_for_small_ep():
    """all-gather moves every token to every EP rank; all-to-all moves top-k copies: all-gather
    wins while EP is small against top-k, loses at large EP."""
    def d(ep, disp):
        return layer(QWEN, cfg(ep=ep, moe_dispatcher=disp), "h100x8x32").dispatch_total
    assert d(2, "allgather") < d(2, "alltoall")
    assert d(64, "allgather") > d(64, "alltoall")


def test_imbalance_at_least_one_and_physical():
    for model in (QWEN, DS, MIXTRAL):
        assert moe.imbalance(model, cfg(ep=1), DEFAULT) == 1.0
        prev = 1.0
        for ep in (2, 4, 8):
            v = moe.imbalance(model, cfg(ep=ep, dp=64), DEFAULT)
            assert v >= prev >= 1.0  # the busiest of more ranks is busier
            prev = v
        forced = moe.imbalance(model, cfg(ep=8, moe_router="forced"), DEFAULT)
        assert 1.0 < forced < moe.imbalance(model, cfg(ep=8), DEFAULT)
    # more tokens per rank: the statistical spread shrinks
    assert (moe.imbalance(QWEN, cfg(ep=8, mbs=4, gbs=2048, moe_router="forced"), DEFAULT)
            < moe.imbalance(QWEN, cfg(ep=8, moe_router="forced"), DEFAULT))


def probe_counts(router: str):
    """(tokens per expert of each call, E) of every ok 1-GPU MoE run with `router` the runner probed."""
    for f in sorted((ROOT / "data" / "measurements").glob("h100x1-moe*.jsonl")):
        for line in open(f):
            r = json.loads(line)
            if r["status"] == "ok" and r["config"].get("moe_router") == router and r.get("moe_probe"):
                calls = r["moe_probe"]["tokens_per_expert"]
                yield calls, len(calls[0])


def busiest_group(calls, E: int, ep: int) -> float:
    """Mean over the calls of the busiest of `ep` consecutive groups of experts over the mean group."""
    return statistics.mean(max(sum(c[i * E // ep:(i + 1) * E // ep]) for i in range(ep)) / (sum(c) / ep)
                           for c in calls)


def test_forced_imbalance_matches_the_recorded_tokens_per_expert():
    """The multinomial spread of `imbalance` against the tokens per expert the runner recorded
    with forced-balanced routing (experts grouped as EP ranks would hold them): within 3%."""
    seen = 0
    for calls, E in probe_counts("forced"):
        for ep in (2, 4, 8):
            if E % ep:
                continue
            got = busiest_group(calls, E, ep)
            want = moe.expected_max_over_mean(ep, sum(calls[0]) / ep)
            assert got >= 1.0 and abs(got - want) < 0.03
            seen += 1
    assert seen >= 12


def test_expected_max_normal_is_the_order_statistic():
    """Blom's formula against the exact expected largest of n standard normals (n = 2: 1/sqrt(pi);
    4, 8: Harter's tables 1.0294, 1.4236); the asymptotic sqrt(2 ln n) it replaced is 0.6 off at 4."""
    for n, exact in ((2, 1 / math.sqrt(math.pi)), (4, 1.0294), (8, 1.4236), (100, 2.5076)):
        assert abs(moe.expected_max_normal(n) - exact) < 0.03
    assert moe.expected_max_normal(1) == 0.0
    assert abs(math.sqrt(2 * math.log(4)) - 1.0294) > 0.6


def test_runner_router_skew_reproduces_the_busiest_rank():
    """The skew measured from each EP = 1 aux-loss run's tokens per expert (our runner's untrained
    routers) through rank_imbalance predicts the busiest group of the same counts at EP 2 / 4 / 8:
    unbiased within 0.03, mean absolute error <= 0.06."""
    errs = []
    for calls, E in probe_counts("aux_loss"):
        skew = moe.router_skew_from_counts(calls, E)
        errs += [moe.rank_imbalance(E, sum(calls[0]) / ep, ep, skew) - busiest_group(calls, E, ep) for ep in (2, 4, 8)]
    assert len(errs) >= 90
    assert abs(statistics.mean(errs)) < 0.03
    assert statistics.mean(abs(e) for e in errs) <= 0.06


def test_grouped_gemm_efficiency_rises_with_tokens_per_expert():
    fr = [moe.grouped_gemm_fraction(n, DEFAULT) for n in (16, 128, 512, 2048, 8192)]
    assert all(0 < a < b < 1 for a, b in zip(fr, fr[1:]))
    # expert time per routed token falls as each expert gets more tokens (mbs up)
    per_token = [layer(QWEN, cfg(ep=1, mbs=b, gbs=64 * b)).expert / b for b in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(per_token, per_token[1:]))


def test_sequential_experts_cost_at_least_their_launches():
    grouped = layer(QWEN, cfg(ep=1))
    seq = layer(QWEN, cfg(ep=1, moe_grouped_gemm=False))
    assert seq.expert >= 128 * DEFAULT.moe_sequential_expert_s > grouped.expert


def test_expert_memory_falls_with_ep():
    cfgs = [TrainConfig(pp=4, dp=64, ep=ep, mbs=1, gbs=1024, seq=4096) for ep in (8, 16, 32, 64)]
    mem = [max(stage_memory(QWEN, c, DEFAULT), key=lambda s: s.total_gib) for c in cfgs]
    # expert weights and gradients are divided by EP (their optimizer states by EP x expert-DP =
    # DP, unchanged); the busiest rank's activations grow a little with EP (load imbalance)
    state = [s.weights_gib + s.grads_gib + s.optimizer_gib for s in mem]
    assert all(a.weights_gib > b.weights_gib for a, b in zip(mem, mem[1:]))
    assert all(a > b for a, b in zip(state, state[1:]))
    assert all(a.activations_gib <= b.activations_gib for a, b in zip(mem, mem[1:]))


def test_terms_sum_into_the_step_categories():
    """The per-term times are part of the GEMM / memory-bound / comm / overhead categories."""
    t = layer(DS, cfg(ep=64, tp=2, sequence_parallel=True, dp=32))
    cats = t.gemm + t.memory_bound + t.comm + t.overhead
    assert math.isclose(cats, t.router + t.permute + t.dispatch + t.expert + t.shared, rel_tol=1e-9)


def test_predict_breakdown_has_the_moe_terms():
    p = predict(QWEN, load_cluster("h100x16"), TrainConfig(dp=16, ep=16, mbs=1, gbs=1024, seq=4096), DEFAULT)
    for k in moe.TERMS:
        assert p.breakdown[k] > 0 or k == "moe_dispatch_s"
    assert p.breakdown["moe_dispatch_s"] > 0
    dense = predict(load_model("llama3-8b"), load_cluster("h100x8"), TrainConfig(dp=8, mbs=1, gbs=64), DEFAULT)
    assert all(dense.breakdown[k] == 0 for k in moe.TERMS)


def test_predict_json_shows_the_moe_terms():
    from tests.test_search_and_cli import run_cli

    r = run_cli("predict", "--model", "qwen3-30b-a3b", "--cluster", "h100x16", "--ep", "16",
                "--gbs", "1024", "--seq", "4096", "--json")
    assert r.returncode == 0, r.stderr
    bd = json.loads(r.stdout)["prediction"]["breakdown"]
    assert all(k in bd and bd[k] >= 0 for k in moe.TERMS) and bd["moe_expert_gemm_s"] > 0


def test_committed_moe_runs_within_the_bench_bounds():
    """data/measurements/h100x1-moe*.jsonl against the model with the constants bench/moe_check.py
    fitted on all four shapes (models/data/moe_local_fit.json): tokens/s <= 10% and memory <= 8%
    MAPE (the bench reports the same bounds out of sample, per held-out shape)."""
    import bench.moe_check as B

    fitted = json.loads((ROOT / "models" / "data" / "moe_local_fit.json").read_text())
    c = B.local_base().replace(**fitted["constants"])
    e = B.errors(B.moe_rows(), c)
    assert e["n"] >= 40
    assert e["tps"] <= B.TOKENS_MAPE_MAX and e["mem"] <= B.MEMORY_MAPE_MAX, e


@pytest.mark.parametrize("model,cluster", [("deepseek-v3", "h100x1024"), ("qwen3-235b-a22b", "h100x256")])
def test_recommend_explains_ep(model, cluster):
    from advisor.api import recommend

    # qwen3-235b-a22b's #1 is Megatron FSDP at EP 1 since session 27, 0.8% ahead of EP 4 with FSDP (a near
    # tie: every GPU reads all 128 experts' weights, FSDP gathers them behind full recompute's compute)
    r = recommend(model, cluster, top=5, seq=4096, gbs=8192, precision="fp8")
    best = next(x for x in r.recommendations if x.config.ep > 1)
    assert best.prediction.tokens_per_s_per_gpu >= 0.97 * r.recommendations[0].prediction.tokens_per_s_per_gpu
    assert f"EP={best.config.ep}:" in best.reason and "experts/GPU" in best.reason
    assert "of the step" in best.reason and "busiest rank" in best.reason


def test_multi_gpu_moe_runs_out_of_sample():
    """The 4 x H100 MoE runs (EP 1 / 2 / 4, all-to-all and allgather dispatchers, PP 2; measured
    after the local profile was fitted, so never fitted) predicted by the shipped local profile:
    tokens/s <= 10% and memory <= 8% MAPE (bench/moe_check.py section 1b prints the groups)."""
    import bench.moe_check as B

    c = B.local_base()
    rows = [r for r in B.moe_rows() if r["rec"].cfg.world_size > 1 and r["rec"].cfg.ep > 1]
    assert len(rows) >= 25 and {r["rec"].cfg.ep for r in rows} >= {2, 4}
    assert {r["rec"].cfg.moe_dispatcher for r in rows} == {"alltoall", "allgather"}
    e = B.errors(rows, c)
    assert e["tps"] <= B.TOKENS_MAPE_MAX and e["mem"] <= B.MEMORY_MAPE_MAX, e


# ---------------------------------------------------------------- issue #24: the new MoE physics
def _layer(model, cfg, cluster="h100x1024"):
    from advisor.catalog import load_cluster
    from advisor.models.constants import DEFAULT
    from advisor.models.step_time import collective_time, gemm_time, group_link

    cl = load_cluster(cluster)
    c = DEFAULT
    gpu = cl.gpu

    def rate(m_, k_, n_, linear=True):
        return gemm_time(m_, k_, n_, gpu.bf16_tflops * 1e12, gpu.hbm_bandwidth_gbs * 1e9, c, c.gemm_efficiency_max)
    return moe.moe_layer_time(model, cfg, cl, c, rate, group_link(cl, cfg.etp, cfg.ep, c),
                              group_link(cl, 1, cfg.etp, c), collective_time)


def test_capacity_caps_the_busiest_load_and_padding_costs_compute():
    from advisor.catalog import load_model

    m = load_model("qwen3-235b-a22b")
    base = TrainConfig(tp=1, ep=8, dp=64, mbs=1, gbs=512, seq=4096)
    assert moe.imbalance(m, base, DEFAULT) > 1.03  # a trained router (skew 0.3) at EP 8: 1.04
    drop = base.replace(moe_capacity_factor=1.0)
    pad = base.replace(moe_capacity_factor=1.5, moe_pad_to_capacity=True)
    t0, t1, t2 = _layer(m, base), _layer(m, drop), _layer(m, pad)
    assert t1.expert < t0.expert and t1.imbalance == pytest.approx(1.0)  # capped at the capacity
    assert t2.expert > t0.expert and t2.imbalance == 1.0  # every expert padded to 1.5 x the mean
    assert t2.tokens_per_expert == pytest.approx(1.5 * t0.tokens_per_expert)


def test_all_to_all_across_nodes_runs_at_each_ranks_nic_not_the_ring_rate():
    from advisor.catalog import load_cluster
    from advisor.models.constants import DEFAULT as c

    cl = load_cluster("h100x1024")
    nbytes = 1e9
    inside = moe.all_to_all_time(nbytes, 8, 1, cl, c)
    across = moe.all_to_all_time(nbytes, 64, 1, cl, c)
    # 56/64 of the bytes leave through one NIC per GPU
    nic = cl.inter_node_bw_gbs * 1e9 * c.network_efficiency
    assert across == pytest.approx(56 / 64 * nbytes / nic + c.inter_latency_s * 63 ** 0.5)
    assert across > 5 * inside
    # DeepEP sends a token once per node (top-8 over 8 nodes: 5.25 nodes, not 7 remote copies)
    assert moe.nodes_hit(8, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    t = 4096.0
    deepep = moe.deepep_time(t, 8, 7168 * 2, 64, 1, cl, c)
    a2a = moe.all_to_all_time(t * 8 * 7168 * 2, 64, 1, cl, c)
    assert deepep < a2a


def test_overlaps_hide_dispatch_behind_the_other_microbatch():
    from advisor.catalog import load_model

    m = load_model("deepseek-v3")
    base = TrainConfig(tp=1, ep=64, dp=1024, mbs=1, gbs=8192, seq=4096)
    t0 = _layer(m, base)
    ovl = _layer(m, base.replace(moe_a2a_overlap=True))
    sh = _layer(m, base.replace(moe_shared_expert_overlap=True))
    assert ovl.dispatch_total == pytest.approx(t0.dispatch_total)
    assert ovl.dispatch < t0.dispatch and sh.dispatch < t0.dispatch
    hide = t0.expert_gemm + t0.expert_mem + t0.shared
    m_ = base.num_microbatches
    assert ovl.dispatch == pytest.approx(t0.dispatch / m_ + (m_ - 1) / m_ * max(0.0, t0.dispatch - hide))
    assert sh.dispatch == pytest.approx(max(0.0, t0.dispatch - t0.shared))


def test_layout_flags_give_etp_megatrons_default():
    from advisor.api import layout_from_flags
    from advisor.catalog import load_cluster, load_model

    cl = load_cluster("h100x64")
    m = load_model("qwen3-235b-a22b")
    assert layout_from_flags(m, cl, {"tp": 2, "ep": 8}).etp == 2  # ETP = TP when not given
    assert layout_from_flags(m, cl, {"tp": 2, "ep": 8, "etp": 1}).etp == 1
    assert layout_from_flags(load_model("llama3-8b"), cl, {"tp": 2}).etp == 1

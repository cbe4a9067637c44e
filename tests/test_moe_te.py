"""MoE under Transformer Engine (issue #24): TE's GroupedLinear issues one cuBLAS GEMM per local
expert, the fused permutation / router are layout knobs the te stack turns on, and the te profile
predicts our own TE MoE runs (data/measurements/h100x4-te.jsonl) without being fitted on them."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from advisor.catalog import load_cluster, load_model
from advisor.catalog.specs import TrainConfig
from advisor.models import DEFAULT, moe
from advisor.models.calibrate import Calibration
from advisor.models.profiles import STACKS, apply_layout_defaults
from advisor.models.step_time import collective_time, gemm_time, group_link

ROOT = Path(__file__).resolve().parent.parent
QWEN = load_model("qwen3-30b-a3b")
TE = moe.te_moe_constants(DEFAULT)


def layer(model, cfg, c, cluster="h100x8"):
    cl = load_cluster(cluster)
    peak, hbm = cl.gpu.bf16_tflops * 1e12, cl.gpu.hbm_bandwidth_gbs * 1e9

    def rate(m, k, n, linear=True):
        return gemm_time(m, k, n, peak, hbm, c, c.gemm_efficiency_max)
    return moe.moe_layer_time(model, cfg, cl, c, rate, group_link(cl, cfg.etp, cfg.ep, c),
                              group_link(cl, 1, cfg.etp, c), collective_time)


def test_grouped_linear_adds_its_host_issue_time_per_local_expert():
    """TE's GroupedLinear: + E_local x moe_grouped_expert_host_s on the experts phase; the local
    stack's one grouped kernel (torch._grouped_mm) adds nothing."""
    assert DEFAULT.moe_grouped_expert_host_s == 0.0 and TE.moe_grouped_expert_host_s > 0
    for ep in (2, 8):
        cfg = TrainConfig(dp=8, ep=ep, mbs=1, gbs=64, seq=4096)
        with_host = layer(QWEN, cfg, TE)
        without = layer(QWEN, cfg, TE.replace(moe_grouped_expert_host_s=0.0))
        assert with_host.expert - without.expert == pytest.approx(128 / ep * TE.moe_grouped_expert_host_s, rel=1e-9)
        assert with_host.overhead - without.overhead == pytest.approx(with_host.expert - without.expert, rel=1e-9)
    # SequentialMLP keeps its own launch-bound floor
    seq = layer(QWEN, TrainConfig(dp=8, ep=8, mbs=1, gbs=64, seq=4096, moe_grouped_gemm=False), TE)
    assert seq.expert >= 16 * TE.moe_sequential_expert_s


def test_fused_permutation_and_router_are_cheaper_and_lose_their_per_expert_launches():
    base = TrainConfig(dp=8, ep=8, mbs=1, gbs=64, seq=4096)
    unf = layer(QWEN, base, TE)
    fp = layer(QWEN, base.replace(moe_permute_fusion=True), TE)
    fr = layer(QWEN, base.replace(moe_router_fusion=True), TE)
    assert fp.permute < unf.permute and fr.router < unf.router
    assert fp.router == unf.router and fr.permute == unf.permute
    # fused: no host-side chunk loop, so no term that grows with the local experts
    more = layer(QWEN, base.replace(ep=2, moe_permute_fusion=True), TE)
    assert more.permute - more.permute_mem == pytest.approx(fp.permute - fp.permute_mem)


def test_te_stack_turns_on_the_recipes_fusions_and_the_local_stack_does_not():
    cfg = TrainConfig(dp=8, ep=8, mbs=1, gbs=64)
    te = apply_layout_defaults(cfg, "te", moe=True)
    assert te.moe_permute_fusion and te.moe_router_fusion and "-rfuse-pfuse" in te.key()
    assert apply_layout_defaults(cfg, "local", moe=True) == cfg
    assert not apply_layout_defaults(cfg, "te", explicit={"moe_permute_fusion": False}, moe=True).moe_permute_fusion
    # a dense model has no router or permutation: its layout keeps megatron-core's defaults
    dense = apply_layout_defaults(TrainConfig(dp=8, mbs=1, gbs=64), "te")
    assert not dense.moe_permute_fusion and not dense.moe_router_fusion and "fuse" not in dense.key()


def test_recommend_space_fuses_moe_only_for_moe_models():
    """recommend's space under te: a MoE model's layouts carry the recipes' fusions, a dense
    model's do not (predict's flags give the same layout as recommend's, key for key)."""
    from advisor.api import recommend
    moe_top = recommend("mixtral-8x7b", "h100x64", top=1, stack="te").recommendations[0].config
    assert moe_top.moe_permute_fusion and moe_top.moe_router_fusion
    dense_top = recommend("llama3-8b", "h100x8", top=1, stack="te").recommendations[0].config
    assert not dense_top.moe_permute_fusion and not dense_top.moe_router_fusion


def test_shipped_te_profile_has_the_stack_moe_constants():
    """The te profile's file holds moe.te_moe_constants (bench/moe_check.py --write-te): the
    unfused router / permutation as measured, MOE_TE_SETTINGS as stated."""
    c = Calibration.load(STACKS["te"].file).constants
    for n in moe.MOE_UNFUSED:
        assert getattr(c, n) == getattr(DEFAULT, n), n
    for n, v in moe.MOE_TE_SETTINGS.items():
        assert getattr(c, n) == v, n


def test_te_profile_predicts_our_te_moe_runs_out_of_sample():
    """None of these runs was fitted: the per-expert host cost is derived from the local stack's
    SequentialMLP measurement, the unfused costs are the local stack's. Before the GroupedLinear
    term and the permute / router knobs the same check gave 65% (Qwen3 proxy 148%)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from te_check import REPEAT
    from compare_measurements import evaluate

    from advisor.models.calibrate import resolve_calibration

    ds, rows = evaluate([ROOT / "data/measurements/h100x4-te.jsonl"], resolve_calibration("default", "te"))
    moe_ids = {r.id for r in ds.records if r.model.is_moe}
    first = {}
    for r in rows:
        if r["id"] in moe_ids:
            first.setdefault(REPEAT.sub("", r["id"]), r)
    err = {k: abs(r["tps_pred"] / r["tps_meas"] - 1) for k, r in first.items()}
    assert len(err) == 14
    assert statistics.mean(err.values()) <= 0.17
    # per shape: Qwen3 proxy 15.2% -> 9.2% and Mixtral proxy 15.8% -> 18.4% (under-predicted, bias
    # -12%) with the te refit on our dense TE runs (session 22: SP re-gather, CP ring per step, the
    # runner's unfused gradient accumulation on experts too); open in issue #24
    for shape, bound in (("-mix-", 0.20), ("-qw3-", 0.17)):
        assert statistics.mean(v for k, v in err.items() if shape in k) <= bound, shape

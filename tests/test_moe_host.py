"""The MoE host issue costs are our VM's (models/moe.py MOE_HOST): the shipped te profile prices the
published runs' hosts (0), profile_fit.on_vm gives our runs our VM's; the token dispatcher's fixed
per-call cost comes from the NCCL micro-benchmark and megatron-core's call count; TE's chunk sort."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from advisor.catalog import load_model
from advisor.models import DEFAULT, moe
from advisor.models.calibrate import resolve_calibration
from advisor.models.profile_fit import on_vm, vm_host
from test_moe import cfg, layer

ROOT = Path(__file__).resolve().parent.parent
QWEN = load_model("qwen3-30b-a3b")
TE = moe.te_moe_constants(DEFAULT)


def test_shipped_te_profile_has_no_moe_host_cost_and_on_vm_adds_ours():
    shipped = resolve_calibration("te", "te")
    assert all(getattr(shipped.constants, n) == 0.0 for n in moe.MOE_HOST)
    assert all(getattr(TE, n) == 0.0 for n in moe.MOE_HOST)
    assert {n: vm_host(shipped)[n] for n in moe.MOE_HOST} == moe.MOE_TE_VM_HOST
    ours = on_vm(shipped).constants
    assert all(getattr(ours, n) == moe.MOE_TE_VM_HOST[n] > 0 for n in moe.MOE_HOST)
    # Qwen3-30B-A3B at EP 2 (64 local experts, 4K tokens): host-bound on our VM (64 x 0.41 ms of
    # issue for less GPU work), GPU-bound on the published hosts; the dispatch pays 7 calls on ours
    c = cfg(ep=2, mbs=1)
    vm, pub = layer(QWEN, c, c=ours), layer(QWEN, c, c=shipped.constants)
    assert vm.expert == pytest.approx(64 * ours.moe_grouped_expert_host_s + ours.moe_expert_overhead_s, rel=1e-9)
    assert pub.expert < vm.expert
    assert vm.dispatch - pub.dispatch == pytest.approx(7 * ours.moe_dispatch_call_s, rel=1e-9)


def test_dispatch_call_cost_is_the_microbenchmarks_small_all_to_all():
    rows = [json.loads(x) for x in (ROOT / "data/microbench/h100x4-nccl-bw.jsonl").read_text().splitlines()]
    small = [d["seconds"] for d in rows if d["op"] == "all_to_all" and d["bytes"] <= 1 << 20]
    assert len(small) == 4
    assert DEFAULT.moe_dispatch_call_s == pytest.approx(statistics.median(small), rel=0.01)


@pytest.mark.parametrize("dispatcher, ep, calls", [("alltoall", 4, 7), ("allgather", 4, 7), ("alltoall", 1, 0),
                                                    ("flex", 8, 0)])
def test_dispatcher_pays_its_calls_once_each(dispatcher, ep, calls):
    c = cfg(ep=ep, moe_dispatcher=dispatcher)
    assert moe.dispatch_calls(c) == calls
    with_calls = layer(QWEN, c, c=DEFAULT)
    without = layer(QWEN, c, c=DEFAULT.replace(moe_dispatch_call_s=0.0))
    assert with_calls.dispatch - without.dispatch == pytest.approx(calls * DEFAULT.moe_dispatch_call_s, rel=1e-9)
    # exposed whatever the overlap of the bytes: host time after the token-count sync
    half = DEFAULT.replace(moe_a2a_exposed=0.5)
    assert (layer(QWEN, c, c=half).dispatch - layer(QWEN, c, c=half.replace(moe_dispatch_call_s=0.0)).dispatch
            == pytest.approx(calls * DEFAULT.moe_dispatch_call_s, rel=1e-9))


def test_fused_permute_adds_the_chunk_sort_only_where_it_runs():
    """TE's sort_chunks_by_index runs with the alltoall dispatcher, EP > 1 and several local
    experts: SORT_CHUNKS_PASSES more HBM passes over the routed tokens."""
    def mem(**kw):
        return layer(QWEN, cfg(moe_permute_fusion=True, **kw), c=TE).permute_mem

    ep1, ep4, ag4 = mem(ep=1), mem(ep=4), mem(ep=4, moe_dispatcher="allgather")
    imb = moe.imbalance(QWEN, cfg(ep=4), TE)  # the busiest rank's tokens
    assert ag4 / ep1 == pytest.approx(imb, rel=1e-9)
    assert ep4 / ep1 == pytest.approx((TE.moe_permute_fused_passes + moe.SORT_CHUNKS_PASSES)
                                      / TE.moe_permute_fused_passes * imb, rel=1e-9)
    lo, hi = moe.MOE_TE_FIT["moe_permute_fused_passes"]
    assert 4.0 <= lo < hi <= 8.0 and lo <= TE.moe_permute_fused_passes <= hi
    assert moe.MOE_TE_FIT["moe_expert_overhead_s"][1] <= 1e-4


def test_moe_layer_host_issue_joins_the_stage_host_time():
    """A MoE layer's host issue (moe_layer_host_s, each local expert's grouped-GEMM host time and
    FP8's share of it) is MoELayerTime.host, which step_time adds to the stage's host issue time:
    where the host is the slower side, each added second per layer-microbatch is a second of step
    per layer-microbatch. The shipped te profile prices none of it (the published runs' hosts)."""
    from advisor.catalog import load_cluster
    from advisor.catalog.specs import TrainConfig
    from advisor.models.predict import predict

    shipped = resolve_calibration("te", "te")
    ours = on_vm(shipped).constants
    e_loc = QWEN.moe.num_experts / 4
    bf = layer(QWEN, cfg(ep=4), c=ours)
    assert bf.host == pytest.approx(ours.moe_layer_host_s + e_loc * ours.moe_grouped_expert_host_s, rel=1e-12)
    f8 = layer(QWEN, cfg(ep=4, precision="fp8"), c=ours)
    assert f8.host - bf.host == pytest.approx(e_loc * ours.moe_fp8_expert_host_s, rel=1e-9)
    assert layer(QWEN, cfg(ep=4), c=shipped.constants).host == 0.0
    # one grouped kernel over all experts (moe_grouped_expert_host_s 0): the layer's fixed part only
    assert layer(QWEN, cfg(ep=4), c=ours.replace(moe_grouped_expert_host_s=0.0)).host == ours.moe_layer_host_s
    model = QWEN.with_layers(4)
    run = TrainConfig(dp=4, ep=4, mbs=1, gbs=32, seq=4096)
    n = 4 * run.num_microbatches  # layer-microbatches of the stage (every Qwen3 layer is MoE)

    def step(extra):
        c = ours.replace(moe_layer_host_s=ours.moe_layer_host_s + extra)
        return predict(model, load_cluster("h100x4"), run, c, check_legal=False).step_time_s
    assert step(0.02) - step(0.01) == pytest.approx(n * 0.01, rel=1e-6)


def test_moe_kernels_bench_compares_every_profiled_moe_run(capsys):
    """bench/moe_kernels.py: each kernel-profiled TE MoE run's non-NCCL kernel time against the
    model's compute, with and without the expert-width penalty (which only ever adds time); its GEMM
    and memory-bound kernels apart, which sum to no more than all of them."""
    from support import load_bench

    bench = load_bench("moe_kernels")
    rs = bench.rows()
    profiled = set()
    for f in ("h100x4-te.jsonl", "h200x1-te.jsonl"):
        recs = [json.loads(x) for x in (ROOT / "data/measurements" / f).read_text().splitlines() if x.strip()]
        profiled |= {r["id"] for r in recs if r.get("status") == "ok" and r["model"].get("moe")
                     and "categories" in (r.get("kernel_profile") or {})}
    assert len(rs) >= 27 and {r["id"] for r in rs} == profiled
    for r in rs:
        assert r["kernels_ms"] > 0 and 0 < r["gemm_kernels_ms"] + r["mem_kernels_ms"] <= r["kernels_ms"]
        assert r["no width penalty"]["compute_ms"] <= r["shipped"]["compute_ms"] + 1e-9
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "no width penalty: model compute vs profiled kernels" in out and "memory_bound_s" in out

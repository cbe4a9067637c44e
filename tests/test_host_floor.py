"""The host issue floor (issue #22, GPT-3 2.7B's idle TP2 / CP2 runs): a stage's microbatch takes
at least the host's issue time of its layers (models.step_time.layer_host_s, Constants.host_*);
the GPU's wait for the host is time with no kernel, inside overhead_s, and shrinks when the GPU
runs slower (lower clocks)."""
from __future__ import annotations

import pytest

from advisor.catalog import TrainConfig
from advisor.models.calibrate import resolve_calibration
from advisor.models.constants import DEFAULT
from advisor.models.dataset import load
from advisor.models.moe import MOE_HOST
from advisor.models.profile_fit import HOST, on_vm, vm_host
from advisor.models.step_time import at_clocks, layer_host_s, stage_times, step_time
from support import ROOT, load_bench

TE_RUNS = ROOT / "data/measurements/h100x4-te.jsonl"
HOSTC = DEFAULT.replace(host_layer_s=4e-3, host_collective_s=2e-4, host_cp_step_s=1e-3, host_fp8_gemm_s=1e-4)


@pytest.fixture(scope="module")
def te_runs():
    ds = load([str(TE_RUNS)])
    return {r.id: r for r in ds.records}


@pytest.fixture(scope="module")
def gpt3(te_runs):  # GPT-3 2.7B as our runs recorded it (not in the catalog)
    r = te_runs["te-gpt3-sp-03"]
    return r.model, r.cluster


def _cfg(**kw):
    return TrainConfig(**{"gbs": 64, "seq": 2048, **kw})


def test_layer_host_time_counts_the_layers_collectives_ring_steps_and_fp8_gemms():
    c = HOSTC
    assert layer_host_s(_cfg(dp=4, mbs=4), c) == pytest.approx(4e-3)
    # TP with SP: 2 all-gathers + 2 reduce-scatters forward, 6 backward; without SP 4 all-reduces
    assert layer_host_s(_cfg(tp=2, dp=2, mbs=4, sequence_parallel=True), c) == pytest.approx(4e-3 + 10 * 2e-4)
    assert layer_host_s(_cfg(tp=2, dp=2, mbs=4), c) == pytest.approx(4e-3 + 4 * 2e-4)
    # CP's p2p ring: cp steps; a sliding-window layer's all-gather CP: 2 collectives
    assert layer_host_s(_cfg(cp=2, dp=2, mbs=4), c) == pytest.approx(4e-3 + 2 * 1e-3)
    assert layer_host_s(_cfg(cp=2, dp=2, mbs=4), c, cp_all_gather=True) == pytest.approx(4e-3 + 2 * 2e-4)
    # 4 FP8 linear GEMMs forward: 12 with dgrad and wgrad
    assert layer_host_s(_cfg(dp=4, mbs=4), c, fp8_gemms=4) == pytest.approx(4e-3 + 12 * 1e-4)
    assert layer_host_s(_cfg(tp=2, dp=2, mbs=4, sequence_parallel=True), DEFAULT) == 0.0


def test_a_host_bound_stage_takes_the_hosts_time_and_a_gpu_bound_one_is_unchanged(gpt3):
    model, cluster = gpt3
    cfg = _cfg(tp=2, dp=2, mbs=4, sequence_parallel=True)
    off = stage_times(model, cluster, cfg, DEFAULT)[0]
    slow = DEFAULT.replace(host_layer_s=10e-3)  # 32 layers x 10 ms: far above the GPU's ~1.5 s
    on = stage_times(model, cluster, cfg, slow)[0]
    assert on.host_s == pytest.approx(32 * 10e-3)
    assert on.total_s == pytest.approx(on.host_s)
    assert on.host_wait_s == pytest.approx(on.host_s - off.total_s)
    assert on.overhead_s == pytest.approx(off.overhead_s + on.host_wait_s)
    # a host time under the GPU's: nothing changes but the host_s bookkeeping
    fast = stage_times(model, cluster, cfg, DEFAULT.replace(host_layer_s=1e-5))[0]
    assert fast.host_wait_s == 0.0 and fast.total_s == pytest.approx(off.total_s)


def test_the_wait_shrinks_when_the_gpu_runs_slower(gpt3):
    model, cluster = gpt3
    cfg = _cfg(tp=2, dp=2, mbs=4, sequence_parallel=True)
    off = stage_times(model, cluster, cfg, DEFAULT)[0]
    c = DEFAULT.replace(host_layer_s=1.2 * off.total_s / 32)  # host 20% above the GPU at full clock
    st = stage_times(model, cluster, cfg, c)
    assert st[0].host_wait_s == pytest.approx(0.2 * off.total_s)
    for x in (0.9, 0.6):
        gpu = at_clocks(stage_times(model, cluster, cfg, DEFAULT), x, c=DEFAULT)[0].total_s
        at = at_clocks(st, x, c=c)[0]
        assert at.total_s == pytest.approx(max(gpu, st[0].host_s))
        assert at.host_wait_s == pytest.approx(max(0.0, st[0].host_s - gpu))
    # and the step at a clock agrees with the stages at it
    assert step_time(model, cluster, cfg, c, sm_clock=0.6).stages[0].total_s == pytest.approx(
        at_clocks(st, 0.6, c=c)[0].total_s)


def test_the_te_profile_prices_gpt3s_host_bound_runs_and_leaves_llama_gpu_bound(te_runs):
    shipped = resolve_calibration("te", "te")
    # the shipped profile prices no host floor (the published runs' hosts); our VM's fitted costs
    # ride along in its fit_info and price our own runs
    assert all(getattr(shipped.constants, n) == 0.0 for n in HOST)
    assert set(vm_host(shipped)) == set(HOST) | set(MOE_HOST)
    cal = on_vm(shipped)
    c = cal.constants
    assert c.host_layer_s > 0 and c.host_collective_s > 0 and shipped.constants.host_layer_s == 0.0
    for rid, bound in (("te-gpt3-sp-03", True), ("te-gpt3-cp-06", True), ("te-l8b-sp-06", False),
                       ("te-l70b-sp-00", False), ("te-l8b-cp-05", False)):
        r = te_runs[rid]
        st = stage_times(r.model, r.cluster, r.cfg, c)[0]
        assert (st.host_wait_s > 0) == bound, rid
    # GPT-3's TP2 and CP2 runs: measured 15,910 and 14,566 tokens/s/GPU, predicted 19,664 and 20,874
    # (+24%, +43%) before the host floor
    for rid in ("te-gpt3-sp-03", "te-gpt3-cp-06"):
        r = te_runs[rid]
        p = cal.predict(r.model, r.cluster, r.cfg, check_legal=False)
        assert abs(p.tokens_per_s_per_gpu / r.y["tokens_per_s_per_gpu"] - 1) < 0.10, rid


def test_host_bound_bench_runs(capsys):
    mod = load_bench("host_bound")
    assert mod.main([]) == 0
    out = capsys.readouterr().out
    assert "te-gpt3-sp-03" in out and "idle fraction MAE" in out

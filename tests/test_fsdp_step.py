"""Megatron FSDP's step time (models.fsdp_time: per micro-batch, each unit's all-gather before its
forward and again before its backward, its reduce-scatter after, overlapped with the neighbouring
units' compute), its place in recommend's space (the te stack searches it, PP 1), its Megatron-LM /
Megatron-Bridge arguments, and this project's runner refusing it."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from advisor.api import compare, recommend
from advisor.catalog import TrainConfig, load_cluster, load_model
from advisor.models.constants import DEFAULT
from advisor.models.fsdp_time import FSDPTerms, fsdp_exposed_per_microbatch
from advisor.models.stages import memo_for
from advisor.models.step_time import one_layout, step_time
from advisor.runners import command as C
from advisor.runners import megatron_args as MA
from advisor.search_spaces.columns import enumerate_columns
from advisor.search_spaces.runnable import first_broken_rule, refused
from advisor.search_spaces.space import SpaceOptions, Workload, enumerate_layouts

L70 = TrainConfig(tp=1, pp=1, dp=64, mbs=1, gbs=128, seq=8192, precision="fp8", fp8_recipe="tensorwise")


def _gathers(m, c, cfg):
    """(one all-gather, one reduce-scatter of the stage's units, units) of a one-stage layout."""
    f = one_layout(m, c, cfg, DEFAULT).dp.fsdp
    return float(f.gather[0]), float(f.reduce[0]), float(f.units[0])


def test_fsdp_adds_the_exposed_part_of_its_gathers():
    # an H100 cluster: DP 64 spans 8 nodes, the gathers go over the network
    m, c = load_model("llama3-70b"), load_cluster("h100x64")
    off, on = step_time(m, c, L70), step_time(m, c, L70.replace(fsdp=True))
    g, r, n = _gathers(m, c, L70.replace(fsdp=True))
    assert n == 80 and g > 0 and r > 0
    st = one_layout(m, c, L70.replace(fsdp=True), DEFAULT)
    fwd, bwd = st.full["forward_s"] + st.full["tp_comm_s"] / 2, st.full["backward_s"] + st.full["tp_comm_s"] / 2
    per_mb = float(fsdp_exposed_per_microbatch(st.dp.fsdp, fwd, bwd, DEFAULT.dp_overlap_efficiency)[0])
    mbs = L70.num_microbatches
    # at least the first unit's gathers (forward and backward) and the last reduce-scatter, per micro-batch
    assert per_mb >= (2 * g + r) / n - 1e-12
    # the step grows by the micro-batches' exposed part, less the per-step gather / reduce-scatter
    # of the units that FSDP no longer does (the distributed optimizer's, mostly hidden)
    assert on.step_time_s > off.step_time_s
    assert on.dp_exposed_s - off.dp_exposed_s == pytest.approx(mbs * per_mb, rel=0.05)
    assert on.dp_comm_s > off.dp_comm_s  # 2 gathers and a reduce-scatter per micro-batch vs once a step


def test_large_compute_per_unit_hides_the_gathers():
    t = FSDPTerms(np.array([1.0]), np.array([2.0]), np.array([10.0]))
    # compute per pass well above the traffic: only the first gather and the last reduce-scatter show
    hidden = fsdp_exposed_per_microbatch(t, np.array([10.0]), np.array([20.0]), 0.8)[0]
    assert hidden == pytest.approx(0.1 + 0.3)
    # no compute to hide behind: all of it (2 gathers and the reduce-scatter)
    assert fsdp_exposed_per_microbatch(t, np.array([0.0]), np.array([0.0]), 0.8)[0] == pytest.approx(4.0)
    # on a real layout: longer sequences (more compute per unit, same parameters) hide more
    m, c = load_model("llama3-70b"), load_cluster("h100x64")
    exposed = []
    for seq in (2048, 16384):
        cfg = L70.replace(seq=seq, fsdp=True)
        st = one_layout(m, c, cfg, DEFAULT)
        fwd = st.full["forward_s"] + st.full["tp_comm_s"] / 2
        bwd = st.full["backward_s"] + st.full["tp_comm_s"] / 2
        e = float(fsdp_exposed_per_microbatch(st.dp.fsdp, fwd, bwd, DEFAULT.dp_overlap_efficiency)[0])
        g, r, n = _gathers(m, c, cfg)
        exposed.append(e / (2 * g + r))
    assert exposed[1] < exposed[0] and exposed[1] < 0.05


def test_fp8_param_gather_halves_the_gathered_bytes():
    m, c = load_model("llama3-70b"), load_cluster("h100x64")
    on = L70.replace(fsdp=True)
    g8 = _gathers(m, c, on.replace(fp8_param_gather=True))[0]
    g16 = _gathers(m, c, on)[0]
    # the linear weights at 1 B (the norms stay BF16); the 80 units' ring latencies do not halve
    assert 0.5 * g16 < g8 < 0.55 * g16


def test_recommend_ranks_fsdp_on_gb200x64():
    res = recommend("llama3-70b", "gb200x64", precision="fp8", fp8_recipe="tensorwise", top=10)
    fs = [r for r in res.recommendations if r.config.fsdp]
    assert fs, [r.config.key() for r in res.recommendations]
    for r in fs:
        assert r.config.pp == 1 and r.config.dp * r.config.cp > 1 and r.config.key().endswith("-fsdp")
        a = r.megatron_args
        assert "--use-megatron-fsdp" in a and "optim_grads_params" in a
    # compare takes it as a layout value
    x = compare(res, {"tp": fs[0].config.tp, "cp": fs[0].config.cp, "mbs": fs[0].config.mbs, "fsdp": True})
    assert x.config.fsdp and x.prediction.tokens_per_s_per_gpu == pytest.approx(
        fs[0].prediction.tokens_per_s_per_gpu, rel=1e-6)


def test_the_space_offers_fsdp_at_pp1_only_and_columns_match_layouts():
    m, c = load_model("llama3-8b"), load_cluster("h100x8")
    wl, opt = Workload(gbs=64, seq=4096), SpaceOptions(fsdp=(False, True), mbs=(1, 2))
    L = enumerate_columns(m, c, wl, opt)
    cfgs = list(enumerate_layouts(m, c, wl, opt))
    assert len(cfgs) == len(L) and all(L.config(i) == cfgs[i] for i in range(len(L)))
    assert L.fsdp.any() and not (L.fsdp & (L.pp > 1)).any()
    # every PP 1 layout with the distributed optimizer comes with and without FSDP
    assert sum(x.fsdp for x in cfgs) == sum(1 for x in cfgs if x.pp == 1 and x.distributed_optimizer and not x.fsdp)


def test_bridge_overrides_and_their_fields_in_megatron_core():
    on = L70.replace(fsdp=True)
    b = C.bridge_overrides(on, 5)
    assert "ddp.use_megatron_fsdp=true" in b and "ddp.data_parallel_sharding_strategy=optim_grads_params" in b
    assert not any("fsdp" in x for x in C.bridge_overrides(L70, 5))
    wheels = sorted((Path(__file__).resolve().parents[1] / ".whl").glob("megatron_core-*.whl"))
    if not wheels:
        pytest.skip("no megatron-core wheel in .whl/")
    import ast

    with zipfile.ZipFile(wheels[-1]) as z:
        src = z.read("megatron/core/distributed/distributed_data_parallel_config.py").decode()
    fields = {n.target.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.AnnAssign)
              and isinstance(n.target, ast.Name)}
    for kv in (x for x in b if x.startswith("ddp.")):  # Megatron-Bridge's ddp is this dataclass
        assert kv[4:].split("=")[0] in fields, kv
    assert "'optim_grads_params'" in src or '"optim_grads_params"' in src


def test_the_runner_refuses_it_and_tune_never_samples_it(tmp_path):
    m = load_model("llama3-8b")
    on = TrainConfig(dp=8, mbs=1, gbs=64, seq=4096, fsdp=True)
    for stack in ("local", "te"):
        assert "Megatron FSDP" in MA.refusal_reason(m, on, stack=stack)
        assert MA.refusal_reason(m, on.replace(fsdp=False), stack=stack) is None
        assert first_broken_rule(m, on, stack, runner=True) == "fsdp"
    assert first_broken_rule(m, on, "te") is None  # the te stack's recommend ranks it
    # recommend on the local stack (this project's runner) leaves it out and says so
    c = load_cluster("h100x8")
    L = enumerate_columns(m, c, Workload(gbs=64, seq=4096), SpaceOptions(fsdp=(False, True)))
    bad, counts = refused(m, L, "local")
    assert counts.get("fsdp", 0) > 0 and bad[L.fsdp].all()  # (the rules before it count some first)
    res = recommend(m, c, stack="local", top=3, options=SpaceOptions.wide(fsdp=(False, True)))
    assert "Megatron FSDP" in res.left_out["line"] and not any(r.config.fsdp for r in res.recommendations)
    from advisor.study import TuneSettings, make_plan

    s = TuneSettings(model="llama3-8b", cluster="h100x8", layers=2, runner="megatron", stack="te", trials=4,
                     storage=str(tmp_path / "s.journal"), dataset=str(tmp_path / "s.jsonl"), calibration=None)
    plan = make_plan(s, SpaceOptions(fsdp=(False, True)))
    assert "Megatron FSDP" in plan.left_out and not any(x.fsdp for x in plan.layouts)


def test_arrays_agree_with_each_layout_alone_under_a_power_cap():
    """models.vectorized on a space with FSDP rows (their DP terms taken per row, DPTerms.take, by
    the power fixed point under a cap) gives each row's per-layout prediction."""
    from advisor.api import resolve
    from advisor.models import vectorized as vz
    from advisor.models.predict import predict

    m, c = resolve("llama3-8b", "h100x8", 450.0)
    wl = Workload(gbs=64, seq=4096)
    L = enumerate_columns(m, c, wl, SpaceOptions(fsdp=(False, True), mbs=(1, 2), recompute=("none",)))
    res = vz.evaluate(m, c, L, DEFAULT)
    rows = [i for i in range(len(L)) if L.fsdp[i]]
    assert rows and (res.row["clock_ratio"][rows] < 1).any()  # the cap holds the clocks down
    for i in rows + [i for i in range(len(L)) if not L.fsdp[i]][:5]:
        ref = predict(m, c, L.config(i), DEFAULT, check_legal=False)
        for name in ("step_time_s", "tokens_per_s_per_gpu", "mean_power_w", "clock_ratio"):
            assert float(res.row[name][i]) == pytest.approx(getattr(ref, name), rel=1e-9), (L.config(i).key(), name)

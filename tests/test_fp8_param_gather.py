"""FP8 primary weights (TrainConfig.fp8_param_gather, Megatron-LM --fp8-param-gather): no BF16 copy
of the TE linear layers' weights, the parameter all-gather in FP8; the te stack's layout default
where a layout runs FP8 with the distributed optimizer; this project's runner runs it off."""
from __future__ import annotations

import pytest

from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.models.constants import DEFAULT, GIB
from advisor.models.memory import layouts_of, linear_params, stage_memory
from advisor.models.profiles import apply_layout_defaults
from advisor.models.stages import Stages, memo_for
from advisor.models.step_time import dp_terms
from advisor.runners import megatron_args as MA
from advisor.search_spaces.columns import Layouts, enumerate_columns
from advisor.search_spaces.layout import stage_layers
from advisor.search_spaces.space import SpaceOptions, Workload

FP8 = TrainConfig(tp=4, pp=8, vp=5, dp=2, mbs=1, gbs=256, seq=8192, precision="fp8")


def test_the_te_default_turns_it_on_only_where_it_can_run():
    assert apply_layout_defaults(FP8, "te").fp8_param_gather
    assert not apply_layout_defaults(FP8, "local").fp8_param_gather
    assert not apply_layout_defaults(FP8.replace(precision="bf16"), "te").fp8_param_gather
    assert not apply_layout_defaults(FP8.replace(distributed_optimizer=False), "te").fp8_param_gather
    with pytest.raises(SpecError, match="fp8_param_gather needs"):
        TrainConfig(precision="bf16", dp=2, fp8_param_gather=True)
    with pytest.raises(SpecError, match="fp8_param_gather needs"):
        FP8.replace(distributed_optimizer=False, fp8_param_gather=True)


def test_no_bf16_copy_of_the_linear_weights():
    m = load_model("llama3-70b")
    on = FP8.replace(fp8_param_gather=True)
    layers = stage_layers(m, FP8)
    for a, b in zip(stage_memory(m, FP8), stage_memory(m, on)):
        saved = linear_params(m, FP8, layers[a.stage]) * DEFAULT.bytes_weight / GIB
        assert saved > 3.0
        assert a.weights_gib - b.weights_gib == pytest.approx(saved)
        assert a.total_gib - b.total_gib == pytest.approx(saved)
        assert (a.grads_gib, a.optimizer_gib, a.activations_gib) == (b.grads_gib, b.optimizer_gib, b.activations_gib)


def test_the_parameter_all_gather_moves_fp8_bytes():
    m, c = load_model("llama3-70b"), load_cluster("h100x64")
    t = {}
    for on in (False, True):
        L = layouts_of(m, FP8.replace(fp8_param_gather=on))
        S = Stages(L)
        t[on] = dp_terms(m, c, L, DEFAULT, memo_for(m, c, DEFAULT), S)
    assert (t[True].grad == t[False].grad).all()
    assert (t[True].gather < t[False].gather).all()


def test_columns_and_configs_carry_it():
    m, c = load_model("llama3-8b"), load_cluster("h100x8")
    wl = Workload(gbs=64, seq=4096, precision="fp8")
    L = enumerate_columns(m, c, wl, SpaceOptions(fp8_param_gather=True))
    assert L.fpg is not None and (L.fpg == L.dist_opt).all() and L.fpg.any()
    for i in range(0, len(L), max(1, len(L) // 50)):
        cfg = L.config(i)
        assert cfg.fp8_param_gather == bool(L.fpg[i])
        assert Layouts.of(m, [cfg]).config(0).fp8_param_gather == cfg.fp8_param_gather
    assert enumerate_columns(m, c, Workload(gbs=64, seq=4096, precision="bf16"),
                             SpaceOptions(fp8_param_gather=True)).fpg is None


def test_megatron_argument_and_the_runner_runs_it_off():
    on = FP8.replace(fp8_param_gather=True)
    assert "--fp8-param-gather" in MA.layout_args(on) and "--use-distributed-optimizer" in MA.layout_args(on)
    assert "--fp8-param-gather" not in MA.layout_args(FP8)
    assert not MA.runner_config(on).fp8_param_gather
    assert MA.runner_config(on).replace(fp8_param_gather=True) == MA.effective_config(on)


def test_the_runner_builds_fp8_primary_weights_where_a_batch_line_asks():
    """A batch line with fp8_param_gather: true keeps it (runner_config(keep_requested=True)): the
    worker's TransformerConfig gets fp8_param (TE's fp8_model_init) and its DDP config
    fp8_param_gather, as Megatron-LM's --fp8-param-gather sets both; every other job dict is as before."""
    from advisor.runners.jobs import job_for, make_entry

    e = make_entry("llama3-8b", 4, layers=2, stack="te", tp=1, pp=1, mbs=1, gbs=8, seq=1024, precision="fp8",
                   fp8_param_gather=True)
    assert e.refused is None and e.config.fp8_param_gather
    job = job_for(e, 0)
    assert job["tc"]["fp8_param"] is True and job["tc"]["fp8"] == "hybrid"
    assert job["ddp"]["fp8_param_gather"] is True and job["ddp"]["use_distributed_optimizer"] is True
    plain = job_for(make_entry("llama3-8b", 4, layers=2, stack="te", tp=1, pp=1, mbs=1, gbs=8, seq=1024,
                               precision="fp8"), 0)
    assert "fp8_param" not in plain["tc"] and "fp8_param_gather" not in plain["ddp"]


def test_fp8_weight_transposes_cost_what_the_measured_pairs_lost():
    """On Hopper TE casts the rank's shard of every FP8 primary weight from its master with its
    transpose each step (Constants.fp8_param_cast_s, 75 ps per shard weight: kernel profiles on one H200
    and on 4 x H100): the two same-machine pairs of session 27 (x4-te-s27d / -s27e: llama3-70b[4L] DP4
    mbs2 -8.2%, llama3-8b[8L] DP4 mbs4 -5.0% with them) predicted within 2.5% of their measured ratio;
    the term is the shard's weights x 75 ps (an eighth of them over DP8, all of them on one GPU);
    nothing on Blackwell, nothing without FP8 primary weights."""
    import json
    from pathlib import Path

    from advisor.models.calibrate import resolve_calibration
    from advisor.models.dataset import load
    from advisor.models.profile_fit import on_vm

    assert DEFAULT.fp8_param_cast_s == 7.5e-11
    runs = Path(__file__).resolve().parent.parent / "data" / "measurements" / "h100x4-te.jsonl"
    recs = {r.id: r for r in load([str(runs)]).records}
    cal = on_vm(resolve_calibration("default", "te"))
    for without, with_ in (("te-l70b-fpg-28", "te-l70b-fpg-29"), ("te-l8b-fpg-81", "te-l8b-fpg-82")):
        a, b = recs[without], recs[with_]
        assert not a.cfg.fp8_param_gather and b.cfg.fp8_param_gather and a.cfg.replace(fp8_param_gather=True) == b.cfg
        pa, pb = (cal.predict(r.model, r.cluster, r.cfg).tokens_per_s_per_gpu for r in (a, b))
        measured = b.y["tokens_per_s_per_gpu"] / a.y["tokens_per_s_per_gpu"]
        assert measured < 0.96 and abs((pb / pa) / measured - 1) < 0.025, (with_, pb / pa, measured)
    m, cfg = load_model("llama3-8b"), TrainConfig(dp=8, mbs=2, gbs=64, seq=4096, precision="fp8")
    on = cfg.replace(fp8_param_gather=True)
    n = linear_params(m, on, range(m.num_layers))
    for cl, x_cfg, shard in (("h100x8", on, n / 8), ("h200x1", on.replace(dp=1, gbs=8), n),
                             ("b200x8", on, 0.0)):
        c = load_cluster(cl)
        opt = []
        for x in (x_cfg.replace(fp8_param_gather=False), x_cfg):
            L = layouts_of(m, x)
            opt.append(float(dp_terms(m, c, L, DEFAULT, memo_for(m, c, DEFAULT), Stages(L)).opt_base[0]))
        assert opt[1] - opt[0] == pytest.approx(shard * 7.5e-11, rel=0.02, abs=1e-9), (cl, x_cfg.dp)


def test_fp8_primary_weight_cast_is_per_shard_weight_on_one_h200():
    """One H200 (DP1: the shard is every weight; session 34, data/measurements/h200x1-te.jsonl): the
    step's cast_transpose_general_kernel calls, one per FP8 linear weight, take 75 ps per weight within
    5% on llama3-8b[8L] and llama3-70b[4L] (1.7 and 3.4 B weights), what 4 x H100 with DP4 gave per
    weight of its quarter shard; the bandwidth reading (45 B per weight held) put them 5.5x lower."""
    import json
    from pathlib import Path

    runs = Path(__file__).resolve().parent.parent / "data" / "measurements" / "h200x1-te.jsonl"
    recs = {r["id"]: r for r in (json.loads(x) for x in runs.read_text().splitlines() if x.strip())}
    for rid, name, layers in (("h1te-l8b-kp-01", "llama3-8b", 8), ("h1te-l70b-kp-03", "llama3-70b", 4)):
        r = recs[rid]
        assert r["config"]["fp8_param_gather"] and r["config"]["dp"] == 1
        m = load_model(name).with_layers(layers)
        n = linear_params(m, TrainConfig(), range(layers))
        k = next(x for x in r["kernel_profile"]["top"] if "cast_transpose_general_kernel" in x["name"])
        assert k["count"] == 4 * layers  # qkv, proj, fc1, fc2 of each layer, once a step
        assert k["ms"] * 1e-3 / n == pytest.approx(DEFAULT.fp8_param_cast_s, rel=0.05), rid
        held = n * 45.0 / (load_cluster("h200x1").gpu.hbm_bandwidth_gbs * 1e9 * DEFAULT.hbm_efficiency)
        assert k["ms"] * 1e-3 > 4 * held

"""Partial recompute (issue #27): TrainConfig.recompute_layers (full recompute, Megatron's block
method on the first N layers of each virtual chunk) and recompute_modules (selective recompute of
megatron-core's modules): validation, the bytes and seconds they move (models/recompute.py), their
Layouts columns, the frozen predictions at their defaults, and the arguments that run them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from advisor.catalog import SpecError, TrainConfig, load_cluster, load_model
from advisor.models.constants import DEFAULT, GIB
from advisor.models.memory import stage_memory
from advisor.models.recompute import module_saved_bytes
from advisor.models.step_time import stage_times, step_time
from advisor.runners import command as C
from advisor.runners import megatron_args as MA
from advisor.runners import measure as M
from advisor.search_spaces.columns import Layouts
from advisor.search_spaces.layout import pipeline_plan, violations
from advisor.validate import InputError, layout_values
from support import load_bench

L8 = load_model("llama3-8b").with_layers(16)
H100 = load_cluster("h100x8")
BASE = TrainConfig(pp=2, dp=2, mbs=1, gbs=16, seq=4096)


def acts(cfg, model=L8):
    return [s.activations_gib for s in stage_memory(model, cfg)]


def rc_s(cfg, model=L8):
    return [s.recompute_s for s in stage_times(model, H100, cfg)]


@pytest.mark.parametrize("kw, msg", [
    (dict(recompute_layers=4), "needs recompute 'full'"),
    (dict(recompute="selective", recompute_layers=4), "needs recompute 'full'"),
    (dict(recompute="full", recompute_layers=-1), "non-negative integer"),
    (dict(recompute="full", recompute_layers=True), "non-negative integer"),
    (dict(recompute_modules=("mlp",)), "needs recompute 'selective'"),
    (dict(recompute="full", recompute_modules=("mlp",)), "needs recompute 'selective'"),
    (dict(recompute="selective", recompute_modules=("mlp", "attn")), "unknown recompute module(s) 'attn'"),
    (dict(recompute="selective", recompute_modules=("mlp", "mlp")), "twice"),
    (dict(recompute="selective", recompute_modules="mlp"), "list of module names"),
])
def test_bad_knobs_are_one_spec_error(kw, msg):
    with pytest.raises(SpecError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kw)


def test_model_rules():
    assert violations(L8, None, BASE.replace(recompute="full", recompute_layers=8)) == []
    assert "exceeds the 8 layers of a virtual chunk" in violations(L8, None, BASE.replace(recompute="full", recompute_layers=9))[0]
    vp = BASE.replace(pp=2, vp=2, recompute="full", recompute_layers=5)  # 4 layers a chunk
    assert any("exceeds the 4 layers" in v for v in violations(L8, None, vp))
    assert "multi-latent attention" in violations(L8, None, BASE.replace(recompute="selective", recompute_modules=("mla_up_proj",)))[0]
    assert "mixture-of-experts" in violations(L8, None, BASE.replace(recompute="selective", recompute_modules=("moe_act",)))[0]
    moe = load_model("mixtral-8x7b").with_layers(4)
    cfg = TrainConfig(dp=4, ep=4, gbs=16, recompute="selective", recompute_modules=("moe_act",))
    assert violations(moe, None, cfg) == []
    assert "moe_grouped_gemm" in violations(moe, None, cfg.replace(moe_grouped_gemm=False))[0]
    # a list (JSON) becomes a tuple: the config stays hashable and equal
    assert TrainConfig.from_dict({"recompute": "selective", "recompute_modules": ["mlp"]}).recompute_modules == ("mlp",)


def test_mlp_bytes_by_hand():
    """One dense llama3-8b layer, TP1, BF16, s 4096, b 1, the local stack's constants (2 GLU copies):
    the MLP's recompute drops the FC1 input (h), FC1 output (2F), activation output (F) and the two
    GLU copies (2F), 2 bytes each."""
    s, h, F = 4096, 4096, 14336
    cfg = TrainConfig(seq=s, mbs=1)
    want = 2 * s * (h + 2 * F + F + 2 * F)
    assert want == 620_756_992
    assert module_saved_bytes(L8, 0, cfg, DEFAULT, "mlp") == want
    # the model: PP1, one microbatch in flight, 16 layers x that, times the fragmentation factor
    one = TrainConfig(mbs=1, gbs=1, seq=s)
    base = stage_memory(L8, one.replace(recompute="selective"))[0].activations_gib
    mlp = stage_memory(L8, one.replace(recompute="selective", recompute_modules=("mlp",)))[0].activations_gib
    assert (base - mlp) * GIB / (1 + DEFAULT.fragmentation) == pytest.approx(16 * want, rel=1e-12)
    # te stack (fused norms): "layernorm" drops nothing on a dense layer; MoE: the pre-MLP norm, in
    # BF16 under fp8 too (the router's gating GEMM saves it as it is)
    assert module_saved_bytes(L8, 0, cfg, DEFAULT, "layernorm") == 0.0
    moe = load_model("mixtral-8x7b")
    assert module_saved_bytes(moe, 0, cfg, DEFAULT, "layernorm") == 2 * s * moe.hidden_size
    assert module_saved_bytes(moe, 0, cfg.replace(precision="fp8"), DEFAULT, "layernorm") == 2 * s * moe.hidden_size


def test_block_layers_interpolate_none_and_full():
    none, full = acts(BASE), acts(BASE.replace(recompute="full"))
    zero = acts(BASE.replace(recompute="full", recompute_layers=0))
    half = acts(BASE.replace(recompute="full", recompute_layers=4))
    every = acts(BASE.replace(recompute="full", recompute_layers=8))
    assert zero == pytest.approx(none, rel=1e-12) and every == pytest.approx(full, rel=1e-12)
    for a, b, c in zip(full, half, none):
        assert a < b < c
    # 4 of 8 layers recomputed: half the layers' bytes and no working set (the microbatch's kept
    # layers are freed before its recomputed ones re-run); full recompute carries one layer's (W),
    # but not on the loss stage, whose logits (larger here) are freed before the working set exists
    from advisor.models.memory import layer_activation_bytes
    W = layer_activation_bytes(L8, 0, BASE) / GIB
    last = stage_memory(L8, BASE.replace(recompute="full"))[-1]
    assert last.logits_gib > W
    assert half == pytest.approx([(none[0] + full[0] - W) / 2, (none[1] + full[1]) / 2], abs=0.05)
    # time: half the recomputed forward
    t_full = rc_s(BASE.replace(recompute="full"))
    t_half = rc_s(BASE.replace(recompute="full", recompute_layers=4))
    assert t_half == pytest.approx([x / 2 for x in t_full], rel=1e-12)
    assert rc_s(BASE.replace(recompute="full", recompute_layers=0)) == [0.0, 0.0]
    steps = [step_time(L8, H100, BASE.replace(**kw)).step_time_s
             for kw in ({}, dict(recompute="full", recompute_layers=4), dict(recompute="full"))]
    assert steps[0] < steps[1] < steps[2]


def test_block_counts_each_virtual_chunk():
    """PP2 VP2: 4 layers a chunk; 2 of each chunk's layers are half of the stage's."""
    cfg = BASE.replace(vp=2, gbs=16, recompute="full")
    assert rc_s(cfg.replace(recompute_layers=2)) == pytest.approx([x / 2 for x in rc_s(cfg)], rel=1e-12)


def test_block_with_a_placement_split():
    """stage_memory of another contiguous split (a placement's): the block method counts the first
    n layers of each of the stage's chunks there too."""
    cfg = BASE.replace(recompute="full")
    split = [10, 6]
    every = [s.activations_gib for s in stage_memory(L8, cfg, layer_counts=split)]
    none = [s.activations_gib for s in stage_memory(L8, BASE, layer_counts=split)]
    six = [s.activations_gib for s in stage_memory(L8, cfg.replace(recompute_layers=6), layer_counts=split)]
    assert six[1] == pytest.approx(every[1], rel=1e-12) and every[0] < six[0] < none[0]


def test_selective_modules_move_memory_and_time():
    sel = BASE.replace(recompute="selective")
    core = sel.replace(recompute_modules=("core_attn",))
    assert acts(core) == acts(sel) and rc_s(core) == pytest.approx(rc_s(sel), rel=1e-12)
    mlp = sel.replace(recompute_modules=("mlp",))
    both = sel.replace(recompute_modules=("core_attn", "mlp"))
    assert all(a < b for a, b in zip(acts(mlp), acts(sel)))
    t_full, t_mlp, t_core, t_both = (rc_s(x) for x in (BASE.replace(recompute="full"), mlp, sel, both))
    for f, m, c, b in zip(t_full, t_mlp, t_core, t_both):
        assert c < m < f and b == pytest.approx(m + c, rel=1e-12)
    # the dense MLP is most of the layer's GEMMs: with the attention it is close to the whole forward
    assert 0.6 < t_both[0] / t_full[0] < 1.0


def test_moe_modules():
    moe = load_model("mixtral-8x7b").with_layers(4)
    cfg = TrainConfig(dp=4, ep=4, gbs=16, mbs=1, recompute="selective")
    base, act, whole = (acts(cfg.replace(recompute_modules=m), moe) for m in ((), ("moe_act",), ("moe",)))
    assert whole[0] < act[0] < base[0]
    t = [rc_s(cfg.replace(recompute_modules=m), moe)[0] for m in (("moe_act",), ("moe",), ("moe", "moe_act"))]
    assert 0 < t[0] < t[1] and t[2] == t[1]  # "moe" covers "moe_act"


def test_columns_round_trip():
    cfgs = [BASE, BASE.replace(recompute="full", recompute_layers=4),
            BASE.replace(recompute="selective", recompute_modules=("layernorm", "mlp"))]
    L = Layouts.of(L8, cfgs)
    assert list(L.rc_layers) == [-1, 4, -1]
    L.split, L.splits = np.zeros(3, np.int64), [{}]  # as search_spaces.columns makes rows: from the columns
    for i, c in enumerate(cfgs):
        L.configs[i] = None
        assert L.key(i) == c.key() and L.config(i) == c
    assert cfgs[1].key().endswith("-full-rcl4") and cfgs[2].key().endswith("-rcm[layernorm+mlp]")
    assert Layouts.of(L8, [BASE]).rc_layers is None and Layouts.of(L8, [BASE]).rc_modules is None


def test_frozen_predictions_hold_through_the_new_path():
    """Frozen predict entries with selective / full recompute, run again with the knobs naming what
    the defaults mean (("core_attn",); block on every layer of a chunk): the partial-recompute path
    gives the frozen numbers (1e-9)."""
    fz = load_bench("freeze_predictions")
    from advisor.api import resolve
    seen = {"selective": 0, "full": 0}
    for e in fz.load():
        rc = e.get("cfg", {}).get("recompute")
        if e["call"] != "predict" or "cap" in e or rc not in seen or seen[rc] >= 6:
            continue
        cfg = TrainConfig(**e["cfg"])
        if rc == "full":
            m, _ = resolve(fz.model_path(e["model"]), e["cluster"])
            knob = {"recompute_layers": max(pipeline_plan(m, cfg).chunk_layers)}
        else:
            knob = {"recompute_modules": ["core_attn"]}
        out = fz.plain(fz.run({**e, "cfg": {**e["cfg"], **knob}}))
        keep = ("peak_memory_gib", "step", "memory")
        bad = [d for d in fz.diff({k: out[k] for k in keep}, {k: e["out"][k] for k in keep}) if "key" not in d]
        assert not bad, (e["id"], bad[:3])
        seen[rc] += 1
    assert seen == {"selective": 6, "full": 6}


def test_arguments():
    full4 = BASE.replace(recompute="full", recompute_layers=4)
    kw = MA.transformer_config_kwargs(L8, full4)
    assert (kw["recompute_granularity"], kw["recompute_method"], kw["recompute_num_layers"]) == ("full", "block", 4)
    sel = BASE.replace(recompute="selective", recompute_modules=("layernorm", "mlp"))
    assert MA.transformer_config_kwargs(L8, sel)["recompute_modules"] == ["layernorm", "mlp"]
    a = MA.megatron_lm_args(L8, full4, 5, runner=True)
    assert a[a.index("--recompute-method") + 1] == "block" and a[a.index("--recompute-num-layers") + 1] == "4"
    a = MA.megatron_lm_args(L8, sel, 5, runner=False)
    i = a.index("--recompute-modules")
    assert a[i + 1:i + 3] == ["layernorm", "mlp"]
    # the defaults' arguments as before: uniform 1 layer, core_attn unnamed outside the runner
    assert MA.recompute_settings(BASE.replace(recompute="full"))["recompute_method"] == "uniform"
    assert "--recompute-modules" not in MA.megatron_lm_args(L8, BASE.replace(recompute="selective"), 5, runner=False)
    br = C.bridge_overrides(sel, 5)
    assert "model.recompute_modules=[layernorm,mlp]" in br and "model.recompute_granularity=selective" in br
    assert "model.recompute_method=block" in C.bridge_overrides(full4, 5)
    assert not any("recompute_modules" in x for x in C.bridge_overrides(BASE.replace(recompute="selective"), 5))
    assert "model.config.recompute_num_layers=4" in C.nemo_overrides(full4, 5)


@pytest.mark.parametrize("values, msg", [
    ({"recompute_layers": -1}, "recompute_layers"),
    ({"recompute_layers": 1.5}, "recompute_layers"),
    ({"recompute_modules": ["mlp", "attention"]}, "unknown module 'attention'"),
    ({"recompute_modules": 3}, "list of module names"),
])
def test_layout_values_refuse(values, msg):
    with pytest.raises(InputError, match=msg):
        layout_values(values)


def test_layout_values_accept():
    out = layout_values({"recompute_layers": 4.0, "recompute_modules": "layernorm, mlp"})
    assert out["recompute_layers"] == 4 and out["recompute_modules"] == ("layernorm", "mlp")


def test_campaign_batch_runs_the_knobs():
    T = load_bench("te_campaign")
    jobs = T.BATCHES["x4-te-s26-recompute"]()
    assert len(jobs) <= 6
    ids = [j["id"] for j in T.all_jobs()]
    assert len(ids) == len(set(ids))
    entries = [M.entry_from_line(j, 4) for j in jobs]
    assert not [e.id for e in entries if e.refused]
    assert [e.config.recompute_layers for e in entries[:3]] == [0, 4, 8]
    assert [e.config.recompute_modules for e in entries[3:]] == [("mlp",), ("layernorm", "mlp"), ("moe_act",)]
    from advisor.runners.jobs import job_for
    tcs = [job_for(e, i)["tc"] for i, e in enumerate(entries)]  # what the worker builds TransformerConfig from
    assert [(t["recompute_granularity"], t["recompute_method"], t["recompute_num_layers"]) for t in tcs[:3]] == [
        ("full", "block", 0), ("full", "block", 4), ("full", "block", 8)]
    assert [t["recompute_modules"] for t in tcs[3:]] == [["mlp"], ["layernorm", "mlp"], ["moe_act"]]
    assert all("recompute_method" not in t for t in tcs[3:])
    written = (T.CONFIGS / "x4-te-s26-recompute.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in written] == jobs


def test_layout_from_flags_carries_the_knobs():
    from advisor.api import layout_from_flags
    cl = load_cluster("h100x8")
    cfg = layout_from_flags(L8, cl, {"pp": 2, "mbs": 1, "gbs": 16, "recompute": "selective",
                                     "recompute_modules": ["mlp", "layernorm"]})
    assert cfg.recompute_modules == ("layernorm", "mlp")
    cfg = layout_from_flags(L8, cl, {"pp": 2, "mbs": 1, "gbs": 16, "recompute": "full", "recompute_layers": 3})
    assert cfg.recompute_layers == 3
    with pytest.raises(SpecError, match="recompute_layers needs recompute 'full'"):
        layout_from_flags(L8, cl, {"pp": 2, "mbs": 1, "gbs": 16, "recompute_layers": 3})


def test_moe_recompute_re_runs_the_blocks_memory_bound_work():
    """"moe" re-runs the MoE block's own memory-bound work (router, permutation, experts): one MoE
    layer's memory-bound forward (step_time.layer_forward) less the passes outside the block, more
    than nothing and less than the layer's; and all of the layer's EP all-to-all."""
    from advisor.models.recompute import module_forward_parts
    from advisor.models.stages import memo_for
    from advisor.models.step_time import StageTime, layer_forward, layer_links
    moe = load_model("mixtral-8x7b").with_layers(4)
    cfg = TrainConfig(dp=4, ep=4, gbs=16, mbs=1)
    one = StageTime(stage=0)
    layer_forward(moe, 0, cfg, H100, DEFAULT, one, *layer_links(memo_for(moe, H100, DEFAULT), 1, 1, 4, 1), [0.0, 0.0])
    parts = module_forward_parts(moe, 0, cfg, DEFAULT, H100.gpu.hbm_bandwidth_gbs * 1e9, ("moe",))
    own = parts[4] + parts[5] * one.memory_bound_s
    assert 0 < own < one.memory_bound_s and parts[3] == 1.0

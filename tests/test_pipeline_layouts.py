"""Uneven pipelines: megatron-core's --account-for-embedding/loss-in-pipeline-split and
--pipeline-model-parallel-layout in the layout rules, the search space, the per-stage models, the
Megatron arguments and the CLI; the published H100 presets are legal, scored and enumerated."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from advisor.api import default_gbs, layout_from_flags, recommend, resolve
from advisor.catalog import load_cluster, load_model
from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig
from advisor.models import predict
from advisor.models.memory import stage_memory
from advisor.models.step_time import step_time
from advisor.runners import megatron_args as MA
from advisor.search_spaces.layout import (bubble_fraction, in_flight_chunks, in_flight_microbatches,
                                          parse_pipeline_layout, pipeline_plan, stage_layers, violations)
from advisor.search_spaces.space import SpaceOptions, Workload, balanced_layout, enumerate_layouts, split_choices
from test_search_and_cli import run_cli

PRESETS = Path(__file__).parent / "data" / "published_h100_presets.csv"
CATALOG = {"llama3_8b": "llama3-8b", "llama3_70b": "llama3-70b", "llama3.1_405b": "llama3.1-405b",
           "gpt3_175b": "gpt3-175b", "nemotron4_340b": "nemotron4-340b", "qwen3_30b_a3b": "qwen3-30b-a3b",
           "qwen3_235b_a22b": "qwen3-235b-a22b", "deepseek_v3": "deepseek-v3"}


def _cfg(**kw) -> TrainConfig:
    kw.setdefault("dp", 1)
    kw.setdefault("gbs", kw["dp"] * kw.get("pp", 1) * 4)
    return TrainConfig(**kw)


# ------------------------------------------------------------------ grammar and plan (megatron-core 0.19.2)

def test_layout_string_grammar_is_megatron_cores():
    # the examples of megatron-core's own docstrings
    chunks = parse_pipeline_layout("Et*3|(tt|)*29,m|L")
    assert chunks == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert parse_pipeline_layout("E|(tt|)*2,(t|)*4,mL") == ["E", "tt", "tt", "t", "t", "t", "t", "mL"]
    assert parse_pipeline_layout("E|(t|)*3,m|m||L")[-2:] == ["", "L"]  # an empty chunk is allowed
    for bad, needle in (("Et|x|L", "'x' is not a layer letter"), ("E(t|)L", "'(' is not a layer letter")):
        with pytest.raises(SpecError) as e:
            parse_pipeline_layout(bad)
        assert needle in str(e.value)


def test_layout_chunks_are_virtual_stage_major_and_layers_numbered_in_chunk_order():
    ds = load_model("deepseek-v3")
    plan = pipeline_plan(ds, _cfg(pp=8, vp=4, pipeline_layout="Et|(tt|)*30L", gbs=64))
    assert len(plan.chunk_layers) == 32 and plan.chunk_layers[0] == 1 and plan.chunk_layers[-1] == 0
    assert plan.counts == (7, 8, 8, 8, 8, 8, 8, 6) and sum(plan.counts) == 61
    assert (plan.embedding_rank, plan.loss_rank) == (0, 7)
    # rank 0 holds chunks 0, 8, 16, 24: layer 0, then 15-16, 31-32, 47-48
    assert stage_layers(ds, _cfg(pp=8, vp=4, pipeline_layout="Et|(tt|)*30L", gbs=64))[0] == (0, 15, 16, 31, 32, 47, 48)
    # a layout may put the embedding alone on rank 0's first chunk, the loss alone on the last rank's
    alone = pipeline_plan(ds, _cfg(pp=2, pipeline_layout="E" + "t" * 30 + "|" + "t" * 31 + "L"))
    assert alone.counts == (30, 31)


def test_account_for_embedding_and_loss_split_like_megatron():
    m = load_model("llama3.1-405b")  # 126 layers + embedding + loss = 128 = 8 ranks x 8 chunks x 2
    plan = pipeline_plan(m, _cfg(pp=8, vp=8, account_for_embedding=True, account_for_loss=True, gbs=64))
    assert plan.chunk_layers[0] == 1 and plan.chunk_layers[-1] == 1 and set(plan.chunk_layers[1:-1]) == {2}
    assert plan.counts == (15, 16, 16, 16, 16, 16, 16, 15)
    only_loss = pipeline_plan(m, _cfg(pp=127, account_for_loss=True))  # 127 = 126 + loss
    assert only_loss.counts[-1] == 0 and set(only_loss.counts[:-1]) == {1}
    # Qwen3-235B: 94 + 2 = 96 over PP8 VP4, 3 per chunk
    q = pipeline_plan(load_model("qwen3-235b-a22b"), _cfg(pp=8, vp=4, account_for_embedding=True,
                                                          account_for_loss=True, gbs=64))
    assert q.counts == (11, 12, 12, 12, 12, 12, 12, 11)


@pytest.mark.parametrize("kw, needle", [
    (dict(pp=8, vp=8), "126 layers do not split evenly over pp=8"),
    (dict(pp=8, vp=8, pp_first_layers=15, pp_last_layers=15), "vp=8 does not divide the 15 layers"),
    (dict(pp=8, vp=3, account_for_embedding=True, account_for_loss=True), "vp=3 does not divide the 16 layers"),
    (dict(pp=8, account_for_embedding=True), "127 do not split evenly over pp=8"),
    (dict(pp=8, account_for_loss=True, pp_first_layers=15), "cannot be combined"),
    (dict(pp=8, vp=2, pipeline_layout="Et|(t*8|)*14t*7L"), "places 120 transformer layers, the model has 126"),
    (dict(pp=8, vp=2, pipeline_layout="Et*8|(t*8|)*14,t*5L", account_for_loss=True), "cannot be combined"),
    (dict(pp=8, vp=4, pipeline_layout="Et*8|(t*8|)*14,t*6L"), "2 virtual stages per rank (16 chunks / pp=8) but vp=4"),
    (dict(pp=3, pipeline_layout="Et*8|(t*8|)*14,t*6L"), "not a multiple of pp=3"),
    (dict(pp=2, pipeline_layout="t*63E|t*63L"), "the embedding 'E' must come exactly once, first"),
    (dict(pp=2, pipeline_layout="Et*63|t*62mL"), "multi-token-prediction"),
])
def test_illegal_splits_name_their_rule(kw, needle):
    m = load_model("llama3.1-405b")
    v = violations(m, None, _cfg(**kw))
    assert any(needle in x for x in v), v


# ----------------------------------------------------------------------- the search space

def test_split_choices_uneven_only_where_even_is_impossible():
    opts = SpaceOptions()
    assert split_choices(80, 4, opts) == [({}, [1, 2, 4, 5, 10, 20])]  # even: VP up to one layer per chunk
    c405 = split_choices(126, 8, opts)
    assert c405[0] == ({"account_for_embedding": True, "account_for_loss": True}, [1, 2, 4, 8, 16])
    assert not any("pp_first_layers" in s for s, _ in c405)  # first/last only when accounting cannot split
    ds = split_choices(61, 8, opts)
    assert ({"pp_first_layers": 6, "pp_last_layers": 7}, [1]) in ds
    assert ({"pipeline_layout": "Et|(tt|)*30L"}, [4]) in ds
    assert balanced_layout(61, 8, 4) == "Et|(tt|)*30L"  # Megatron-LM's DeepSeek-V3 layout without MTP
    for L, pp in ((61, 8), (61, 4), (94, 16), (126, 16), (61, 2)):  # every generated layout is legal and balanced
        for split, vps in split_choices(L, pp, opts):
            if "pipeline_layout" in split:
                plan = pipeline_plan(L, _cfg(pp=pp, vp=vps[0], **split))
                units = [n + (r == plan.embedding_rank) + (r == plan.loss_rank) for r, n in enumerate(plan.counts)]
                assert max(units) - min(units) <= 1, (L, pp, split, plan.counts)


def _rows():
    with open(PRESETS, newline="") as f:
        return [r for r in csv.DictReader(f) if r["model_key"] in CATALOG and not r["num_layers_run"]]


def _preset_cfg(r) -> tuple:
    i = lambda k, d=1: int(r[k]) if r[k] else d  # noqa: E731
    tp, pp, cp, vp, ep = i("tp"), i("pp"), i("cp"), i("vp"), i("ep")
    gpus = int(r["num_gpus"])
    return (CATALOG[r["model_key"]], f"h100x{gpus}", Workload(seq=int(r["seq_len"]), gbs=int(r["gbs"]),
            precision="fp8" if r["precision"].upper().startswith("FP8") else "bf16"),
            dict(tp=tp, pp=pp, cp=cp, vp=vp, ep=ep, mbs=i("mbs"), dp=gpus // (tp * pp * cp)))


EXPECTED_SPLITS = {"llama3.1-405b": {"account_for_embedding": True, "account_for_loss": True},
                   "qwen3-235b-a22b": {"account_for_embedding": True, "account_for_loss": True},
                   "deepseek-v3": {"pipeline_layout": "Et|(tt|)*30L"}}


def test_every_published_h100_preset_is_legal_scored_and_in_the_space():
    rows = _rows()
    assert len(rows) >= 30 and {r["model_key"] for r in rows} >= {"llama3.1_405b", "deepseek_v3", "qwen3_235b_a22b"}
    done = set()
    for r in rows:
        name, cluster, wl, want = _preset_cfg(r)
        if (name, cluster, wl, tuple(want.items())) in done:
            continue
        done.add((name, cluster, wl, tuple(want.items())))
        m, c = resolve(name, cluster)
        found = [cfg for cfg in enumerate_layouts(m, c, wl, SpaceOptions(moe_fusion=True))  # the te stack's space
                 if all(getattr(cfg, k) == v for k, v in want.items()) and cfg.recompute == "none"]
        assert found, f"row {r['row_id']}: {name} {want} on {cluster} is not in the space"
        split = EXPECTED_SPLITS.get(name, {})
        assert any(all(getattr(cfg, k) == v for k, v in split.items()) for cfg in found), (r["row_id"], found)
        cfg = next(cfg for cfg in found if all(getattr(cfg, k) == v for k, v in split.items()))
        assert violations(m, c, cfg) == []
        p = predict(m, c, cfg)
        assert p.tokens_per_s_per_gpu > 0 and 0 < p.mfu < 1 and 0 <= p.bubble_fraction < 1
        # what the published run sets, from `advisor predict` flags: the same layout
        flags = dict(want, gbs=wl.gbs, seq=wl.seq, precision=wl.precision, **split)
        flags.pop("dp")
        if m.is_moe:  # the recipes set ETP 1 (Megatron-Bridge); not given, Megatron takes ETP = TP
            flags.setdefault("etp", cfg.etp)
        if "pipeline_layout" in split:
            flags.pop("vp")  # implied by the layout
        assert layout_from_flags(m, c, flags).key() == cfg.key()
    assert len(done) >= 15


def test_nvidia_405b_preset_the_issue_named():
    m, c = resolve("llama3.1-405b", "h100x1024")
    base = dict(tp=8, pp=8, cp=2, vp=8, mbs=1, gbs=1536, seq=8192)
    with pytest.raises(SpecError, match="126 layers do not split evenly over pp=8"):
        from advisor.api import predict_layout
        predict_layout(m, c, base)
    cfg = layout_from_flags(m, c, dict(base, account_for_embedding=True, account_for_loss=True))
    assert violations(m, c, cfg) == [] and cfg.dp == 8
    args = MA.megatron_lm_args(m, cfg)
    assert "--account-for-embedding-in-pipeline-split" in args and "--account-for-loss-in-pipeline-split" in args
    assert args[args.index("--num-virtual-stages-per-pipeline-rank") + 1] == "8"


# --------------------------------------------------------- per-stage memory and time attribution

def test_embedding_and_loss_stages_with_virtual_chunks():
    m, c = load_model("llama3.1-405b"), load_cluster("h100x512")
    even = dict(tp=8, pp=8, dp=8, gbs=512, seq=8192, sequence_parallel=True)
    acc = TrainConfig(vp=8, account_for_embedding=True, account_for_loss=True, **even)
    fl = TrainConfig(vp=1, pp_first_layers=15, pp_last_layers=15, **even)
    mem = stage_memory(m, acc)
    assert mem[-1].logits_gib > 0 and all(s.logits_gib == 0 for s in mem[:-1])
    assert [s.layers for s in mem] == [15, 16, 16, 16, 16, 16, 16, 15]
    # rank 0's first chunk holds one layer (and the embedding), and it holds the most microbatches
    assert mem[0].activations_gib < mem[1].activations_gib
    st = step_time(m, c, acc).stages
    mid = st[3].total_s
    # the first stage: one layer less, the embedding lookup; the last: one layer less plus the output layer
    assert st[0].total_s < mid and st[-1].total_s < mid + (mid / 16)
    assert st[-1].gemm_s > st[0].gemm_s
    # a layout that puts the loss on its own chunk of the last rank
    lay = TrainConfig(vp=2, pipeline_layout="Et*8|(t*8|)*13,t*14|L", **even)
    assert violations(m, None, lay) == []
    lm = stage_memory(m, lay)
    assert lm[-1].logits_gib > 0 and lm[-1].layers == 8 and lm[-2].layers == 22
    assert pipeline_plan(m, fl).counts == pipeline_plan(m, acc).counts  # same layers per rank, other chunks


def test_in_flight_chunks_follow_megatrons_warmup():
    cfg = TrainConfig(pp=4, dp=1, mbs=1, gbs=16, vp=2)
    # warm-up of rank 0: (4-0-1)·2 + (2-1)·4 + 1 = 11 forwards in groups of pp=4 microbatches:
    # 4 through chunk 0, 4 through chunk 1, 3 through chunk 0
    assert in_flight_chunks(cfg, 0) == [7, 4]
    assert in_flight_chunks(cfg, 3) == [4, 1]
    for s in range(4):
        assert sum(in_flight_chunks(cfg, s)) / 2 == in_flight_microbatches(cfg, s)
    assert in_flight_chunks(cfg.replace(vp=1), 1) == [3]


def test_bubble_is_a_share_of_the_step_never_above_one():
    # equal stages (tied embeddings, tiny vocabulary): 16 stages, 8 microbatches: the schedule's
    # ratio is 15/8 = 187.5%, the share of the pipeline time idle 15/23
    m = ModelSpec("uniform", num_layers=32, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32,
                  vocab_size=128, tied_embeddings=True)
    c = load_cluster("h100x128")
    cfg = TrainConfig(tp=1, pp=16, dp=8, gbs=64, mbs=1, seq=4096)
    assert bubble_fraction(cfg) == pytest.approx(15 / 8)
    assert predict(m, c, cfg, check_legal=False).bubble_fraction == pytest.approx(15 / 23, abs=0.01)
    # unequal stages: the lighter ones also wait on the slowest, which the share counts
    uneven = cfg.replace(pp=8, dp=16, gbs=128, pp_first_layers=1, pp_last_layers=1)
    p = predict(m, c, uneven, check_legal=False)
    assert p.bubble_fraction > 7 / (8 + 7) + 0.05
    ds = load_model("deepseek-v3")
    res = recommend(ds, load_cluster("h100x1024"), top=3, calibration=None)
    for r in res.recommendations:
        assert 0 <= r.prediction.bubble_fraction < 1
        assert "% of the pipeline time in the bubble" in r.reason or r.config.pp == 1


# ------------------------------------------------------------------------------ Megatron args

def test_megatron_args_for_layouts():
    m = load_model("deepseek-v3")
    cfg = TrainConfig(tp=2, pp=8, vp=4, ep=64, dp=64, gbs=8192, seq=4096, pipeline_layout="Et|(tt|)*30L")
    a = MA.megatron_lm_args(m, cfg)
    assert a[a.index("--pipeline-model-parallel-layout") + 1] == "Et|(tt|)*30L"
    # Megatron-LM allows only one of the layout and --num-virtual-stages-per-pipeline-rank
    assert "--num-virtual-stages-per-pipeline-rank" not in a and "--decoder-first-pipeline-num-layers" not in a
    kw = MA.transformer_config_kwargs(m, cfg)
    assert kw["pipeline_model_parallel_layout"] == "Et|(tt|)*30L" and kw["virtual_pipeline_model_parallel_size"] == 4
    acc = MA.transformer_config_kwargs(m, cfg.replace(pipeline_layout=None, pp=1, vp=1, account_for_loss=True))
    assert acc["account_for_loss_in_pipeline_split"] and not acc["account_for_embedding_in_pipeline_split"]


def test_config_records_without_the_new_fields_load_and_keep_their_keys():
    old = {"tp": 2, "pp": 4, "dp": 8, "vp": 2, "mbs": 1, "gbs": 64, "seq": 4096, "recompute": "selective"}
    cfg = TrainConfig.from_dict(old)
    assert cfg.key() == "tp2-pp4-dp8-cp1-ep1-etp1-vp2-mbs1-gbs64-seq4096-bf16-selective"
    assert (cfg.account_for_embedding, cfg.account_for_loss, cfg.pipeline_layout) == (False, False, None)
    new = cfg.replace(account_for_embedding=True, account_for_loss=True)
    assert new.key().endswith("-acce-accl") and TrainConfig.from_dict(new.to_dict()) == new
    with pytest.raises(SpecError, match="pipeline_layout"):
        TrainConfig(pipeline_layout="")


# ------------------------------------------------------------------------------------- CLI

def test_predict_cli_takes_the_split_flags():
    r = run_cli("predict", "-m", "llama3.1-405b", "-c", "h100x1024", "--tp", "8", "--pp", "8", "--cp", "2",
                "--vp", "8", "--gbs", "1536", "--account-for-embedding", "--account-for-loss",
                "--recompute", "full", "--calibration", "none", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["config"]["account_for_embedding"] and d["config"]["account_for_loss"] and d["config"]["dp"] == 8
    r = run_cli("predict", "-m", "deepseek-v3", "-c", "h100x1024", "--tp", "2", "--pp", "8", "--ep", "64",
                "--gbs", "8192", "--seq", "4096", "--pipeline-layout", "Et|(tt|)*30L", "--recompute", "full",
                "--calibration", "none", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["vp"] == 4  # implied by the 32 chunks over pp=8
    bad = run_cli("predict", "-m", "deepseek-v3", "-c", "h100x1024", "--tp", "2", "--pp", "8", "--ep", "64",
                  "--gbs", "8192", "--pipeline-layout", "Et|(tt|)*30mL")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: illegal layout: pipeline layout") and "multi-token" in bad.stderr


# -------------------------------------------------------------------- defaults and warnings at scale

def test_default_gbs_grows_with_the_cluster_like_public_recipes():
    assert default_gbs(64, 8192) == 128  # as before on small clusters (NVIDIA's 70B preset: 128)
    assert default_gbs(1024, 8192) == 1024  # 8M tokens (405B presets on 1024 H100: 512 and 1536)
    assert default_gbs(16384, 8192) == 2048  # Llama 3 405B: 16M tokens
    assert default_gbs(6144, 4096) == 3072  # Megatron-LM's weak scaling on 6144 H100: 3072
    assert default_gbs(48, 8192) == 192  # a multiple of every DP of 48 GPUs up to 64
    for world in (8, 24, 48, 96, 256, 1024, 3072, 16384):
        g = default_gbs(world, 8192)
        assert g >= 128 and all(g % dp == 0 for dp in range(1, world + 1) if world % dp == 0 and dp <= g
                                and (dp & -dp) <= (g & -g))


def test_recommend_warns_about_dp1_bubbles_and_low_mfu_with_cause_and_fix():
    res = recommend("llama3.1-405b", "h100x1024", gbs=32, top=1, calibration=None)
    top = res.recommendations[0]
    assert top.config.dp == 1 and top.prediction.bubble_fraction > 0.15
    assert len(res.warnings) == 1 and "DP=1" in res.warnings[0] and "only 32 microbatches" in res.warnings[0]
    assert "fix: raise --gbs (e.g. --gbs 1024" in res.warnings[0]
    assert res.to_dict()["warnings"] == res.warnings
    ok = recommend("llama3.1-405b", "h100x1024", top=1, calibration=None)  # the default gbs: 1024
    assert ok.workload.gbs == 1024 and not (ok.recommendations[0].config.dp == 1
                                            and ok.recommendations[0].prediction.bubble_fraction > 0.15)
    r = run_cli("recommend", "-m", "llama3.1-405b", "-c", "h100x1024", "--gbs", "16", "--top", "1",
                "--calibration", "none")
    assert r.returncode == 0, r.stderr
    warn = [x for x in r.stdout.splitlines() if x.startswith("warning: ")]
    assert any("DP=1" in w for w in warn) and any("MFU" in w and "the pipeline bubble takes" in w for w in warn)
    assert all("fix: raise --gbs" in w for w in warn)


# ------------------------------------------- megatron-core's own placement, recorded on the device

MEGATRON_CHECK = Path(__file__).resolve().parents[1] / "data" / "layout" / "h100x1-megatron-core-0.19.2-layout-check.jsonl"


def test_plans_equal_megatron_cores_recorded_placement():
    """bench/megatron_layout_check.py asked megatron-core 0.19.2 (get_num_layers_to_build /
    get_transformer_layer_offset) where every split of the space puts each chunk's layers; today's
    pipeline_plan must give the same, and every recorded argument line parsed, validated and built
    a TransformerConfig."""
    rows = [json.loads(x) for x in MEGATRON_CHECK.read_text().splitlines()]
    splits = [r for r in rows if r["check"] == "split"]
    assert len(splits) >= 150 and {bool(r["layout"]) for r in splits} == {True, False}
    for r in splits:
        cfg = TrainConfig(pp=r["pp"], vp=r["vp"], gbs=r["pp"] * 4, pp_first_layers=r["first"],
                          pp_last_layers=r["last"], account_for_embedding=r["acc_e"], account_for_loss=r["acc_l"],
                          pipeline_layout=r["layout"])
        ours = [[x.start, len(x)] for x in pipeline_plan(r["layers"], cfg).chunk_ranges]
        assert ours == r["megatron"], r
    args = [r for r in rows if r["check"] == "args" and "parsed" in r]
    assert len(args) >= 20 and all(r["parsed"] and r["validated"] and r["config"] for r in args)
    assert {r["model"] for r in args if "--pipeline-model-parallel-layout" in r["args"]} >= {"deepseek-v3"}
    assert any("--account-for-embedding-in-pipeline-split" in r["args"] for r in args)


def test_published_pretraining_presets_fit_in_memory_under_the_te_profile():
    """Under the te profile (bf16 gradient buffers: megatron-core's DDP with grad_reduce_in_fp32 off,
    as the recipes set it), NVIDIA's dense pretraining presets fit the 80 GB H100 they ran on.
    Left out, each for a reason the model does not cover: LoRA rows (not pretraining), rows run
    with FSDP (llama3-8b DP8: the FSDP column), and the MoE / 340B rows whose TE activation memory
    is not measured (docs/moe.md, 'Not run, and limits')."""
    from advisor.api import predict_layout

    checked = set()
    for r in _rows():
        if r["task"] != "pretrain" or "FSDP" in r["notes"] or r["model_key"] in (
                "deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b", "nemotron4_340b"):
            continue
        name, cluster, wl, want = _preset_cfg(r)
        split = EXPECTED_SPLITS.get(name, {})
        flags = dict(want, gbs=wl.gbs, seq=wl.seq, precision=wl.precision, **split)
        flags.pop("dp")
        flags.setdefault("etp", 1)  # the recipes set ETP 1 (Megatron-Bridge); not given, Megatron takes ETP = TP
        key = (name, cluster, tuple(sorted(flags.items())))
        if key in checked:
            continue
        checked.add(key)
        m, c = resolve(name, cluster)
        _, p = predict_layout(m, c, flags, stack="te")
        assert p.memory_gib_per_gpu <= c.gpu.memory_gib, (r["row_id"], name, want, p.memory_gib_per_gpu)
    assert len(checked) >= 8

"""The recipes behind the published rows (models/published_recipes.py): lookup by precision,
container and config variant, pending settings applied or named, the read config's layout gate,
and row 630's swapped batch columns."""
from __future__ import annotations

import pytest

from advisor.models import published as P
from advisor.models import published_recipes as R
from advisor.search_spaces.layout import parse_pipeline_layout

BMB = "megatron_bridge_perf_summary"


@pytest.fixture(scope="module")
def by_id():
    return {r.row_id: r for r in P.load()}


def test_lookup_depends_on_precision_fsdp_and_variant():
    gb200_fp8 = R.recipe_settings(BMB, "llama3_70b", "GB200", True, "fp8")
    gb200_bf16 = R.recipe_settings(BMB, "llama3_70b", "GB200", True, "bf16")
    assert gb200_fp8.pending == {"cpu_offload_layers": 40} and gb200_fp8.layout["mbs"] == 2
    assert gb200_bf16.pending == {"cpu_offload_layers": 20} and gb200_bf16.layout["mbs"] == 1
    assert R.recipe_settings(BMB, "llama3_70b", "GB300", True, "fp8").pending == {"cpu_offload_layers": 20}
    assert R.recipe_settings(BMB, "llama3_70b", "GB200", False, "fp8") is None  # the FP8_CS preset is FSDP
    mx = R.recipe_settings(BMB, "llama3_70b", "GB200", False, "mxfp8")
    assert mx.layout == {"tp": 2, "pp": 4, "vp": 5, "cp": 1, "ep": 1, "mbs": 1} and mx.fields["tp_comm_overlap"]
    assert not R.recipe_settings(BMB, "llama3_70b", "GB200", False, "nvfp4").fields["tp_comm_overlap"]
    # Llama 3.1 405B GB200 NVFP4: V1 (GBS 64) recomputes one layer per stage, V2 (GBS 1536) sets it None
    assert R.recipe_settings(BMB, "llama3.1_405b", "GB200", False, "nvfp4", gbs=64).pending == {"recompute_layers": 1}
    assert R.recipe_settings(BMB, "llama3.1_405b", "GB200", False, "nvfp4", gbs=1536).pending == {}
    assert R.precision_class("fp8", "blockwise") == "fp8_blockwise" and R.precision_class("fp8", "tensorwise") == "fp8"


def test_a_recipe_keyed_by_container_matches_only_that_container():
    rec = R.Recipe(BMB, "m", "GB200", R.RecipeSettings({}, "src"), containers=frozenset({"NeMo container 26.02"}))
    assert rec.matches(BMB, "m", "GB200", False, "fp8", "NeMo container 26.02", 64)
    assert not rec.matches(BMB, "m", "GB200", False, "fp8", "NeMo container 26.04", 64)
    assert not rec.matches(BMB, "m", "GB200", True, "fp8", "NeMo container 26.02", 64)  # FSDP is part of the key


def test_pending_is_applied_when_trainconfig_has_the_field_else_named():
    names = R.trainconfig_fields()
    applied, missing = R.split_pending({"cpu_offload_layers": 40, "recompute_modules": ("mlp",)},
                                       names - {"cpu_offload_layers", "recompute_modules"})
    assert applied == {} and len(missing) == 2 and missing[0].startswith("cpu_offload_layers=40")
    applied, missing = R.split_pending({"cpu_offload_layers": 40, "recompute_modules": ("mlp",)},
                                       names | {"cpu_offload_layers", "recompute_modules"})
    assert applied == {"cpu_offload_layers": 40, "recompute_modules": ("mlp",), "recompute": "selective"}
    assert missing == ()
    applied, _ = R.split_pending({"recompute_layers": 1}, names | {"recompute_layers"})
    assert applied == {"recompute_layers": 1, "recompute": "full"}


def test_the_loader_applies_a_pending_setting_trainconfig_has(monkeypatch, by_id):
    """A pending key that is a TrainConfig field reaches the row's config and its explicit set."""
    key = next(r for r in R.RECIPES if r.model_key == "llama3.1_405b" and r.gpu_type == "GB200" and r.fsdp)
    s = key.settings
    patched = R.Recipe(key.source_group, key.model_key, key.gpu_type, R.RecipeSettings(
        s.fields, s.source, s.unmodelled, s.notes, {"cuda_graph_scope": "full_iteration", "nccl_lazy_init": True}, s.layout),
        key.fsdp, key.precisions, key.containers, key.gbs)
    monkeypatch.setattr(R, "RECIPES", (patched,) + tuple(r for r in R.RECIPES if r is not key))
    row = next(r for r in P.load() if r.row_id == "305")
    assert row.cfg.nccl_lazy_init and "nccl_lazy_init" in row.explicit
    assert any(u.startswith("cuda_graph_scope='full_iteration'") for u in row.unmodelled)  # not a field
    assert "nccl_lazy_init" not in by_id["305"].explicit  # the shipped recipe has no such setting


def test_rows_get_their_recipe_only_where_the_layout_is_the_read_configs(by_id):
    r305 = by_id["305"]  # GB200 405B FSDP V1 (GBS 64): cpu_offloading_num_layers 92 (TrainConfig.cpu_offload_layers)
    assert r305.cfg.fsdp and r305.cfg.account_for_embedding and r305.cfg.account_for_loss
    assert r305.cfg.cpu_offload_layers == 92 and "cpu_offload_layers" in r305.explicit
    assert not any(u.startswith("cpu_offload_layers") for u in r305.unmodelled)
    r126 = by_id["126"]  # B200 DeepSeek-V3 MXFP8 V2: its pp_layout less the MTP layer, flex dispatcher
    assert r126.cfg.pipeline_layout == "Et*4|(t*4|)*14tL" and r126.cfg.moe_dispatcher == "flex"
    assert r126.cfg.moe_a2a_overlap and {"pipeline_layout", "moe_dispatcher"} <= r126.explicit
    assert any("multi-token-prediction" in u for u in r126.unmodelled)
    assert r126.cfg.recompute == "selective" and r126.cfg.recompute_modules == ("mla_up_proj", "mlp")
    r123 = by_id["123"]  # GB300 DeepSeek-V3 MXFP8 at mbs 2: the newest FP8_MX preset runs mbs 1, the earlier
    assert r123.cfg.pipeline_layout == "Et*4|(t*4|)*14tL"  # version's (GB300_V1 for every precision) mbs 2
    assert any("earlier version" in a for a in r123.assumptions)
    assert r123.cfg.recompute_modules == ("mla_up_proj",)
    r171 = by_id["171"]  # B300 DeepSeek-V3 MXFP8 PP16 (26.04): no version read prints that layout
    assert r171.explicit == frozenset() and r171.unmodelled == ()
    assert any(a.startswith("recipe read") for a in r171.assumptions)


def test_later_config_versions_are_keyed_to_the_containers_that_print_their_layout(by_id):
    """B300 DeepSeek-V3 V2 at PP8 (no VP) mbs 2 (rows 78 / 125: containers 26.06 / 26.04.01) and the
    perf_matrix-era Qwen3 30B-A3B H100 PP2 VP24 mbs 2 (rows 299 / 327: containers 25.11 / 25.09)."""
    for rid in ("78", "125"):
        r = by_id[rid]
        assert r.cfg.recompute == "selective" and r.cfg.recompute_modules == ("mla_up_proj",)
        assert r.cfg.moe_dispatcher == "flex" and not r.cfg.moe_a2a_overlap
        assert any(u.startswith("cuda_graph_impl transformer_engine") for u in r.unmodelled)
        assert not any(a.startswith("recipe read") for a in r.assumptions)
    ds = R.recipes_for(BMB, "deepseek_v3", "B300", False, "mxfp8", "NeMo container 26.04", 4096)
    assert all(s.layout != {"tp": 1, "pp": 8, "vp": 1, "cp": 1, "ep": 8, "mbs": 2} for s in ds)  # not 26.04's
    for rid in ("299", "327"):
        r = by_id[rid]
        assert r.cfg.recompute == "none" and r.cfg.moe_router_fusion and r.cfg.cross_entropy_impl == "te"
        assert {"moe_router_fusion", "recompute"} <= r.explicit
    assert R.recipe_settings(BMB, "qwen3_30b_a3b", "H100", False, "fp8", "NeMo container 26.02", 1024) is None


def test_every_recipe_layout_is_consistent():
    """A recipe's pipeline layout has pp x vp chunks of its own layout, and the model's layers."""
    from advisor.catalog import load_model

    checked = 0
    for rec in R.RECIPES:
        lay = rec.settings.fields.get("pipeline_layout")
        if lay:
            chunks = parse_pipeline_layout(lay)
            assert len(chunks) == rec.settings.layout["pp"] * rec.settings.layout["vp"], (rec, lay)
            assert sum(c.count("t") for c in chunks) == load_model(P.CATALOG[rec.model_key]).num_layers
            checked += 1
    assert checked >= 4


def test_swapped_batch_columns_are_read_from_the_rows_own_ga(by_id):
    assert P.read_batch(1, 64, 4, 16)[:2] == (64, 1)
    assert P.read_batch(64, 1, 4, 16) == (64, 1, "")  # a batch that runs is kept
    assert P.read_batch(1, 64, 4, None) == (1, 64, "")  # no GA printed: nothing to check the swap with
    assert P.read_batch(1, 64, 4, 8) == (1, 64, "")  # the swap does not give the row's GA: kept as printed
    r630 = by_id["630"]
    assert (r630.cfg.gbs, r630.cfg.mbs, r630.cfg.dp) == (64, 1, 4)
    assert any("read swapped" in a for a in r630.assumptions)
    # NeMo's model_configs_b200.csv runs this layout at mbs 1 / gbs 64: its recipe matches only the swapped reading
    assert "cross_entropy_impl" in r630.explicit and not any(a.startswith("recipe read") for a in r630.assumptions)


def test_nemo_blackwell_rows_get_the_recommended_configs_line(by_id):
    r634 = by_id["634"]  # GB200 llama3-70b FP8: use_mcore_fsdp 1, no recompute, no offload
    assert r634.cfg.fsdp and r634.explicit == frozenset({"recompute", "cross_entropy_impl"})
    assert r634.cfg.cross_entropy_impl == "native" and r634.unmodelled == ()
    r635 = by_id["635"]  # GB200 405B FP8 as printed (TP4 PP8 CP2 VP8, no FSDP) is not the CSV's fp8 line (TP2 FSDP)
    # no recipe read: only NeMo 2.0's cross entropy (published_recipes.SOURCE_DEFAULTS)
    assert r635.explicit == frozenset({"cross_entropy_impl"}) and not r635.cfg.fsdp
    assert r635.cfg.cross_entropy_impl == "native"
    nemo = R.recipe_settings("nemo_framework_docs_perf_summary", "llama3.1_405b", "GB200", True, "fp8")
    assert nemo.pending == {"cpu_offload_layers": 95} and nemo.layout["tp"] == 2

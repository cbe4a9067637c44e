"""The 2025-26 model families from their published config.json (tests/data/hf_configs, each file's
`_source` names the model repository it was copied from) and their per-layer attention physics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.catalog import load_model
from advisor.catalog.errors import CatalogError
from advisor.catalog.hf import model_from_hf_config
from advisor.catalog.specs import TrainConfig
from advisor.models.flops import (active_params, attention_core_flops_per_token, keys_per_query,
                                  total_params, training_flops_per_token)

HF = Path(__file__).parent / "data" / "hf_configs"


# Published sizes (total parameters of the language model):
# - Gemma 2: the HF checkpoints hold 9,241,705,984 (gemma-2-9b) and 27,227,128,320 (gemma-2-27b);
# - Gemma 3 technical report, Table 1: 1B = 302M embedding + 698M non-embedding; 27B = 1,416M +
#   25,600M (its 417M vision encoder is not part of the language model);
# - Phi-3-mini: 3,821,079,552 (checkpoint); Phi-4: 14,659,507,200 (checkpoint; "14B" card);
# - OLMo 2 model cards: 7B = 7.30B, 13B = 13.7B; Granite 3.1 cards: 8B = 8.17B, 3B-A800M = 3.30B;
# - GLM-4-9B-0414: 9.40B (checkpoint); GLM-4.5 card: 355B total (its MTP layer,
#   num_nextn_predict_layers = 1, is in that count and not in the trained decoder here: -0.6%);
# - Llama 4 Maverick card: 400B total (text); gpt-oss-120b card: 116.83B (117B) total.
PUBLISHED = [
    ("gemma-2-9b.json", 9_241_705_984), ("gemma-2-27b.json", 27_227_128_320),
    ("gemma-3-1b.json", 1_000e6), ("gemma-3-27b.json", 27_016e6),
    ("phi-3-mini-4k.json", 3_821_079_552), ("phi-4.json", 14_659_507_200),
    ("olmo-2-7b.json", 7.30e9), ("olmo-2-13b.json", 13.7e9),
    ("granite-3.1-8b.json", 8.17e9), ("granite-3.1-3b-a800m.json", 3.30e9),
    ("glm-4-9b-0414.json", 9.40e9), ("glm-4.5.json", 355e9),
    ("llama-4-maverick.json", 400e9), ("gpt-oss-120b.json", 116.83e9),
]


@pytest.mark.parametrize("fixture, published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_sizes_within_one_percent(fixture, published):
    m = load_model(str(HF / fixture))
    assert total_params(m) == pytest.approx(published, rel=0.01)
    assert "_source" in json.loads((HF / fixture).read_text())


def test_gemma2_fields():
    m = load_model(str(HF / "gemma-2-9b.json"))
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_dim) == (42, 3584, 16, 8, 256)
    assert m.kv_channels == 256  # decoupled from hidden / heads = 224
    assert m.tied_embeddings and m.norm_placement == "pre+post" and m.norms_per_layer == 4
    assert (m.attn_logit_softcap, m.final_logit_softcap) == (50.0, 30.0)
    # transformers' Gemma2: even layers local (4096), odd layers global
    assert [m.layer_window(i) for i in range(4)] == [4096, 0, 4096, 0]


def test_gemma3_text_and_multimodal_fields():
    one = load_model(str(HF / "gemma-3-1b.json"))
    assert one.qk_norm == "head" and one.window_size == 512 and one.window_pattern == (1, 1, 1, 1, 1, 0)
    assert [i for i in range(one.num_layers) if not one.layer_window(i)] == [5, 11, 17, 23]
    big = load_model(str(HF / "gemma-3-27b.json"))  # model_type gemma3: its sparse text_config
    assert (big.num_layers, big.hidden_size, big.head_dim, big.vocab_size, big.window_size) == (62, 5376, 128, 262208, 1024)
    assert big.family == "gemma3" and big.final_logit_softcap == 0.0


def test_llama4_interleaved_moe_and_chunked_attention():
    mav = load_model(str(HF / "llama-4-maverick.json"))
    assert mav.moe.first_dense_layers == 1 and mav.moe.layer_freq == 2  # MoE on layers 1, 3, 5, ...
    assert [mav.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert mav.ffn_hidden_size == 16384 and mav.moe.ffn_hidden_size == 8192 and mav.moe.shared_ffn_hidden_size == 8192
    assert mav.window_type == "chunked" and mav.window_size == 8192
    assert [mav.layer_window(i) for i in range(8)] == [8192, 8192, 8192, 0] * 2  # every 4th global (NoPE)
    assert mav.nope_pattern == (0, 0, 0, 1) and mav.qk_norm == "none"
    scout = load_model(str(HF / "llama-4-scout.json"))
    assert scout.moe.layer_freq == 1 and scout.moe.num_experts == 16 and scout.qk_norm == "l2"
    # both activate the same 17B: one routed + one shared expert of 8192, 48 layers
    assert active_params(scout) == pytest.approx(active_params(mav), rel=0.01)


def test_glm4_moe_and_granitemoe_and_olmo2_fields():
    glm = load_model(str(HF / "glm-4.5.json"))
    assert glm.moe.first_dense_layers == 3 and glm.moe.num_shared_experts == 1 and glm.moe.dense_ffn_hidden_size == 12288
    assert glm.qk_norm == "head" and glm.qkv_bias and glm.rotary_percent == 0.5
    g = load_model(str(HF / "granite-3.1-3b-a800m.json"))
    assert (g.moe.num_experts, g.moe.top_k, g.moe.ffn_hidden_size) == (40, 8, 512) and g.tied_embeddings
    o = load_model(str(HF / "olmo-2-7b.json"))
    assert o.qk_norm == "full" and o.norm_placement == "post" and o.norms_per_layer == 2
    # the full-width q and k norms: 2 x 4096 weights per layer more than none
    base = total_params(model_from_hf_config({**json.loads((HF / "olmo-2-7b.json").read_text()),
                                              "model_type": "llama"}, "x"))
    assert total_params(o) - base == 32 * 2 * 4096


def test_gpt_oss_from_config_matches_catalog():
    hf = load_model(str(HF / "gpt-oss-120b.json"))
    cat = load_model("gpt-oss-120b")
    assert hf.attention_sinks and cat.attention_sinks
    assert (hf.window_size, hf.window_pattern) == (cat.window_size, cat.window_pattern) == (128, (1, 0))
    assert total_params(hf) == total_params(cat)


def test_qwen2_window_only_with_use_sliding_window():
    cfg = json.loads((HF / "qwen2-7b.json").read_text())
    assert load_model(str(HF / "qwen2-7b.json")).window_size == 0
    on = model_from_hf_config({**cfg, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}, "x")
    assert [bool(on.layer_window(i)) for i in (0, 19, 20, 27)] == [False, False, True, True]


def test_bad_layer_types_are_one_line_errors():
    cfg = json.loads((HF / "gemma-3-1b.json").read_text())
    with pytest.raises(CatalogError, match="one type per layer"):
        model_from_hf_config({**cfg, "layer_types": ["full_attention"]}, "x")
    with pytest.raises(CatalogError, match="unsupported layer_types"):
        model_from_hf_config({**cfg, "layer_types": ["linear_attention"] * 26}, "x")


# ---------------------------------------------------------------------------------- the physics
def test_keys_per_query_counts_the_mask():
    """Against a brute-force count of the mask (query i, 1-based, sees min(i, w) keys; chunked:
    its position in its block), in the continuous form the model uses (full causal = s / 2)."""
    s = 8192
    for w in (1024, 2048, 4096):
        exact = sum(min(i, w) for i in range(1, s + 1)) / s
        assert keys_per_query(s, w) == pytest.approx(exact, rel=w / s)  # differs by 1/2 key
        assert abs(keys_per_query(s, w) - exact) <= 0.5
    chunk = sum((i % 3000) + 1 for i in range(s)) / s
    assert abs(keys_per_query(s, 3000, "chunked") - chunk) <= 0.5
    assert keys_per_query(s, 0) == keys_per_query(s, s) == keys_per_query(s, 10 * s) == s / 2
    assert keys_per_query(s, 1024, causal=False) == s


def test_windowed_layers_cut_attention_flops_and_time_not_activations():
    from advisor.catalog.loaders import load_cluster
    from advisor.models.memory import layer_activation_bytes
    from advisor.models.step_time import stage_times

    m = load_model(str(HF / "gemma-3-27b.json"))
    import dataclasses
    nowin = dataclasses.replace(m, window_size=0)
    seq = 32768
    loc, glob = attention_core_flops_per_token(m, seq, layer=0), attention_core_flops_per_token(m, seq, layer=5)
    assert glob == attention_core_flops_per_token(nowin, seq)
    assert loc / glob == pytest.approx((1024 - 1024 ** 2 / (2 * seq)) / (seq / 2))
    assert training_flops_per_token(m, seq) < training_flops_per_token(nowin, seq)
    cfg = TrainConfig(tp=4, pp=1, dp=2, gbs=8, seq=seq)
    assert layer_activation_bytes(m, 0, cfg) == layer_activation_bytes(m, 5, cfg)  # flash attention
    cl = load_cluster("h100x8")
    a, b = stage_times(m, cl, cfg)[0], stage_times(nowin, cl, cfg)[0]
    assert a.attention_s < b.attention_s / 3 and a.gemm_s == pytest.approx(b.gemm_s, rel=1e-12)


def test_windowed_layers_under_cp_pay_an_exposed_all_gather():
    import dataclasses

    from advisor.catalog.loaders import load_cluster
    from advisor.models.step_time import stage_times

    m = load_model(str(HF / "gemma-2-9b.json"))
    cl = load_cluster("h100x16")
    cfg = TrainConfig(tp=2, cp=4, dp=2, gbs=8, seq=32768)
    win = stage_times(m, cl, cfg)[0].cp_comm_s
    nowin = stage_times(dataclasses.replace(m, window_size=0), cl, cfg)[0].cp_comm_s
    assert win > nowin  # the ring hides behind full attention; the all-gather does not


def test_window_attention_check_predicts_what_step_time_prices():
    """bench/window_attention_check.py's prediction of a TE attention case is the attention time
    step_time gives one such layer (forward + backward), for a window and for full attention."""
    import dataclasses

    from advisor.catalog.loaders import load_cluster, load_gpu
    from advisor.models.constants import DEFAULT
    from advisor.models.step_time import stage_times
    from support import load_bench

    check = load_bench("window_attention_check")
    gemma = load_model(str(HF / "gemma-2-9b.json"))
    one = dataclasses.replace(gemma, num_layers=1, window_pattern=())  # its one layer windowed
    cl = load_cluster("h100x8")
    for w in (4096, 0):
        m = dataclasses.replace(one, window_size=w)
        row = dict(q_heads=16, kv_heads=8, head_dim=256, seq=16384, window=w, batch=1)
        _, pred = check.predict_case(row, load_gpu("h100"), DEFAULT)
        st = stage_times(m, cl, TrainConfig(tp=1, dp=8, gbs=8, seq=16384), DEFAULT)[0]
        assert pred == pytest.approx(st.attention_s, rel=1e-12)
    assert check.gpu_name("NVIDIA H100 80GB HBM3") == "h100"


def test_gpt_oss_clamp_from_config():
    """swiglu_limit (7.0 in the released configs) becomes the activation's clamp; a bad one is a
    one-line error."""
    cfg = json.loads((HF / "gpt-oss-120b.json").read_text())
    assert load_model(str(HF / "gpt-oss-120b.json")).activation_clamp == load_model("gpt-oss-120b").activation_clamp == 7.0
    assert model_from_hf_config({**cfg, "swiglu_limit": 10}, "x").activation_clamp == 10.0
    with pytest.raises(CatalogError, match="swiglu_limit must be a non-negative number"):
        model_from_hf_config({**cfg, "swiglu_limit": "seven"}, "x")

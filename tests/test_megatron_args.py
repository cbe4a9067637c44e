"""Config -> megatron-core TransformerConfig kwargs / Megatron-LM args, and the refusal rules
(pure, no torch)."""
from __future__ import annotations

import json
import shlex

import pytest

from advisor.catalog import load_model
from advisor.catalog.specs import ModelSpec, MoESpec, TrainConfig
from advisor.runners import megatron_args as MA

LLAMA = load_model("llama3-8b").with_layers(8)
MIXTRAL = load_model("mixtral-8x7b").with_layers(4)
GPT = ModelSpec(name="gpt3-2.7b", num_layers=8, hidden_size=2560, ffn_hidden_size=10240,
                num_attention_heads=32, vocab_size=50257, activation="gelu", normalization="layernorm",
                position_embedding="learned", max_position_embeddings=2048, add_bias_linear=True,
                tied_embeddings=True)


def test_llama_kwargs():
    kw = MA.transformer_config_kwargs(LLAMA, TrainConfig(tp=2, pp=2, dp=1, vp=2, mbs=1, gbs=8))
    json.dumps(kw)  # plain JSON: travels to the worker
    assert kw["num_layers"] == 8 and kw["hidden_size"] == 4096 and kw["ffn_hidden_size"] == 14336
    assert kw["num_attention_heads"] == 32 and kw["num_query_groups"] == 8 and kw["kv_channels"] == 128
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and kw["activation_func"] == "silu"
    assert kw["tensor_model_parallel_size"] == 2 and kw["pipeline_model_parallel_size"] == 2
    assert kw["virtual_pipeline_model_parallel_size"] == 2
    assert kw["transformer_impl"] == "local" and kw["bf16"] and kw["params_dtype"] == "bfloat16"
    assert not kw["add_bias_linear"] and not kw["gradient_accumulation_fusion"]
    assert "recompute_granularity" not in kw and "num_moe_experts" not in kw


def test_gpt_and_recompute_kwargs():
    kw = MA.transformer_config_kwargs(GPT, TrainConfig(recompute="selective"))
    assert kw["normalization"] == "LayerNorm" and kw["activation_func"] == "gelu"
    assert not kw["gated_linear_unit"] and kw["add_bias_linear"] and kw["add_qkv_bias"]
    assert kw["virtual_pipeline_model_parallel_size"] is None
    assert kw["recompute_granularity"] == "selective" and kw["recompute_modules"] == ["core_attn"]
    full = MA.transformer_config_kwargs(GPT, TrainConfig(recompute="full"))
    assert (full["recompute_granularity"], full["recompute_method"], full["recompute_num_layers"]) == (
        "full", "uniform", 1)
    mk = MA.model_kwargs(GPT, TrainConfig(tp=4, seq=4096))
    assert mk["position_embedding_type"] == "learned_absolute" and mk["share_embeddings_and_output_weights"]
    assert mk["vocab_size"] == 50688 and mk["vocab_size"] % 512 == 0 and mk["max_sequence_length"] == 4096


def test_moe_kwargs_and_dense_first_layers():
    kw = MA.transformer_config_kwargs(MIXTRAL, TrainConfig(ep=4, dp=4))
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 14336
    assert kw["moe_grouped_gemm"] is False and kw["expert_model_parallel_size"] == 4
    assert "moe_layer_freq" not in kw  # every layer is MoE
    m = ModelSpec(name="ds", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  vocab_size=100, moe=MoESpec(num_experts=4, top_k=2, ffn_hidden_size=32,
                                              first_dense_layers=1, shared_ffn_hidden_size=64))
    kw = MA.transformer_config_kwargs(m, TrainConfig())
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["moe_shared_expert_intermediate_size"] == 64
    args = MA.megatron_lm_args(m, TrainConfig())
    assert args[args.index("--moe-layer-freq") + 1] == "[0,1,1,1]"


def test_megatron_lm_args():
    cfg = TrainConfig(tp=2, pp=2, vp=2, dp=1, mbs=1, gbs=8, recompute="full")
    s = MA.megatron_lm_args_string(LLAMA, cfg)
    a = shlex.split(s)
    assert a[a.index("--tensor-model-parallel-size") + 1] == "2"
    assert a[a.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert a[a.index("--num-query-groups") + 1] == "8"
    for flag in ("--swiglu", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--transformer-impl", "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert flag in a
    assert a[a.index("--recompute-granularity") + 1] == "full"
    g = MA.megatron_lm_args(GPT, TrainConfig(distributed_optimizer=False))
    assert "--swiglu" not in g and "--use-distributed-optimizer" not in g
    assert "--overlap-param-gather" not in g  # only with the distributed optimizer
    assert g[g.index("--position-embedding-type") + 1] == "learned_absolute"


@pytest.mark.parametrize("model,cfg,world,needle", [
    (LLAMA, TrainConfig(precision="fp8"), None, "fp8 needs Transformer Engine"),
    (LLAMA, TrainConfig(tp=2, sequence_parallel=True), None, "sequence_parallel"),
    (LLAMA, TrainConfig(cp=2), None, "context parallelism"),
    (LLAMA, TrainConfig(tp_comm_overlap=True), None, "tp_comm_overlap"),
    (load_model("deepseek-v3").with_layers(4), TrainConfig(), None, "multi-latent attention"),
    (LLAMA, TrainConfig(tp=2, dp=1), 4, "world size 4"),
    (LLAMA, TrainConfig(dp=4, mbs=2, gbs=12), None, "gbs 12"),
    (GPT, TrainConfig(tp=3), None, "attention heads"),
    (LLAMA.with_layers(6), TrainConfig(pp=4), None, "6 layers"),
    (LLAMA, TrainConfig(pp=2, vp=3, gbs=8), None, "8 layers are not divisible by pp*vp = 2*3"),
    (LLAMA, TrainConfig(vp=2), None, "needs pp > 1"),
    (LLAMA, TrainConfig(pp=4, vp=2, mbs=1, gbs=2), None, "multiple of pp"),
    (MIXTRAL, TrainConfig(ep=3, dp=3, gbs=3), None, "experts are not divisible"),
    (MIXTRAL, TrainConfig(tp=2, dp=2, ep=2, gbs=2), None, "sequence parallelism"),
    (MIXTRAL, TrainConfig(ep=4, dp=2, gbs=2), None, "does not divide"),
    (LLAMA, TrainConfig(ep=2, dp=2, gbs=2), None, "mixture-of-experts"),
    (LLAMA, TrainConfig(pp=2, pp_first_layers=9), None, "cannot be split"),
])
def test_refusals(model, cfg, world, needle):
    reason = MA.refusal_reason(model, cfg, world)
    assert reason and needle in reason and "\n" not in reason
    with pytest.raises(MA.RefusedError):
        MA.check_runnable(model, cfg, world)


@pytest.mark.parametrize("model,cfg", [
    (LLAMA, TrainConfig(tp=2, pp=2, dp=1, mbs=1, gbs=8)),
    (LLAMA, TrainConfig(pp=4, vp=2, mbs=1, gbs=8)),
    (LLAMA, TrainConfig(tp=4, mbs=4, gbs=32, recompute="full")),
    (LLAMA, TrainConfig(pp=3, pp_first_layers=2, pp_last_layers=2, dp=1)),
    (MIXTRAL, TrainConfig(ep=4, dp=4, mbs=1, gbs=16)),
    (GPT, TrainConfig(dp=4, mbs=8, gbs=64, seq=2048)),
])
def test_runnable(model, cfg):
    assert MA.refusal_reason(model, cfg, cfg.world_size) is None


def test_padded_vocab_and_effective_config():
    assert MA.padded_vocab_size(128256, 1) == 128256 and MA.padded_vocab_size(32000, 3) == 32256
    assert MA.padded_vocab_size(32000, 8) == 32768
    c = MA.effective_config(TrainConfig(distributed_optimizer=False))
    assert c.overlap_param_gather is False
    assert MA.ddp_kwargs(TrainConfig())["use_distributed_optimizer"] is True

"""A (model, layout) pair in megatron-core's terms: TransformerConfig keyword arguments, the
equivalent Megatron-LM command line, and the rules for what megatron-core can run WITHOUT
Transformer Engine (the only way our GPU machines run it). Pure: no torch, no megatron import.

The kwargs are plain JSON values; the worker turns the few non-JSON ones into torch objects
(``params_dtype`` / ``pipeline_dtype`` names, ``activation_func`` name).
"""
from __future__ import annotations

import shlex
from typing import Any

from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


class RefusedError(SpecError):
    """The layout cannot be run by megatron-core without Transformer Engine, or is illegal."""


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by * TP."""
    m = divisible_by * tp
    return -(-vocab // m) * m


def moe_layer_pattern(model: ModelSpec) -> list[int] | None:
    """1 = MoE layer, 0 = dense, per layer; None for a dense model."""
    if not model.is_moe:
        return None
    return [1 if model.is_moe_layer(i) else 0 for i in range(model.num_layers)]


def refusal_reason(model: ModelSpec, cfg: TrainConfig, world_size: int | None = None) -> str | None:
    """Why this (model, layout) cannot run here, in one line; None if it can."""
    # What megatron-core cannot do without Transformer Engine (seen on megatron-core 0.19.2).
    if cfg.precision == "fp8":
        return "fp8 needs Transformer Engine, which is not installed (bf16 only)"
    if cfg.sequence_parallel:
        return "sequence_parallel fails without Transformer Engine ('sequence parallel not supported by torch LayerNorm')"
    if cfg.cp > 1:
        return "context parallelism (cp > 1) needs TEDotProductAttention; the local spec asserts cp == 1"
    if cfg.tp_comm_overlap:
        return "tp_comm_overlap needs Transformer Engine userbuffers"
    if model.mla is not None:
        return "multi-latent attention is not supported by this runner (MLATransformerConfig path untested without TE)"
    # Illegal layouts.
    if world_size is not None and cfg.world_size != world_size:
        return (f"world size {world_size} != tp*pp*cp*dp = {cfg.tp}*{cfg.pp}*{cfg.cp}*{cfg.dp} "
                f"= {cfg.world_size}")
    if cfg.gbs % (cfg.mbs * cfg.dp):
        return f"gbs {cfg.gbs} is not a multiple of mbs*dp = {cfg.mbs}*{cfg.dp}"
    if model.num_attention_heads % cfg.tp:
        return f"{model.num_attention_heads} attention heads are not divisible by tp {cfg.tp}"
    kv = model.kv_heads
    if kv % cfg.tp and cfg.tp % kv:
        return f"{kv} query groups are neither a multiple nor a divisor of tp {cfg.tp}"
    if model.ffn_hidden_size % cfg.tp:
        return f"ffn_hidden_size {model.ffn_hidden_size} is not divisible by tp {cfg.tp}"
    if cfg.vp > 1 and cfg.pp == 1:
        return "vp > 1 (interleaved pipeline) needs pp > 1"
    first, last = cfg.pp_first_layers, cfg.pp_last_layers
    if first is None and last is None:
        if model.num_layers % (cfg.pp * cfg.vp):
            return f"{model.num_layers} layers are not divisible by pp*vp = {cfg.pp}*{cfg.vp}"
    else:
        if cfg.pp < 2:
            return "an uneven pipeline split (pp_first_layers / pp_last_layers) needs pp > 1"
        middle_stages = cfg.pp - (first is not None) - (last is not None)
        middle = model.num_layers - (first or 0) - (last or 0)
        if middle < 0 or (middle_stages == 0 and middle) or (middle_stages and middle % middle_stages):
            return (f"{model.num_layers} layers cannot be split as first={first}, last={last} over "
                    f"pp {cfg.pp}")
        for n in [x for x in (first, last) if x is not None] + (
                [middle // middle_stages] if middle_stages else []):
            if n % cfg.vp:
                return f"a pipeline stage of {n} layers is not divisible by vp {cfg.vp}"
    if cfg.vp > 1:
        m = cfg.num_microbatches
        if m < cfg.pp or m % cfg.pp:
            return (f"interleaved pipeline needs the number of microbatches ({m}) to be a multiple "
                    f"of pp ({cfg.pp})")
    if model.is_moe:
        if cfg.tp > 1:
            return ("MoE with tp > 1 needs sequence parallelism (megatron-core raises otherwise), "
                    "which needs Transformer Engine")
        if model.num_experts % cfg.ep:
            return f"{model.num_experts} experts are not divisible by ep {cfg.ep}"
        if (cfg.tp * cfg.cp * cfg.dp) % (cfg.ep * cfg.etp):
            return (f"ep*etp = {cfg.ep}*{cfg.etp} does not divide tp*cp*dp = "
                    f"{cfg.tp}*{cfg.cp}*{cfg.dp}")
        if model.moe.ffn_hidden_size % cfg.etp:
            return f"expert ffn size {model.moe.ffn_hidden_size} is not divisible by etp {cfg.etp}"
    elif cfg.ep > 1 or cfg.etp > 1:
        return "ep/etp > 1 needs a mixture-of-experts model"
    return None


def check_runnable(model: ModelSpec, cfg: TrainConfig, world_size: int | None = None) -> None:
    reason = refusal_reason(model, cfg, world_size)
    if reason:
        raise RefusedError(reason)


def effective_config(cfg: TrainConfig) -> TrainConfig:
    """The layout as it will actually run: overlapping the parameter all-gather only exists with
    the distributed optimizer."""
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        return cfg.replace(overlap_param_gather=False)
    return cfg


_ACTIVATION = {"swiglu": ("silu", True), "gelu": ("gelu", False), "relu2": ("squared_relu", False)}


def transformer_config_kwargs(model: ModelSpec, cfg: TrainConfig) -> dict[str, Any]:
    """megatron.core.transformer.TransformerConfig(**kwargs) for the local (non-TE) layer spec.
    ``params_dtype`` / ``pipeline_dtype`` are dtype names and ``activation_func`` a function name;
    the worker maps them to torch objects."""
    act, gated = _ACTIVATION[model.activation]
    kw: dict[str, Any] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.kv_heads,
        "kv_channels": model.head_dim,
        "normalization": "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        "layernorm_epsilon": 1e-5,
        "gated_linear_unit": gated,
        "activation_func": act,
        "add_bias_linear": model.add_bias_linear,
        "add_qkv_bias": model.qkv_bias or model.add_bias_linear,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # Fusions that need apex / TE / custom kernels are off; the rest stays default.
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "transformer_impl": "local",
        # Parallelism.
        "tensor_model_parallel_size": cfg.tp,
        "pipeline_model_parallel_size": cfg.pp,
        "virtual_pipeline_model_parallel_size": cfg.vp if cfg.vp > 1 else None,
        "context_parallel_size": cfg.cp,
        "expert_model_parallel_size": cfg.ep,
        "expert_tensor_parallel_size": cfg.etp,
        "sequence_parallel": cfg.sequence_parallel,
        "num_layers_in_first_pipeline_stage": cfg.pp_first_layers,
        "num_layers_in_last_pipeline_stage": cfg.pp_last_layers,
        # Precision.
        "bf16": cfg.precision == "bf16",
        "params_dtype": "bfloat16",
        "pipeline_dtype": "bfloat16",
    }
    if cfg.recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif cfg.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if model.is_moe:
        m = model.moe
        kw.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.top_k,
            moe_ffn_hidden_size=m.ffn_hidden_size,
            moe_grouped_gemm=False,  # grouped GEMM needs TE or the grouped_gemm package
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
        )
        if m.shared_ffn_hidden_size:
            kw["moe_shared_expert_intermediate_size"] = m.shared_ffn_hidden_size
        pattern = moe_layer_pattern(model)
        if pattern is not None and not all(pattern):
            kw["moe_layer_freq"] = pattern
    return kw


def model_kwargs(model: ModelSpec, cfg: TrainConfig) -> dict[str, Any]:
    """GPTModel(...) keyword arguments other than config and layer spec."""
    return {
        "vocab_size": padded_vocab_size(model.vocab_size, cfg.tp),
        "max_sequence_length": max(cfg.seq, model.max_position_embeddings),
        "position_embedding_type": "rope" if model.position_embedding == "rope" else "learned_absolute",
        "share_embeddings_and_output_weights": model.tied_embeddings,
    }


def ddp_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """DistributedDataParallelConfig(**kwargs)."""
    cfg = effective_config(cfg)
    return {
        "grad_reduce_in_fp32": True,
        "overlap_grad_reduce": cfg.overlap_grad_reduce,
        "overlap_param_gather": cfg.overlap_param_gather,
        "use_distributed_optimizer": cfg.distributed_optimizer,
    }


def optimizer_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """OptimizerConfig(**kwargs); params_dtype is a dtype name."""
    cfg = effective_config(cfg)
    return {
        "optimizer": "adam", "lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0,
        "bf16": cfg.precision == "bf16", "params_dtype": "bfloat16",
        "use_distributed_optimizer": cfg.distributed_optimizer,
        "overlap_param_gather": cfg.overlap_param_gather,
    }


def megatron_lm_args(model: ModelSpec, cfg: TrainConfig, train_iters: int = 20) -> list[str]:
    """The same run as Megatron-LM's pretrain_gpt.py command line (mock data, local spec)."""
    cfg = effective_config(cfg)
    a: list[str] = [
        "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
        "--ffn-hidden-size", str(model.ffn_hidden_size),
        "--num-attention-heads", str(model.num_attention_heads),
        "--kv-channels", str(model.head_dim),
        "--seq-length", str(cfg.seq), "--max-position-embeddings", str(max(cfg.seq, model.max_position_embeddings)),
        "--vocab-size", str(model.vocab_size),
        "--make-vocab-size-divisible-by", str(VOCAB_DIVISIBLE_BY),
        "--normalization", "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        "--position-embedding-type", "rope" if model.position_embedding == "rope" else "learned_absolute",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "local",
        "--no-bias-swiglu-fusion" if model.activation == "swiglu" else "--no-bias-gelu-fusion",
        "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion",
        "--tensor-model-parallel-size", str(cfg.tp),
        "--pipeline-model-parallel-size", str(cfg.pp),
        "--context-parallel-size", str(cfg.cp),
        "--micro-batch-size", str(cfg.mbs), "--global-batch-size", str(cfg.gbs),
        "--train-iters", str(train_iters), "--lr", "1e-4", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--optimizer", "adam", "--mock-data",
        "--tokenizer-type", "NullTokenizer",
    ]
    if model.kv_heads != model.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if model.activation == "swiglu":
        a.append("--swiglu")
    elif model.activation == "relu2":
        a.append("--squared-relu")
    if not model.add_bias_linear:
        a.append("--disable-bias-linear")
    if model.qkv_bias and not model.add_bias_linear:
        a.append("--add-qkv-bias")
    if not model.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if cfg.precision == "bf16":
        a.append("--bf16")
    else:
        a += ["--bf16", "--fp8-format", "hybrid"]
    if cfg.vp > 1:
        a += ["--num-virtual-stages-per-pipeline-rank", str(cfg.vp)]
    if cfg.pp_first_layers is not None:
        a += ["--decoder-first-pipeline-num-layers", str(cfg.pp_first_layers)]
    if cfg.pp_last_layers is not None:
        a += ["--decoder-last-pipeline-num-layers", str(cfg.pp_last_layers)]
    if cfg.sequence_parallel:
        a.append("--sequence-parallel")
    if cfg.recompute == "selective":
        a += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    elif cfg.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "1"]
    if cfg.distributed_optimizer:
        a.append("--use-distributed-optimizer")
    if cfg.overlap_grad_reduce:
        a.append("--overlap-grad-reduce")
    if cfg.overlap_param_gather:
        a.append("--overlap-param-gather")
    if cfg.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    if model.is_moe:
        m = model.moe
        a += ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.top_k),
              "--moe-ffn-hidden-size", str(m.ffn_hidden_size),
              "--moe-token-dispatcher-type", "alltoall",
              "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
              "--expert-model-parallel-size", str(cfg.ep),
              "--expert-tensor-parallel-size", str(cfg.etp)]
        if m.shared_ffn_hidden_size:
            a += ["--moe-shared-expert-intermediate-size", str(m.shared_ffn_hidden_size)]
        pattern = moe_layer_pattern(model)
        if pattern is not None and not all(pattern):
            a += ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
    return a


def megatron_lm_args_string(model: ModelSpec, cfg: TrainConfig, train_iters: int = 20) -> str:
    return shlex.join(megatron_lm_args(model, cfg, train_iters))

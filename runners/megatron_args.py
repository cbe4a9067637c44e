"""A (model, layout) pair in megatron-core's terms: TransformerConfig keyword arguments, the
Megatron-LM command line (production arguments for a run with Transformer Engine, or exactly
what this repo's runner runs), and the rules for what the runner can run with each of its stacks:
megatron-core's local layers (no Transformer Engine) or the Transformer Engine layer spec.
Pure: no torch, no megatron import.

The kwargs are plain JSON values; the worker turns the few non-JSON ones into torch objects
(``params_dtype`` / ``pipeline_dtype`` names, ``activation_func`` name).
"""
from __future__ import annotations

import itertools
import shlex
from typing import Any

from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig
from advisor.search_spaces.layout import violations
from advisor.search_spaces.runnable import refusal

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


RUNNER_STACKS = ("local", "te")  # what this repo's runner builds: megatron-core's local or TE layer spec


def refusal_reason(model: ModelSpec, cfg: TrainConfig, world_size: int | None = None,
                   stack: str = "local") -> str | None:
    """Why this (model, layout) cannot run here, in one line; None if it can.

    The rules are: what the stack's runner cannot do (`stack` "local": megatron-core WITHOUT
    Transformer Engine, advisor.search_spaces.runnable, the rule recommend and tune share; "te":
    the TE layer spec runs SP, CP, FP8 and MoE with TP, but this runner does not run TP
    communication overlap), the world size of this machine, then the layout legality rules shared
    with the advisor (``advisor.search_spaces.layout.violations`` with no cluster: the first rule
    broken)."""
    if stack not in RUNNER_STACKS:
        return f"unknown runner stack {stack!r} (known: {', '.join(RUNNER_STACKS)})"
    cfg = effective_config(cfg)
    reason = refusal(model, cfg, stack, runner=True)
    if reason:
        return reason
    if cfg.gradient_accumulation_fusion:
        # megatron-core's fused wgrad accumulation of the output layer is apex's
        # fused_weight_gradient_mlp_cuda, which the runner's machines lack
        return "gradient_accumulation_fusion needs apex, which this runner's machines lack; measure it with --runner command"
    if model.is_moe and cfg.moe_dispatcher == "flex":
        return "the flex dispatcher needs DeepEP, which the runner's machines do not have"
    if model.is_moe and stack == "local" and cfg.moe_router_fusion:
        return "moe_router_fusion needs Transformer Engine's fused router kernels"
    if model.is_moe and stack == "local" and cfg.moe_permute_fusion:
        return "moe_permute_fusion needs Transformer Engine's fused permutation kernels"
    if stack == "local" and cfg.cross_entropy_impl == "te":
        return "cross_entropy_impl te needs Transformer Engine's parallel_cross_entropy"
    if stack == "te":
        if cfg.tp_comm_overlap:
            # TE's userbuffers can map NVLink multicast, which the lent machines must not use
            # (KINDS.md); the te profile predicts the layout with and without it.
            return "tp_comm_overlap (TE userbuffers) is not run by this runner; measure it with --runner command"
        if model.is_moe and cfg.tp > 1 and not cfg.sequence_parallel:
            return "MoE with tp > 1 needs sequence parallelism (megatron-core raises otherwise)"
    # This machine.
    if world_size is not None and cfg.world_size != world_size:
        return (f"world size {world_size} != tp*pp*cp*dp = {cfg.tp}*{cfg.pp}*{cfg.cp}*{cfg.dp} "
                f"= {cfg.world_size}")
    # Layout legality (the advisor's rules).
    v = violations(model, None, cfg)
    if v:
        return f"illegal layout: {v[0]}"
    return None


def check_runnable(model: ModelSpec, cfg: TrainConfig, world_size: int | None = None,
                   stack: str = "local") -> None:
    reason = refusal_reason(model, cfg, world_size, stack)
    if reason:
        raise RefusedError(reason)


def effective_config(cfg: TrainConfig) -> TrainConfig:
    """The layout as it will actually run: overlapping the parameter all-gather only exists with
    the distributed optimizer."""
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        return cfg.replace(overlap_param_gather=False)
    return cfg


def runner_config(cfg: TrainConfig, keep_requested: bool = False) -> TrainConfig:
    """The layout as this project's runner runs it: effective_config with megatron-core's DDP with the
    distributed optimizer, not Megatron FSDP (fsdp off: the worker builds DistributedDataParallel
    itself), NCCL communicators created eagerly (nccl_lazy_init off: the worker passes device_id to
    init_process_group), BF16 weights (FP8 primary weights off), torch's allocator as it comes
    (expandable segments off) and megatron-core's default of keeping the pipeline's sent outputs
    (deallocate_pipeline_outputs off); with `keep_requested` (a batch line that asks for them) the
    last three as the layout says: the worker then builds TE's linear weights in FP8
    (TransformerConfig.fp8_param, DDP fp8_param_gather: Megatron-LM's --fp8-param-gather), turns
    expandable segments on for that job (megatron_worker.set_allocator) and its TransformerConfig
    sets deallocate_pipeline_outputs. Its records say so."""
    cfg = effective_config(cfg)
    runner_off = ("fsdp", "nccl_lazy_init") + (() if keep_requested else ("fp8_param_gather", "expandable_segments",
                                                                          "deallocate_pipeline_outputs"))
    off = {k: False for k in runner_off if getattr(cfg, k)}
    return cfg.replace(**off) if off else cfg


def launch_env(cfg: TrainConfig) -> dict[str, str]:
    """Environment variables the layout needs at launch besides Megatron's arguments: torch's
    allocator with expandable segments (TrainConfig.expandable_segments)."""
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if cfg.expandable_segments else {}


def fp8_param_args(cfg: TrainConfig) -> list[str]:
    """FP8 primary weights (TrainConfig.fp8_param_gather): Megatron-LM's --fp8-param-gather
    (megatron/training/arguments.py; validate_args wants the distributed optimizer with it)."""
    return ["--fp8-param-gather"] if cfg.fp8_param_gather else []


def offload_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """TransformerConfig fields of activation offloading (TrainConfig.cpu_offload_layers): the first
    N layers' activations only (cpu_offloading_weights off, as Megatron-Bridge's performance scripts
    set it: scripts/performance/utils/overrides.py; TE 2.x's offload ignores weights anyway,
    "Offloading weights is deprecated"). {} when nothing is offloaded."""
    n = cfg.cpu_offload_layers
    return ({"cpu_offloading": True, "cpu_offloading_num_layers": n, "cpu_offloading_activations": True,
             "cpu_offloading_weights": False} if n else {})


def offload_args(cfg: TrainConfig) -> list[str]:
    """Activation offloading as Megatron-LM arguments (TransformerConfig's fields as flags:
    --cpu-offloading --cpu-offloading-num-layers N). [] when nothing is offloaded."""
    n = cfg.cpu_offload_layers
    return ["--cpu-offloading", "--cpu-offloading-num-layers", str(n)] if n else []


def config_overrides(fields: dict[str, Any], prefix: str) -> list[str]:
    """TransformerConfig fields as recipe overrides under `prefix` ("model." for Megatron-Bridge's
    ConfigContainer, "model.config." for NeMo 2's GPTConfig): KEY=VALUE, booleans lower case, lists
    as [a,b]."""
    def value(v):
        if isinstance(v, bool):
            return str(v).lower()
        return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else v
    return [f"{prefix}{k}={value(v)}" for k, v in fields.items()]


def offload_overrides(cfg: TrainConfig, prefix: str) -> list[str]:
    """Activation offloading as recipe overrides (config_overrides), as Megatron-Bridge's
    set_recompute_overrides writes them. [] when nothing is offloaded."""
    return config_overrides(offload_kwargs(cfg), prefix)


def recompute_overrides(cfg: TrainConfig, prefix: str) -> list[str]:
    """The recompute_* fields (recompute_settings) as recipe overrides (config_overrides); the default
    module, core_attn, is left to the recipe unless the layout names modules."""
    s = recompute_settings(cfg)
    if not cfg.recompute_modules:
        s.pop("recompute_modules", None)
    return config_overrides(s, prefix)


def fsdp_args(cfg: TrainConfig) -> list[str]:
    """Megatron FSDP (TrainConfig.fsdp): --use-megatron-fsdp with the optim_grads_params sharding
    strategy, and the checkpoint format validate_args asserts with it (megatron/training/
    arguments.py: "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format")."""
    return (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
             "--ckpt-format", "fsdp_dtensor"] if cfg.fsdp else [])


_ACTIVATION = {"swiglu": ("silu", True), "gelu": ("gelu", False), "relu2": ("squared_relu", False)}


FP8_RECIPES = ("delayed", "tensorwise")  # Hopper FP8 recipes the runner runs (tensorwise: current scaling)


def transformer_config_kwargs(model: ModelSpec, cfg: TrainConfig, stack: str = "local",
                              fp8_recipe: str = "delayed") -> dict[str, Any]:
    """megatron.core.transformer.TransformerConfig(**kwargs) for the local (non-TE) layer spec, or
    with ``stack="te"`` for the Transformer Engine spec with the fusions NVIDIA's recipes turn on
    (see ``_te_config``). ``params_dtype`` / ``pipeline_dtype`` are dtype names and
    ``activation_func`` a function name; the worker maps them to torch objects."""
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
        "account_for_embedding_in_pipeline_split": cfg.account_for_embedding,
        "account_for_loss_in_pipeline_split": cfg.account_for_loss,
        "pipeline_model_parallel_layout": cfg.pipeline_layout,
        # the pipeline frees each stage output once sent (megatron-core's default keeps it)
        **({"deallocate_pipeline_outputs": True} if cfg.deallocate_pipeline_outputs else {}),
        # Precision.
        "bf16": True,  # every format keeps bf16 params (the quantized copies are TE's)
        "params_dtype": "bfloat16",
        "pipeline_dtype": "bfloat16",
        # The loss (TrainConfig.cross_entropy_impl; megatron-core's default impl is "native").
        "cross_entropy_loss_fusion": cfg.cross_entropy_impl != "unfused",
        "cross_entropy_fusion_impl": "native" if cfg.cross_entropy_impl == "unfused" else cfg.cross_entropy_impl,
    }
    if model.activation_clamp:  # gpt-oss: quick-GeGLU x (linear + 1), both halves clamped
        kw.update(activation_func="quick_gelu", glu_linear_offset=1.0,
                  activation_func_clamp_value=float(model.activation_clamp))
    kw.update(recompute_settings(cfg))
    if model.mla is not None:
        # megatron.core's MLATransformerConfig (the worker builds that class when it sees
        # multi_latent_attention); plain RoPE on the rope part, as in pretraining at 4K.
        a = model.mla
        kw.update(multi_latent_attention=True, q_lora_rank=a.q_lora_rank or None,
                  kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_nope_head_dim,
                  qk_pos_emb_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, rope_type="rope")
        kw["kv_channels"] = a.v_head_dim
    if model.is_moe:
        m = model.moe
        kw.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.top_k,
            moe_ffn_hidden_size=m.ffn_hidden_size,
            # The local spec has no grouped GEMM (TE's GroupedLinear or the grouped_gemm package):
            # with cfg.moe_grouped_gemm the worker swaps in its torch._grouped_mm experts
            # (job["moe_experts"], runners/moe_probe.py); megatron-core itself sees False.
            moe_grouped_gemm=False,
            moe_token_dispatcher_type=cfg.moe_dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            moe_router_force_load_balancing=cfg.moe_router == "forced",
            moe_expert_capacity_factor=cfg.moe_capacity_factor,
            moe_pad_expert_input_to_capacity=cfg.moe_pad_to_capacity,
            moe_shared_expert_overlap=cfg.moe_shared_expert_overlap,
            overlap_moe_expert_parallel_comm=cfg.moe_a2a_overlap,
            delay_wgrad_compute=cfg.moe_a2a_overlap,
            moe_router_fusion=cfg.moe_router_fusion,
            moe_permute_fusion=cfg.moe_permute_fusion,
        )
        if cfg.moe_dispatcher == "flex":
            kw["moe_flex_dispatcher_backend"] = "deepep"
        if m.shared_ffn_hidden_size:
            kw["moe_shared_expert_intermediate_size"] = m.shared_ffn_hidden_size
        pattern = moe_layer_pattern(model)
        if pattern is not None and not all(pattern):
            kw["moe_layer_freq"] = pattern
    if stack == "te":
        kw.update(_te_config(model, cfg, fp8_recipe))
    return {**kw, **offload_kwargs(cfg)}


def _te_config(model: ModelSpec, cfg: TrainConfig, fp8_recipe: str) -> dict[str, Any]:
    """What the TE stack changes in the TransformerConfig: TE layers and the fusions Megatron-LM /
    NeMo turn on by default (bias-activation, RoPE through TE; the cross entropy is the layout's,
    TrainConfig.cross_entropy_impl),
    FP8 through TE (hybrid E4M3 / E5M2, amax history 1024 as in NVIDIA's recipes), and grouped
    GEMM experts through TE's GroupedLinear. gradient_accumulation_fusion stays off: the output
    layer's fused wgrad kernel is apex's (fused_weight_gradient_mlp_cuda), which the lent
    machines lack; Megatron-LM turns it off the same way when apex is missing."""
    if fp8_recipe not in FP8_RECIPES:
        raise SpecError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {fp8_recipe!r}")
    kw: dict[str, Any] = {
        "transformer_impl": "transformer_engine",
        "bias_activation_fusion": model.activation in ("swiglu", "gelu"),
        "masked_softmax_fusion": True,
        "apply_rope_fusion": model.position_embedding == "rope" and model.mla is None,
        "persist_layer_norm": True,
        "gradient_accumulation_fusion": False,
    }
    # per-layer attention through TE's DotProductAttention (the local spec's SDPA has neither): the
    # sliding window (a query sees itself and window_size - 1 keys before it) on the layers
    # window_pattern marks (megatron-core's window_attn_skip_freq list: 1 = windowed), and the
    # learned sink logit per head (softmax_type "learnable")
    if model.window_size and model.window_type == "sliding":
        kw["window_size"] = (model.window_size - 1, 0)
        per_layer = windowed_layers(model)
        if not all(per_layer):
            kw["window_attn_skip_freq"] = per_layer
    if model.attention_sinks:
        kw["softmax_type"] = "learnable"
    if cfg.precision == "fp8":
        kw.update(fp8="hybrid", fp8_recipe=fp8_recipe, fp8_amax_history_len=1024,
                  fp8_amax_compute_algo="max")
    elif cfg.precision == "mxfp8":
        kw.update(fp8="e4m3", fp8_recipe="mxfp8")
    elif cfg.precision == "nvfp4":
        kw.update(fp4="e2m1", fp4_recipe="nvfp4")
    if cfg.fp8_param_gather:  # FP8 primary weights: TE builds its linear weights under fp8_model_init
        kw["fp8_param"] = True
    if model.is_moe:
        kw["moe_grouped_gemm"] = cfg.moe_grouped_gemm
        if cfg.precision != "bf16":  # FP8 grouped GEMMs want each expert's token count padded to 16
            kw["moe_router_padding_for_quantization"] = True
    return kw


def model_kwargs(model: ModelSpec, cfg: TrainConfig) -> dict[str, Any]:
    """GPTModel(...) keyword arguments other than config and layer spec."""
    return {
        "vocab_size": padded_vocab_size(model.vocab_size, cfg.tp),
        "max_sequence_length": max(cfg.seq, model.max_position_embeddings),
        "position_embedding_type": "rope" if model.position_embedding == "rope" else "learned_absolute",
        "share_embeddings_and_output_weights": model.tied_embeddings,
    }


def ddp_kwargs(cfg: TrainConfig, stack: str = "local") -> dict[str, Any]:
    """DistributedDataParallelConfig(**kwargs). The TE stack reduces gradients in bf16, as NVIDIA's
    recipes do (grad_reduce_in_fp32 off); the local runner in fp32."""
    cfg = effective_config(cfg)
    return {
        "grad_reduce_in_fp32": stack != "te",
        "overlap_grad_reduce": cfg.overlap_grad_reduce,
        "overlap_param_gather": cfg.overlap_param_gather,
        "use_distributed_optimizer": cfg.distributed_optimizer,
        # FP8 primary weights: the distributed optimizer all-gathers the FP8 weights (only where asked:
        # the job dicts of every other layout stay as they were)
        **({"fp8_param_gather": True} if cfg.fp8_param_gather else {}),
    }


def optimizer_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """OptimizerConfig(**kwargs); params_dtype is a dtype name."""
    cfg = effective_config(cfg)
    return {
        "optimizer": "adam", "lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0,
        "bf16": True, "params_dtype": "bfloat16",
        "use_distributed_optimizer": cfg.distributed_optimizer,
        "overlap_param_gather": cfg.overlap_param_gather,
    }


IMPLS = ("transformer_engine", "local")


def megatron_lm_args(model: ModelSpec, cfg: TrainConfig, train_iters: int = 20, *,
                     impl: str = "transformer_engine", runner: bool = False) -> list[str]:
    """The layout as Megatron-LM ``pretrain_gpt.py`` arguments (flag names as in megatron-core
    0.19's ``megatron/training/arguments.py``).

    ``impl="transformer_engine"`` (the default; what ``advisor recommend`` shows): production
    arguments to paste into a real run with Transformer Engine: parallelism, batch, sequence,
    model architecture, precision, recompute, overlap and MoE / MLA flags. Data, tokenizer (and
    so the vocabulary), optimizer, learning rate, iterations and checkpointing stay the user's.

    ``runner=True`` or ``impl="local"``: the run exactly as this repo's runner does it (local
    spec without TE, fusions off, mock data, NullTokenizer, ``train_iters`` iterations, Adam)."""
    if impl not in IMPLS:
        raise SpecError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if runner or impl == "local":
        return _runner_args(model, cfg, train_iters)
    return _te_args(model, cfg)


def megatron_lm_args_string(model: ModelSpec, cfg: TrainConfig, train_iters: int = 20, *,
                            impl: str = "transformer_engine", runner: bool = False) -> str:
    """``megatron_lm_args`` as one shell-quoted line."""
    return shlex.join(megatron_lm_args(model, cfg, train_iters, impl=impl, runner=runner))


def _shape_args(model: ModelSpec) -> list[str]:
    return ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(model.ffn_hidden_size),
            "--num-attention-heads", str(model.num_attention_heads),
            "--kv-channels", str(model.head_dim)]


def _norm_position_args(model: ModelSpec) -> list[str]:
    return ["--normalization", "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
            "--position-embedding-type",
            "rope" if model.position_embedding == "rope" else "learned_absolute"]


def _architecture_flags(model: ModelSpec) -> list[str]:
    a: list[str] = []
    if model.kv_heads != model.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if model.activation_clamp:  # gpt-oss's clamped gated activation
        a += ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value",
              f"{model.activation_clamp:g}"]
    elif model.activation == "swiglu":
        a.append("--swiglu")
    elif model.activation == "relu2":
        a.append("--squared-relu")
    if not model.add_bias_linear:
        a.append("--disable-bias-linear")
    if model.qkv_bias and not model.add_bias_linear:
        a.append("--add-qkv-bias")
    if not model.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    return a


def pattern_expression(per_layer: list[int]) -> str:
    """A per-layer 0/1 list as the Python list expression Megatron-LM evaluates for its pattern
    flags (--moe-layer-freq, --window-attn-skip-freq, --no-rope-freq), e.g. ([1]*5+[0])*10+[1]*2."""
    n = len(per_layer)
    period = next(p for p in range(1, n + 1) if all(per_layer[i] == per_layer[i % p] for i in range(n)))

    def runs(xs: list[int]) -> str:
        return "+".join(f"[{v}]*{k}" if k > 1 else f"[{v}]" for v, k in
                        ((v, len(list(g))) for v, g in itertools.groupby(xs)))
    reps, tail = divmod(n, period)
    body = runs(per_layer[:period])
    if reps == 1:
        return runs(per_layer)
    return f"({body})*{reps}" + (f"+{runs(per_layer[:tail])}" if tail else "")


def windowed_layers(model: ModelSpec) -> list[int]:
    """Per layer, 1 where it is windowed (megatron-core's window_attn_skip_freq list form)."""
    return [1 if model.layer_window(i) else 0 for i in range(model.num_layers)]


def _attention_args(model: ModelSpec) -> list[str]:
    """Per-layer attention and its details, as megatron-core's flags (megatron/training/
    arguments.py): --window-size (TE's (left, right) window: a query sees itself and `left` keys
    before it), --window-attn-skip-freq (1 = windowed layer), --softmax-type learnable (attention
    sinks), --qk-layernorm (per-head q / k norm), --rotary-percent, --no-rope-freq. What Megatron-LM
    has no flag for is listed by megatron_notes."""
    a: list[str] = []
    if model.window_size and model.window_type == "sliding":
        a += ["--window-size", f"{model.window_size - 1},0"]
        per_layer = windowed_layers(model)
        if not all(per_layer):
            a += ["--window-attn-skip-freq", pattern_expression(per_layer)]
    if model.attention_sinks:
        a += ["--softmax-type", "learnable"]
    if model.qk_norm == "head":
        a.append("--qk-layernorm")
    if model.rotary_percent != 1.0:
        a += ["--rotary-percent", f"{model.rotary_percent:g}"]
    if model.nope_pattern:
        p = model.nope_pattern
        a += ["--no-rope-freq", pattern_expression([p[i % len(p)] for i in range(model.num_layers)])]
    return a


def cp_comm_types(model: ModelSpec, cfg: TrainConfig) -> list[str]:
    """--cp-comm-type for a CP run: Transformer Engine runs a sliding window with context
    parallelism only over "a2a" or "all_gather" (attn_forward_func_with_cp asserts it,
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py), so the
    windowed layers get all_gather and the full ones keep the ring (p2p), one type per layer
    (Megatron-LM's --cp-comm-type takes a list). This is what step_time prices."""
    if cfg.cp <= 1 or not (model.window_size and model.window_type == "sliding"):
        return []
    types = ["all_gather" if model.layer_window(i) else "p2p" for i in range(model.num_layers)]
    return ["--cp-comm-type"] + (types[:1] if len(set(types)) == 1 else types)


def megatron_notes(model: ModelSpec) -> list[str]:
    """What the model has that Megatron-LM's arguments cannot express: the printed arguments
    train a model without it (its cost as the advisor prices it may differ from what they run)."""
    notes = []
    if model.window_size and model.window_type == "chunked":
        notes.append(f"chunked local attention ({model.window_size}-token blocks, Llama 4): Megatron-LM has no flag "
                     "for it; these arguments run those layers as full causal attention (slower past "
                     f"{model.window_size} tokens than predicted)")
    if model.norm_placement != "pre":
        notes.append(f"{model.norm_placement} norms ({model.family}): Megatron-LM's layers have pre-norms only")
    if model.qk_norm == "full":
        notes.append("QK norm over the whole q / k projection (OLMo 2): Megatron-LM's --qk-layernorm normalises per head")
    if model.qk_norm == "l2":
        notes.append("weightless L2 QK norm (Llama 4): Megatron-LM's --qk-layernorm is a learned per-head norm")
    if model.attn_logit_softcap or model.final_logit_softcap:
        notes.append("logit soft-capping (Gemma 2): Megatron-LM has no flag for it, and TE's fused attention "
                     "no soft-capping")
    if model.family in ("gemma2", "gemma3"):
        notes.append("GeGLU MLP (tanh-GELU gate): Megatron-LM's --swiglu gates with SiLU (same cost)")
    return notes


def _pipeline_args(cfg: TrainConfig) -> list[str]:
    """The split flags of megatron-core 0.19.2's megatron/training/arguments.py. A layout sets
    the virtual stages itself (its chunks / pp; Megatron-LM refuses it together with
    --num-virtual-stages-per-pipeline-rank) and excludes the other split flags."""
    if cfg.pipeline_layout is not None:
        return ["--pipeline-model-parallel-layout", cfg.pipeline_layout]
    a: list[str] = []
    if cfg.vp > 1:
        # Megatron-LM also has --num-layers-per-virtual-pipeline-stage; only this one works
        # together with an uneven first/last stage.
        a += ["--num-virtual-stages-per-pipeline-rank", str(cfg.vp)]
    if cfg.account_for_embedding:
        a.append("--account-for-embedding-in-pipeline-split")
    if cfg.account_for_loss:
        a.append("--account-for-loss-in-pipeline-split")
    if cfg.pp_first_layers is not None:
        a += ["--decoder-first-pipeline-num-layers", str(cfg.pp_first_layers)]
    if cfg.pp_last_layers is not None:
        a += ["--decoder-last-pipeline-num-layers", str(cfg.pp_last_layers)]
    return a


def _moe_layer_freq(model: ModelSpec, compact: bool = False) -> list[str]:
    """--moe-layer-freq as a pattern (1 = MoE layer); compact: run-length form that Megatron-LM
    evaluates, e.g. [0]*3+[1]*58 for DeepSeek-V3."""
    pattern = moe_layer_pattern(model)
    if pattern is None or all(pattern):
        return []
    if compact:
        runs = [(v, len(list(g))) for v, g in itertools.groupby(pattern)]
        return ["--moe-layer-freq", "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs)]
    return ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]


def _te_args(model: ModelSpec, cfg: TrainConfig) -> list[str]:
    cfg = effective_config(cfg)
    a = _shape_args(model) + _norm_position_args(model) + _architecture_flags(model) + _attention_args(model)
    a += cp_comm_types(model, cfg)
    a += [
        "--seq-length", str(cfg.seq),
        "--max-position-embeddings", str(max(cfg.seq, model.max_position_embeddings)),
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "transformer_engine",
    ] + _parallel_size_args(cfg) + ["--bf16"] + precision_args(cfg) + fp8_param_args(cfg) + fsdp_args(cfg)
    a += offload_args(cfg)
    a += _pipeline_args(cfg)
    if cfg.sequence_parallel:
        a.append("--sequence-parallel")
    if cfg.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    a += _recompute_args(cfg, name_modules=False)  # selective: megatron's default module, core_attn
    a += cross_entropy_args(cfg)
    if cfg.distributed_optimizer:
        a.append("--use-distributed-optimizer")
    if cfg.overlap_grad_reduce:
        a.append("--overlap-grad-reduce")
        # Megatron-LM asserts --overlap-param-gather comes with --overlap-grad-reduce.
        if cfg.overlap_param_gather:
            a.append("--overlap-param-gather")
    a += _mla_args(model)
    if model.is_moe:
        a += _moe_arch_args(model)
        if cfg.moe_grouped_gemm:
            a.append("--moe-grouped-gemm")
        a += ["--expert-model-parallel-size", str(cfg.ep),
              "--expert-tensor-parallel-size", str(cfg.etp)] + moe_knob_args(cfg)
    return a


def moe_knob_args(cfg: TrainConfig) -> list[str]:
    """The MoE knobs as megatron-core 0.19's Megatron-LM flags (megatron/training/arguments.py
    builds them from TransformerConfig / ModelParallelConfig fields): the dispatcher (flex with
    the DeepEP backend; --moe-enable-deepep is 0.19's deprecated spelling), forced balancing,
    the capacity factor and padding, the 1F1B all-to-all overlap (with --delay-wgrad-compute,
    which Megatron-LM's MoE guide pairs it with), shared-expert overlap, router and permute fusion."""
    a = ["--moe-token-dispatcher-type", cfg.moe_dispatcher]
    if cfg.moe_dispatcher == "flex":
        a += ["--moe-flex-dispatcher-backend", "deepep"]
    if cfg.moe_router == "forced":
        a.append("--moe-router-force-load-balancing")
    if cfg.moe_capacity_factor is not None:
        a += ["--moe-expert-capacity-factor", f"{cfg.moe_capacity_factor:g}"]
        if cfg.moe_pad_to_capacity:
            a.append("--moe-pad-expert-input-to-capacity")
    if cfg.moe_a2a_overlap:
        a += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if cfg.moe_shared_expert_overlap:
        a.append("--moe-shared-expert-overlap")
    if cfg.moe_router_fusion:
        a.append("--moe-router-fusion")
    if cfg.moe_permute_fusion:
        a.append("--moe-permute-fusion")
    return a


def cross_entropy_args(cfg: TrainConfig) -> list[str]:
    """The loss's cross entropy as Megatron-LM flags (megatron/training/arguments.py:
    --cross-entropy-loss-fusion, --cross-entropy-fusion-impl {native,te}); none when unfused."""
    if cfg.cross_entropy_impl == "unfused":
        return []
    return ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", cfg.cross_entropy_impl]


def _parallel_size_args(cfg: TrainConfig) -> list[str]:
    """TP / PP / CP sizes and the batch (DP follows from the world size)."""
    return ["--tensor-model-parallel-size", str(cfg.tp), "--pipeline-model-parallel-size", str(cfg.pp),
            "--context-parallel-size", str(cfg.cp),
            "--micro-batch-size", str(cfg.mbs), "--global-batch-size", str(cfg.gbs)]


def recompute_settings(cfg: TrainConfig) -> dict:
    """megatron-core TransformerConfig recompute_* fields of a layout (Megatron-Bridge's
    model.recompute_* take the same): selective = its modules (recompute_modules; () = megatron's
    default, core_attn); full = every layer one at a time (method uniform, 1 layer a unit) or, with
    recompute_layers N, the block method on the first N layers of each virtual chunk."""
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(cfg.recompute_modules or ("core_attn",))}
    if cfg.recompute == "full":
        n = cfg.recompute_layers
        return {"recompute_granularity": "full", "recompute_method": "uniform" if n is None else "block",
                "recompute_num_layers": 1 if n is None else n}
    return {}


def _recompute_args(cfg: TrainConfig, name_modules: bool) -> list[str]:
    """Recompute flags (recompute_settings); the default module, core_attn, is named only where
    `name_modules` (the runner's records) or the layout names modules."""
    s = recompute_settings(cfg)
    if not s:
        return []
    a = ["--recompute-granularity", s["recompute_granularity"]]
    if "recompute_method" in s:
        a += ["--recompute-method", s["recompute_method"], "--recompute-num-layers", str(s["recompute_num_layers"])]
    if "recompute_modules" in s and (name_modules or cfg.recompute_modules):
        a += ["--recompute-modules", *s["recompute_modules"]]
    return a


def _runner_args(model: ModelSpec, cfg: TrainConfig, train_iters: int) -> list[str]:
    """What this repo's runner runs (megatron-core without Transformer Engine)."""
    cfg = effective_config(cfg)
    a = _shape_args(model) + [
        "--seq-length", str(cfg.seq), "--max-position-embeddings", str(max(cfg.seq, model.max_position_embeddings)),
        "--vocab-size", str(model.vocab_size),
        "--make-vocab-size-divisible-by", str(VOCAB_DIVISIBLE_BY),
    ] + _norm_position_args(model) + [
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "local",
        "--no-bias-swiglu-fusion" if model.activation == "swiglu" else "--no-bias-gelu-fusion",
        "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion",
    ] + _parallel_size_args(cfg) + [
        "--train-iters", str(train_iters), "--lr", "1e-4", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--optimizer", "adam", "--mock-data",
        "--tokenizer-type", "NullTokenizer",
    ]
    a += _architecture_flags(model)
    if cfg.precision == "bf16":
        a.append("--bf16")
    else:
        a += ["--bf16", "--fp8-format", "hybrid"]
    a += _pipeline_args(cfg)
    if cfg.sequence_parallel:
        a.append("--sequence-parallel")
    a += _recompute_args(cfg, name_modules=True)
    a += cross_entropy_args(cfg)
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
              "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
              "--expert-model-parallel-size", str(cfg.ep),
              "--expert-tensor-parallel-size", str(cfg.etp)] + moe_knob_args(cfg)
        if m.shared_ffn_hidden_size:
            a += ["--moe-shared-expert-intermediate-size", str(m.shared_ffn_hidden_size)]
        a += _moe_layer_freq(model)
    return a


# The MoE sub-step timing the worker runs after a MoE job's measured steps (runners/moe_probe.py).
MOE_PROFILE_STEPS = 2


def moe_job_keys(model: ModelSpec, cfg: TrainConfig, stack: str = "local") -> dict[str, Any]:
    """What a MoE job tells the worker besides the TransformerConfig: which experts module
    ("grouped": torch._grouped_mm, "sequential": megatron-core's SequentialMLP, "te_grouped":
    TE's GroupedLinear, chosen by megatron-core itself) and how many steps to time the MoE
    sub-steps for."""
    if not model.is_moe:
        return {}
    if stack == "te":
        kind = "te_grouped" if cfg.moe_grouped_gemm else "sequential"
        return {"moe_experts": kind, "moe_profile_steps": MOE_PROFILE_STEPS}
    return {"moe_experts": "grouped" if cfg.moe_grouped_gemm else "sequential",
            "moe_profile_steps": MOE_PROFILE_STEPS}


def _mla_args(model: ModelSpec) -> list[str]:
    if model.mla is None:
        return []
    m = model.mla
    a = ["--multi-latent-attention"]
    if m.q_lora_rank:  # 0 = no query compression: megatron's default (None)
        a += ["--q-lora-rank", str(m.q_lora_rank)]
    return a + ["--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim", str(m.qk_nope_head_dim),
                "--qk-pos-emb-head-dim", str(m.qk_rope_head_dim), "--v-head-dim", str(m.v_head_dim)]


def _moe_arch_args(model: ModelSpec) -> list[str]:
    m = model.moe
    a = ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.top_k),
         "--moe-ffn-hidden-size", str(m.ffn_hidden_size)]
    if m.shared_ffn_hidden_size:
        a += ["--moe-shared-expert-intermediate-size", str(m.shared_ffn_hidden_size)]
    return a + _moe_layer_freq(model, compact=True)


def layout_args(cfg: TrainConfig) -> list[str]:
    """Only what the layout decides, as Megatron-LM arguments (for the user's own command line,
    which keeps its model, data, tokenizer and optimizer): TP / PP / CP / EP sizes, micro and
    global batch, sequence length, virtual pipeline and uneven split, sequence parallelism,
    recompute, the loss's cross entropy, distributed optimizer, overlap, precision."""
    cfg = effective_config(cfg)
    a = _parallel_size_args(cfg) + ["--seq-length", str(cfg.seq)]
    if cfg.ep > 1 or cfg.etp > 1:
        a += ["--expert-model-parallel-size", str(cfg.ep), "--expert-tensor-parallel-size", str(cfg.etp)]
        a += moe_knob_args(cfg)
    a += _pipeline_args(cfg)
    if cfg.sequence_parallel:
        a.append("--sequence-parallel")
    if cfg.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    a += _recompute_args(cfg, name_modules=False)
    a += cross_entropy_args(cfg)
    if cfg.distributed_optimizer:
        a.append("--use-distributed-optimizer")
    if cfg.overlap_grad_reduce:
        a.append("--overlap-grad-reduce")
        if cfg.overlap_param_gather:  # Megatron-LM asserts it comes with --overlap-grad-reduce
            a.append("--overlap-param-gather")
    a.append("--bf16")
    return a + precision_args(cfg) + fp8_param_args(cfg) + fsdp_args(cfg) + offload_args(cfg)


def precision_args(cfg: TrainConfig) -> list[str]:
    """Megatron-LM's Transformer Engine flags of the layout's format (megatron/training/
    arguments.py, _add_transformer_engine_args: --fp8-format {e4m3,hybrid}, --fp8-recipe
    {tensorwise,delayed,mxfp8,blockwise}, --fp4-format e2m1, --fp4-recipe nvfp4). Delayed scaling
    with the amax history of NVIDIA's recipes; the block formats use E4M3 in both passes (TE's
    MXFP8BlockScaling / Float8BlockScaling defaults)."""
    if cfg.precision == "fp8" and cfg.fp8_recipe == "delayed":
        return ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]
    if cfg.precision == "fp8":
        return ["--fp8-format", "hybrid" if cfg.fp8_recipe == "tensorwise" else "e4m3", "--fp8-recipe", cfg.fp8_recipe]
    if cfg.precision == "mxfp8":
        return ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]
    if cfg.precision == "nvfp4":
        return ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
    return []


def model_args(model: ModelSpec, cfg: TrainConfig) -> list[str]:
    """The model's architecture as Megatron-LM arguments (shape, norm, position embedding, GQA,
    activation, biases, vocabulary, MoE and MLA): for a command whose script does not fix the
    model, e.g. a proxy with fewer layers."""
    return _shape_args(model) + _norm_position_args(model) + _architecture_flags(model) + [
        "--max-position-embeddings", str(max(cfg.seq, model.max_position_embeddings)),
        "--vocab-size", str(model.vocab_size),
        "--make-vocab-size-divisible-by", str(VOCAB_DIVISIBLE_BY),
    ] + _attention_args(model) + _mla_args(model) + (_moe_arch_args(model) if model.is_moe else [])

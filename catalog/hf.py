"""Hugging Face ``config.json`` -> ModelSpec, for the model types whose configs we know.

Conventions (the same as the catalog's YAML files, so that both give equal specs):
- ``num_query_groups`` is None when the KV heads equal the attention heads (MHA);
- ``kv_channels`` is None when the head dim equals hidden / heads; MLA models use ``v_head_dim``;
- ``ffn_hidden_size`` is the dense MLP size (``intermediate_size``), ``moe.ffn_hidden_size`` the
  size of one routed expert; ``moe.dense_ffn_hidden_size`` is set only when some layers are dense.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from advisor.catalog.errors import CatalogError
from advisor.catalog.specs import MLASpec, ModelSpec, MoESpec

_MISSING = object()


class _Cfg:
    """Field access with one-line errors; JSON nulls count as absent."""

    def __init__(self, cfg: Mapping[str, Any], model_type: str, origin: str):
        self.cfg, self.model_type, self.origin = cfg, model_type, origin

    def req(self, key: str) -> Any:
        v = self.cfg.get(key)
        if v is None:
            raise CatalogError(
                f"{self.origin}: missing required field {key!r} for model_type {self.model_type}"
            )
        return v

    def get(self, key: str, default: Any = None) -> Any:
        v = self.cfg.get(key)
        return default if v is None else v


def _moe_layout(num_layers: int, is_moe: Callable[[int], bool], c: _Cfg) -> tuple[int, int] | None:
    """(first_dense_layers, layer_freq) reproducing the config's MoE layer set; None = no MoE layer."""
    moe = [i for i in range(num_layers) if is_moe(i)]
    if not moe:
        return None
    first = moe[0]
    freq = moe[1] - moe[0] if len(moe) > 1 else 1
    if moe != list(range(first, num_layers, freq)):
        raise CatalogError(
            f"{c.origin}: MoE layer pattern {moe} is not 'dense first, then every k-th layer' "
            f"(unsupported for model_type {c.model_type})"
        )
    return first, freq


def _split_heads(c: _Cfg, hidden: int, heads: int, hidden_key: str, heads_key: str, fix: str) -> None:
    """Without a head_dim the head dim is hidden / heads, which must divide (transformers and
    Megatron refuse the model otherwise); flooring it would model another network."""
    if heads > 0 and hidden % heads:
        raise CatalogError(
            f"{c.origin}: {hidden_key} {hidden} is not a multiple of {heads_key} {heads}, so the head dim "
            f"would be {hidden / heads:g}; {fix}"
        )


def _attention(c: _Cfg, mla: bool = False) -> dict[str, Any]:
    """`mla`: the head dims are MLA's own fields (qk_nope / qk_rope / v_head_dim), not hidden / heads."""
    hidden, heads = int(c.req("hidden_size")), int(c.req("num_attention_heads"))
    kv = int(c.get("num_key_value_heads", heads))
    head_dim = c.get("head_dim")
    if not head_dim and not mla:
        _split_heads(c, hidden, heads, "hidden_size", "num_attention_heads", "give head_dim")
    return dict(
        num_layers=int(c.req("num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=int(c.req("vocab_size")),
        num_query_groups=kv if kv != heads else None,
        kv_channels=int(head_dim) if head_dim and int(head_dim) * heads != hidden else None,
    )


def _qwen_windows(c: _Cfg) -> Callable[[int], bool] | None:
    """Qwen2 / Qwen3: layers from max_window_layers on are windowed, only with use_sliding_window
    (transformers' Qwen2Config.layer_types)."""
    start = int(c.get("max_window_layers", 0))
    return (lambda i: i >= start) if c.get("use_sliding_window", False) else (lambda i: False)


def _llama_like(c: _Cfg, family: str, max_pos: int, qkv_bias: bool | None = None,
                mla: bool = False, tied_default: bool = False,
                windows: Callable[[int], bool] | None = None) -> dict[str, Any]:
    """`windows`: which layers a config's sliding_window applies to (None: all of them)."""
    attn_bias = bool(c.get("attention_bias", False))
    att = _attention(c, mla)
    return dict(
        att,
        **_windows(c, att["num_layers"], windows),
        ffn_hidden_size=int(c.req("intermediate_size")),
        activation="swiglu",
        normalization="rmsnorm",
        position_embedding="rope",
        max_position_embeddings=int(c.get("max_position_embeddings", max_pos)),
        tied_embeddings=bool(c.get("tie_word_embeddings", tied_default)),
        add_bias_linear=attn_bias and bool(c.get("mlp_bias", False)),
        qkv_bias=attn_bias if qkv_bias is None else qkv_bias,
        family=family,
    )


def _llama(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "llama", 2048)


def _mistral(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "mistral", 4096 * 32)


def _qwen2(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "qwen2", 32768, qkv_bias=True, windows=_qwen_windows(c))  # always q/k/v biases


def _qwen3(c: _Cfg) -> dict[str, Any]:
    return dict(_llama_like(c, "qwen3", 32768, windows=_qwen_windows(c)), qk_norm="head")


def _mixtral(c: _Cfg) -> dict[str, Any]:
    d = _llama_like(c, "mixtral", 4096 * 32)
    d["moe"] = MoESpec(
        num_experts=int(c.req("num_local_experts")),
        top_k=int(c.req("num_experts_per_tok")),
        ffn_hidden_size=d["ffn_hidden_size"],
    )
    return d


def _qwen3_moe(c: _Cfg) -> dict[str, Any]:
    d = _qwen3(c)
    # required: without it the config would silently become a dense model (an explicit 0 is dense)
    experts = int(c.req("num_experts"))
    step = int(c.get("decoder_sparse_step", 1))
    dense_only = set(c.get("mlp_only_layers", []))
    # transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % step == 0
    layout = _moe_layout(
        d["num_layers"], lambda i: experts > 0 and i not in dense_only and (i + 1) % step == 0, c
    )
    if layout:
        first, freq = layout
        d["moe"] = MoESpec(
            num_experts=experts,
            top_k=int(c.req("num_experts_per_tok")),
            ffn_hidden_size=int(c.req("moe_intermediate_size")),
            first_dense_layers=first,
            dense_ffn_hidden_size=d["ffn_hidden_size"] if (first or freq > 1) else 0,
            layer_freq=freq,
        )
    return d


def _deepseek_v3(c: _Cfg) -> dict[str, Any]:
    d = _llama_like(c, "deepseek", 4096, mla=True)
    d["mla"] = MLASpec(
        q_lora_rank=int(c.get("q_lora_rank", 0)),  # null = plain q projection
        kv_lora_rank=int(c.req("kv_lora_rank")),
        qk_nope_head_dim=int(c.req("qk_nope_head_dim")),
        qk_rope_head_dim=int(c.req("qk_rope_head_dim")),
        v_head_dim=int(c.req("v_head_dim")),
    )
    d["kv_channels"] = d["mla"].v_head_dim  # as Megatron's MLA configs set it
    experts = int(c.req("n_routed_experts"))  # required, as num_experts for qwen3_moe
    first_k = int(c.get("first_k_dense_replace", 0))
    freq = int(c.get("moe_layer_freq", 1))
    # transformers' DeepseekV3DecoderLayer: MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0
    layout = _moe_layout(d["num_layers"], lambda i: experts > 0 and i >= first_k and i % freq == 0, c)
    if layout:
        first, lfreq = layout
        moe_ffn = int(c.req("moe_intermediate_size"))
        shared = int(c.get("n_shared_experts", 0))
        d["moe"] = MoESpec(
            num_experts=experts,
            top_k=int(c.req("num_experts_per_tok")),
            ffn_hidden_size=moe_ffn,
            num_shared_experts=shared,
            shared_ffn_hidden_size=shared * moe_ffn,
            first_dense_layers=first,
            dense_ffn_hidden_size=d["ffn_hidden_size"] if (first or lfreq > 1) else 0,
            layer_freq=lfreq,
        )
    return d


def _nemotron(c: _Cfg) -> dict[str, Any]:
    d = _llama_like(c, "nemotron", 4096)
    d.update(activation="relu2", normalization="layernorm")  # squared ReLU, LayerNorm1P
    return d


def _gpt2(c: _Cfg) -> dict[str, Any]:
    hidden, heads = int(c.req("n_embd")), int(c.req("n_head"))
    _split_heads(c, hidden, heads, "n_embd", "n_head", "GPT-2 configs have no head_dim to give instead")
    return dict(
        num_layers=int(c.req("n_layer")),
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=int(c.req("vocab_size")),
        ffn_hidden_size=int(c.get("n_inner", 4 * hidden)),
        activation="gelu",
        normalization="layernorm",
        position_embedding="learned",
        max_position_embeddings=int(c.get("n_positions", 1024)),
        tied_embeddings=bool(c.get("tie_word_embeddings", True)),
        add_bias_linear=True,
        qkv_bias=True,
        family="gpt",
    )


# ---- 2025-26 families ---------------------------------------------------------------------------
# Each reads the fields transformers' own <Family>Config defines; a field a published config.json
# leaves out takes that class's default (named where it matters).

def _gemma_common(c: _Cfg, family: str, windows: Callable[[int], bool]) -> dict[str, Any]:
    """Gemma 2 / 3: GeGLU MLP (gated, priced as the 3-matrix SwiGLU), a norm before and after
    attention and MLP, tied embeddings by default, head_dim given apart from hidden / heads."""
    d = _llama_like(c, family, 8192, tied_default=True, windows=windows)
    d.update(norm_placement="pre+post",
             attn_logit_softcap=float(c.get("attn_logit_softcapping", 0.0)),
             final_logit_softcap=float(c.get("final_logit_softcapping", 0.0)))
    return d


def _gemma2(c: _Cfg) -> dict[str, Any]:
    # transformers' Gemma2Config.layer_types: even layers sliding, odd layers global
    return _gemma_common(c, "gemma2", lambda i: i % 2 == 0)


# transformers' Gemma3TextConfig defaults, for the fields a multimodal config's sparse text_config
# omits (google/gemma-3-*-pt config.json give only the fields that differ from them)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                         "max_position_embeddings": 131072, "num_key_value_heads": 4, "intermediate_size": 9216}


def _gemma3_text(c: _Cfg) -> dict[str, Any]:
    # Gemma3TextConfig.layer_types: every sliding_window_pattern-th layer global, the others local
    k = int(c.get("sliding_window_pattern", 6))
    return dict(_gemma_common(c, "gemma3", lambda i: (i + 1) % k != 0), qk_norm="head")


def _nested_text(key_defaults: Mapping[str, Any], inner: Callable[[_Cfg], dict[str, Any]], text_type: str):
    """A multimodal config (gemma3, llama4): the language model is its text_config (the vision
    tower is not part of the training-cost model)."""
    def build(c: _Cfg) -> dict[str, Any]:
        t = c.req("text_config")
        if not isinstance(t, Mapping):
            raise CatalogError(f"{c.origin}: text_config must be an object")
        merged = {**key_defaults, **{k: v for k, v in t.items() if v is not None}}
        _check_types(merged, f"{c.origin} text_config")
        return inner(_Cfg(merged, text_type, f"{c.origin} text_config"))
    return build


def _phi3(c: _Cfg) -> dict[str, Any]:
    # Phi-3 / Phi-4: fused qkv and gate_up projections (the same weights as separate ones); a
    # sliding_window, when set, on every layer
    return _llama_like(c, "phi3", 4096)


def _olmo2(c: _Cfg) -> dict[str, Any]:
    # OLMo 2: norms after attention and MLP only, RMSNorm on the whole q and k projections
    return dict(_llama_like(c, "olmo2", 2048), norm_placement="post", qk_norm="full")


def _granite(c: _Cfg) -> dict[str, Any]:
    # Granite 3: Llama with scaling multipliers (embedding / residual / attention / logits), which
    # cost nothing
    return _llama_like(c, "granite", 2048)


def _granitemoe(c: _Cfg) -> dict[str, Any]:
    d = _llama_like(c, "granite", 2048)
    d["moe"] = MoESpec(num_experts=int(c.req("num_local_experts")), top_k=int(c.req("num_experts_per_tok")),
                       ffn_hidden_size=d["ffn_hidden_size"])  # intermediate_size: one expert's
    return d


def _glm_rotary(c: _Cfg) -> float:
    r = float(c.get("partial_rotary_factor", 0.5))
    if not 0.0 < r <= 1.0:
        raise CatalogError(f"{c.origin}: partial_rotary_factor must be in (0, 1], got {r!r}")
    return r


def _glm4(c: _Cfg) -> dict[str, Any]:
    # GLM-4-0414: q/k/v biases, a norm after attention and after the MLP too, half-rotary RoPE
    return dict(_llama_like(c, "glm4", 32768, qkv_bias=bool(c.get("attention_bias", True))),
                norm_placement="pre+post", rotary_percent=_glm_rotary(c))


def _glm4_moe(c: _Cfg) -> dict[str, Any]:
    # GLM-4.5: DeepSeek-style MoE (dense first layers, one shared expert), QK norm per head.
    # num_nextn_predict_layers (the MTP layer) is not a layer of the trained decoder here.
    d = _llama_like(c, "glm4_moe", 131072, qkv_bias=bool(c.get("attention_bias", True)))
    d.update(rotary_percent=_glm_rotary(c), qk_norm="head" if c.get("use_qk_norm", False) else "none")
    experts = int(c.req("n_routed_experts"))
    first_k = int(c.get("first_k_dense_replace", 0))
    # transformers' Glm4MoeDecoderLayer: MoE iff layer >= first_k_dense_replace
    layout = _moe_layout(d["num_layers"], lambda i: experts > 0 and i >= first_k, c)
    if layout:
        first, freq = layout
        moe_ffn = int(c.req("moe_intermediate_size"))
        shared = int(c.get("n_shared_experts", 0))
        d["moe"] = MoESpec(num_experts=experts, top_k=int(c.req("num_experts_per_tok")), ffn_hidden_size=moe_ffn,
                           num_shared_experts=shared, shared_ffn_hidden_size=shared * moe_ffn,
                           first_dense_layers=first, dense_ffn_hidden_size=d["ffn_hidden_size"] if first else 0,
                           layer_freq=freq)
    return d


def _llama4_text(c: _Cfg) -> dict[str, Any]:
    """Llama 4: interleaved MoE (routed + one shared expert of intermediate_size) and dense
    (intermediate_size_mlp) layers; chunked local attention on the RoPE layers, global NoPE
    attention on every no_rope_layer_interval-th layer (transformers' Llama4TextConfig)."""
    n = int(c.req("num_hidden_layers"))
    interval = int(c.get("no_rope_layer_interval", 4))
    rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]  # 1 = RoPE
    if not isinstance(rope, list) or len(rope) != n or any(x not in (0, 1) for x in rope):
        raise CatalogError(f"{c.origin}: no_rope_layers must hold a 0 or 1 per layer ({n})")
    dense_ffn = int(c.req("intermediate_size_mlp"))
    expert_ffn = int(c.req("intermediate_size"))
    d = _llama_like(c, "llama4", 131072)
    d.update(_windows(c, n, lambda i: bool(rope[i]), size_key="attention_chunk_size", window_type="chunked"))
    d.update(ffn_hidden_size=dense_ffn, qk_norm="l2" if c.get("use_qk_norm", False) else "none",
             nope_pattern=_period([1 - x for x in rope]) if not all(rope) else ())
    step = int(c.get("interleave_moe_layer_step", 1))
    moe_layers = c.get("moe_layers")
    moe_set = set(moe_layers) if moe_layers is not None else set(range(step - 1, n, step))
    experts = int(c.req("num_local_experts"))
    layout = _moe_layout(n, lambda i: experts > 0 and i in moe_set, c)
    if layout:
        first, freq = layout
        d["moe"] = MoESpec(num_experts=experts, top_k=int(c.req("num_experts_per_tok")), ffn_hidden_size=expert_ffn,
                           num_shared_experts=1, shared_ffn_hidden_size=expert_ffn, first_dense_layers=first,
                           dense_ffn_hidden_size=dense_ffn if (first or freq > 1) else 0, layer_freq=freq)
    return d


def _gpt_oss(c: _Cfg) -> dict[str, Any]:
    """gpt-oss: MoE on every layer (biases on the experts too), sliding window on the layers its
    layer_types mark, a learned attention sink per head, the clamped gated activation (swiglu_limit,
    7.0 in both released configs)."""
    d = _llama_like(c, "gpt-oss", 131072, windows=lambda i: i % 2 == 0)
    d.update(attention_sinks=True, add_bias_linear=bool(c.get("attention_bias", True)),
             qkv_bias=bool(c.get("attention_bias", True)), activation_clamp=float(c.get("swiglu_limit", 7.0)))
    d["moe"] = MoESpec(num_experts=int(c.req("num_local_experts")),
                       top_k=int(c.get("num_experts_per_tok") or c.req("experts_per_token")),
                       ffn_hidden_size=d["ffn_hidden_size"])
    return d


# Fields read as integers / booleans: a JSON value of another type is refused (int() would turn
# 32.5 layers into 32 and `true` into 1 without a word).
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "intermediate_size", "max_position_embeddings", "num_local_experts",
               "num_experts_per_tok", "num_experts", "decoder_sparse_step", "moe_intermediate_size",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "first_k_dense_replace", "moe_layer_freq", "n_shared_experts", "n_embd",
               "n_layer", "n_head", "n_inner", "n_positions", "sliding_window", "sliding_window_pattern",
               "max_window_layers", "attention_chunk_size", "intermediate_size_mlp", "interleave_moe_layer_step",
               "no_rope_layer_interval", "experts_per_token")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_qk_norm")
_NONNEGATIVE_FIELDS = ("swiglu_limit",)


def _check_types(cfg: Mapping[str, Any], origin: str) -> None:
    for k in _INT_FIELDS:
        v = cfg.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
            raise CatalogError(f"{origin}: {k} must be an integer, got {v!r}")
    for k in _BOOL_FIELDS:
        v = cfg.get(k)
        if v is not None and not isinstance(v, bool):
            raise CatalogError(f"{origin}: {k} must be true or false, got {v!r}")
    for k in _NONNEGATIVE_FIELDS:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            raise CatalogError(f"{origin}: {k} must be a non-negative number, got {v!r}")
    for k in ("mlp_only_layers",):
        v = cfg.get(k)
        if v is not None and (not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v)):
            raise CatalogError(f"{origin}: {k} must be a list of layer indices, got {v!r}")


def _period(pattern: list[int]) -> tuple[int, ...]:
    """The shortest repeating unit of a per-layer 0/1 pattern (the whole of it if none repeats);
    () when every layer is 1."""
    if all(pattern):
        return ()
    n = len(pattern)
    for p in range(1, n + 1):
        if all(pattern[i] == pattern[i % p] for i in range(n)):
            return tuple(pattern[:p])
    return tuple(pattern)  # unreachable: p = n always matches


_LOCAL_TYPES = {"sliding_attention": "sliding", "chunked_attention": "chunked"}


def _windows(c: _Cfg, num_layers: int, default: Callable[[int], bool] | None, size_key: str = "sliding_window",
             window_type: str = "sliding") -> dict[str, Any]:
    """window_size / window_type / window_pattern from the config: its ``layer_types`` when given
    (transformers >= 4.53 writes them), else the family's rule `default(layer) -> windowed`
    (None: every layer windowed when a window is set)."""
    w = c.get(size_key)
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise CatalogError(f"{c.origin}: layer_types must list one type per layer ({num_layers}), got {types!r}")
        unknown = sorted({t for t in types if t not in _LOCAL_TYPES and t != "full_attention"}, key=str)
        if unknown:
            raise CatalogError(f"{c.origin}: unsupported layer_types {unknown} (supported: full_attention, "
                               f"{', '.join(_LOCAL_TYPES)})")
        kinds = {_LOCAL_TYPES[t] for t in types if t in _LOCAL_TYPES}
        if len(kinds) > 1:
            raise CatalogError(f"{c.origin}: layer_types mixes sliding and chunked attention (unsupported)")
        pattern = [1 if t in _LOCAL_TYPES else 0 for t in types]
        window_type = kinds.pop() if kinds else window_type
    else:
        pattern = [1 if default is None or default(i) else 0 for i in range(num_layers)]
    if not w or not any(pattern):
        return {}
    return dict(window_size=int(w), window_type=window_type, window_pattern=_period(pattern))


_BUILDERS: dict[str, Callable[[_Cfg], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gpt2": _gpt2,
    "nemotron": _nemotron,
    "deepseek_v3": _deepseek_v3,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gemma3": _nested_text(_GEMMA3_TEXT_DEFAULTS, _gemma3_text, "gemma3_text"),
    "phi3": _phi3,
    "olmo2": _olmo2,
    "granite": _granite,
    "granitemoe": _granitemoe,
    "glm4": _glm4,
    "glm4_moe": _glm4_moe,
    "llama4_text": _llama4_text,
    "llama4": _nested_text({}, _llama4_text, "llama4_text"),
    "gpt_oss": _gpt_oss,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def model_from_hf_config(cfg: dict, name: str, *, origin: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed HF ``config.json``; unknown fields are ignored.

    ``origin`` names the file in error messages. Raises CatalogError (one line) for an unsupported
    ``model_type`` or a missing required field.
    """
    if not isinstance(cfg, Mapping):
        raise CatalogError(f"{origin}: expected a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in _BUILDERS:
        raise CatalogError(
            f"{origin}: unsupported model_type {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    _check_types(cfg, origin)
    c = _Cfg(cfg, model_type, origin)
    try:
        fields = _BUILDERS[model_type](c)
    except (TypeError, ValueError) as e:
        if isinstance(e, CatalogError):
            raise
        raise CatalogError(f"{origin}: bad value for model_type {model_type}: {e}") from None
    return ModelSpec(name=name, source=f"HF {origin} (model_type {model_type})", **fields)

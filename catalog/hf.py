"""Hugging Face ``config.json`` -> ModelSpec, for the model types whose configs we know.

Conventions (the same as the catalog's YAML files, so that both give equal specs):
- ``num_query_groups`` is None when the KV heads equal the attention heads (MHA);
- ``kv_channels`` is None when the head dim equals hidden / heads; MLA models use ``v_head_dim``;
- ``ffn_hidden_size`` is the dense MLP size (``intermediate_size``), ``moe.ffn_hidden_size`` the
  size of one routed expert; ``moe.dense_ffn_hidden_size`` is set only when some layers are dense.
"""
from __future__ import annotations

import math
import warnings
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


def _llama_like(c: _Cfg, family: str, max_pos: int, qkv_bias: bool | None = None,
                mla: bool = False) -> dict[str, Any]:
    attn_bias = bool(c.get("attention_bias", False))
    return dict(
        _attention(c, mla),
        ffn_hidden_size=int(c.req("intermediate_size")),
        activation="swiglu",
        normalization="rmsnorm",
        position_embedding="rope",
        max_position_embeddings=int(c.get("max_position_embeddings", max_pos)),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        add_bias_linear=attn_bias and bool(c.get("mlp_bias", False)),
        qkv_bias=attn_bias if qkv_bias is None else qkv_bias,
        family=family,
    )


def _llama(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "llama", 2048)


def _mistral(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "mistral", 4096 * 32)


def _qwen2(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "qwen2", 32768, qkv_bias=True)  # Qwen2 always has q/k/v biases


def _qwen3(c: _Cfg) -> dict[str, Any]:
    return _llama_like(c, "qwen3", 32768)


def _mixtral(c: _Cfg) -> dict[str, Any]:
    d = _llama_like(c, "mixtral", 4096 * 32)
    d["moe"] = MoESpec(
        num_experts=int(c.req("num_local_experts")),
        top_k=int(c.req("num_experts_per_tok")),
        ffn_hidden_size=d["ffn_hidden_size"],
    )
    return d


def _qwen3_moe(c: _Cfg) -> dict[str, Any]:
    d = _llama_like(c, "qwen3", 32768)
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


# Fields read as integers / booleans: a JSON value of another type is refused (int() would turn
# 32.5 layers into 32 and `true` into 1 without a word).
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "intermediate_size", "max_position_embeddings", "num_local_experts",
               "num_experts_per_tok", "num_experts", "decoder_sparse_step", "moe_intermediate_size",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "first_k_dense_replace", "moe_layer_freq", "n_shared_experts", "n_embd",
               "n_layer", "n_head", "n_inner", "n_positions", "sliding_window")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


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
    for k in ("mlp_only_layers",):
        v = cfg.get(k)
        if v is not None and (not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v)):
            raise CatalogError(f"{origin}: {k} must be a list of layer indices, got {v!r}")


class SlidingWindowWarning(UserWarning):
    """An HF config's sliding-window attention, which the model does not describe."""


def _warn_sliding_window(cfg: Mapping[str, Any], origin: str) -> None:
    """Sliding-window attention is not modelled: attention is predicted as full causal attention
    over the whole sequence (FLOPs, time), i.e. slower than such a model runs at sequences longer
    than the window. Said once, as a warning, when the config turns the window on."""
    w = cfg.get("sliding_window")
    if w is None or cfg.get("use_sliding_window") is False:
        return
    ctx = cfg.get("max_position_embeddings")
    if isinstance(ctx, int) and w >= ctx:
        return  # a window as long as the context is full attention
    warnings.warn(SlidingWindowWarning(
        f"{origin}: sliding_window={w} is not modelled; attention is predicted as full causal attention "
        f"over the whole sequence (pessimistic for sequences longer than {w} tokens)"), stacklevel=3)


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
    _warn_sliding_window(cfg, origin)
    c = _Cfg(cfg, model_type, origin)
    try:
        fields = _BUILDERS[model_type](c)
    except (TypeError, ValueError) as e:
        if isinstance(e, CatalogError):
            raise
        raise CatalogError(f"{origin}: bad value for model_type {model_type}: {e}") from None
    return ModelSpec(name=name, source=f"HF {origin} (model_type {model_type})", **fields)

"""Parameter counts and FLOPs of a decoder-only transformer (pure functions of a ModelSpec).

Conventions: a matrix multiply of an (M x K) by (K x N) matrix costs 2·M·K·N FLOPs. Training
costs forward + backward = 3x forward for every weight GEMM (the backward computes the input and
the weight gradients). Core attention is counted causally (half of the full s x s score matrix),
which is what flash attention actually computes; `causal=False` gives the PaLM/Megatron-classic
count.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from advisor.catalog.specs import ModelSpec


def _attn_weight_params(m: ModelSpec) -> int:
    h = m.hidden_size
    if m.mla is not None:
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        heads = m.num_attention_heads
        if a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * qk  # down, norm, up
        else:
            q = h * heads * qk
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank  # down + norm
        kv += a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)  # up
        o = heads * a.v_head_dim * h
        return q + kv + o
    hd = m.head_dim
    q = h * m.num_attention_heads * hd
    kv = 2 * h * m.kv_heads * hd
    o = m.num_attention_heads * hd * h
    bias = 0
    if m.add_bias_linear or m.qkv_bias:
        bias += (m.num_attention_heads + 2 * m.kv_heads) * hd
    if m.add_bias_linear:
        bias += h
    return q + kv + o + bias + qk_norm_params(m) + (m.num_attention_heads if m.attention_sinks else 0)


def qk_norm_params(m: ModelSpec) -> int:
    """Weights of the q and k norms of one layer: one head's width each ("head"), the whole
    projection ("full", OLMo 2), none for a weightless L2 norm ("l2", Llama 4). MLA's norms sit on
    its latents and are counted with them."""
    if m.mla is not None:
        return 0
    if m.qk_norm == "head":
        return 2 * m.head_dim
    if m.qk_norm == "full":
        return (m.num_attention_heads + m.kv_heads) * m.head_dim
    return 0


def _mlp_params(m: ModelSpec, ffn: int) -> int:
    h = m.hidden_size
    mats = 3 if m.activation == "swiglu" else 2
    bias = (ffn * (2 if m.activation == "swiglu" else 1) + h) if m.add_bias_linear else 0
    return mats * h * ffn + bias


def qk_norm_width(m: ModelSpec) -> int:
    """Elements per token (all heads) that the q and k norms read, 0 without them (MLA: its latent
    norms, in its own count)."""
    if m.qk_norm == "none" or m.mla is not None:
        return 0
    return (m.num_attention_heads + m.kv_heads) * m.head_dim


def _norm_params(m: ModelSpec) -> int:
    return m.hidden_size * (2 if m.normalization == "layernorm" else 1)


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, split the way parallelism shards them."""

    attention: int  # sharded by TP
    dense_mlp: int  # sharded by TP (0 on MoE layers)
    experts: int  # routed experts, all of them: sharded by EP x ETP
    shared_experts: int  # sharded by TP
    router: int  # replicated
    norms: int  # replicated

    @property
    def total(self) -> int:
        return self.attention + self.dense_mlp + self.experts + self.shared_experts + self.router + self.norms


def layer_params(m: ModelSpec, layer: int) -> LayerParams:
    """Memoised by the model object's identity (recommend asks for the same layers of one model
    for every layout it ranks); the memo keeps the model alive, so an id is never reused."""
    key = (id(m), layer)
    hit = _PARAMS_MEMO.get(key)
    if hit is None or hit[0] is not m:
        if len(_PARAMS_MEMO) > 8192:
            _PARAMS_MEMO.clear()
        hit = _PARAMS_MEMO[key] = (m, _layer_params(m, layer))
    return hit[1]


_PARAMS_MEMO: dict[tuple, tuple] = {}


def _layer_params(m: ModelSpec, layer: int) -> LayerParams:
    attn = _attn_weight_params(m)
    norms = m.norms_per_layer * _norm_params(m)
    if m.is_moe_layer(layer):
        moe = m.moe
        experts = moe.num_experts * _mlp_params(m, moe.ffn_hidden_size)
        shared = _mlp_params(m, moe.shared_ffn_hidden_size) if moe.shared_ffn_hidden_size else 0
        return LayerParams(attn, 0, experts, shared, m.hidden_size * moe.num_experts, norms)
    ffn = m.ffn_hidden_size
    if m.moe is not None and m.moe.dense_ffn_hidden_size and layer < m.moe.first_dense_layers:
        ffn = m.moe.dense_ffn_hidden_size
    return LayerParams(attn, _mlp_params(m, ffn), 0, 0, 0, norms)


def embedding_params(m: ModelSpec) -> int:
    pos = m.max_position_embeddings * m.hidden_size if m.position_embedding == "learned" else 0
    return m.vocab_size * m.hidden_size + pos


def output_params(m: ModelSpec) -> int:
    """Output layer (LM head) plus the final norm. Zero extra weights when tied, except the norm."""
    return (0 if m.tied_embeddings else m.vocab_size * m.hidden_size) + _norm_params(m)


def total_params(m: ModelSpec) -> int:
    return embedding_params(m) + output_params(m) + sum(layer_params(m, i).total for i in range(m.num_layers))


def active_params(m: ModelSpec) -> int:
    """Parameters touched per token (routed experts counted top_k times, not num_experts)."""
    n = embedding_params(m) + output_params(m)
    for i in range(m.num_layers):
        lp = layer_params(m, i)
        experts = lp.experts // m.moe.num_experts * m.moe.top_k if lp.experts else 0
        n += lp.total - lp.experts + experts
    return n


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------

def keys_per_query(seq: int, window: int = 0, window_type: str = "sliding", causal: bool = True) -> float:
    """Mean number of keys a query attends to over a sequence of `seq` tokens (the count that
    flash attention computes, up to its tile granularity):
    - full causal: seq / 2 (the lower triangle of the seq x seq score matrix); non-causal: seq;
    - sliding window w (query i sees keys max(0, i - w) .. i): the integral of min(x, w) over the
      sequence, / seq = w - w^2 / (2 seq) for w < seq (seq / 2 once w >= seq: full causal);
    - chunked by C (query i sees its own block of C tokens up to itself): C / 2 per full block,
      r^2 / 2 over the last r = seq mod C tokens, / seq."""
    if not causal:
        return float(seq)
    if window <= 0 or window >= seq:
        return seq / 2.0
    if window_type == "chunked":
        full, rest = divmod(seq, window)
        return (full * window * window / 2.0 + rest * rest / 2.0) / seq
    return window - window * window / (2.0 * seq)


def attention_core_flops_per_token(m: ModelSpec, seq: int, causal: bool = True, layer: int | None = None) -> float:
    """Forward FLOPs per token of one layer's softmax(QK^T)V (scores + weighted sum); `layer`:
    that layer's window (ModelSpec.layer_window), else full attention."""
    if m.mla is not None:
        qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
        v = m.mla.v_head_dim
    else:
        qk = v = m.head_dim
    window = m.layer_window(layer) if layer is not None else 0
    return 2.0 * keys_per_query(seq, window, m.window_type, causal) * m.num_attention_heads * (qk + v)


@lru_cache(maxsize=1024)
def attention_flops_all_layers(m: ModelSpec, seq: int, causal: bool = True) -> float:
    """Forward core-attention FLOPs per token summed over the layers, each with its window."""
    if not m.window_size:
        return m.num_layers * attention_core_flops_per_token(m, seq, causal)
    return sum(attention_core_flops_per_token(m, seq, causal, i) for i in range(m.num_layers))


@lru_cache(maxsize=256)
def matmul_params_per_token(m: ModelSpec) -> int:
    """Weights that a token multiplies through (active, excluding the embedding lookup, norms,
    biases and routers are included since they are tiny). Cached: a pure function of the spec."""
    n = 0
    for i in range(m.num_layers):
        lp = layer_params(m, i)
        experts = lp.experts // m.moe.num_experts * m.moe.top_k if lp.experts else 0
        n += lp.attention + lp.dense_mlp + experts + lp.shared_experts + lp.router
    n += m.vocab_size * m.hidden_size  # logits, tied or not
    return n


def forward_flops_per_token(m: ModelSpec, seq: int, causal: bool = True) -> float:
    return 2.0 * matmul_params_per_token(m) + attention_flops_all_layers(m, seq, causal)


def training_flops_per_token(m: ModelSpec, seq: int, causal: bool = True) -> float:
    """Model FLOPs per token for one training step (forward + backward, no recompute): the
    numerator of MFU. Equals 6·N_matmul + 3·L·attention."""
    return 3.0 * forward_flops_per_token(m, seq, causal)


def recompute_flops_per_token(m: ModelSpec, seq: int, recompute: str, causal: bool = True) -> float:
    """Extra forward FLOPs per token spent re-computing activations (hardware FLOPs - model FLOPs)."""
    if recompute == "full":
        return forward_flops_per_token(m, seq, causal) - 2.0 * m.vocab_size * m.hidden_size
    if recompute == "selective":
        return attention_flops_all_layers(m, seq, causal)
    return 0.0

"""Partial recompute (issue #27): Megatron's block method on some layers of each virtual chunk
(TrainConfig.recompute_layers, recompute "full") and selective recompute of named modules
(TrainConfig.recompute_modules, recompute "selective"). What each choice stops keeping for the
backward (models/memory.py's activation terms) and the forward work it re-runs in the backward
(models/step_time.py's per-layer forward costs). Pure functions of (model, config, constants).

What each module's recompute drops (megatron-core transformer_layer.py / mlp.py / moe/experts.py /
moe/moe_layer.py / multi_latent_attention.py), on the te stack (Transformer Engine's fused
LayerNormLinear / LayerNormMLP: a dense layer's two pre-norms are fused into the QKV and FC1 GEMMs,
megatron's input_layernorm / pre_mlp_layernorm are IdentityOp there):
- "core_attn" (normal checkpoint of the core attention): flash attention stores no score matrix,
  so it drops ~nothing (memory.layer_activation_bytes); re-runs the attention forward.
- "mlp" (normal checkpoint of a dense MLP; MoE layers are not touched): keeps the MLP's input (the
  residual stream the fused norm reads, counted as a norm input) and drops the fused norm's output
  (the FC1 input), the FC1 output, the activation output (the FC2 input) and the stack's extra
  GLU copies; re-runs the MLP's GEMMs, its elementwise passes, its FP8 casts and its TP collective.
- "layernorm" (output-discarding checkpoint of input_layernorm / pre_mlp_layernorm where they are
  modules of their own: a MoE layer's pre-MLP norm, an MLA layer's input norm): drops the norm's
  BF16 output where its consumer keeps it as is (bf16, and a MoE layer's under any format: the
  router's gating GEMM saves it in BF16); under an FP8 format the MLA input norm's consumers keep
  their own FP8 copies, so nothing is dropped there; re-runs the norm (c.norm_passes over its input).
- "moe_act" (output-discarding checkpoint of the experts' activation with the routing
  probabilities, TEGroupedMLP): keeps the FC1 output (the checkpoint's input) and drops the
  activation output and, under bf16, its probability-weighted copy that FC2 keeps (under FP8 FC2's
  FP8 copy stays); re-runs the activation (c.elementwise_ffn_passes over the routed tokens).
- "moe" (normal checkpoint of the MoE block): keeps its input (the pre-MLP norm output) and drops
  everything moe.moe_activation_elements counts; re-runs the router, the dispatch and combine
  (all-to-all), the experts and shared experts.
- "shared_experts": drops the shared experts' FC1 output and FC2 input; re-runs their GEMMs.
- "mla_up_proj" (output-discarding checkpoint of MLA's up-projections and RoPE): keeps the latents
  and drops q, k, v (released once the attention's forward has run); re-runs the up-projection
  GEMMs.
Block recompute keeps the input of the recomputed layers (memory.layer_activation_bytes "full")
and everything of the others; the recomputed layers re-run their whole forward.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.constants import Constants
from advisor.models.flops import layer_params, qk_norm_width
from advisor.models.moe import expert_load, moe_activation_elements, routed_tokens
from advisor.models.quant import saved_input_bytes
from advisor.models.stages import Memo, Stages, gather_blocks, layer_shape_config, quant_fields
from advisor.search_spaces.columns import recompute_modules_of
from advisor.search_spaces.layout import in_flight_chunks, layer_kind_counts

DEFAULT_MODULES: tuple[str, ...] = ("core_attn",)  # megatron-core's default recompute_modules


def effective_modules(modules: Sequence[str]) -> frozenset[str]:
    """The modules recomputed: () means megatron-core's default, core_attn; "moe" covers "moe_act"
    and "shared_experts" (the whole MoE block)."""
    mods = frozenset(modules or DEFAULT_MODULES)
    return mods - {"moe_act", "shared_experts"} if "moe" in mods else mods


def _separate_norms(model: ModelSpec, layer: int) -> int:
    """input_layernorm / pre_mlp_layernorm that are modules of their own on the te stack: the
    pre-MLP norm of a MoE layer (the router reads its output), the input norm of an MLA layer
    (its down-projections are plain linears)."""
    return int(model.is_moe_layer(layer)) + int(model.mla is not None)


def _dense_ffn(model: ModelSpec, layer: int) -> int:
    if model.moe is not None and model.moe.dense_ffn_hidden_size and layer < model.moe.first_dense_layers:
        return model.moe.dense_ffn_hidden_size
    return model.ffn_hidden_size


def module_saved_bytes(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants, module: str) -> float:
    """Bytes one layer stops keeping per microbatch on one GPU when `module` is recomputed (0 where
    the module does not exist in the layer)."""
    s, b, h, t = cfg.seq / cfg.cp, cfg.mbs, model.hidden_size, cfg.tp
    sp = t if cfg.sequence_parallel else 1
    e = c.bytes_activation
    quantized = cfg.precision != "bf16"
    gemm = saved_input_bytes(cfg.quant_code, c) if quantized else e
    gated = model.activation == "swiglu"
    moe_layer = model.is_moe_layer(layer)
    if module == "mlp":
        if moe_layer:
            return 0.0
        f = s * b * _dense_ffn(model, layer) / t
        return gemm * s * b * h / sp + e * (2 if gated else 1) * f + gemm * f + e * (c.glu_kept_copies * f if gated else 0.0)
    if module == "layernorm":
        # under an FP8 format the MLA input norm's consumers keep FP8 copies (nothing dropped), but a
        # MoE layer's pre-MLP norm output is the router's BF16 saved input (memory.layer_activation_bytes)
        norms = int(moe_layer) if quantized else _separate_norms(model, layer)
        return norms * e * s * b * h / sp
    if module == "mla_up_proj":
        if model.mla is None:
            return 0.0
        m = model.mla
        return e * s * b * model.num_attention_heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.v_head_dim) / t
    if not moe_layer:
        return 0.0
    if module == "moe":
        elems, gemm_in = moe_activation_elements(model, cfg, c)
        return e * elems + gemm * gemm_in
    if module == "moe_act":
        routed = routed_tokens(model, cfg, c)
        return routed * model.moe.ffn_hidden_size * (e + (0.0 if quantized else e))
    if module == "shared_experts":
        fs = s * b * model.moe.shared_ffn_hidden_size / t
        return e * (2 if gated else 1) * fs + gemm * fs
    return 0.0  # core_attn


def selective_saved_bytes(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants,
                          modules: Sequence[str]) -> float:
    """Bytes the selective recompute of `modules` drops from one layer."""
    return sum(module_saved_bytes(model, layer, cfg, c, m) for m in sorted(effective_modules(modules)))


def module_forward_parts(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants, hbm_bw: float,
                         modules: Sequence[str]) -> np.ndarray:
    """[6] what the selective recompute of `modules` re-runs of one layer's forward, as shares of
    its forward terms plus seconds of its own: (share of the GEMM and FP8-cast time, share of the
    attention, share of the TP collectives, share of the EP all-to-all, memory-bound seconds, share
    of the memory-bound time; "moe": all of it less the passes outside the MoE block, i.e. the
    router's, the permutation's and the experts' memory-bound work).
    A module's GEMM share is its weights' share of the weights one token passes through (forward
    GEMM FLOPs are 2 x those per token; a routed token passes top_k experts of the layer's E x the
    busiest rank's load); its memory-bound seconds are the passes step_time.layer_forward counts."""
    mods = effective_modules(modules)
    lp = layer_params(model, layer)
    moe_layer = model.is_moe_layer(layer)
    routed_w = 0.0
    if moe_layer:
        routed_w = lp.experts * model.moe.top_k / model.moe.num_experts * expert_load(model, cfg, c)[0]
    per_token = lp.attention + lp.dense_mlp + lp.shared_experts + lp.router + routed_w
    s, b, h, t = cfg.seq / cfg.cp, cfg.mbs, model.hidden_size, cfg.tp
    sp = t if cfg.sequence_parallel else 1
    T = s * b
    rate = c.bytes_activation / (hbm_bw * c.hbm_efficiency)
    gemm = attn = tp = ep = mb = mb_share = 0.0
    if "core_attn" in mods:
        attn = 1.0
    if "mlp" in mods and not moe_layer:
        gemm += lp.dense_mlp / per_token
        tp += 0.5  # the FC2 reduce (one of the layer's two TP collectives)
        mb += rate * T * (c.elementwise_ffn_passes * _dense_ffn(model, layer) / t + c.norm_passes * h / sp)
    if "layernorm" in mods:
        mb += rate * T * c.norm_passes * _separate_norms(model, layer) * h / sp
    if "mla_up_proj" in mods and model.mla is not None:
        m = model.mla
        up = model.num_attention_heads * (m.q_lora_rank * (m.qk_nope_head_dim + m.qk_rope_head_dim) * bool(m.q_lora_rank)
                                          + m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim))
        gemm += up / per_token
    if moe_layer:
        if "moe" in mods:
            gemm += (lp.shared_experts + lp.router + routed_w) / per_token
            ep = 1.0
            tp += 0.5
            mb_share = 1.0  # less step_time.layer_forward's passes outside the MoE block:
            mb -= rate * T * (c.elementwise_hidden_passes * h / sp
                              + c.norm_passes * ((model.norms_per_layer - 2) * h / sp + qk_norm_width(model) / t))
            if cfg.cp > 1:  # and CP's per-step merges of the attention output
                width = model.num_attention_heads * (model.mla.v_head_dim if model.mla is not None else model.head_dim) / t
                mb -= cfg.cp * c.cp_step_passes * T * width * 4.0 / (hbm_bw * c.hbm_efficiency) / 3
        if "shared_experts" in mods:
            gemm += lp.shared_experts / per_token
        if "moe_act" in mods:
            routed = routed_tokens(model, cfg, c)
            mb += rate * c.elementwise_ffn_passes * routed * model.moe.ffn_hidden_size
    return np.array([gemm, attn, tp, ep, mb, mb_share])


def saved_table(memo: Memo, key, code: int) -> np.ndarray:
    """[K] selective_saved_bytes per kind for memory.activation_table's layer-shape key and a
    recompute_modules_code."""
    return memo.get("rc_saved", (key, code), lambda: np.array(
        [selective_saved_bytes(memo.model, i, layer_shape_config(key), memo.c, recompute_modules_of(code)) for i in memo.kinds]))


def rank_chunk_layers(plan, rank: int) -> list[range]:
    """The layers of each virtual chunk of a pipeline rank, in virtual-stage order: a PipelinePlan's
    chunks, or a memory.ContiguousSplit's rank layers cut into vp equal chunks (as it takes them)."""
    if hasattr(plan, "chunk_ranges"):
        return [plan.chunk_ranges[ch] for ch in plan.rank_chunks(rank)]
    lay = plan.rank_layers[rank]
    cuts = np.linspace(0, len(lay), plan.vp + 1).round().astype(int)
    return [lay[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def block_table(memo: Memo, plan, n: int, m: int) -> np.ndarray:
    """[2, pp, K]: per rank, the layers of each kind the block method recomputes (the first n of
    each virtual chunk) and their layer-microbatches in flight at the rank's peak
    (layout.in_flight_chunks)."""
    def make():
        cfg = TrainConfig(pp=plan.pp, vp=plan.vp, gbs=m)
        layers, flight = [], []
        for r in range(plan.pp):
            lay, fl = {}, {}
            for k, chunk in zip(in_flight_chunks(cfg, r), rank_chunk_layers(plan, r)):
                for i, cnt in layer_kind_counts(memo.model, chunk[:n]).items():
                    lay[i] = lay.get(i, 0) + cnt
                    fl[i] = fl.get(i, 0.0) + k * cnt
            layers.append(lay)
            flight.append(fl)
        return np.stack([memo.per_kind(layers), memo.per_kind(flight)])
    return memo.get("rc_block", (plan, n, m), make)


def recomputed_layers(L, memo: Memo, S: Stages, counts: np.ndarray, flight: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray | None]:
    """([S, K] layers each stage recomputes whole, [S, K] their layer-microbatches in flight, or
    None without `flight`): every layer under recompute "full" without recompute_layers, the block
    method's first n layers of each chunk with it, none otherwise."""
    r = S.row
    full = (L.recompute == 2)[r]
    n = L.rc_layers if L.rc_layers is not None else np.full(len(L), -1, np.int64)
    m = L.num_microbatches
    plans = L.plans
    block = gather_blocks([L.plan, np.maximum(n, 0), m], lambda i: block_table(
        memo, plans[L.plan[i]], int(max(n[i], 0)), int(m[i])).transpose(1, 0, 2).reshape(plans[L.plan[i]].pp, -1), S)
    K = counts.shape[1]
    blk = (n >= 0)[r][:, None]
    lay = np.where(full[:, None], np.where(blk, block[:, :K], counts), 0.0)
    fl = None if flight is None else np.where(full[:, None], np.where(blk, block[:, K:], flight), 0.0)
    return lay, fl


def partial_activations(L, memo: Memo, S: Stages, keys: list, key: np.ndarray, per_key: np.ndarray,
                        flight: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(activation bytes per stage, [S, K] layers recomputed whole: the recompute working set's
    candidates) with the partial-recompute columns (Layouts.rc_layers / rc_modules): recomputed
    layers keep their input (per_key[..., 0]), the others everything (per_key[..., 1]) less what
    the selective modules drop."""
    r = S.row
    K = per_key.shape[1]
    lay, fl = recomputed_layers(L, memo, S, counts, flight)
    keep = per_key[:, :, 1][key]
    if L.rc_modules is not None:
        sel = (L.recompute == 1)[r]
        codes = L.rc_modules[r]
        saved = np.zeros_like(keep)
        for code in np.unique(codes[sel]):
            rows = sel & (codes == code)
            tables = np.stack([saved_table(memo, keys[u], int(code)) for u in range(len(keys))])
            saved[rows] = tables[key[rows]]
        keep = keep - saved
    acts = np.zeros(len(r))
    for j in range(K):
        acts = acts + fl[:, j] * per_key[:, j, 0][key] + (flight[:, j] - fl[:, j]) * keep[:, j]
    return acts, lay


def recompute_time(model: ModelSpec, L, memo: Memo, S: Stages, U: np.ndarray, fields: Sequence[str], key: np.ndarray,
                   counts: np.ndarray, hbm_bw: float) -> np.ndarray:
    """[S] forward seconds per microbatch each stage re-runs in its backward with the
    partial-recompute columns: the whole forward of the layers recomputed whole, the module parts
    (module_forward_parts) of the selective ones. U: [keys, K, fields] one layer's forward terms
    per layer shape (step_time.layer_units), key: each stage's layer shape."""
    r = S.row
    f = {n: U[:, :, i] for i, n in enumerate(fields)}
    whole = f["gemm_s"] + f["attention_s"] + f["memory_bound_s"] + f["fp8_fwd_s"] + f["tp_comm_s"] + f["cp_comm_s"] + f["ep_comm_s"]
    lay, _ = recomputed_layers(L, memo, S, counts)
    K = counts.shape[1]
    out = np.zeros(len(r))
    for j in range(K):
        out = out + lay[:, j] * whole[:, j][key]
    sel = (L.recompute == 1)[r]
    codes = L.rc_modules[r] if L.rc_modules is not None else np.zeros(len(r), np.int64)
    if sel.any():
        cfgs = {}
        for code in np.unique(codes[sel]):
            rows = np.flatnonzero(sel & (codes == code))
            for u in np.unique(key[rows]):
                i = int(rows[key[rows] == u][0])
                cfg = cfgs.setdefault(u, _time_cfg(L, int(S.row[i])))
                parts = memo.get("rc_parts", (cfg, int(code), hbm_bw), lambda: np.array(
                    [module_forward_parts(model, k, cfg, memo.c, hbm_bw, recompute_modules_of(int(code))) for k in memo.kinds]))
                g, a, t, e, mb, ms = (parts[:, x] for x in range(6))
                per = (g * (f["gemm_s"][u] + f["fp8_fwd_s"][u]) + a * f["attention_s"][u] + t * f["tp_comm_s"][u]
                       + e * f["ep_comm_s"][u] + mb + ms * f["memory_bound_s"][u])
                hit = rows[key[rows] == u]
                out[hit] = out[hit] + (counts[hit] * per).sum(axis=1)
    return out


def _time_cfg(L, i: int) -> TrainConfig:
    """The layer-shape fields of row i that module_forward_parts reads."""
    return TrainConfig(tp=int(L.tp[i]), cp=int(L.cp[i]), mbs=int(L.mbs[i]), seq=int(L.seq[i]), ep=int(L.ep[i]),
                       etp=int(L.etp[i]), sequence_parallel=bool(L.sp[i]), **quant_fields(L.fp8[i]),
                       **dict(zip(("moe_dispatcher", "moe_grouped_gemm", "moe_router", "moe_capacity_factor",
                                   "moe_pad_to_capacity"), L.extras[i][:5])))

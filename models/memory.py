"""Memory per GPU for each pipeline stage: weights, gradients, optimizer states, activations,
logits, runtime overhead. Pure functions of (model, config, constants).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) generalised to GQA / MLA, SwiGLU and MoE, with flash attention (no
s x s score matrix is stored; this is what Megatron runs with TE or SDPA attention).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, GIB, Constants
from advisor.models.flops import embedding_params, layer_params, output_params
from advisor.models.moe import moe_activation_elements
from advisor.search_spaces.layout import in_flight_microbatches, layer_kind_counts, stage_layers


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    params: int  # parameters held by one GPU of this stage
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float
    step_transient_gib: float = 0.0  # optimizer-step transient beyond the activations (peak = the larger)

    @property
    def total_gib(self) -> float:
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib
                + self.logits_gib + self.overhead_gib + self.step_transient_gib)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_gib"] = self.total_gib
        return d


def stage_params(model: ModelSpec, cfg: TrainConfig, layers: range, stage: int) -> tuple[float, float]:
    """(dense params, expert params) held by one GPU of the stage."""
    dense = 0.0
    experts = 0.0
    for i, n in layer_kind_counts(model, layers).items():
        lp = layer_params(model, i)
        dense += n * ((lp.attention + lp.dense_mlp + lp.shared_experts) / cfg.tp + lp.router + lp.norms)
        experts += n * lp.experts / (cfg.ep * cfg.etp)
    if stage == 0:
        dense += embedding_params(model) / cfg.tp
    if stage == cfg.pp - 1:
        dense += output_params(model) / cfg.tp
        if model.tied_embeddings and cfg.pp > 1:  # Megatron keeps a copy of the word embeddings
            dense += model.vocab_size * model.hidden_size / cfg.tp
    return dense, experts


def linear_params(model: ModelSpec, cfg: TrainConfig, layers: range) -> float:
    """Weights of the TE linear layers one GPU holds for these layers (attention, MLP, experts):
    the ones that get FP8 copies under fp8."""
    n = 0.0
    for i, k in layer_kind_counts(model, layers).items():
        lp = layer_params(model, i)
        n += k * ((lp.attention + lp.dense_mlp + lp.shared_experts) / cfg.tp + lp.experts / (cfg.ep * cfg.etp))
    return n


def layer_activation_bytes(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants = DEFAULT) -> float:
    """Bytes of activations one transformer layer stores for one microbatch on one GPU."""
    s = cfg.seq / cfg.cp
    b = cfg.mbs
    h = model.hidden_size
    t = cfg.tp
    sp = t if cfg.sequence_parallel else 1
    e = c.bytes_activation
    sbh = s * b * h
    if cfg.recompute == "full":
        return e * sbh / sp  # only the layer input is kept
    # two norm inputs (residual stream) and two norm outputs (inputs of the QKV and FC1 GEMMs),
    # stored sharded with sequence parallelism. Selective recompute (Megatron's default module,
    # core_attn) re-runs flash attention, which stores no score matrix, so it saves ~nothing here.
    # Under fp8 Transformer Engine saves the inputs of its FP8 GEMMs (the norm outputs, the
    # attention output, the activation output) as FP8 copies: 1 byte instead of 2 (`gemm_in`).
    elems = 2 * sbh / sp
    gemm_in = 2 * sbh / sp
    a = model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        elems += s * b * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)  # latents (replicated)
        elems += s * b * a * (2 * qk + m.v_head_dim) / t  # q, k, v
        gemm_in += s * b * a * m.v_head_dim / t  # attention output
    else:
        hd = model.head_dim
        elems += s * b * (a + 2 * model.kv_heads) * hd / t  # q, k, v
        gemm_in += s * b * a * hd / t  # attention output
    gated = model.activation == "swiglu"
    if model.is_moe_layer(layer):
        moe_elems, moe_gemm_in = moe_activation_elements(model, cfg, c)  # models/moe.py
        elems += moe_elems
        gemm_in += moe_gemm_in
    else:
        ffn = model.ffn_hidden_size
        if model.moe is not None and model.moe.dense_ffn_hidden_size and layer < model.moe.first_dense_layers:
            ffn = model.moe.dense_ffn_hidden_size
        elems += (2 if gated else 1) * s * b * ffn / t  # FC1 output
        gemm_in += s * b * ffn / t  # activation output (FC2 input)
    gemm_bytes = c.bytes_fp8_activation if cfg.precision == "fp8" else e
    return e * elems + gemm_bytes * gemm_in


def _optimizer_transient(dense: float, experts: float, cfg: TrainConfig, c: Constants) -> float:
    """Bytes the optimizer step allocates on top of the states: a copy of the gradient shard it
    updates (bytes_optimizer_transient per parameter of the shard)."""
    shard = dense / (cfg.dp * cfg.cp) + experts / cfg.expert_dp if cfg.distributed_optimizer else dense + experts
    return c.bytes_optimizer_transient * shard


def _full_layer_bytes(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants) -> float:
    return layer_activation_bytes(model, layer, cfg.replace(recompute="none"), c)


def stage_memory(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT,
                 layer_counts: list[int] | None = None) -> list[StageMemory]:
    """Memory of one GPU in every pipeline stage, for the config's split or `layer_counts`."""
    out = []
    for stage, layers in enumerate(stage_layers(model, cfg, layer_counts)):
        dense, experts = stage_params(model, cfg, layers, stage)
        params = dense + experts
        weights = params * c.bytes_weight
        if cfg.precision == "fp8":  # FP8 copies of the FP8 GEMMs' weights (not embedding / output)
            weights += linear_params(model, cfg, layers) * c.bytes_fp8_weight_copy
        grads = params * c.bytes_grad
        if cfg.distributed_optimizer:
            opt = c.bytes_optimizer * (dense / (cfg.dp * cfg.cp) + experts / cfg.expert_dp)
        else:
            opt = c.bytes_optimizer * params
        kinds = layer_kind_counts(model, layers)
        per_mb = sum(n * layer_activation_bytes(model, i, cfg, c) for i, n in kinds.items())
        acts = per_mb * in_flight_microbatches(cfg, stage)
        if cfg.recompute == "full" and len(layers):
            acts += max(_full_layer_bytes(model, i, cfg, c) for i in kinds)  # recompute working set
        logits = 0.0
        if stage == cfg.pp - 1:
            s, b = cfg.seq / cfg.cp, cfg.mbs
            # bf16 logits + fp32 copy for the vocab-parallel cross entropy (one microbatch at a time)
            logits = s * b * model.vocab_size / cfg.tp * (c.bytes_activation + c.bytes_logits_fp32)
        out.append(StageMemory(
            stage=stage,
            layers=len(layers),
            params=int(params),
            weights_gib=weights / GIB,
            grads_gib=grads / GIB,
            optimizer_gib=opt / GIB,
            activations_gib=acts * (1.0 + c.fragmentation) / GIB,
            # the peak is the larger of the activations (in the backward) and the optimizer step's
            # transient copy of its gradient shard (in the step): what the step adds beyond them
            step_transient_gib=max(0.0, _optimizer_transient(dense, experts, cfg, c) - acts * (1.0 + c.fragmentation)) / GIB,
            logits_gib=logits * (1.0 + c.fragmentation) / GIB,
            overhead_gib=c.runtime_overhead_gib,
        ))
    return out


def peak_memory_gib(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> float:
    return max(s.total_gib for s in stage_memory(model, cfg, c))

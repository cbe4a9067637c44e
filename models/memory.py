"""Memory per GPU for each pipeline stage: weights, gradients, optimizer states, activations,
logits, runtime overhead. Pure functions of (model, config, constants).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) generalised to GQA / MLA, SwiGLU and MoE, with flash attention (no
s x s score matrix is stored; this is what Megatron runs with TE or SDPA attention).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, GIB, Constants
from advisor.models.flops import embedding_params, layer_params, output_params, qk_norm_width
from advisor.models.moe import moe_activation_elements
from advisor.models.quant import saved_input_bytes, weight_copy_bytes
from advisor.search_spaces.layout import (PipelinePlan, in_flight_chunks, in_flight_layers, layer_kind_counts,
                                          pipeline_plan, rank_kinds, stage_layers)


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
        """dataclasses.asdict plus total_gib (the fields are numbers: no copies)."""
        d = {f: getattr(self, f) for f in _MEMORY_FIELDS}
        d["total_gib"] = self.total_gib
        return d


_MEMORY_FIELDS = tuple(f.name for f in fields(StageMemory))


def stage_params(model: ModelSpec, cfg: TrainConfig, layers: range | tuple[int, ...], stage: int) -> tuple[float, float]:
    """(dense params, expert params) held by one GPU of the stage: its transformer layers, plus the
    word embeddings on the stage that holds the embedding and the output layer on the one that
    holds the loss (the first and last stage, unless a pipeline layout places them elsewhere)."""
    plan = pipeline_plan(model, cfg)
    return _stage_params(model, layer_kind_counts(model, layers), stage == plan.embedding_rank,
                         stage == plan.loss_rank, plan.embedding_rank != plan.loss_rank, cfg.tp, cfg.ep * cfg.etp)[:2]


def linear_params(model: ModelSpec, cfg: TrainConfig, layers: range | tuple[int, ...]) -> float:
    """Weights of the TE linear layers one GPU holds for these layers (attention, MLP, experts):
    the ones that get FP8 copies under fp8."""
    return _stage_params(model, layer_kind_counts(model, layers), False, False, False, cfg.tp, cfg.ep * cfg.etp)[2]


@lru_cache(maxsize=4096)
def plan_params(model: ModelSpec, plan: PipelinePlan, tp: int, ep_etp: int) -> tuple[tuple[float, float, float], ...]:
    """(dense, expert, linear) params of every rank of a pipeline plan (see _stage_params)."""
    split = plan.embedding_rank != plan.loss_rank
    return tuple(_stage_params(model, kinds, r == plan.embedding_rank, r == plan.loss_rank, split, tp, ep_etp)
                 for r, kinds in enumerate(rank_kinds(model, plan)))


def _stage_params(model: ModelSpec, kinds: dict[int, int], embedding: bool, loss: bool, split: bool,
                  tp: int, ep_etp: int) -> tuple[float, float, float]:
    """(dense, expert, linear) params: linear = the weights of the TE linear layers (attention,
    MLP, experts), the ones that get FP8 copies under fp8 (not the embedding / output layer)."""
    dense = 0.0
    experts = 0.0
    linear = 0.0
    for i, n in kinds.items():
        lp = layer_params(model, i)
        dense += n * ((lp.attention + lp.dense_mlp + lp.shared_experts) / tp + lp.router + lp.norms)
        experts += n * lp.experts / ep_etp
        linear += n * ((lp.attention + lp.dense_mlp + lp.shared_experts) / tp + lp.experts / ep_etp)
    if embedding:
        dense += embedding_params(model) / tp
    if loss:
        dense += output_params(model) / tp
        if model.tied_embeddings and split:  # Megatron keeps a copy of the word embeddings
            dense += model.vocab_size * model.hidden_size / tp
    return dense, experts, linear


def logits_bytes_per_logit(model: ModelSpec, c: Constants = DEFAULT) -> float:
    """Bytes per logit the loss stage holds: bf16 logits and the fp32 copy of the vocab-parallel
    cross entropy, plus the uncapped logits a final soft-capping (tanh) keeps for its backward."""
    return c.bytes_activation + c.bytes_logits_fp32 + (c.bytes_activation if model.final_logit_softcap else 0.0)


def layer_activation_bytes(model: ModelSpec, layer: int, cfg: TrainConfig, c: Constants = DEFAULT,
                           recompute: str | None = None) -> float:
    """Bytes of activations one transformer layer stores for one microbatch on one GPU (with
    `recompute` instead of the config's mode when given)."""
    s = cfg.seq / cfg.cp
    b = cfg.mbs
    h = model.hidden_size
    t = cfg.tp
    sp = t if cfg.sequence_parallel else 1
    e = c.bytes_activation
    sbh = s * b * h
    if (cfg.recompute if recompute is None else recompute) == "full":
        return e * sbh / sp  # only the layer input is kept
    # two norm inputs (residual stream) and two norm outputs (inputs of the QKV and FC1 GEMMs),
    # stored sharded with sequence parallelism. Selective recompute (Megatron's default module,
    # core_attn) re-runs flash attention, which stores no score matrix, so it saves ~nothing here.
    # Under fp8 Transformer Engine saves the inputs of its FP8 GEMMs (the norm outputs, the
    # attention output, the activation output) as FP8 copies: 1 byte instead of 2 (`gemm_in`).
    elems = 2 * sbh / sp
    gemm_in = 2 * sbh / sp
    # post-norms (Gemma 2/3, GLM-4) keep their inputs too (the attention / MLP outputs, sharded
    # with SP), and q / k norms the unnormalised q and k. Flash attention stores no score matrix,
    # so a window (local attention) leaves the stored activations as they are: q, k, v, output
    # and the softmax statistics, whatever the number of keys each query saw.
    elems += (model.norms_per_layer - 2) * sbh / sp + s * b * qk_norm_width(model) / t
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
    gemm_bytes = saved_input_bytes(cfg.quant_code, c) if cfg.precision != "bf16" else e
    return e * elems + gemm_bytes * gemm_in


def stage_memory(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT,
                 layer_counts: list[int] | None = None) -> list[StageMemory]:
    """Memory of one GPU in every pipeline stage, for the config's split or `layer_counts`
    (contiguous layers per stage; virtual chunks then taken as equal)."""
    f = 1.0 + c.fragmentation
    # the peak is the larger of the activations (in the backward) and the optimizer step's transient
    # copy of its gradient shard (in the step): step_transient_gib is what the step adds beyond them
    return [StageMemory(stage=stage, layers=n, params=int(params), weights_gib=weights / GIB, grads_gib=grads / GIB,
                        optimizer_gib=opt / GIB, activations_gib=acts * f / GIB, logits_gib=logits * f / GIB,
                        overhead_gib=c.runtime_overhead_gib, step_transient_gib=max(0.0, transient - acts * f) / GIB)
            for stage, n, params, weights, grads, opt, acts, logits, transient
            in _stage_bytes(model, cfg, c, layer_counts)]


def peak_memory_gib(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> float:
    """The fullest stage's memory per GPU (the total of stage_memory, without building it)."""
    f = 1.0 + c.fragmentation
    peak = max(weights + grads + opt + max(acts * f, transient) + logits * f
               for _, _, _, weights, grads, opt, acts, logits, transient in _stage_bytes(model, cfg, c, None))
    return peak / GIB + c.runtime_overhead_gib


def _stage_bytes(model: ModelSpec, cfg: TrainConfig, c: Constants, layer_counts: list[int] | None):
    """Per stage: (stage, layers, params, weight, gradient, optimizer, activation, logits bytes, the
    optimizer step's transient bytes)."""
    plan = pipeline_plan(model, cfg)
    per_kind: dict[tuple[int, bool], float] = {}

    def layer_bytes(i: int, full: bool = False) -> float:  # i: a kind's representative layer
        key = (i, full)
        v = per_kind.get(key)
        if v is None:
            v = per_kind[key] = layer_activation_bytes(model, i, cfg, c, "none" if full else None)
        return v

    def bytes_of(kinds: dict[int, float]) -> float:
        return sum(n * layer_bytes(i) for i, n in kinds.items())

    if layer_counts is None:
        layers_of = plan.rank_layers
        kinds_of = rank_kinds(model, plan)
        params_of = plan_params(model, plan, cfg.tp, cfg.ep * cfg.etp)
        in_flight = in_flight_layers(model, plan, cfg.num_microbatches)
    else:
        layers_of = stage_layers(model, cfg, layer_counts)
        kinds_of = [layer_kind_counts(model, layers) for layers in layers_of]
        params_of = [stage_params(model, cfg, layers, k) + (linear_params(model, cfg, layers),)
                     for k, layers in enumerate(layers_of)]
    fp8_copy = weight_copy_bytes(cfg.quant_code, c)  # the quantized copies of the linear layers' weights
    d, edp = cfg.dp * cfg.cp, cfg.expert_dp
    full = cfg.recompute == "full"
    for stage, layers in enumerate(layers_of):
        dense, experts, linear = params_of[stage]
        kinds = kinds_of[stage]
        params = dense + experts
        shard = dense / d + experts / edp if cfg.distributed_optimizer else params  # the optimizer's
        opt = c.bytes_optimizer * shard
        # the optimizer step's transient: a copy of the gradient shard it updates
        transient = c.bytes_optimizer_transient * shard
        if layer_counts is None:  # each virtual chunk with its own layers and in-flight microbatches
            acts = bytes_of(in_flight[stage])
        else:
            acts = bytes_of(kinds) * sum(in_flight_chunks(cfg, stage)) / cfg.vp
        if full and kinds:  # recompute working set
            acts += max(layer_bytes(i, full=True) for i in kinds)
        logits = 0.0
        if stage == plan.loss_rank:
            # bf16 logits + fp32 copy for the vocab-parallel cross entropy (one microbatch at a time)
            logits = cfg.seq / cfg.cp * cfg.mbs * model.vocab_size / cfg.tp * logits_bytes_per_logit(model, c)
        yield (stage, len(layers), params, params * c.bytes_weight + linear * fp8_copy, params * c.bytes_grad, opt,
               acts, logits, transient)

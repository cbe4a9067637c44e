"""Physical features of one layout, for the surrogates.

Every feature comes from the analytical model's own breakdown (FLOPs, bytes, phase fractions,
memory terms) rather than raw knob values, so that what a surrogate learns on a 4-GPU node carries
over to other cluster sizes, models and GPUs: a TP=2 layout on 4 GPUs and on 64 GPUs differ in DP
bytes and bubble, which the features say, not in a world-size column.
"""
from __future__ import annotations

import math

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.flops import recompute_flops_per_token, training_flops_per_token
from advisor.models.memory import stage_params
from advisor.models.predict import Prediction
from advisor.search_spaces.layout import bubble_fraction, stage_layers

FEATURE_NAMES = (
    "log10_flops_per_gpu_step",  # model + recompute FLOPs one GPU runs per step
    "log2_tokens_per_microbatch",  # seq / cp * mbs
    "log2_gemm_intensity",  # FLOPs per element of the typical MLP GEMM: 1/(1/T + 1/h + 1/(f/tp))
    "gemm_utilization",  # achieved / best GEMM rate (analytical)
    "bubble_fraction",  # (p - 1) / (v·m) of the schedule
    "frac_gemm",  # phase fractions of the step (analytical); idle = 1 - the others
    "frac_memory_bound",
    "frac_communication",
    "log1p_mb_tp_collective",  # bytes per collective, MB (0 when that parallelism is 1)
    "log1p_mb_dp_collective",
    "log1p_mb_pp_p2p",
    "log1p_mb_ep_all_to_all",
    "log2_num_microbatches",
    "log2_static_gib",  # weights + grads + optimizer of the fullest stage
    "log2_activation_gib",  # activations + logits of the fullest stage
    "memory_fraction",  # predicted memory / GPU memory
    "power_demand_mean_ratio",  # uncapped mean power demand / power cap
    "power_demand_peak_ratio",
)


def features(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, p: Prediction) -> np.ndarray:
    """The FEATURE_NAMES vector of one layout, from its analytical prediction `p`."""
    e = 2.0  # bf16 bytes
    T = cfg.seq / cfg.cp * cfg.mbs
    h = model.hidden_size
    tokens_gpu = cfg.tokens_per_step / cluster.world_size
    flops = tokens_gpu * (training_flops_per_token(model, cfg.seq)
                          + recompute_flops_per_token(model, cfg.seq, cfg.recompute))
    ffn = model.moe.ffn_hidden_size if model.is_moe else model.ffn_hidden_size
    intensity = 1.0 / (1.0 / T + 1.0 / h + 1.0 / (ffn / (cfg.etp if model.is_moe else cfg.tp)))
    f = p.breakdown["phase_fractions"]
    tp_b = T * h * e if cfg.tp > 1 else 0.0
    d = cfg.dp * cfg.cp
    dp_b = 0.0
    if d > 1:
        dense, experts = stage_params(model, cfg, stage_layers(model, cfg)[0], 0)
        dp_b = 4.0 * (dense + experts)
    pp_b = T * h * e / (cfg.tp if cfg.sequence_parallel else 1) if cfg.pp > 1 else 0.0
    ep_b = T * model.moe.top_k * h * e if (model.is_moe and cfg.ep > 1) else 0.0
    mb = p.memory_breakdown
    static = mb["weights_gib"] + mb["grads_gib"] + mb["optimizer_gib"]
    act = mb["activations_gib"] + mb["logits_gib"]
    cap = cluster.power_cap_w
    return np.array([
        math.log10(max(flops, 1.0)),
        math.log2(T),
        math.log2(intensity),
        p.breakdown["gemm_utilization"],
        bubble_fraction(cfg),  # the schedule's (p-1)/(v·m), as the fitted surrogates were trained on
        f["gemm"],
        f["memory_bound"],
        f["communication"],
        math.log1p(tp_b / 1e6),
        math.log1p(dp_b / 1e6),
        math.log1p(pp_b / 1e6),
        math.log1p(ep_b / 1e6),
        math.log2(cfg.num_microbatches),
        math.log2(max(static, 1e-3)),
        math.log2(max(act, 1e-3)),
        p.memory_gib_per_gpu / cluster.gpu.memory_gib,
        p.breakdown["power_demand_mean_w"] / cap,
        p.breakdown["power_demand_peak_w"] / cap,
    ], dtype=float)

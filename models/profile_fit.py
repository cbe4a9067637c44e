"""Fitting the `te` stack profile on published runs, and checking any profile against them.

The `te` profile is the analytical model with the physics of Megatron-Core + Transformer Engine
(`te_base`: constants whose values come from the TE stack's own settings, each with its source)
and a few efficiencies fitted on the published fit set (`TE_FIT`: each a physical quantity with
a plausible range). The fit is bounded least squares on log(predicted / measured tokens/s) with a
soft-L1 loss and a weak pull towards the starting values; every distinct configuration weighs the
same (a layout republished by several container versions counts once). It is reported out of
sample: leave one source out and leave one model family out (`cross_validate`).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import STACK_LAYER_KEEPS
from advisor.models.moe import MOE_HOST, MOE_TE_SETTINGS, MOE_TE_VM_HOST
from advisor.models.predict import Prediction, predict
from advisor.models.profiles import apply_layout_defaults
from advisor.models.published import PublishedRun
from advisor.search_spaces.layout import violations

# The TE stack's physics before fitting: settings of the stack, with their sources.
TE_SETTINGS = {
    # Megatron-Bridge / NeMo performance recipes: ddp.grad_reduce_in_fp32 = False (bf16 reduction)
    "dp_grad_reduce_bytes": 2.0,
    # ... and so the gradient buffer itself is bf16: megatron-core's DDP allocates its grad buffers
    # in `torch.float if grad_reduce_in_fp32 else param.dtype` (distributed/distributed_data_parallel.py),
    # and TE's fused wgrad accumulation adds into that bf16 main_grad
    "bytes_grad": 2.0,
    # TE / apex fused Adam (one kernel per tensor chunk: 30 B/param), the Megatron-Bridge / NeMo
    # default with Transformer Engine installed (models/constants.py)
    "optimizer_bytes_per_param": 30.0,
    # where gradient_accumulation_fusion is off (a layout field: the te stack's default is on, this
    # project's runner runs it off), DDP's hook adds the bf16 weight gradient into the bf16 main
    # grad: read 2 + read 2 + write 2 bytes per parameter and microbatch
    "grad_accum_bytes_per_param": 6.0,
    # no fragmentation share: the stack's reserved-but-unallocated memory is the caching allocator's
    # physical term (models/allocator_memory.py; peak allocated MAPE of our TE runs with 0: dense 1.5%,
    # MoE 2.3%, with the local profile's 0.08: 3.4 / 3.5%, commit 4d35dc0)
    "fragmentation": 0.0,
    # what TE's fused layers keep for the backward (models/memory.py STACK_LAYER_KEEPS)
    **STACK_LAYER_KEEPS["te"],
    # MoE under TE: fused permutation, CUDA-graphed router, TE's activation memory (models/moe.py)
    **MOE_TE_SETTINGS,
    # ... priced with the published runs' hosts: no MoE host issue cost (our VM's: vm_host)
    **{n: 0.0 for n in MOE_HOST},
}

# What the physics says of the fitted constants before any published run is seen: (centre, one
# standard deviation), each measured or derived. The fit is the maximum a posteriori estimate: the
# published runs move a constant away from its centre only as far as they outweigh this.
TE_PRIOR: dict[str, tuple[float, float]] = {
    # BF16 GEMM at the maximum clock: transformer-shaped GEMMs (8192 x 4096..28672) in short bursts
    # at 1,890-1,965 MHz on our H100 reach 695-730 TFLOP/s (data/dvfs/h100x1-kernel-rates.jsonl,
    # bench/kernel_rates.py), 8192^3 bursts 713-803 (and data/dvfs/h100x1-sweep.jsonl): 0.70-0.81 of
    # 989 after the shape factor
    "gemm_efficiency_max": (0.76, 0.04),
    # FP8 GEMM (torch._scaled_mm, e4m3) at the maximum clock: 1,254-1,280 TFLOP/s at 1,965 MHz for
    # 8192 x 4096 x 6144 / 4096 x 4096 x 14336 / 16384 x 8192 x 2048 bursts = 0.63-0.65 of 1,979,
    # 0.70-0.71 before their shape factor (gemm_half_dim_fp8)
    "gemm_efficiency_max_fp8": (0.72, 0.04),
    # Fused causal attention (Transformer Engine uses cuDNN's on Hopper), forward + backward at one
    # rate, head dim 128: cuDNN through SDPA on our H100 reaches 409 (4K), 486-510 (8K), 525-547
    # (16K), 559-587 (32K) TFLOP/s for forward + backward at ~the maximum clock = 0.41-0.59 of 989;
    # 8K is the typical pre-training length (head dim 64: 373). The FlashAttention-2 kernels of
    # torch's flash backend reach 231-323 (0.23-0.33) on the same shapes.
    "attention_efficiency": (0.50, 0.05),
    # Memory-bound passes per layer and token: TE fuses norm+cast, rope, bias-dropout-add and the
    # activation: 2 norms x 2, 2 residual adds x 3, rope ~2 = 12 (vs 16 unfused)
    "elementwise_hidden_passes": (12.0, 4.0),
    # TP communication hidden by TE userbuffers, of the 1 - 1 / (2 tp) it can hide: Megatron-Core
    # reports most of it hidden (0.7 of all of it at TP 8: 0.75 of the hideable)
    "tp_overlap_fraction": (0.75, 0.2),
    # overlap_p2p_comm of the interleaved schedule: most of the send/recv behind compute
    "pp_overlap_fraction": (0.6, 0.3),
    # GPU-side fixed time per layer and microbatch: TE runs ~60-100 kernels per layer forward +
    # backward (more under FP8: casts, amax updates), each with a few us of launch latency and
    # tail between dependent kernels: 0.1-0.5 ms. The host's own issue time is host_* below (the
    # GPU waits for it only where its work is shorter: step_time.layer_host_s)
    "layer_overhead_s": (200e-6, 150e-6),
    # The host issue costs (models/constants.py host_*), our VM's, measured from the kernel profiles
    # of llama3-8b runs (not host-bound; GPT-3 2.7B not used) by `python bench/host_issue.py`: the
    # issue time of a step is the main thread's + the autograd thread's profiler-busy minus their
    # time in syncs (low: profiler events only) or their OS CPU time minus syncs (high: the
    # interpreter between ops too), / the profiler's host slow-down (1.27, the autograd thread's CPU
    # time profiled / unprofiled), on the runs whose launch queue never fills (PP2 DP2 mbs2 BF16 and
    # FP8: megatron-core synchronises at each p2p; every GPU-bound run without PP ends its step with
    # 800-1,000 kernels queued, its host paced by the GPU). Each prior: centre of the range, sd half
    # of it. Per layer and microbatch (with the stage's per-step work: optimizer, embedding, p2p):
    # 4.06-5.54 ms
    "host_layer_s": (4.8e-3, 0.74e-3),
    # per TP collective: the launches (low) and CPU-side profiler events (high) llama3-8b's TP2 / TP4
    # SP runs add per collective over its data-parallel runs (counts do not depend on the queue) x
    # the unblocked runs' issue time per launch (91 us) / per event (14.7 us): 83-387 us (the bare
    # small NCCL call from an idle GPU, host issue and GPU latency together: 81 us median)
    "host_collective_s": (235e-6, 152e-6),
    # per CP ring step, the same way from the CP2 runs: 0.68-2.52 ms
    "host_cp_step_s": (1.6e-3, 0.92e-3),
    # per FP8 GEMM: the PP2 FP8 - BF16 issue time / (N x 12 FP8 GEMMs): 58-106 us. Not fitted
    # (VM_HOST_MEASURED): the prior documents the measurement
    "host_fp8_gemm_s": (82e-6, 24e-6),
    # NCCL all-gather / reduce-scatter on 4 x H100 NVLink, 16 MiB - 1 GiB, fitted in the profile's
    # form (collective_time: bus bytes / (450 GB/s x efficiency) + latency x sqrt(n - 1)) over groups
    # of 2 and 4: efficiency 0.597, latency 50 us (bench/te_terms.py on
    # data/measurements/h100x4-nccl-bw.jsonl; per group the bus bandwidth is 246-254 GB/s over 2,
    # 312-313 over 4: 0.55-0.70). The microbenchmark's latency holds the host's launch of each call,
    # which a training step mostly hides: a wide prior
    "nvlink_efficiency": (0.60, 0.07),
    "intra_latency_s": (50e-6, 30e-6),
    # the SP backward re-gather runs on NCCL's stream beside the dgrad GEMM: anywhere from hidden to
    # exposed (no measurement of its own)
    "sp_regather_exposed": (0.5, 0.4),
    # TE's CP ring step's fp32 merges, counted in models/constants.py: ~6 passes
    "cp_step_passes": (6.0, 4.0),
}
# the run-to-run spread of our own TE runs (repeats of the same job: 0.2-3.6%, bench/te_check.py)
# with the power-capped clock they run at: what the model cannot know of one of our runs
MEASURED_SPREAD = 0.04
# the spread of published throughput the model cannot know about (container versions, node
# quality): the same llama3-70b 64-GPU layout republished across containers spans ~8%
PUBLISHED_SPREAD = 0.08

# Constants fitted on the published runs, with their bounds (physical ranges).
TE_FIT: dict[str, tuple[float, float]] = {
    "gemm_efficiency_max": (0.55, 0.90),  # BF16 GEMM, fraction of dense peak (cuBLAS 8192^3: 0.80)
    "gemm_efficiency_max_fp8": (0.40, 0.85),  # FP8 GEMM, fraction of FP8 dense peak
    "attention_efficiency": (0.25, 0.85),  # fused attention (cuDNN / FA3 on Hopper), of BF16 peak
    "elementwise_hidden_passes": (4.0, 20.0),  # HBM passes of the fused norm / rope / residual kernels
    "tp_overlap_fraction": (0.0, 1.0),  # TP communication hidden by userbuffers overlap
    "pp_overlap_fraction": (0.0, 1.0),  # PP send/recv hidden by overlap_p2p_comm (interleaved)
    "layer_overhead_s": (1e-6, 1e-3),  # per layer per microbatch GPU-side launch gaps
    "host_layer_s": (1e-4, 1.2e-2),  # host issue time per layer and microbatch
    "host_collective_s": (5e-6, 1e-3),  # ... per TP collective
    "host_cp_step_s": (1e-6, 5e-3),  # ... per CP ring step
    "nvlink_efficiency": (0.3, 1.0),  # NCCL bus bandwidth of the NVLink collectives, fraction of the link
    "intra_latency_s": (5e-6, 200e-6),  # per NCCL call in a node, seconds
    "sp_regather_exposed": (0.0, 1.0),  # SP's backward re-gather of the column-parallel inputs left exposed
    "cp_step_passes": (0.0, 40.0),  # HBM passes over the fp32 attention output per CP ring step
}


# Our VM's host issue costs that are measured, not fitted: the host's issue time per FP8 GEMM, the
# centre of its measured range (TE_PRIOR: llama3-8b's PP2 FP8 - BF16 pairs, 58-106 us; GPT-3 2.7B's
# TP2 SP FP8 - BF16 pair measures 85-103 us, `python bench/host_issue.py`). Fitted, it was pulled to
# 205 us by GPT-3's two host-bound FP8 runs (session 28's refit): a fit moving a measured machine
# cost 5 sd to absorb another term's error. Fixed here, it stays what the profiles measured.
VM_HOST_MEASURED = {"host_fp8_gemm_s": TE_PRIOR["host_fp8_gemm_s"][0]}


def te_base(base: Constants = DEFAULT) -> Constants:
    """The TE stack's physics before fitting (TE_SETTINGS), with our VM's measured host costs
    (VM_HOST_MEASURED: they price our own runs only; published rows are priced without_host)."""
    return base.replace(**TE_SETTINGS, **VM_HOST_MEASURED)


@dataclass
class Row:
    """A published run ready to predict: its config with the stack's layout defaults."""

    run: PublishedRun
    cfg: object
    weight: float
    spread: float = PUBLISHED_SPREAD  # what the model cannot know about the row (log scale)
    # priced with the fitted host issue costs (HOST: our own runs, on our VM's CPU); a published
    # row is not (HOST at 0: its bare-metal hosts issue faster than any of its GPU work, the rows say)
    host: bool = False

    @property
    def y(self) -> float:
        return self.run.tokens_per_s_per_gpu


def fit_rows(runs: Iterable[PublishedRun], stack: str = "te",
             keep: Callable[[PublishedRun], bool] | None = None) -> tuple[list[Row], Counter]:
    """Usable, legal runs (with the stack's layout defaults), each distinct configuration weighing
    1 in total; and a count of what was left out and why."""
    left = Counter()
    rows = []
    for r in runs:
        if not r.usable:
            left[r.why] += 1
            continue
        if keep is not None and not keep(r):
            left["not selected"] += 1
            continue
        v = violations(r.model, r.cluster, r.cfg)
        if v:
            left[f"layout not enterable: {v[0].split(':')[0][:60]}"] += 1
            continue
        rows.append(Row(r, apply_layout_defaults(r.cfg, stack, r.explicit, moe=r.model.is_moe), 1.0))
    dup = Counter(_key(x) for x in rows)
    for x in rows:
        x.weight = 1.0 / dup[_key(x)]
    return rows, left


@dataclass(frozen=True)
class MeasuredRun:
    """One of our own measured runs (a models.dataset Record) in the shape of a PublishedRun row."""

    row_id: str
    model_key: str
    model: object
    cluster: object
    cfg: object
    tokens_per_s_per_gpu: float
    source_group: str = "measured"
    family: str = ""
    fp8_recipe: str = ""

    @property
    def gpu_type(self) -> str:
        return self.cluster.gpu.name

    @property
    def num_gpus(self) -> int:
        return self.cluster.world_size


def measured_rows(records: Iterable, source: str = "measured", spread: float = MEASURED_SPREAD) -> list[Row]:
    """Rows of measured records (models.dataset Record) as they ran: their config is the runner's,
    no stack layout defaults; the repeats of one configuration weigh 1 together."""
    rows = []
    for r in records:
        name = r.model.name.split("[")[0]
        run = MeasuredRun(r.id, name, r.model, r.cluster, r.cfg, float(r.y["tokens_per_s_per_gpu"]), source,
                          r.model.family or "", r.cfg.fp8_recipe if r.cfg.precision == "fp8" else "")
        rows.append(Row(run, r.cfg, 1.0, spread, host=True))
    dup = Counter(_key(x) for x in rows)
    for x in rows:
        x.weight = 1.0 / dup[_key(x)]
    return rows


def architecture(x: Row) -> str:
    """A row's architecture for leave-one-architecture-out: the model (llama3-8b, llama3-70b, ...),
    every GPT-3 size as one ("gpt3": same layer design) and every Nemotron as one ("nemotron")."""
    key = x.run.model_key.replace("_", "-")
    if key.startswith("gpt3"):
        return "gpt3"
    if x.run.family == "nemotron" or key.startswith("nemotron"):
        return "nemotron"
    return key


def _key(x: Row) -> tuple:
    return (x.run.model_key, x.run.gpu_type, x.run.num_gpus, x.cfg.key(), x.run.fp8_recipe)


# The host issue costs (models/constants.py host_*): a property of the machine the GPUs sit in, not
# of the stack. Fitted on our runs (Row.host); the shipped profile keeps them at 0 (the published
# runs' hosts: no published row is host-bound at any cost our runs allow) and carries our VM's
# fitted values apart (vm_host), for predicting our own runs.
HOST = ("host_layer_s", "host_collective_s", "host_cp_step_s", "host_fp8_gemm_s")


def without_host(c: Constants) -> Constants:
    return c.replace(**{n: 0.0 for n in HOST})


def vm_host(cal) -> dict[str, float]:
    """Our VM's host issue costs, as a profile recorded them ({} where it has none): the dense ones
    its fit fitted (HOST) or it keeps as measured (fit_info["vm_host_measured"]), and the MoE ones
    (moe.MOE_HOST) it keeps in fit_info["moe_vm_host"]."""
    info = getattr(cal, "fit_info", None) or {}
    fitted = {**info.get("fitted", {}), **info.get("vm_host_measured", {})}
    moe = info.get("moe_vm_host", {})
    return {**{n: float(fitted[n]) for n in HOST if n in fitted},
            **{n: float(moe[n]) for n in MOE_HOST if n in moe}}


def with_vm_host(info: dict) -> dict:
    """A te profile's fit_info carrying our VM's measured host issue costs for vm_host: the dense
    ones not fitted (VM_HOST_MEASURED) and the MoE ones (moe.MOE_TE_VM_HOST)."""
    return {**info, "vm_host_measured": dict(VM_HOST_MEASURED), "moe_vm_host": dict(MOE_TE_VM_HOST)}


def on_vm(cal):
    """A copy of calibration `cal` with our VM's host issue costs (vm_host): how it predicts our runs."""
    import dataclasses

    host = vm_host(cal)
    return dataclasses.replace(cal, constants=cal.constants.replace(**host)) if host else cal


def predict_rows(rows: Sequence[Row], c: Constants) -> list[Prediction]:
    ref = without_host(c)
    return [predict(x.run.model, x.run.cluster, x.cfg, c if x.host else ref, check_legal=False) for x in rows]


def log_errors(rows: Sequence[Row], c: Constants) -> np.ndarray:
    return np.array([math.log(p.tokens_per_s_per_gpu / x.y) for x, p in zip(rows, predict_rows(rows, c))])


def fit(rows: Sequence[Row], base: Constants, names: Sequence[str] = tuple(TE_FIT),
        bounds: dict[str, tuple[float, float]] = TE_FIT, priors: dict[str, tuple[float, float]] = TE_PRIOR,
        spread: float = PUBLISHED_SPREAD, max_nfev: int = 80) -> tuple[Constants, dict]:
    """Maximum a posteriori constants: each run's log error over the published spread, each
    constant's distance from its prior centre over the prior's standard deviation (a constant
    without a prior: a weak pull towards `base`), robust (soft L1 beyond 1.5 standard deviations),
    every constant within its bounds."""
    from scipy.optimize import least_squares

    names = list(names)
    lo = np.array([bounds[n][0] for n in names], float)
    span = np.array([bounds[n][1] for n in names], float) - lo
    start = np.array([priors[n][0] if n in priors else getattr(base, n) for n in names], float)
    u0 = np.clip((start - lo) / span, 0.0, 1.0)
    centre = np.array([priors.get(n, (getattr(base, n), 0.0))[0] for n in names], float)
    sigma = np.array([priors[n][1] if n in priors else 10.0 * span[i] for i, n in enumerate(names)], float)
    wsum = sum(x.weight for x in rows)
    w = np.sqrt(np.array([x.weight for x in rows]) * len(rows) / wsum) / np.array(
        [spread if x.spread == PUBLISHED_SPREAD else x.spread for x in rows])

    def consts(u):
        return base.replace(**{n: float(v) for n, v in zip(names, lo + span * u)})

    def resid(u):
        return np.concatenate([w * log_errors(rows, consts(u)), (lo + span * u - centre) / sigma])

    # the host issue floor is a max(): where it binds for no row its constants feel only their
    # prior, so the fit also starts where it binds (host_* at prior centre + 2 sd) and keeps the
    # better optimum of the two starts
    starts = [u0]
    host = [i for i, n in enumerate(names) if n.startswith("host_") and n in priors]
    if host:
        u1 = u0.copy()
        for i in host:
            u1[i] = np.clip((centre[i] + 2.0 * sigma[i] - lo[i]) / span[i], 0.0, 1.0)
        starts.append(u1)
    res = min((least_squares(resid, u, bounds=(0.0, 1.0), loss="soft_l1", f_scale=1.5, diff_step=1e-3,
                             xtol=1e-6, ftol=1e-8, max_nfev=max_nfev) for u in starts), key=lambda r: r.cost)
    c = consts(res.x)
    info = {"nfev": int(res.nfev), "status": int(res.status), "rows": len(rows),
            "fitted": {n: getattr(c, n) for n in names},
            "prior": {n: list(priors[n]) for n in names if n in priors}, "spread": spread,
            "at_bound": [n for n, u in zip(names, res.x) if min(u, 1 - u) < 1e-3]}
    return c, info


def cross_validate(rows: Sequence[Row], base: Constants, by: Callable[[Row], str],
                   names: Sequence[str] = tuple(TE_FIT), only: Iterable[str] | None = None,
                   **kw) -> tuple[np.ndarray, dict[str, dict]]:
    """Leave-one-group-out: fit without each group (each of `only`, when given), predict it.
    Returns the out-of-fold log errors (one per row; NaN for rows never left out) and
    {group: {"n", "mape", "bias"}}."""
    groups = defaultdict(list)
    for i, x in enumerate(rows):
        groups[by(x)].append(i)
    if only is not None:
        groups = {g: idx for g, idx in groups.items() if g in set(only)}
    oof = np.full(len(rows), np.nan)
    out = {}
    for g, idx in sorted(groups.items()):
        train = [x for i, x in enumerate(rows) if i not in set(idx)]
        if not train:
            continue
        c, _ = fit(train, base, names, **kw)
        e = log_errors([rows[i] for i in idx], c)
        oof[idx] = e
        out[g] = summary(e)
    return oof, out


def summary(log_err: np.ndarray, weights: np.ndarray | None = None) -> dict:
    """MAPE and median bias (%) of predictions whose log(pred / measured) are `log_err`."""
    e = np.asarray(log_err, float)
    ok = np.isfinite(e)
    if not ok.any():
        return {"n": 0, "mape": math.nan, "bias": math.nan}
    ape = np.abs(np.exp(e[ok]) - 1.0) * 100
    w = None if weights is None else np.asarray(weights, float)[ok]
    return {"n": int(ok.sum()), "mape": float(np.average(ape, weights=w)),
            "bias": float((np.exp(np.median(e[ok])) - 1.0) * 100)}

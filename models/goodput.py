"""Goodput of a long training run: failures, checkpoints, restarts, and the time and energy they
cost. Pure functions of (model, layout, cluster size, rates); `advisor plan` sweeps them.

Model (exponential failures, one restart of the whole job per failure, as a synchronous
data-parallel job has):
  * failure rate: `failures_per_gpu_hour` x GPUs -> the job's mean time between failures M;
  * checkpoint write time C: the bytes the fullest rank writes x ranks / the storage's aggregate
    bandwidth (every rank writes its shard at once, sharing the file system's bandwidth);
  * restart time R: a fixed part (detection, rescheduling, process start, NCCL init) plus reading
    the checkpoint back at the same bandwidth;
  * checkpoint interval tau: Daly's higher-order optimum (J. T. Daly, "A higher order estimate of
    the optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3),
    2006), which tends to Young's sqrt(2 C M) (J. W. Young, CACM 17(9), 1974) for C << M;
  * expected wall time T_w = M e^(R/M) (e^((tau+C)/M) - 1) T_s / tau for T_s seconds of useful
    compute (Daly 2006: the complete cost function his interval minimises);
  * goodput (effective training time) = T_s / T_w.

Sources of the defaults (each overridable):
  * 419 unexpected interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100
    (466 in all, 47 of them planned maintenance) -> 419 / (54 x 24 x 16,384) = 1.97e-5 per GPU-hour,
    a job MTBF of 3.1 h at 16K GPUs ("The Llama 3 Herd of Models", Meta 2024, §3.3.4 and Table 5;
    the paper reports > 90% effective training time over that period). Planned interruptions are
    not counted: they lose no work (a checkpoint is taken before) and are scheduled.
  * storage: Meta's Tectonic file system for Llama 3, 2 TB/s sustained (7 TB/s peak) (same paper,
    §3.3.1); the default when a cluster YAML gives no `storage_bw_gbs`.
  * restart fixed part: ASSUMED 10 min. No published measurement of an LLM job's restart was found;
    10 min is the restart time of Daly's worked examples (2006, Figs. 3-5), not a measurement.
  * checkpoint bytes: bf16 weights (2 B) + fp32 master weights and Adam moments (12 B) per
    parameter (models.constants bytes_weight / bytes_optimizer), each rank writing its 1/(DP·CP)
    share of its stage's tensors (Megatron's distributed checkpoint with a fully parallel save
    writes every replicated tensor once, spread over the data-parallel ranks).

Energy: useful compute and re-done (lost) work at the layout's mean power; checkpoint writes and
restarts at the GPU's idle power (the job waits); GPU energy only, like the rest of the advisor.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import plan_params
from advisor.search_spaces.layout import pipeline_plan

HOUR = 3600.0
DAY = 86400.0

# Llama 3 paper (Meta 2024), §3.3.4 / Table 5: unexpected interruptions in the 54-day snapshot on
# 16,384 H100 GPUs.
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_SNAPSHOT_DAYS = 54
LLAMA3_GPUS = 16384
DEFAULT_FAILURES_PER_GPU_HOUR = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_SNAPSHOT_DAYS * 24 * LLAMA3_GPUS)
FAILURE_SOURCE = ("Llama 3 paper (Meta 2024) §3.3.4: 419 unexpected interruptions in 54 days "
                  "on 16,384 H100")
# Llama 3 paper §3.3.1: Tectonic, 2 TB/s sustained throughput (7 TB/s peak).
DEFAULT_STORAGE_BW_GBS = 2000.0
STORAGE_SOURCE = "Llama 3 paper §3.3.1: Tectonic, 2 TB/s sustained"
# ASSUMPTION (no published measurement found): the fixed part of a restart, seconds.
DEFAULT_RESTART_S = 600.0
RESTART_SOURCE = "assumed (Daly 2006's worked examples use 10 min); --restart-min overrides"


def checkpoint_bytes_per_rank(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> float:
    """Bytes the fullest rank writes per checkpoint: (bf16 weights + fp32 optimizer state) per
    parameter of its stage's TP/EP shard, spread over the data-parallel replicas (dense tensors over
    DP·CP, expert tensors over the expert-data-parallel size)."""
    per_rank = plan_params(model, pipeline_plan(model, cfg), cfg.tp, cfg.ep * cfg.etp)
    d, edp = cfg.dp * cfg.cp, cfg.expert_dp
    return max((dense / d + experts / edp) * (c.bytes_weight + c.bytes_optimizer)
               for dense, experts, _ in per_rank)


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 C M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006), the perturbation solution: tau = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C for
    C < 2M, else M. (Compute time between checkpoints, the write excluded.)"""
    if not math.isfinite(mtbf_s):
        return math.inf
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


def expected_wall_s(compute_s: float, interval_s: float, checkpoint_s: float, restart_s: float,
                    mtbf_s: float) -> float:
    """Daly (2006), the complete model: T_w = M e^(R/M) (e^((tau+C)/M) - 1) T_s / tau. With no failures
    (M infinite): T_s + (T_s / tau) C."""
    if not math.isfinite(mtbf_s):
        return compute_s + (compute_s / interval_s) * checkpoint_s if math.isfinite(interval_s) else compute_s
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s) * compute_s / interval_s


@dataclass(frozen=True)
class Goodput:
    """Where the wall time and the energy of a run go (seconds, joules; all GPUs together)."""
    gpus: int
    failures_per_gpu_hour: float
    mtbf_s: float               # the job's mean time between failures
    checkpoint_bytes_per_rank: float
    checkpoint_s: float         # one checkpoint write (blocking)
    restart_s: float            # one restart: the fixed part + reading the checkpoint back
    interval_s: float           # compute between checkpoints (Daly)
    young_interval_s: float
    compute_s: float            # useful compute T_s
    wall_s: float               # expected wall time T_w
    failures: float             # expected failures over the run
    checkpoint_total_s: float   # all checkpoint writes
    restart_total_s: float      # all restarts
    rework_s: float             # work lost to failures and done again
    energy_j: float             # GPU energy of the whole run
    idle_energy_j: float        # of it, waiting at idle power (checkpoints and restarts)

    @property
    def goodput(self) -> float:
        return self.compute_s / self.wall_s

    @property
    def days(self) -> float:
        return self.wall_s / DAY

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(goodput=self.goodput, days=self.days)
        return d


def run_goodput(compute_s: float, gpus: int, checkpoint_bytes: float, train_power_w: float, idle_power_w: float,
                failures_per_gpu_hour: float = DEFAULT_FAILURES_PER_GPU_HOUR,
                storage_bw_gbs: float = DEFAULT_STORAGE_BW_GBS, restart_fixed_s: float = DEFAULT_RESTART_S,
                interval_s: float | None = None) -> Goodput:
    """The expected run of `compute_s` seconds of useful compute on `gpus` GPUs, each rank
    writing `checkpoint_bytes` per checkpoint, at the Daly interval (or `interval_s`). Power per
    GPU: `train_power_w` while computing, `idle_power_w` while writing checkpoints or restarting."""
    rate = failures_per_gpu_hour * gpus / HOUR  # failures per second of the job
    mtbf = 1.0 / rate if rate > 0 else math.inf
    ckpt = checkpoint_bytes * gpus / (storage_bw_gbs * 1e9)
    restart = restart_fixed_s + ckpt  # reading the checkpoint back at the same bandwidth
    tau = daly_interval(ckpt, mtbf) if interval_s is None else interval_s
    tau = min(tau, compute_s) if math.isfinite(tau) else compute_s
    wall = expected_wall_s(compute_s, tau, ckpt, restart, mtbf)
    failures = wall / mtbf if math.isfinite(mtbf) else 0.0
    ckpt_total = compute_s / tau * ckpt
    restart_total = failures * restart
    rework = max(0.0, wall - compute_s - ckpt_total - restart_total)
    idle = (ckpt_total + restart_total) * idle_power_w * gpus
    energy = (compute_s + rework) * train_power_w * gpus + idle
    return Goodput(gpus=gpus, failures_per_gpu_hour=failures_per_gpu_hour, mtbf_s=mtbf,
                   checkpoint_bytes_per_rank=checkpoint_bytes, checkpoint_s=ckpt, restart_s=restart,
                   interval_s=tau, young_interval_s=young_interval(ckpt, mtbf) if math.isfinite(mtbf) else math.inf,
                   compute_s=compute_s, wall_s=wall, failures=failures, checkpoint_total_s=ckpt_total,
                   restart_total_s=restart_total, rework_s=rework, energy_j=energy, idle_energy_j=idle)

"""The analytical model on arrays of layouts: `evaluate` runs memory (models/memory.py), stage
times and the step (models/step_time.py) and the power / DVFS fixed point (models/power_arrays.py),
each written once on arrays, over every layout (and every pipeline stage of every layout) at once;
`Calibrated` applies a calibration to the rows. recommend and predict run it; the per-layout API
(predict, estimate_power, stage_times, stage_memory) runs the same code on a Layouts of one.

Layout of the arrays: `Layouts` holds one row per layout; stage arrays are flat, the stages of
row r at `start[r] : start[r] + pp[r]` (ragged; segment reductions with numpy's reduceat).

    res = evaluate(model, cluster, Layouts.of(cfgs), constants)
    res.tokens_per_s_per_gpu, res.energy_j_per_token, res.throttle_risk   # arrays, one per layout
    res.prediction(i)                                                     # the Prediction of row i
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec
from advisor.models.constants import DEFAULT, Constants
from advisor.models.flops import training_flops_per_token
from advisor.models.memory import memory_arrays, peak_memory_many, stage_memory, stage_memory_of
from advisor.models.power import stage_caps_many  # noqa: F401 (API: per-stage caps of several layouts)
from advisor.models.power_arrays import POWER_FIELDS, PowerArrays, PowerInputs, evaluate_power, power_at_step_arrays
from advisor.models.prediction import assemble
from advisor.models.quant import mfu_peak_tflops
from advisor.models.residuals import ADDITIVE, apply_residual
from advisor.models.stages import Stages, memo_for
from advisor.search_spaces.columns import Layouts  # noqa: F401 (Layouts: API)

__all__ = ["Calibrated", "Layouts", "POWER_FIELDS", "Result", "evaluate", "peak_memory_gib", "power_at_step",
           "stage_caps_many", "vectorizable"]


@dataclass
class Result:
    """What `evaluate` computed, per row (1-d arrays) and per stage (flat arrays, see Stages):
    `pa` the power evaluation (its inputs: stage times at the maximum clocks `full`, the step at
    them `base`; at the clocks held: `at`, `step`; `power` per stage, clocks `x`, `extra`)."""

    model: ModelSpec
    cluster: ClusterSpec
    layouts: Layouts
    constants: Constants
    stages: Stages
    pa: PowerArrays
    row: dict              # per-row results (tokens_per_s_per_gpu, energy_j_per_token, throttle_risk, ...)
    peak_gib: np.ndarray   # memory.peak_memory_gib per row

    def __getattr__(self, name):
        row = self.__dict__.get("row")
        if row is not None and name in row:
            return row[name]
        pa = self.__dict__.get("pa")
        if pa is not None and name in ("full", "base"):
            return getattr(pa.inp, name)
        if pa is not None and name in ("at", "step", "power", "x", "extra"):
            return getattr(pa, name)
        raise AttributeError(name)

    def step_objects(self, i: int):
        """(StepTime at the maximum clocks, StepTime at the clocks held) of row i."""
        return self.pa.step_objects(i)

    def power_estimate(self, i: int, cluster: ClusterSpec | None = None):
        """(models.power.PowerEstimate of row i, its step at the maximum clocks); `cluster`: the
        cluster with the cap row i was evaluated at, when that is not the cluster's."""
        return self.pa.power_estimate(i, cluster)

    def prediction(self, i: int, cluster: ClusterSpec | None = None):
        """The models.predict.Prediction of row i; `cluster` as for power_estimate."""
        power, base = self.power_estimate(i, cluster)
        return assemble(self.model, cluster or self.cluster, self.layouts.config(i), self.constants,
                        self.stage_memory(i), base, power)

    def stage_memory(self, i: int) -> list:
        """memory.stage_memory of row i (from the arrays when memory was evaluated)."""
        if self.stages.cache.get("memory") is None:
            return stage_memory(self.model, self.layouts.config(i), self.constants, gpu=self.cluster.gpu)
        return stage_memory_of(self.stages, i, self.constants)


def peak_memory_gib(model: ModelSpec, L: Layouts, c: Constants = DEFAULT, cluster: ClusterSpec | None = None
                    ) -> np.ndarray:
    """memory.peak_memory_gib of every row: the fullest stage's memory per GPU (`cluster`: its GPU
    decides the copies of the FP8 weights, GPUSpec.fp8_transposed_copy; None: Hopper-like)."""
    return peak_memory_many(model, L, c, cluster.gpu if cluster is not None else None)


def evaluate(model: ModelSpec, cluster: ClusterSpec, L: Layouts, c: Constants = DEFAULT,
             caps: float | np.ndarray | None = None, stage_caps: np.ndarray | None = None,
             extra_wait_s: np.ndarray | float = 0.0, memory: bool = True) -> Result:
    """predict() of every row of `L` on `cluster` as arrays: memory, stage times, the step and the
    power fixed point (power_arrays.evaluate_power) under `caps` (per GPU: one number, one per row,
    or `stage_caps`, one per stage in the flat order; default the cluster's cap). Divisions by
    zero take the per-element branches (np.where), so numpy's warnings about them are off."""
    with np.errstate(divide="ignore", invalid="ignore"):
        S = Stages(L)
        pa = evaluate_power(PowerInputs.of(model, cluster, L, c, caps, stage_caps, S=S), extra_wait_s)
        gpu = cluster.gpu
        rowd = dict(pa.row)
        tokens = L.gbs * L.seq
        tps = tokens / rowd["step_time_s"] / cluster.world_size
        seqs, sinv = np.unique(L.seq, return_inverse=True)
        flops = np.array([training_flops_per_token(model, int(s)) for s in seqs])[sinv.reshape(-1)]
        tflops = tps * flops / 1e12
        sq, qinv = np.unique(np.stack([L.seq, L.fp8]), axis=1, return_inverse=True)
        mfu_peak = np.array([mfu_peak_tflops(model, int(a), gpu, int(b)) for a, b in sq.T])[qinv.reshape(-1)]
        rowd.update(tokens_per_s_per_gpu=tps, tflops_per_gpu=tflops, mfu=tflops / mfu_peak)
        if memory:
            peak, total_gib = memory_arrays(model, L, c, memo_for(model, cluster, c), S, gpu)
            rowd["memory_gib_per_gpu"] = S.max(total_gib)
        else:
            peak = np.full(len(L), np.nan)
        rowd["peak_memory_gib"] = peak
        return Result(model=model, cluster=cluster, layouts=L, constants=c, stages=S, pa=pa, row=rowd, peak_gib=peak)


# ------------------------------------------------------------------------------------------------
# calibration (models.calibrate.Calibration.predict_many on arrays)
# ------------------------------------------------------------------------------------------------

def vectorizable(cal) -> bool:
    """A calibration whose levels are all analytical / calibrated (no surrogate in use): its
    predictions are functions of the analytical model's, which `Calibrated` computes on arrays.
    Surrogates need the reference's per-layout features (Calibration.predict_many)."""
    return not any(v["mode"] == "surrogate" and cal.surrogates.get(t) is not None for t, v in cal.targets.items())


class Calibrated:
    """Calibration.predict_many of every row of `res` (evaluated with the calibration's constants),
    as arrays: tokens_per_s_per_gpu, step_time_s, energy_j_per_token, mean_power_w, throttle_risk,
    sm_clock_mhz, clock_ratio, memory_gib_per_gpu, feasible; `prediction(i)` composes the
    CalibratedPrediction of row i as the reference does (Calibration._compose), with the power
    evaluation of power_of done here on arrays."""

    def __init__(self, cal, res: Result, caps: np.ndarray | None = None):
        if res.constants is not cal.constants:
            raise ValueError("Calibrated needs the rows evaluated with the calibration's constants")
        self.cal, self.res = cal, res
        model, cluster, L = res.model, res.cluster, res.layouts
        self.caps = caps
        dft = None
        if any(v["mode"] == "analytical" for v in cal.targets.values()):
            dft = res if cal.constants is DEFAULT else evaluate(model, cluster, L, DEFAULT, caps=caps)
        self.dft = dft
        names = {"tokens_per_s_per_gpu": "tokens_per_s_per_gpu", "memory_gib_per_gpu": "memory_gib_per_gpu",
                 "mean_power_w": "mean_power_w", "peak_power_w": "peak_power_w",
                 "throttle_fraction": "throttle_fraction"}
        est = {}
        for t, spec in cal.targets.items():
            base = (dft if spec["mode"] == "analytical" else res).row[names[t]]
            iv = spec["interval"]
            v = apply_residual(t, base, 0.0) if t in ADDITIVE else base
            lo, hi = apply_residual(t, base, iv["lo"]), apply_residual(t, base, iv["hi"])
            est[t] = (v, np.minimum(lo, hi), np.maximum(lo, hi))
        self.est = est
        n = cluster.world_size
        tokens = L.gbs * L.seq
        tps = est["tokens_per_s_per_gpu"][0]
        step = tokens / (tps * n)
        # the power evaluation behind the printed power numbers (Calibration.power_of)
        if cal.targets["mean_power_w"]["mode"] == "analytical":
            self.pw = (dft, np.arange(len(L)))
            pw_rows = dft.row
            src = {k: pw_rows[k] for k in ("mean_power_w", "throttle_risk", "sm_clock_mhz", "clock_ratio")}
            self.pw_of = [(dft, i) for i in range(len(L))]
        else:
            self.pw_of, src = power_at_step(res, step, caps)
        mem = est["memory_gib_per_gpu"][0]
        self.row = {"tokens_per_s_per_gpu": tps, "step_time_s": step, "memory_gib_per_gpu": mem,
                    "feasible": mem <= cal.constants.usable_memory_gib(cluster.gpu.memory_gib),
                    "mean_power_w": src["mean_power_w"], "throttle_risk": src["throttle_risk"],
                    "sm_clock_mhz": src["sm_clock_mhz"], "clock_ratio": src["clock_ratio"],
                    "energy_j_per_token": src["mean_power_w"] * n * step / tokens}

    def __getattr__(self, name):
        row = self.__dict__.get("row")
        if row is not None and name in row:
            return row[name]
        raise AttributeError(name)

    def prediction(self, i: int, cluster: ClusterSpec | None = None):
        res = self.res
        cl = cluster or res.cluster
        p = res.prediction(i, cl)
        pres, j = self.pw_of[i]
        pw = pres.power_estimate(j, cl)[0]
        est = {t: tuple(float(a[i]) for a in e) for t, e in self.est.items()}
        return self.cal._compose(res.model, cl, res.layouts.config(i), p, est, pw=pw)


def power_at_step(res: Result, step_s: np.ndarray, caps=None) -> tuple[list, dict]:
    """models.power.power_at_step of every row of `res` at `step_s` (power_arrays.
    power_at_step_arrays; the caps are those `res` was evaluated under): [(PowerArrays, row) per
    row], and the per-row arrays of the evaluation each row ends with."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return power_at_step_arrays(res.pa.inp, res.pa, np.asarray(step_s, float))

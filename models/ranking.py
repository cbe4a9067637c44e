"""Recommend's evaluation helpers: a layout's prediction as advisor prints it (calibrated when a
calibration is in use), a head of layouts at every cap of a sweep in one array, and the layouts
that rank best at one cap."""
from __future__ import annotations

import math

import numpy as np

from advisor.catalog import ClusterSpec, ModelSpec, TrainConfig, with_power_cap
from advisor.models import Constants, Prediction, predict
from advisor.models.objectives import rank_order, score_arrays
from advisor.models.power import CapPoint

__all__ = ["best_at_cap", "CapTable", "predict_at", "predict_many", "cap_evaluator"]


def best_at_cap(m: ModelSpec, c: ClusterSpec, L, cap: float, objective: str, constants: Constants, cal,
                 calv: bool) -> list[TrainConfig]:
    """The layouts of `L` (rows that fit) in the order of their score at one per-GPU cap (as
    recommend predicts them: calibrated when a calibration is in use; a layout the calibrated
    memory says does not fit is left out)."""
    from advisor.models import vectorized as vz

    at = with_power_cap(c, cap)
    if cal is None or calv:  # (the cluster as it is, with the cap per row: the same arrays, its memos)
        R = vz.evaluate(m, c, L, constants, caps=cap, memory=cal is not None)
        A = vz.Calibrated(cal, R) if cal is not None else R
        ok = np.asarray(A.feasible, bool) if cal is not None else np.ones(len(L), bool)
        tps, e, risk = A.tokens_per_s_per_gpu, A.energy_j_per_token, A.throttle_risk
    else:
        preds = predict_many(m, at, [L.config(i) for i in range(len(L))], constants, cal)
        ok = np.array([p.feasible for p in preds], bool)
        tps, e, risk = (np.array([getattr(p, k) for p in preds]) for k in
                        ("tokens_per_s_per_gpu", "energy_j_per_token", "throttle_risk"))
    idx = np.flatnonzero(ok)
    if not len(idx):
        return []
    score = score_arrays(tps[idx], e[idx], risk[idx], objective, float(tps[idx].max()), float(e[idx].min()))
    return [L.config(int(idx[j])) for j in rank_order(score, L.take(idx))]


class CapTable:
    """A head's predictions at every cap of a sweep, evaluated as one array (caps vary fastest)."""

    def __init__(self, m, c, cfgs, caps, constants, cal, calv):
        from advisor.models import vectorized as vz

        self.m, self.c, self.cfgs, self.caps, self.constants, self.cal = m, c, cfgs, list(caps), constants, cal
        self.col = {cap: j for j, cap in enumerate(self.caps)}
        L = vz.Layouts.of(m, cfgs).repeat(len(self.caps))
        capv = np.tile(np.array(self.caps, float), len(cfgs))
        if cal is None or calv:
            R = vz.evaluate(m, c, L, constants, caps=capv, memory=cal is not None)
            self.arr = vz.Calibrated(cal, R, caps=capv) if cal is not None else R
            self.ref = None
        else:  # a calibration with surrogates: the reference, cap by cap
            self.arr = None
            self.ref = {cap: predict_many(m, with_power_cap(c, cap), cfgs, constants, cal) for cap in self.caps}

    def point(self, i: int, cap: float) -> CapPoint:
        if self.ref is not None:
            p = self.ref[cap][i]
            return CapPoint(cap, p.step_time_s, p.energy_j_per_token, p.mean_power_w, p.sm_clock_mhz, p.clock_ratio)
        r = i * len(self.caps) + self.col[cap]
        a = self.arr
        sm = float(a.sm_clock_mhz[r])
        return CapPoint(cap, float(a.step_time_s[r]), float(a.energy_j_per_token[r]), float(a.mean_power_w[r]),
                        None if math.isnan(sm) else sm, float(a.clock_ratio[r]))

    def prediction(self, i: int, cap: float) -> Prediction:
        if self.ref is not None:
            return self.ref[cap][i]
        return self.arr.prediction(i * len(self.caps) + self.col[cap], with_power_cap(self.c, cap))


def predict_at(m: ModelSpec, c: ClusterSpec, cfg: TrainConfig, constants: Constants, cal) -> Prediction:
    """The prediction advisor prints for (layout, cluster with its cap): calibrated when a
    calibration is in use."""
    return cal.predict(m, c, cfg, check_legal=False) if cal is not None else predict(m, c, cfg, constants, check_legal=False)


def predict_many(m: ModelSpec, c: ClusterSpec, cfgs: list[TrainConfig], constants: Constants, cal) -> list[Prediction]:
    if cal is not None:
        return cal.predict_many(m, c, cfgs, check_legal=False)
    return [predict(m, c, cfg, constants, check_legal=False) for cfg in cfgs]


def cap_evaluator(m: ModelSpec, c: ClusterSpec, cfg: TrainConfig, constants: Constants, cal):
    """evaluate(cap) -> CapPoint with the same predictions advisor prints (one source)."""
    def evaluate(cap: float) -> CapPoint:
        p = predict_at(m, with_power_cap(c, cap), cfg, constants, cal)
        return CapPoint(cap, p.step_time_s, p.energy_j_per_token, p.mean_power_w, p.sm_clock_mhz, p.clock_ratio)
    return evaluate

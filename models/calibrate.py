"""Calibration: the analytical model's constants fitted to measurements, residual surrogates on
top, prediction intervals (the what-if overrides, re-exported here, live in models/overrides.py).

Three levels are compared per target on grouped cross-validation (no model shape in both the
training and the test folds):
  analytical   predict() with the default Constants
  calibrated   predict() with constants fitted by bounded least squares (log step time, log memory,
               log mean and peak power; robust soft-L1 loss; a weak pull towards the defaults so that
               constants the data cannot see stay where they were)
  surrogate    calibrated x exp(GP residual) (throttle fraction: + GP residual) on physical features
The level with the lowest CV error is used for each target; the analytical model is kept for a
target where nothing beats it (recorded in the file), so a calibration is never worse than the
analytical model on held-out model shapes. 80% intervals come from the out-of-fold residuals of
the level used, not widened to contain the point (`_interval`: residual quantiles for the
analytical level, +- the 80% quantile of |residual| for the calibrated level, a split-conformal
scale on the GP's floored standard deviation for the surrogate level).

File format (joblib, load trusted files only: joblib unpickles): a dict with "format":
"advisor.calibration", "version": 2, "feature_names", "constants", "fitted_constants", "targets",
"surrogates" (PortableGP states: numpy arrays, so loading needs no scikit-learn), "trained_on",
"cv", "created", "versions". Version 1 files (scikit-learn objects as surrogates) are still read.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.dataset import ADDITIVE, TARGETS, Dataset, Record, apply_residual, residual  # noqa: F401 (API)
from advisor.models.features import FEATURE_NAMES, features
from advisor.models.flops import training_flops_per_token
from advisor.models.power import power_at_step
from advisor.models.predict import Prediction, power_fields, predict
from advisor.models.quant import mfu_peak_tflops
from advisor.models.overrides import (CLUSTER_KEYS, LAYOUT_BOOL, LAYOUT_INT, LAYOUT_STR, MODEL_KEYS,  # noqa: F401
                                      OVERRIDE_KEYS, apply_overrides, override_workload, parse_sets)
from advisor.models.surrogate import MIN_ROWS, ResidualGP

FORMAT = "advisor.calibration"
# 2: surrogates stored as numpy arrays (PortableGP: no scikit-learn to load or use them);
# 1: scikit-learn objects. This advisor writes 2 and reads both.
VERSION = 2
READS = (1, 2)
LEVEL = 0.8  # central coverage of the intervals
MODES = ("analytical", "calibrated", "surrogate")
# Power targets come from the DVFS model (models.power.estimate_power) with the constants of the
# level chosen for mean power, never from a surrogate: every power, clock, throttle and energy
# number of a prediction then comes from one evaluation and they cannot disagree.
POWER_TARGETS = ("mean_power_w", "peak_power_w", "throttle_fraction")
# fitted on mean and peak power by the power model given each record's measured step (second stage
# of fit_constants), with the step-time constants of the first stage
POWER_CONSTANTS = ("comm_power", "wait_power", "peak_overshoot")
SURROGATE_MARGIN = 0.97  # the surrogate level must cut the calibrated CV error by 3% to be used  # fractions in [0, 1]: additive residual, error = MAE
DEFAULT_FILE = Path(__file__).parent / "data" / "default_calibration.joblib"

# The constants `fit` adjusts, with their bounds.
FIT_BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_efficiency_max": (0.3, 0.95),
    "gemm_half_dim": (4.0, 2048.0),
    "hbm_efficiency": (0.2, 0.95),
    # at most FlashAttention-3's BF16 forward on an H100 SXM, 740 of 989 TFLOP/s (Shah et al. 2024):
    # a fitted efficiency above it is the fit trading attention for other terms
    "attention_efficiency": (0.1, 0.75),
    "layer_overhead_s": (1e-6, 5e-3),
    "step_overhead_s": (1e-4, 2.0),
    "nvlink_efficiency": (0.1, 1.0),
    "network_efficiency": (0.1, 1.0),
    "runtime_overhead_gib": (0.05, 16.0),
    "fragmentation": (0.001, 1.5),
    "comm_power": (0.02, 0.8),
    "wait_power": (0.005, 1.0),
    "peak_overshoot": (0.05, 1.0),
}
# least-squares residual groups: target -> weight
FIT_TARGETS = {"tokens_per_s_per_gpu": 1.0, "memory_gib_per_gpu": 1.0, "mean_power_w": 1.0, "peak_power_w": 0.5}


class CalibrationError(SpecError):
    """Unreadable calibration file or impossible fit; one line for the user."""


# ------------------------------------------------------------------------------------------------
# analytical values of the targets
# ------------------------------------------------------------------------------------------------

def target_values(p: Prediction, cluster: ClusterSpec) -> dict[str, float]:
    return {"tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "memory_gib_per_gpu": p.memory_gib_per_gpu,
            "mean_power_w": p.mean_power_w, "peak_power_w": p.peak_power_w,
            "throttle_fraction": p.throttle_fraction}


def _groups(records: Sequence[Record], idx: Sequence[int]) -> dict:
    """Indices of `idx` by (model, cluster): the records the array model evaluates at once."""
    out: dict = {}
    for i in idx:
        out.setdefault((records[i].model, records[i].cluster), []).append(i)
    return out


def _predict_rows(records: Sequence[Record], c: Constants) -> list[Prediction]:
    """predict() of every record, the records of one model and cluster evaluated at once on arrays."""
    from advisor.models.vectorized import Layouts, evaluate

    out: list = [None] * len(records)
    for (m, cl), idx in _groups(records, range(len(records))).items():
        res = evaluate(m, cl, Layouts.of(m, [records[i].cfg for i in idx]), c)
        for j, i in enumerate(idx):
            out[i] = res.prediction(j)
    return out


def _values(records: Sequence[Record], preds: Sequence[Prediction]) -> dict[str, np.ndarray]:
    vals = [target_values(p, r.cluster) for r, p in zip(records, preds)]
    return {t: np.array([v[t] for v in vals]) for t in TARGETS}


def _features(records: Sequence[Record], preds: Sequence[Prediction]) -> np.ndarray:
    return np.array([features(r.model, r.cluster, r.cfg, p) for r, p in zip(records, preds)])


# ------------------------------------------------------------------------------------------------
# fitting the constants
# ------------------------------------------------------------------------------------------------

def fit_constants(records: Sequence[Record], base: Constants = DEFAULT,
                  names: Sequence[str] = tuple(FIT_BOUNDS), prior_weight: float = 0.003,
                  max_nfev: int = 100) -> tuple[Constants, dict]:
    """Bounded least squares in the log of each constant relative to `base`, in two stages:
    (1) the step-time and memory constants on log(predicted / measured) tokens/s and memory;
    (2) with those fixed, the power constants (POWER_CONSTANTS) on log(predicted / measured) mean
    and peak power, the power predicted by the DVFS model given each record's measured step
    (models.power.power_at_step: the power model is fitted on what it has to explain, not on the
    step model's error). FIT_TARGETS gives the weights. Soft-L1 loss (robust to a few bad
    trials); `prior_weight` pulls each log-constant towards 0 so unobservable ones stay put."""
    from scipy.optimize import least_squares

    names = list(names)
    meas = {t: np.array([r.y[t] for r in records]) for t in FIT_TARGETS}
    masks = {t: np.isfinite(v) & (v > 0) for t, v in meas.items()}
    steps = np.array([r.cfg.tokens_per_step / (r.y["tokens_per_s_per_gpu"] * r.cluster.world_size) for r in records])

    def power_values(c: Constants) -> dict[str, np.ndarray]:
        from advisor.models import vectorized as vz

        out = {t: np.full(len(records), np.nan) for t in ("mean_power_w", "peak_power_w")}
        need = np.flatnonzero(masks["mean_power_w"] | masks["peak_power_w"])
        for (m, cl), idx in _groups(records, need).items():  # power_at_step of each, on arrays
            res = vz.evaluate(m, cl, vz.Layouts.of(m, [records[i].cfg for i in idx]), c, memory=False)
            where, got = vz.power_at_step(res, steps[idx], None)
            out["mean_power_w"][idx] = got["mean_power_w"]
            out["peak_power_w"][idx] = [r.row["peak_power_w"][j] for r, j in where]
        return out

    stages = [([n for n in names if n not in POWER_CONSTANTS], ("tokens_per_s_per_gpu", "memory_gib_per_gpu")),
              ([n for n in names if n in POWER_CONSTANTS], ("mean_power_w", "peak_power_w"))]
    c, info = base, {"cost_before": 0.0, "cost_after": 0.0, "nfev": 0, "status": [], "message": [], "at_bound": []}
    for stage_names, targets in stages:
        if not stage_names or not any(masks[t].any() for t in targets):
            continue
        v0 = np.array([getattr(c, n) for n in stage_names], float)
        lo = np.log(np.array([FIT_BOUNDS[n][0] for n in stage_names]) / v0)
        hi = np.log(np.array([FIT_BOUNDS[n][1] for n in stage_names]) / v0)

        def consts(x, c0=c, ns=stage_names, v=v0):
            return c0.replace(**{n: float(val) for n, val in zip(ns, v * np.exp(x))})

        def resid(x, targets=targets, consts=consts):
            cx = consts(x)
            vals = (_values(records, _predict_rows(records, cx)) if "tokens_per_s_per_gpu" in targets
                    else power_values(cx))
            parts = []
            for t in targets:
                m = masks[t]
                if m.any():
                    parts.append(FIT_TARGETS[t] * np.log(vals[t][m] / meas[t][m]) / math.sqrt(m.sum()))
            parts.append(prior_weight * x)
            return np.concatenate(parts)

        x0 = np.zeros(len(stage_names))
        r0 = resid(x0)
        res = least_squares(resid, np.clip(x0, lo + 1e-12, hi - 1e-12), bounds=(lo, hi), loss="soft_l1",
                            f_scale=0.05, diff_step=1e-3, ftol=1e-6, xtol=1e-6, gtol=1e-8, max_nfev=max_nfev)
        c = consts(res.x)
        info["cost_before"] += float(0.5 * np.sum(r0 ** 2))
        info["cost_after"] += float(0.5 * np.sum(res.fun ** 2))
        info["nfev"] += int(res.nfev)
        info["status"].append(int(res.status))
        info["message"].append(str(res.message))
        info["at_bound"] += [n for n, x, a, b in zip(stage_names, res.x, lo, hi) if min(x - a, b - x) < 1e-3]
    return c, info


# ------------------------------------------------------------------------------------------------
# one fold: constants + surrogates on `train`, predictions for `test`
# ------------------------------------------------------------------------------------------------

@dataclass
class _Fitted:
    constants: Constants
    surrogates: dict[str, ResidualGP | None]
    fit_info: dict


def _fit_level2(records: Sequence[Record], seed: int, surrogates: bool) -> tuple[_Fitted, list[Prediction]]:
    c, info = fit_constants(records)
    preds = _predict_rows(records, c)
    X = _features(records, preds)
    vals = _values(records, preds)
    sur: dict[str, ResidualGP | None] = {}
    for t in TARGETS:
        y = np.array([r.y[t] for r in records])
        r = residual(t, y, vals[t])
        ok = np.isfinite(r)
        sur[t] = ResidualGP(seed).fit(X[ok], r[ok]) if surrogates and ok.sum() >= MIN_ROWS else None
    return _Fitted(c, sur, info), preds


def _predict_levels(fitted: _Fitted, records: Sequence[Record], analytical: dict[str, np.ndarray]):
    """{target: {"analytical", "calibrated", "surrogate", "mu", "sd"}} arrays for `records`."""
    preds = _predict_rows(records, fitted.constants)
    X = _features(records, preds)
    cal = _values(records, preds)
    out = {}
    for t in TARGETS:
        d = {"analytical": analytical[t], "calibrated": cal[t],
             "surrogate": np.full(len(records), np.nan), "mu": np.full(len(records), np.nan),
             "sd": np.full(len(records), np.nan)}
        gp = fitted.surrogates.get(t)
        if gp is not None:
            mu, sd = gp.predict(X)
            d["mu"], d["sd"] = mu, sd
            d["surrogate"] = apply_residual(t, cal[t], mu)
        else:  # too few rows for a surrogate: the surrogate level is the calibrated model
            d["surrogate"] = cal[t]
        out[t] = d
    return out


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------

def error(target: str, y: np.ndarray, p: np.ndarray) -> float:
    """MAPE in % (MAE in percentage points for fractions)."""
    ok = np.isfinite(y) & np.isfinite(p)
    if not ok.any():
        return math.nan
    if target in ADDITIVE:
        return float(np.mean(np.abs(p[ok] - y[ok])) * 100)
    return float(np.mean(np.abs(p[ok] - y[ok]) / np.abs(y[ok])) * 100)


def r2(y: np.ndarray, p: np.ndarray) -> float:
    ok = np.isfinite(y) & np.isfinite(p)
    if ok.sum() < 2 or np.var(y[ok]) == 0:
        return math.nan
    return float(1.0 - np.sum((y[ok] - p[ok]) ** 2) / np.sum((y[ok] - y[ok].mean()) ** 2))


def metric_name(target: str) -> str:
    return "MAE_pp" if target in ADDITIVE else "MAPE_%"


# ------------------------------------------------------------------------------------------------
# the whole fit
# ------------------------------------------------------------------------------------------------

def cv_splits(ds: Dataset, folds: int, by_depth: bool = False) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """Grouped k-fold by model shape (architecture without depth); by shape with depth when there
    are fewer than 2 architectures or when `by_depth` (then a fold holds out one depth of a model
    and trains on its other depths); ungrouped (and said so) when even that is one group."""
    from sklearn.model_selection import GroupKFold, KFold

    n = len(ds)
    schemes = ((False, "model architecture"), (True, "model architecture and depth"))
    for with_layers, how in schemes[1:] if by_depth else schemes:
        groups = ds.groups(with_layers)
        k = min(folds, len(set(groups)))
        if k >= 2:
            return list(GroupKFold(n_splits=k).split(np.zeros(n), groups=groups)), f"GroupKFold({k}) by {how}"
    k = min(folds, n)
    if k < 2:
        return [], "none (fewer than 2 records)"
    return (list(KFold(n_splits=k, shuffle=True, random_state=0).split(np.zeros(n))),
            f"KFold({k}) UNGROUPED: one model shape only, CV does not test other shapes")


def fit(ds: Dataset, folds: int = 5, seed: int = 0, surrogates: bool = True, log=None,
        by_depth: bool = False) -> "Calibration":
    """Cross-validate the three levels per target, choose one per target, refit on everything.
    The out-of-fold predictions stay on the result as `oof` (not saved to the file)."""
    say = log or (lambda s: None)
    records = ds.records
    if len(records) < 3:
        raise CalibrationError(f"need at least 3 usable measurement records to fit, got {len(records)}"
                               + (f" ({len(ds.rejected)} rejected)" if ds.rejected else ""))
    y = {t: ds.y(t) for t in TARGETS}
    analytical = _values(records, _predict_rows(records, DEFAULT))
    splits, how = cv_splits(ds, folds, by_depth)
    n = len(records)
    oof = {t: {k: np.full(n, np.nan) for k in ("analytical", "calibrated", "surrogate", "mu", "sd")}
           for t in TARGETS}
    fold_constants = []
    for i, (train, test) in enumerate(splits):
        say(f"  fold {i + 1}/{len(splits)}: train {len(train)} rows, test {len(test)} rows")
        fitted, _ = _fit_level2([records[j] for j in train], seed, surrogates)
        fold_constants.append({k: getattr(fitted.constants, k) for k in FIT_BOUNDS})
        lv = _predict_levels(fitted, [records[j] for j in test], {t: analytical[t][test] for t in TARGETS})
        for t in TARGETS:
            for k in oof[t]:
                oof[t][k][test] = lv[t][k]
    cv: dict[str, Any] = {"scheme": how, "folds": len(splits), "level": LEVEL, "targets": {}}
    targets: dict[str, dict] = {}
    for t in TARGETS:
        has = np.isfinite(y[t])
        row = {"n": int(has.sum()), "metric": metric_name(t)}
        for m in MODES:
            row[m] = {"error": error(t, y[t], oof[t][m]), "r2": r2(y[t], oof[t][m]),
                      "n": int((has & np.isfinite(oof[t][m])).sum())}
        # choose: the lowest CV error, the analytical model unless something beats it on the same rows
        chosen, why = "analytical", "no CV (cannot show it beats the analytical model)"
        if splits and row["analytical"]["n"]:
            errs = {m: row[m]["error"] for m in MODES
                    if row[m]["n"] == row["analytical"]["n"] and math.isfinite(row[m]["error"])}
            if t in POWER_TARGETS:
                errs.pop("surrogate", None)
            if "surrogate" in errs and "calibrated" in errs and errs["surrogate"] > SURROGATE_MARGIN * errs["calibrated"]:
                errs.pop("surrogate")  # the simpler level unless the surrogate clearly helps
            chosen = min(errs, key=lambda m: (errs[m], MODES.index(m)))
            why = "lowest CV error" if chosen != "analytical" else "nothing beat the analytical model on CV"
        if chosen == "analytical" and splits:
            why = "fallback: " + why if row["analytical"]["n"] else "no measurements of this target"
        if t in POWER_TARGETS and t != "mean_power_w":
            chosen = targets["mean_power_w"]["mode"]
            why = "the level of mean power: one DVFS evaluation gives every power number"
        row["chosen"], row["why"] = chosen, why
        targets[t] = {"mode": chosen, "kind": "additive" if t in ADDITIVE else "log_ratio",
                      "interval": _interval(t, chosen, y[t], oof[t])}
        row["interval"] = targets[t]["interval"]
        cv["targets"][t] = row
    cv["fold_constants"] = fold_constants
    say("  final fit on all rows")
    need_sur = surrogates and any(v["mode"] == "surrogate" for v in targets.values())
    final, _ = _fit_level2(records, seed, need_sur)
    sur = {t: (final.surrogates.get(t) if targets[t]["mode"] == "surrogate" else None) for t in TARGETS}
    for t in TARGETS:  # a surrogate chosen on CV that could not be refitted: use calibrated
        if targets[t]["mode"] == "surrogate" and sur[t] is None:
            targets[t]["mode"] = "calibrated"
    names = [f["path"] + (f" (study {f['study']})" if "study" in f else "") for f in ds.files]
    trained_on = {"n_rows": len(records), "rejected": len(ds.rejected), "skipped": dict(ds.skipped),
                  "duplicates": ds.duplicates,
                  "files": names, "sha256": {n: f["sha256"] for n, f in zip(names, ds.files)},
                  "model_shapes": len(set(ds.groups())),
                  "gpus": sorted({r.cluster.gpu.name for r in records}),
                  "world_sizes": sorted({r.cluster.world_size for r in records})}
    return Calibration(constants=final.constants, targets=targets, surrogates=sur, trained_on=trained_on,
                       cv=cv, fit_info=final.fit_info,
                       oof={"source": [r.source for r in records], "y": y, "levels": oof})


def _interval(t: str, mode: str, y: np.ndarray, o: dict[str, np.ndarray]) -> dict:
    """How to draw the LEVEL interval of `mode` from its out-of-fold residuals r (log ratio,
    difference for fractions); `coverage_cv` is the share of out-of-fold rows inside it.

    analytical  the 10% / 90% quantiles of r: the analytical model is the same in every fold and in
                use, so its residuals (bias included) are what to expect.
    calibrated  +-q, q the 80% quantile of |r| (split conformal, symmetric): each fold's constants
                are fitted without the held-out architecture, so r carries a bias of that fold
                (+8% llama3, +26% gpt3, -32% mixtral on the campaigns) whose sign does not carry
                over to the final fit, which has seen every architecture; its size does.
    surrogate   mu +- k * max(sd, sd_floor): sd the GP's standard deviation, sd_floor the median
                out-of-fold sd, k the 80% quantile of |r - mu| / max(sd, sd_floor). The floor keeps
                the band from shrinking to the GP's noise level next to its training rows (the
                out-of-fold rows are all far from them); above it the band widens with sd.
    Neither is widened to contain the point estimate."""
    a = (1 - LEVEL) / 2
    z_nominal = float(_z(LEVEL))
    if mode == "surrogate":
        r = residual(t, y, o["calibrated"])
        ok = np.isfinite(r) & np.isfinite(o["mu"]) & np.isfinite(o["sd"])
        e, sd = (r - o["mu"])[ok], o["sd"][ok]
        if e.size < 5:
            return {"type": "gp_sd", "k": z_nominal, "sd_floor": 0.0, "nominal_k": z_nominal,
                    "nominal_coverage_cv": math.nan, "coverage_cv": math.nan,
                    "note": "too few CV residuals: the GP's nominal band"}
        floor = float(np.median(sd))
        z = np.abs(e) / np.maximum(sd, floor)
        k = float(np.quantile(z, LEVEL))
        return {"type": "gp_sd", "k": k, "sd_floor": floor, "nominal_k": z_nominal,
                "nominal_coverage_cv": float(np.mean(np.abs(e) <= z_nominal * sd)),
                "coverage_cv": float(np.mean(z <= k)), "n_cv": int(e.size)}
    r = residual(t, y, o[mode])
    r = r[np.isfinite(r)]
    if r.size < 5:
        return {"type": "quantiles", "lo": -0.25, "hi": 0.25, "coverage_cv": math.nan,
                "note": "too few CV residuals: +-25% (0.25 for fractions)"}
    q_lo, q_hi = float(np.quantile(r, a)), float(np.quantile(r, 1 - a))
    if mode == "calibrated":
        q = float(np.quantile(np.abs(r), LEVEL))
        lo, hi, how = -q, q, "symmetric: +-80% quantile of |out-of-fold residual|"
    else:
        lo, hi, how = q_lo, q_hi, "10% / 90% quantiles of the out-of-fold residuals"
    return {"type": "quantiles", "lo": lo, "hi": hi, "construction": how, "q_lo": q_lo, "q_hi": q_hi,
            "coverage_cv": float(np.mean((r >= lo) & (r <= hi))), "n_cv": int(r.size)}


def _z(level: float) -> float:
    from scipy.stats import norm

    return norm.ppf(0.5 + level / 2)


# ------------------------------------------------------------------------------------------------
# a fitted surrogate in numpy alone
# ------------------------------------------------------------------------------------------------

class PortableGP:
    """The prediction of a fitted ResidualGP (StandardScaler + GaussianProcessRegressor with
    ConstantKernel * RBF(ARD) + WhiteKernel, normalize_y) in numpy alone, so that loading and
    using a calibration file does not import scikit-learn (~0.7 s of a 2-core machine's start-up).
    The file stores `state_of(gp)`: plain floats and arrays."""

    KIND = "rbf_ard+white/v1"

    def __init__(self, state: Mapping[str, Any]):
        if state.get("kind") != self.KIND:
            raise CalibrationError(f"unknown surrogate kind {state.get('kind')!r}; refit with 'advisor fit'")
        self.state = dict(state)

    @staticmethod
    def state_of(gp: "ResidualGP | PortableGP") -> dict:
        if isinstance(gp, PortableGP):
            return gp.state
        scaler, reg = gp.model[0], gp.model[-1]
        k = reg.kernel_
        const, rbf, white = k.k1.k1, k.k1.k2, k.k2
        names = [type(x).__name__ for x in (k, k.k1, const, rbf, white)]
        if names != ["Sum", "Product", "ConstantKernel", "RBF", "WhiteKernel"]:  # pragma: no cover
            raise CalibrationError(f"surrogate kernel {k} is not ConstantKernel * RBF + WhiteKernel")
        L_inv = np.linalg.solve(reg.L_, np.eye(len(reg.L_)))  # lower triangular: V = L^-1 K*^T
        return {"kind": PortableGP.KIND, "kernel": str(k),
                "x_mean": np.asarray(scaler.mean_, float), "x_scale": np.asarray(scaler.scale_, float),
                "x_train": np.asarray(reg.X_train_, float), "alpha": np.asarray(reg.alpha_, float).ravel(),
                "L_inv": L_inv, "y_mean": float(np.ravel(reg._y_train_mean)[0]),
                "y_std": float(np.ravel(reg._y_train_std)[0]), "constant": float(const.constant_value),
                "length_scale": np.broadcast_to(np.asarray(rbf.length_scale, float), (reg.X_train_.shape[1],)).copy(),
                "noise": float(white.noise_level)}

    @property
    def kernel(self) -> str:
        return self.state["kernel"]

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, standard deviation) of the residual at each row of X, as scikit-learn's
        predict(return_std=True) computes them."""
        d = self.state
        Z = (np.asarray(X, float) - d["x_mean"]) / d["x_scale"]
        A, B = Z / d["length_scale"], d["x_train"] / d["length_scale"]
        sq = (A ** 2).sum(1)[:, None] + (B ** 2).sum(1)[None, :] - 2.0 * A @ B.T
        K = d["constant"] * np.exp(-0.5 * np.maximum(sq, 0.0))  # the white kernel is 0 off the diagonal
        mu = K @ d["alpha"] * d["y_std"] + d["y_mean"]
        V = d["L_inv"] @ K.T
        var = np.maximum(d["constant"] + d["noise"] - np.einsum("ij,ij->j", V, V), 0.0)
        return mu, np.maximum(np.sqrt(var) * d["y_std"], 1e-9)


# ------------------------------------------------------------------------------------------------
# the fitted calibration
# ------------------------------------------------------------------------------------------------

@dataclass
class CalibratedPrediction(Prediction):
    """A Prediction after calibration, with the measured-style throttle fraction and intervals
    ({target: [lo, hi]} at `intervals_level`)."""

    intervals: dict = field(default_factory=dict)
    intervals_level: float = LEVEL
    calibration: dict = field(default_factory=dict)  # file and the level used per target


@dataclass
class Calibration:
    constants: Constants
    targets: dict[str, dict]
    surrogates: dict[str, ResidualGP | None]
    trained_on: dict = field(default_factory=dict)
    cv: dict = field(default_factory=dict)
    fit_info: dict = field(default_factory=dict)
    feature_names: tuple[str, ...] = FEATURE_NAMES
    source: str = ""
    # out-of-fold predictions of the fit that made this ({"source", "y", "levels"}); not saved
    oof: dict = field(default_factory=dict, repr=False)
    # the profile's name (the shipped "te" / "local", or what `advisor fit --profile-name` gave)
    profile: str = "custom"
    # the constants the fit adjusted, with their bounds (None: advisor fit's FIT_BOUNDS)
    fitted_bounds: dict | None = None
    # the constants the fit started from (None: the defaults)
    base_constants: Constants | None = None

    @property
    def screening_constants(self) -> Constants:
        """Constants whose memory prediction matches the level used for memory (for a fast
        memory screen before `rescore`)."""
        return DEFAULT if self.targets["memory_gib_per_gpu"]["mode"] == "analytical" else self.constants

    # ---- prediction ----------------------------------------------------------------------------
    def predict(self, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig,
                check_legal: bool = True) -> CalibratedPrediction:
        return self.predict_many(model, cluster, [cfg], check_legal)[0]

    def predict_many(self, model: ModelSpec, cluster: ClusterSpec, cfgs: Sequence[TrainConfig],
                     check_legal: bool = True,
                     calibrated: Sequence[Prediction] | None = None) -> list[CalibratedPrediction]:
        """Calibrated predictions of several layouts of one model on one cluster (the surrogates
        run once on all of them). `calibrated`: the analytical predictions of `cfgs` under this
        calibration's constants when the caller has them already (recommend ranks with them)."""
        if not cfgs:
            return []
        need_default = any(v["mode"] == "analytical" for v in self.targets.values())
        cal = (list(calibrated) if calibrated is not None else
               [predict(model, cluster, cfg, self.constants, check_legal=check_legal) for cfg in cfgs])
        dft = ([predict(model, cluster, cfg, DEFAULT, check_legal=False) for cfg in cfgs]
               if need_default else cal)
        X = np.array([features(model, cluster, cfg, p) for cfg, p in zip(cfgs, cal)])
        est: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # target -> value, lo, hi
        for t, spec in self.targets.items():
            mode = spec["mode"]
            base = np.array([target_values(p, cluster)[t] for p in (dft if mode == "analytical" else cal)])
            iv = spec["interval"]
            if mode == "surrogate" and self.surrogates.get(t) is not None:
                mu, sd = self.surrogates[t].predict(X)
                v = apply_residual(t, base, mu)
                half = iv["k"] * np.maximum(sd, iv.get("sd_floor", 0.0))  # version-1 files: no floor
                lo, hi = apply_residual(t, base, mu - half), apply_residual(t, base, mu + half)
            else:
                v = apply_residual(t, base, 0.0) if t in ADDITIVE else base
                lo, hi = apply_residual(t, base, iv["lo"]), apply_residual(t, base, iv["hi"])
            est[t] = (v, np.minimum(lo, hi), np.maximum(lo, hi))
        out = []
        for i, (cfg, p) in enumerate(zip(cfgs, cal)):
            out.append(self._compose(model, cluster, cfg, p, {t: tuple(float(a[i]) for a in e) for t, e in est.items()}))
        return out

    @property
    def power_constants(self) -> Constants:
        """The constants of the level chosen for mean power (every power number comes from them)."""
        return DEFAULT if self.targets["mean_power_w"]["mode"] == "analytical" else self.constants

    def power_of(self, model, cluster, cfg, step_s: float, analytical: Prediction | None = None):
        """The models.power evaluation behind a calibrated prediction's power numbers: at the
        analytical level the analytical model's own (its step, default constants); otherwise
        power_at_step at the calibrated step time with the calibrated constants."""
        if self.targets["mean_power_w"]["mode"] == "analytical":
            from advisor.models.power import estimate_power

            return estimate_power(model, cluster, cfg, DEFAULT)
        return power_at_step(model, cluster, cfg, step_s, self.constants)

    def _compose(self, model, cluster, cfg, p: Prediction, est: dict, pw=None) -> CalibratedPrediction:
        """`p`: the analytical prediction with the calibrated constants. Every power field comes
        from one models.power evaluation (power_of, or `pw` when the caller has evaluated it:
        models.vectorized); energy per token is its mean power x GPUs over the tokens/s printed."""
        n = cluster.world_size
        tokens = cfg.tokens_per_step
        tps, tps_lo, tps_hi = est["tokens_per_s_per_gpu"]
        mem, mem_lo, mem_hi = est["memory_gib_per_gpu"]
        step = tokens / (tps * n)
        tflops = tps * training_flops_per_token(model, cfg.seq) / 1e12
        scale = mem / p.memory_gib_per_gpu if p.memory_gib_per_gpu else 1.0
        cap = self.constants.usable_memory_gib(cluster.gpu.memory_gib)
        feasible = mem <= cap
        reason = "" if feasible else (f"needs {mem:.1f} GiB (calibrated) > {cap:.1f} GiB usable per GPU")
        d = {f.name: getattr(p, f.name) for f in dataclasses.fields(Prediction)}
        pw = self.power_of(model, cluster, cfg, step) if pw is None else pw
        d.update(power_fields(pw))
        d.update(feasible=feasible, reason=reason, tokens_per_s_per_gpu=tps, step_time_s=step,
                 tflops_per_gpu=tflops, mfu=tflops / mfu_peak_tflops(model, cfg.seq, cluster.gpu, cfg.quant_code),
                 memory_gib_per_gpu=mem,
                 memory_per_stage_gib=[s * scale for s in p.memory_per_stage_gib],
                 energy_j_per_token=pw.mean_power_w * n * step / tokens)
        iv = {t: [e[1], e[2]] for t, e in est.items()}
        printed = target_values(Prediction(**d), cluster)
        for t in POWER_TARGETS:  # around the values printed (their residuals are of this level)
            spec = self.targets[t]["interval"]
            if "lo" not in spec:  # a surrogate's band (files from before power came from one model)
                continue
            lo, hi = apply_residual(t, printed[t], spec["lo"]), apply_residual(t, printed[t], spec["hi"])
            iv[t] = [float(min(lo, hi)), float(max(lo, hi))]
        iv["step_time_s"] = [tokens / (tps_hi * n), tokens / (tps_lo * n)]
        return CalibratedPrediction(**d, intervals=iv, intervals_level=LEVEL,
                                    calibration={"file": self.source, "profile": self.profile,
                                                 "levels": {t: v["mode"] for t, v in self.targets.items()}})

    def rescore(self, model: ModelSpec, cluster: ClusterSpec,
                pairs: Sequence[tuple[TrainConfig, Prediction]],
                with_constants: bool = False) -> list[tuple[TrainConfig, Prediction]]:
        """Replace analytical predictions by calibrated ones (for recommend); layouts the
        calibrated memory says do not fit are dropped unless none would remain.
        `with_constants`: the pairs' predictions were made with this calibration's constants
        (they are reused instead of computed again)."""
        cfgs = [cfg for cfg, _ in pairs]
        preds = self.predict_many(model, cluster, cfgs, check_legal=False,
                                  calibrated=[p for _, p in pairs] if with_constants else None)
        out = list(zip(cfgs, preds))
        fit = [cp for cp in out if cp[1].feasible]
        return fit or out

    # ---- file ----------------------------------------------------------------------------------
    def to_payload(self) -> dict:
        import importlib.metadata as md

        def version(pkg: str) -> str | None:
            try:
                return md.version(pkg)
            except md.PackageNotFoundError:
                return None

        bounds = self.fitted_bounds or FIT_BOUNDS
        base = self.base_constants or DEFAULT
        return {
            "format": FORMAT, "version": VERSION, "profile": self.profile,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "feature_names": list(self.feature_names),
            "constants": self.constants.to_dict(),
            "fitted_constants": {k: {"default": getattr(base, k), "fitted": getattr(self.constants, k),
                                     "bounds": list(bounds[k])} for k in bounds},
            "targets": self.targets,
            "surrogates": {t: PortableGP.state_of(s) for t, s in self.surrogates.items() if s is not None},
            "trained_on": self.trained_on, "cv": self.cv, "fit_info": self.fit_info,
            "versions": {k: version(k) for k in ("scikit-learn", "scipy", "joblib", "numpy")},
        }

    def save(self, path: str | Path) -> None:
        import json

        import joblib

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        payload = self.to_payload()
        joblib.dump(payload, p, compress=3)
        meta = {k: v for k, v in payload.items() if k != "surrogates"}
        meta["surrogates"] = {t: s["kernel"] for t, s in payload["surrogates"].items()}
        p.with_suffix(".json").write_text(json.dumps(meta, indent=1, default=json_default) + "\n")
        self.source = str(p)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        import joblib

        p = Path(path)
        if not p.is_file():
            raise CalibrationError(f"{p}: no such calibration file")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # sklearn version notes; versions are recorded
                d = joblib.load(p)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
            raise CalibrationError(f"{p}: not a readable calibration file ({type(e).__name__})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            fmt = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CalibrationError(f"{p}: not an advisor calibration file (format {fmt!r}, expected {FORMAT!r})")
        if d.get("version") not in READS:
            raise CalibrationError(f"{p}: calibration format version {d.get('version')!r} is not supported "
                                   f"(this advisor reads versions {', '.join(map(str, READS))}); "
                                   f"refit with 'advisor fit'")
        if tuple(d.get("feature_names", ())) != FEATURE_NAMES:
            raise CalibrationError(f"{p}: fitted on other features than this advisor computes; refit with 'advisor fit'")
        known = {f.name for f in dataclasses.fields(Constants)}
        c = Constants(**{k: v for k, v in d["constants"].items() if k in known})
        sur = {t: d["surrogates"].get(t) for t in d["targets"]}
        # version 2: numpy arrays; version 1: ResidualGP objects (scikit-learn was imported to unpickle them)
        sur = {t: PortableGP(s) if isinstance(s, dict) else s for t, s in sur.items()}
        # files written before profiles had names: the shipped default is the local stack's
        profile = d.get("profile") or ("local" if p.resolve() == DEFAULT_FILE.resolve() else "custom")
        # the fitted constants' bounds and starting values, so that a loaded calibration saves as it was
        fitted = {k: v for k, v in (d.get("fitted_constants") or {}).items() if k in known}
        return cls(constants=c, targets=d["targets"], surrogates=sur, trained_on=d.get("trained_on", {}),
                   cv=d.get("cv", {}), fit_info=d.get("fit_info", {}), source=str(p), profile=profile,
                   fitted_bounds={k: tuple(v["bounds"]) for k, v in fitted.items()} or None,
                   base_constants=DEFAULT.replace(**{k: v["default"] for k, v in fitted.items()}) if fitted else None)


def interval_coverage(cal: "Calibration", records: Sequence[Record]) -> dict[str, dict]:
    """How many measured values fall inside the calibration's intervals, per target:
    {target: {"inside", "n", "below", "above"}} over the records that measured it."""
    out = {t: {"inside": 0, "n": 0, "below": 0, "above": 0} for t in TARGETS}
    for r in records:
        p = cal.predict(r.model, r.cluster, r.cfg, check_legal=False)
        for t in TARGETS:
            y = r.y[t]
            if not math.isfinite(y):
                continue
            lo, hi = p.intervals[t]
            c = out[t]
            c["n"] += 1
            c["inside" if lo <= y <= hi else "below" if y < lo else "above"] += 1
    return out


def json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def resolve_calibration(spec: "str | Path | Calibration | None",
                        stack: str | None = None, gpu=None) -> "Calibration | None":
    """None / "none" / "off": no calibration; "default": the shipped profile of `stack` (the default
    stack when None; see advisor.models.profiles) for `gpu`'s generation (a Blackwell GPU: the
    profile fitted on Blackwell rows, where the stack ships one); a stack's name ("te", "local"):
    its profile; a Calibration: itself; anything else: a file path."""
    from advisor.models.profiles import STACKS, get_stack

    if spec is None or isinstance(spec, Calibration):
        return spec
    s = str(spec)
    if s.lower() in ("none", "off", "analytical"):
        return None
    if s.lower() == "default" or s.lower() in STACKS:
        st = get_stack(stack if s.lower() == "default" else s.lower())
        f = st.file_for(gpu)
        return _load_cached(str(f)) if f.is_file() else None
    return Calibration.load(s)


_CACHE: dict[str, "Calibration"] = {}


def _load_cached(path: str) -> "Calibration":
    """Shipped profiles are read once per process (recommend / predict --batch ask many times)."""
    if path not in _CACHE:
        _CACHE[path] = _load_twin(Path(path)) or Calibration.load(path)
    return _CACHE[path]


def _load_twin(path: Path) -> "Calibration | None":
    """A shipped profile without surrogates from the JSON twin `save` writes next to it (the
    same payload but the surrogates' states): no joblib import, a third of a cold command's
    start-up on a small machine. tests/test_vectorized.py checks that both files of every
    shipped profile load to the same calibration. None when the twin is missing or the profile
    has surrogates (their states are only in the joblib file)."""
    import json

    twin = path.with_suffix(".json")
    if not twin.is_file():
        return None
    try:
        d = json.loads(twin.read_text())
    except ValueError:
        return None
    if (d.get("format") != FORMAT or d.get("version") not in READS or d.get("surrogates") != {}
            or tuple(d.get("feature_names", ())) != FEATURE_NAMES):
        return None
    known = {f.name for f in dataclasses.fields(Constants)}
    c = Constants(**{k: v for k, v in d["constants"].items() if k in known})
    profile = d.get("profile") or ("local" if path.resolve() == DEFAULT_FILE.resolve() else "custom")
    return Calibration(constants=c, targets=d["targets"], surrogates={t: None for t in d["targets"]},
                       trained_on=d.get("trained_on", {}), cv=d.get("cv", {}), fit_info=d.get("fit_info", {}),
                       source=str(path), profile=profile)


def format_intervals(p: CalibratedPrediction) -> str:
    """One line: the calibration file and the intervals."""
    units = {"tokens_per_s_per_gpu": ("tokens/s/GPU", "{:,.0f}"), "step_time_s": ("step s", "{:.3g}"),
             "memory_gib_per_gpu": ("GiB", "{:.1f}"), "mean_power_w": ("mean W", "{:.0f}"),
             "peak_power_w": ("peak W", "{:.0f}"), "throttle_fraction": ("throttled", "{:.0%}")}
    parts = [f"{u} {f.format(p.intervals[k][0])}-{f.format(p.intervals[k][1])}"
             for k, (u, f) in units.items() if k in p.intervals]
    src = Path(p.calibration.get("file") or "?").name
    prof = p.calibration.get("profile")
    what = f"profile {prof} ({src})" if prof else f"calibrated ({src})"
    return f"{what}, {p.intervals_level:.0%} intervals: " + ", ".join(parts)

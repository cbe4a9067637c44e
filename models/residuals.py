"""What a calibration's surrogates learn of a target: the residual of a measurement against the
analytical prediction (a log ratio, or a difference for fractions), and its inverse. Below both the
dataset (models/dataset.py, TARGETS) and the calibrated predictions on arrays (models/vectorized.py)."""
from __future__ import annotations

import math

import numpy as np

__all__ = ["ADDITIVE", "apply_residual", "residual"]

ADDITIVE = ("throttle_fraction",)  # targets whose residual is a difference (fractions), not a log ratio


def residual(target: str, measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """What a surrogate learns: log(measured / predicted), or measured - predicted for fractions."""
    if target in ADDITIVE:
        return measured - predicted
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(measured / predicted)


def apply_residual(target: str, predicted, r):
    if type(predicted) is float and type(r) is float:  # one number (a prediction's interval): no numpy
        if target in ADDITIVE:
            return min(max(predicted + r, 0.0), 1.0)
        return predicted * math.exp(r)
    if target in ADDITIVE:
        return np.clip(predicted + r, 0.0, 1.0)
    return predicted * np.exp(r)

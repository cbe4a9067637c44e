"""What recommend optimizes, as named strategies: a layout's score per objective (throughput,
energy, balanced), and the per-GPU power cap chosen from a sweep (as Zeus's OptimumSelector):
``Time`` (the fastest step), ``Energy`` (the least J/token), ``MaxSlowdown`` (the least J/token with
a step within ``slack`` of the fastest). ``OBJECTIVE_CAPS`` names the cap each objective takes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["OBJECTIVES", "TIME_SLACK", "Time", "Energy", "MaxSlowdown", "OBJECTIVE_CAPS", "score_prediction",
           "score_arrays", "rank_order"]

OBJECTIVES = ("throughput", "energy", "balanced")
TIME_SLACK = 0.05  # "within 5% of the fastest step"


# ------------------------------------------------------------------------------------------------
# the cap of a sweep (points: models.power.CapPoint: power_cap_w, step_time_s, energy_j_per_token)
# ------------------------------------------------------------------------------------------------
class Time:
    """The shortest step (steps equal to 1 ns: the lowest cap)."""

    name = "time"

    def select(self, points: Sequence[Any]):
        return min(points, key=lambda p: (round(p.step_time_s, 9), p.power_cap_w))


class Energy:
    """The least J/token (equal energies: the highest cap)."""

    name = "energy"

    def select(self, points: Sequence[Any]):
        return min(points, key=lambda p: (p.energy_j_per_token, -p.power_cap_w))


@dataclass(frozen=True)
class MaxSlowdown:
    """The least J/token among the caps whose step is within `slack` of the fastest one's."""

    slack: float = TIME_SLACK
    name = "max-slowdown"

    def select(self, points: Sequence[Any]):
        fastest = Time().select(points)
        return Energy().select([p for p in points if p.step_time_s <= fastest.step_time_s * (1 + self.slack)])


# the cap each objective ranks a layout at, as models.power.CapSweep's field
OBJECTIVE_CAPS = {"throughput": "fastest", "energy": "min_energy", "balanced": "min_energy_within"}


# ------------------------------------------------------------------------------------------------
# a layout's score (higher is better)
# ------------------------------------------------------------------------------------------------
def score_prediction(p, objective: str, best_tps: float, best_energy: float) -> float:
    """Higher is better."""
    if objective == "throughput":
        # within 1% of each other, prefer the layout less likely to throttle
        return p.tokens_per_s_per_gpu * (1.0 - 0.01 * p.throttle_risk)
    if objective == "energy":
        return -p.energy_j_per_token * (1.0 + 0.01 * p.throttle_risk)
    return (0.5 * math.log(p.tokens_per_s_per_gpu / best_tps) + 0.5 * math.log(best_energy / p.energy_j_per_token)
            - 0.05 * p.throttle_risk)


def score_arrays(tps, energy, risk, objective: str, best_tps: float, best_e: float):
    """score_prediction on arrays (the same formulas)."""
    if objective == "throughput":
        return tps * (1.0 - 0.01 * risk)
    if objective == "energy":
        return -energy * (1.0 + 0.01 * risk)
    return 0.5 * np.log(tps / best_tps) + 0.5 * np.log(best_e / energy) - 0.05 * risk


def rank_order(score, L):
    """Rows by descending score, equal scores by layout key (as sorted(key=(-score, key)))."""
    order = np.argsort(-score, kind="stable")
    s = score[order]
    out = order.copy()
    i, n = 0, len(order)
    while i < n:
        j = i + 1
        while j < n and s[j] == s[i]:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(order[i:j], key=L.key)
        i = j
    return out

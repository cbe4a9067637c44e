"""recommend's screen on the columns of every legal layout (issue #27): first what the stack's runner
cannot run is left out (advisor.search_spaces.runnable, counted by rule), then what does not fit in
memory: a layout fits when the upper bound of its memory interval (advisor.models.memory_band) is
under the usable memory; of one layout's recompute modes only the cheapest that fits is ranked
(more recompute only adds work), the others count as fitting."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from advisor.catalog import ClusterSpec, ModelSpec, SpecError
from advisor.models import memory_band as MB
from advisor.models.memory_band import band_upper_many
from advisor.models.constants import Constants
from advisor.search_spaces.runnable import left_out_line, refused

RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}  # extra work per step, in this order


class NoFeasibleLayout(SpecError):
    """The model fits nowhere on the cluster."""


@dataclass
class Screened:
    keep: np.ndarray  # rows of the columns that are ranked
    feasible: int  # layouts that run and fit (with the recompute modes that are not ranked)
    margin: float
    left_out: dict = field(default_factory=dict)  # {"count", "by_rule", "line"}: what the runner cannot run


def screen(m: ModelSpec, c: ClusterSpec, L_all, constants: Constants, stack: str, margin: float | None) -> Screened:
    margin = MB.default_margin(constants.memory_margin_gib, c.gpu.memory_gib) if margin is None else MB.check_margin(margin)
    bad, by_rule = refused(m, L_all, stack)
    left = {"count": int(bad.sum()), "by_rule": by_rule, "line": left_out_line(stack, by_rule)}
    runs = np.flatnonzero(~bad)
    if not len(runs):
        raise NoFeasibleLayout(f"none of the {len(L_all):,} legal layouts of {m.name} on {c.name} can be run by "
                               f"the {stack} stack's runner: {left['line']}")
    L = L_all.take(runs)
    band = MB.band(stack, m.is_moe)
    # each stage with its own outside term; with expandable segments on, the allocator's cache past
    # what it could not give back when pressed is not counted (Band.rf_pressure_expandable_gib)
    mems, upper, tight, outside = band_upper_many(m, L, band, constants, under_pressure=True, gpu=c.gpu)
    fit = (upper <= MB.usable_gib(c.gpu.memory_gib, margin)).tolist()
    # the layout but its recompute mode (recompute varies fastest): a new group where any other column changes
    fsdp = L.fsdp if L.fsdp is not None else np.zeros(len(L.tp), bool)
    but = np.stack([L.tp, L.pp, L.dp, L.cp, L.ep, L.etp, L.vp, L.mbs, L.dist_opt, L.split, fsdp], 1)
    group = np.concatenate([[0], np.cumsum(np.any(but[1:] != but[:-1], axis=1))]).tolist()
    costs = np.array([RECOMPUTE_COST[r] for r in ("none", "selective", "full")])[L.recompute].tolist()
    feasible = 0
    keep: list[int] = []
    fits_with = (None, math.inf)  # (layout but recompute, the cheapest recompute that fits it)
    for i in range(len(L)):
        key, cost = group[i], costs[i]
        if key == fits_with[0] and cost > fits_with[1]:
            feasible += 1  # recompute only costs time: with a cheaper mode fitting, this one fits and is slower
            continue
        if not fit[i]:
            continue
        feasible += 1
        fits_with = (key, cost)
        keep.append(i)
    if not keep:
        i = int(np.argmin(upper))
        need = float(upper[i])
        raise NoFeasibleLayout(
            f"{m.name} fits nowhere on {c.name}: the smallest layout needs up to {need:.1f} GiB per GPU "
            f"({float(tight[i]):.1f} predicted in torch's allocator + {float(outside[i]):.1f} outside it, "
            f"{L.config(i).key()}) but a {c.gpu.name} has "
            f"{MB.usable_gib(c.gpu.memory_gib, margin):.1f} GiB usable ({1 - margin:.0%} of {c.gpu.memory_gib:.1f}); "
            f"use more GPUs or a bigger GPU")
    return Screened(keep=runs[np.array(keep)], feasible=feasible, margin=margin, left_out=left)

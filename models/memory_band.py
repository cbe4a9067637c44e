"""The stated uncertainty of a memory prediction and the rule that says a layout fits (issue #27).

A memory prediction is the fullest pipeline stage's peak per GPU as torch's caching allocator holds
it, A (models.memory: StageMemory.total_gib), and, beside it, the memory outside the allocator, U
(CUDA context, NCCL communicators: models/outside_memory.py, StageMemory.outside_gib, a physical
term measured on its own). A is two physical quantities with errors of their own: what the tensors
allocate, A - R, and what the caching allocator holds reserved but unallocated, R
(StageMemory.reserved_free_gib, models/allocator_memory.py). The runs measure both (torch's peak
allocated and peak reserved memory), so the band has two parts, each fitted on its own residuals:
- allocated: lo / hi = the smallest and largest measured / predicted allocated peak over the
  measured runs of the stack (separately dense and MoE), or, where the residual is additive rather
  than proportional (the fit keeps the form with the smaller leave-one-architecture-out error),
  affine: measured = b * (A - R) + a by least squares, lo = hi = b and add_lo / add_hi = a plus
  the smallest / largest residual in GiB;
- reserved but unallocated, with expandable segments off (torch's default; per stack and class):
  lines in the predicted R, [rf_lo_scale R + rf_lo, rf_hi_scale R + rf_hi], the upper one never
  under R itself. Stranded memory is made of freed blocks no later request can reuse, so what a
  layout can strand grows with the sizes of the blocks it frees and allocates again (the loss
  stage's logits, a dense layer's FC1 output, a dropless MoE layer's token buffers: what R is made
  of, models/allocator_memory.py), not by a fixed amount whatever the layout. The lines hold every
  run's measured reserved-but-unallocated memory; their form is the one of R + constant (slope 1),
  ratio (no intercept) and affine (the tightest lines of slope >= 0, least total slack) that holds
  the most runs leave-one-architecture-out (bench/memory_edge.py reserved_part).
  Two sets of lines per stack and class, by the step's allocation sequence (periodic_layout): with
  PP = 1 and CP = 1 every micro-batch allocates and frees the same tensors in the same order
  (megatron-core's forward_backward_no_pipelining: forward then backward), so once the first has
  run each freed block is asked for again at its size and little strands: those layouts get the
  narrower of the lines fitted on those runs alone (rf_periodic, used where they span 2
  architectures or more) and the lines of every run; a pipeline (1F1B warm-up and cool-down, the
  interleaved schedule's chunks) or CP (Transformer Engine's ring attention allocates each step's
  tensors on a second CUDA stream, and the caching allocator pools blocks per stream) puts
  allocations of other sizes between a block's free and its next request, as a dropless MoE's
  token buffers do whose sizes follow the routing (they change every micro-batch), and those
  layouts get the lines fitted on every run;
  with expandable segments on (rf_lo_expandable / rf_hi_expandable, every stack's runs with them
  on pooled: segments grow by pages and strand nothing, so the term does not depend on the model's
  blocks) R plus the measured - predicted range. A layout with expandable segments on is not
  charged the fragmentation spread of the runs that had them off.
The interval of a prediction is

    [lo (A - R) + add_lo + rf_lo_scale R + rf_lo + U, hi (A - R) + add_hi + rf_hi_scale R + rf_hi + U]

(Band.reserved_free_interval: the periodic layouts' narrower lines; expandable segments: R +
rf_lo_expandable / R + rf_hi_expandable in place of the R terms)

with U counted once: the stage's own outside-allocator term (the first stage holds the most
communicators; the OOM messages' "memory in use" less torch's reserved memory check it: `python
bench/memory_edge.py --outside`). recommend bounds every stage so (band_upper_many)
and a layout fits when every stage does. Fitted on the records of data/measurements/ (`python
bench/memory_edge.py --fit`, written to models/data/memory_band.json with the command). A stack
with no measured run has the band [1, 1] and says so.

With expandable segments on, the reserved-but-unallocated memory is mostly cache the allocator gives
back when an allocation would fail (it unmaps free pages and retries): pressed with a ballast
(bench/allocator_pressure.py), every measured layout ran once it had 2.5 GiB beyond its peak
allocated, where unpressed the same layouts held 2.3-10 GiB, at 0-39% of their speed in allocator
retries. So the verdict (recommend's screen, memory_fit's "fits") takes the upper line no higher than
rf_pressure_expandable_gib there (under_pressure=True), with the usable memory's margin on top of it;
the unpressed line says whether the allocator may keep all it caches (memory_fit's
fits_without_retries).

A layout fits when the upper bound is at most the usable memory: the GPU's memory less a margin
(`--memory-margin`, a fraction of the GPU's memory; default Constants.memory_margin_gib of it, 4 GiB).
Works on floats and on numpy arrays alike (recommend's array path and the per-layout path use the
same function, so they cannot disagree).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from advisor.catalog.specs import GPUSpec, ModelSpec, SpecError, TrainConfig
from advisor.models.allocator_memory import moe_buffer_bytes
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import memory_arrays
from advisor.models.stages import Stages, memo_for
from advisor.search_spaces.columns import Layouts

BAND_FILE = Path(__file__).parent / "data" / "memory_band.json"
FORMAT = "advisor.memory_band/7"  # 7: expandable segments' spread per schedule (6: pooled; 5: a constant GiB range)
CLASSES = ("dense", "moe")


@dataclass(frozen=True)
class Band:
    lo: float  # smallest measured / predicted
    hi: float  # largest measured / predicted
    stack: str
    kind: str  # dense / moe
    source: str  # where the numbers come from (the stack's own records, or another stack's)
    add_lo_gib: float = 0.0  # the affine form's additive part of the lower / upper end (GiB)
    add_hi_gib: float = 0.0
    form: str = "ratio"  # "ratio" (add_* = 0) or "affine"
    # reserved but unallocated with expandable segments off: [rf_lo_scale R + rf_lo_gib, rf_hi_scale R + rf_hi_gib]
    rf_lo_gib: float = 0.0
    rf_hi_gib: float = 0.0
    rf_lo_scale: float = 1.0
    rf_hi_scale: float = 1.0
    # the same lines fitted on the runs with a periodic schedule alone (periodic_schedule; None: the above)
    rf_periodic: tuple[float, float, float, float] | None = None  # (lo_scale, lo_gib, hi_scale, hi_gib)
    # measured - predicted reserved but unallocated (GiB) with expandable segments on, every run pooled
    # (the lower line of a non-periodic layout with them on)
    rf_lo_expandable_gib: float = 0.0
    rf_hi_expandable_gib: float = 0.0
    # the same range over the runs with them on and a periodic layout alone (None: fewer than
    # MIN_ARCHITECTURES architectures; such layouts are then bounded as non-periodic ones)
    rf_expandable_periodic: tuple[float, float] | None = None  # (lo_gib, hi_gib)
    # with expandable segments on, the reserved-but-unallocated memory the allocator could not give
    # back when the device filled: every pressed layout ran with this much headroom beside a ballast
    # (bench/allocator_pressure.py; None: no pressure runs). Past it the cached memory is released
    # (unmapped pages) at the cost of allocator retries, so it bounds whether a layout runs at all,
    # not whether it runs at the predicted speed (interval(..., under_pressure=True)).
    rf_pressure_expandable_gib: float | None = None

    def interval(self, predicted_gib, outside_gib, reserved_free_gib, expandable, periodic=False,
                 reserved_free_off_gib=None, under_pressure=False):
        """(lower, upper) GiB on the device of a predicted allocator peak (floats or arrays): its
        allocated part (predicted - reserved_free_gib) scaled by lo / hi plus add_lo / add_hi, the
        reserved-but-unallocated term's envelope for the allocator setting (`expandable`: expandable
        segments on) and the schedule (`periodic`: periodic_schedule), plus the memory outside the
        allocator (models/outside_memory.py) once. `reserved_free_off_gib`: the term the caching
        allocator would hold with expandable segments off (StageMemory.reserved_free_off_gib; None:
        reserved_free_gib), which bounds a non-periodic layout's with them on. `under_pressure`: the
        bound on whether the layout runs at all, with the allocator giving back its cache (allocator
        retries) where expandable segments are on (rf_pressure_expandable_gib)."""
        x = np.asarray(expandable, bool)
        alloc = predicted_gib - reserved_free_gib
        rf_lo, rf_hi = self.reserved_free_interval(reserved_free_gib, x, periodic, reserved_free_off_gib, under_pressure)
        lo = alloc * self.lo + self.add_lo_gib + rf_lo + outside_gib
        hi = alloc * self.hi + self.add_hi_gib + rf_hi + outside_gib
        if np.ndim(lo) == 0:
            return float(lo), float(hi)
        return lo, hi

    def reserved_free_interval(self, reserved_free_gib, expandable, periodic=False, reserved_free_off_gib=None,
                               under_pressure=False):
        """(lower, upper) GiB of the reserved-but-unallocated memory of a predicted term R (floats
        or arrays): expandable segments off, the lines rf_*_scale R + rf_*_gib (where `periodic`, the
        narrower of them and those fitted on the periodic-schedule runs, which hold those runs both),
        the upper one never under R itself (a line of slope
        < 1 is not extrapolated below the term's own prediction past the measured R). On: a periodic
        layout, R plus the periodic runs' measured - predicted range (rf_expandable_periodic); any
        other, from R plus every run's smallest measured - predicted up to the expandable-off upper
        line (every run's lines, not the periodic ones) at the layout's expandable-off term R_off
        (`reserved_free_off_gib`; None: R): a segment that grows by pages strands no tail, but the
        holes between live blocks stay reserved, a subset of what the caching allocator strands
        on the same layout. `under_pressure` (expandable segments on): the upper line no higher than
        what the allocator could not give back when pressed (rf_pressure_expandable_gib)."""
        x = np.asarray(expandable, bool)
        p = np.asarray(periodic, bool)
        r = np.asarray(reserved_free_gib, float)
        r_off = r if reserved_free_off_gib is None else np.asarray(reserved_free_off_gib, float)
        lo = self.rf_lo_scale * r + self.rf_lo_gib
        hi = self.rf_hi_scale * r + self.rf_hi_gib
        hi_off = np.maximum(self.rf_hi_scale * r_off + self.rf_hi_gib, r_off)  # every run's line at R_off
        if self.rf_periodic is not None:  # both lines hold the periodic runs: the narrower of the two
            pls, plg, phs, phg = self.rf_periodic
            lo = np.where(p, np.maximum(lo, pls * r + plg), lo)
            hi = np.where(p, np.minimum(hi, phs * r + phg), hi)
        x_lo, x_hi = r + self.rf_lo_expandable_gib, np.maximum(hi_off, r)
        if self.rf_expandable_periodic is not None:
            elo, ehi = self.rf_expandable_periodic
            x_lo, x_hi = np.where(p, r + elo, x_lo), np.where(p, r + ehi, x_hi)
        if under_pressure and self.rf_pressure_expandable_gib is not None:
            x_hi = np.minimum(x_hi, np.maximum(r, self.rf_pressure_expandable_gib))
            x_lo = np.minimum(x_lo, x_hi)
        lo = np.where(x, x_lo, lo)
        hi = np.where(x, x_hi, np.maximum(hi, r))
        if np.ndim(lo) == 0:
            return float(lo), float(hi)
        return lo, hi


def periodic_schedule(pp, cp):
    """Whether a layout's schedule allocates the same tensors in the same order every micro-batch
    (floats or arrays): PP = 1 (no pipeline schedule) and CP = 1 (no ring-attention steps on a second
    stream). A dropless MoE stage whose buffers follow the routing is not periodic whatever its
    schedule (periodic_layout; band_upper_many per stage)."""
    return (np.asarray(pp) == 1) & (np.asarray(cp) == 1)


def periodic_layout(model, cfg) -> bool:
    """periodic_schedule, and no MoE token buffer whose size follows the routing
    (allocator_memory.moe_buffer_bytes: their sizes change every micro-batch)."""
    return bool(periodic_schedule(cfg.pp, cfg.cp)) and moe_buffer_bytes(model, cfg) == 0.0


@lru_cache(maxsize=4)
def _load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: no memory band file (make it: python bench/memory_edge.py --fit)")
    d = json.loads(p.read_text(encoding="utf-8"))
    if d.get("format") != FORMAT:
        raise SpecError(f"{p}: format {d.get('format')!r}, expected {FORMAT!r}")
    return d


def band(stack: str | None, is_moe: bool, path: str | Path = BAND_FILE) -> Band:
    """The band of a stack's dense or MoE predictions (a custom profile: the default stack's). A
    stack without measured runs in data/ has the width-0 band [1, 1] and says so (`unmeasured`):
    another stack's residuals measure another model's error, not this one's."""
    d = _load(str(path))
    stacks = d["stacks"]
    name = stack if stack in stacks else d["default_stack"]
    s = stacks[name]
    src = f"measured runs of the {name} stack ({s['records']})" if "unmeasured" not in s else s["unmeasured"]
    k = CLASSES[bool(is_moe)]
    b = s[k]
    x = s.get("expandable", {})
    p = b.get("periodic")
    rf_periodic = None if p is None or not p.get("used", True) else (p["rf_lo_scale"], p["rf_lo_gib"], p["rf_hi_scale"], p["rf_hi_gib"])
    xp = x.get("periodic")
    x_periodic = None if xp is None or not xp.get("used", True) else (xp["rf_lo_gib"], xp["rf_hi_gib"])
    return Band(lo=b["lo"], hi=b["hi"], stack=name, kind=k, source=src,
                add_lo_gib=b.get("add_lo_gib", 0.0), add_hi_gib=b.get("add_hi_gib", 0.0), form=b.get("form", "ratio"),
                rf_lo_gib=b.get("rf_lo_gib", 0.0), rf_hi_gib=b.get("rf_hi_gib", 0.0),
                rf_lo_scale=b.get("rf_lo_scale", 1.0), rf_hi_scale=b.get("rf_hi_scale", 1.0), rf_periodic=rf_periodic,
                rf_lo_expandable_gib=x.get("rf_lo_gib", 0.0), rf_hi_expandable_gib=x.get("rf_hi_gib", 0.0),
                rf_expandable_periodic=x_periodic,
                rf_pressure_expandable_gib=(x.get("pressure") or {}).get("cap_gib"))


def default_margin(memory_margin_gib: float, gpu_memory_gib: float) -> float:
    """The default margin as a share of the GPU's memory: Constants.memory_margin_gib of it."""
    return min(memory_margin_gib / gpu_memory_gib, 0.5)


def check_margin(margin: float) -> float:
    if not (isinstance(margin, (int, float)) and np.isfinite(margin) and 0.0 <= margin <= 0.5):
        raise SpecError(f"--memory-margin must be a fraction of the GPU's memory in [0, 0.5], got {margin!r}")
    return float(margin)


def usable_gib(gpu_memory_gib: float, margin: float) -> float:
    """The memory a layout's upper bound must stay under."""
    return gpu_memory_gib * (1.0 - margin)


def fits(predicted_gib, outside_gib, reserved_free_gib, expandable, b: Band, gpu_memory_gib: float, margin: float,
         periodic=False, reserved_free_off_gib=None, under_pressure=True):
    """True (or a boolean array) where the upper bound of the prediction is under usable memory: the
    verdict's bound (under_pressure, recommend's screen) by default."""
    return (b.interval(predicted_gib, outside_gib, reserved_free_gib, expandable, periodic, reserved_free_off_gib,
                       under_pressure)[1] <= usable_gib(gpu_memory_gib, margin))


def memory_fit(predicted_gib: float, per_stage_gib, outside_per_stage_gib, reserved_free_per_stage_gib,
               expandable: bool, b: Band, gpu_memory_gib: float, margin: float, periodic: bool = False,
               reserved_free_off_per_stage_gib=None) -> dict:
    """What recommend / predict say about one layout's memory: each stage's interval (the band on
    its allocator peak and its reserved-but-unallocated term, plus its own memory outside the
    allocator), the usable memory, and for the stage whose upper bound is largest (the tightest
    stage) its interval and the headroom (usable - upper bound; negative: does not fit).
    `reserved_free_off_per_stage_gib`: each stage's term with expandable segments off (None: the
    reserved_free terms), which bounds a non-periodic layout's with them on."""
    offs = reserved_free_off_per_stage_gib or reserved_free_per_stage_gib
    los, his = b.interval(np.asarray(per_stage_gib, float), np.asarray(outside_per_stage_gib, float),
                          np.asarray(reserved_free_per_stage_gib, float), expandable, periodic, np.asarray(offs, float))
    k = int(np.argmax(his))
    lo, hi = float(los[k]), float(his[k])
    rlo, rhi = b.reserved_free_interval(reserved_free_per_stage_gib[k], expandable, periodic, offs[k])
    usable = usable_gib(gpu_memory_gib, margin)
    pressed = float(np.max(b.interval(np.asarray(per_stage_gib, float), np.asarray(outside_per_stage_gib, float),
                                      np.asarray(reserved_free_per_stage_gib, float), expandable, periodic,
                                      np.asarray(offs, float), under_pressure=True)[1]))
    return {"predicted_gib": float(predicted_gib), "outside_gib": float(outside_per_stage_gib[k]),
            "interval_gib": [float(lo), float(hi)],
            # usable less the unpressed upper end where that fits, else less the verdict's bound
            "usable_gib": usable, "margin": margin, "headroom_gib": usable - (float(hi) if hi <= usable else pressed),
            # the verdict: the upper bound with the cache the allocator gives back when pressed
            # (expandable segments on; = the interval's upper end with them off)
            "fits": bool(pressed <= usable), "tightest_stage": k, "upper_under_pressure_gib": pressed,
            # and whether the allocator may hold all it caches unpressed (no allocator retries)
            "fits_without_retries": bool(hi <= usable),
            "band": {"lo": b.lo, "hi": b.hi, "add_lo_gib": b.add_lo_gib, "add_hi_gib": b.add_hi_gib,
                     "form": b.form, "kind": b.kind, "source": b.source,
                     "reserved_free_gib": float(reserved_free_per_stage_gib[k]), "expandable_segments": bool(expandable),
                     "pressure_expandable_gib": b.rf_pressure_expandable_gib,
                     "periodic_schedule": bool(periodic),
                     "reserved_free_interval_gib": [float(rlo), float(rhi)]}}


def fit_line(mf: dict) -> str:
    """One line for the terminal."""
    lo, hi = mf["interval_gib"]
    line = (f"{mf['predicted_gib']:.1f} GiB + {mf['outside_gib']:.1f} outside the allocator ({lo:.1f}-{hi:.1f}) on stage {mf['tightest_stage']}, "
            f"usable {mf['usable_gib']:.1f} GiB (margin {mf['margin']:.0%}): headroom {mf['headroom_gib']:+.1f} GiB")
    if mf["fits"] and not mf.get("fits_without_retries", True):
        line += (f" with {mf['upper_under_pressure_gib']:.1f} GiB as the bound: counts on the allocator giving back up "
                 f"to {hi - mf['upper_under_pressure_gib']:.1f} GiB of its cache (expandable segments; with only "
                 f"{mf['band'].get('pressure_expandable_gib') or 0:.1f} GiB to spare the pressed runs retried, 0-39% "
                 f"slower: bench/allocator_pressure.py)")
    return line


def band_upper_many(model: ModelSpec, L: Layouts, band, c: Constants = DEFAULT, under_pressure: bool = False,
                    gpu: GPUSpec | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every row of L: (the fullest stage's allocator peak, the largest band upper bound over its
    stages, and that stage's allocator peak and memory outside the allocator). Each stage's bound is
    the band (Band.interval) on its own allocator peak and reserved-but-unallocated
    term (with the spread of its allocator setting and its schedule, periodic_schedule)
    plus its own memory outside the allocator (the first stage holds more communicators than a middle
    one), so a layout fits when every stage does. `gpu`: the GPU the FP8 weights' copies depend on
    (memory.memory_arrays; None: Hopper-like)."""
    S = Stages(L)
    peak, total = memory_arrays(model, L, c, memo_for(model, None, c), S, gpu)
    parts = S.cache["memory"][0]
    outside = parts["outside_gib"]
    xseg = L.xseg[S.row] if L.xseg is not None else np.zeros(len(S.row), bool)
    periodic = periodic_schedule(L.pp, L.cp)[S.row] & ~parts["routing_sized"]
    upper = band.interval(total, outside, parts["reserved_free_gib"], xseg, periodic, parts["reserved_free_off_gib"],
                          under_pressure)[1]
    top = S.start + S.argmax(upper)
    return peak, upper[top], total[top], outside[top]


def band_upper_gib(model: ModelSpec, cfg: TrainConfig, band, c: Constants = DEFAULT, under_pressure: bool = False,
                   gpu: GPUSpec | None = None) -> float:
    """One layout's largest band upper bound over its stages (band_upper_many of one row)."""
    return float(band_upper_many(model, Layouts.of(model, [cfg]), band, c, under_pressure, gpu)[1][0])

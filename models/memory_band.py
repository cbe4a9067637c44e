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
- reserved but unallocated: R plus the smallest / largest measured - predicted (GiB) of the runs
  with the same allocator setting: with expandable segments off (rf_lo / rf_hi, per stack and
  class: fragmentation spreads with the blocks a step frees) or on (rf_lo_expandable /
  rf_hi_expandable, every stack's runs with them on pooled: segments grow by pages and strand
  nothing, so the term does not depend on the model's blocks). A layout with expandable segments
  on is not charged the fragmentation spread of the runs that had them off.
The interval of a prediction is

    [lo (A - R) + add_lo + R + rf_lo + U, hi (A - R) + add_hi + R + rf_hi + U]

with U counted once: the stage's own outside-allocator term (the first stage holds the most
communicators; the OOM messages' "memory in use" less torch's reserved memory check it: `python
bench/memory_edge.py --outside`). recommend bounds every stage so (models.memory.band_upper_many)
and a layout fits when every stage does. Fitted on the records of data/measurements/ (`python
bench/memory_edge.py --fit`, written to models/data/memory_band.json with the command). A stack
with no measured run has the band [1, 1] and says so.

A layout fits when the upper bound is at most the usable memory: the GPU's memory less a margin
(`--memory-margin`, a fraction of the GPU's memory; default 1 - Constants.memory_usable_fraction).
Works on floats and on numpy arrays alike (recommend's array path and the per-layout path use the
same function, so they cannot disagree).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from advisor.catalog.specs import SpecError

BAND_FILE = Path(__file__).parent / "data" / "memory_band.json"
FORMAT = "advisor.memory_band/5"  # 5: allocated and reserved-but-unallocated apart, by allocator setting
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
    # measured - predicted reserved but unallocated (GiB), expandable segments off / on
    rf_lo_gib: float = 0.0
    rf_hi_gib: float = 0.0
    rf_lo_expandable_gib: float = 0.0
    rf_hi_expandable_gib: float = 0.0

    def interval(self, predicted_gib, outside_gib, reserved_free_gib, expandable):
        """(lower, upper) GiB on the device of a predicted allocator peak (floats or arrays): its
        allocated part (predicted - reserved_free_gib) scaled by lo / hi plus add_lo / add_hi, the
        reserved-but-unallocated term plus its measured spread for the allocator setting
        (`expandable`: expandable segments on), plus the memory outside the allocator
        (models/outside_memory.py) once."""
        x = np.asarray(expandable, bool)
        alloc = predicted_gib - reserved_free_gib
        rf_lo = np.where(x, self.rf_lo_expandable_gib, self.rf_lo_gib)
        rf_hi = np.where(x, self.rf_hi_expandable_gib, self.rf_hi_gib)
        lo = alloc * self.lo + self.add_lo_gib + reserved_free_gib + rf_lo + outside_gib
        hi = alloc * self.hi + self.add_hi_gib + reserved_free_gib + rf_hi + outside_gib
        if np.ndim(lo) == 0:
            return float(lo), float(hi)
        return lo, hi


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
    return Band(lo=b["lo"], hi=b["hi"], stack=name, kind=k, source=src,
                add_lo_gib=b.get("add_lo_gib", 0.0), add_hi_gib=b.get("add_hi_gib", 0.0), form=b.get("form", "ratio"),
                rf_lo_gib=b.get("rf_lo_gib", 0.0), rf_hi_gib=b.get("rf_hi_gib", 0.0),
                rf_lo_expandable_gib=x.get("rf_lo_gib", 0.0), rf_hi_expandable_gib=x.get("rf_hi_gib", 0.0))


def default_margin(memory_usable_fraction: float) -> float:
    return 1.0 - memory_usable_fraction


def check_margin(margin: float) -> float:
    if not (isinstance(margin, (int, float)) and np.isfinite(margin) and 0.0 <= margin <= 0.5):
        raise SpecError(f"--memory-margin must be a fraction of the GPU's memory in [0, 0.5], got {margin!r}")
    return float(margin)


def usable_gib(gpu_memory_gib: float, margin: float) -> float:
    """The memory a layout's upper bound must stay under."""
    return gpu_memory_gib * (1.0 - margin)


def fits(predicted_gib, outside_gib, reserved_free_gib, expandable, b: Band, gpu_memory_gib: float, margin: float):
    """True (or a boolean array) where the upper bound of the prediction is under usable memory."""
    return b.interval(predicted_gib, outside_gib, reserved_free_gib, expandable)[1] <= usable_gib(gpu_memory_gib, margin)


def memory_fit(predicted_gib: float, per_stage_gib, outside_per_stage_gib, reserved_free_per_stage_gib,
               expandable: bool, b: Band, gpu_memory_gib: float, margin: float) -> dict:
    """What recommend / predict say about one layout's memory: each stage's interval (the band on
    its allocator peak and its reserved-but-unallocated term, plus its own memory outside the
    allocator), the usable memory, and for the stage whose upper bound is largest (the tightest
    stage) its interval and the headroom (usable - upper bound; negative: does not fit)."""
    uppers = [b.interval(m, o, r, expandable)[1]
              for m, o, r in zip(per_stage_gib, outside_per_stage_gib, reserved_free_per_stage_gib)]
    k = int(np.argmax(uppers))
    lo, hi = b.interval(per_stage_gib[k], outside_per_stage_gib[k], reserved_free_per_stage_gib[k], expandable)
    usable = usable_gib(gpu_memory_gib, margin)
    return {"predicted_gib": float(predicted_gib), "outside_gib": float(outside_per_stage_gib[k]),
            "interval_gib": [float(lo), float(hi)],
            "usable_gib": usable, "margin": margin, "headroom_gib": usable - float(hi),
            "fits": bool(hi <= usable), "tightest_stage": k,
            "band": {"lo": b.lo, "hi": b.hi, "add_lo_gib": b.add_lo_gib, "add_hi_gib": b.add_hi_gib,
                     "form": b.form, "kind": b.kind, "source": b.source,
                     "reserved_free_gib": float(reserved_free_per_stage_gib[k]), "expandable_segments": bool(expandable),
                     "rf_lo_gib": b.rf_lo_expandable_gib if expandable else b.rf_lo_gib,
                     "rf_hi_gib": b.rf_hi_expandable_gib if expandable else b.rf_hi_gib}}


def fit_line(mf: dict) -> str:
    """One line for the terminal."""
    lo, hi = mf["interval_gib"]
    return (f"{mf['predicted_gib']:.1f} GiB + {mf['outside_gib']:.1f} outside the allocator ({lo:.1f}-{hi:.1f}) on stage {mf['tightest_stage']}, "
            f"usable {mf['usable_gib']:.1f} GiB (margin {mf['margin']:.0%}): headroom {mf['headroom_gib']:+.1f} GiB")

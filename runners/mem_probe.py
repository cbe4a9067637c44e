"""Per-phase memory of one training step, as the CUDA caching allocator sees it (issue #27, item 1).
Part of the GPU worker (never imports ``advisor``, nor torch: ``point`` is handed ``torch.cuda``),
so the summary is testable on CPU with fake numbers.

The worker reads ``point`` at named moments of one extra step run after the measured ones (so the
timed steps are untouched): ``start`` (before the model is built), ``built`` (model, gradient
buffers, fp32 main parameters), ``step_start`` (the steady state between steps: + the optimizer's
states), ``forward_backward`` (its peak counter reset just before the step's zero-grad and
forward-backward schedule), ``optimizer`` (reset just before ``optimizer.step()``, read after it).
``start``, ``step_start`` and ``optimizer`` also read ``torch.cuda.mem_get_info`` (the whole device as
the driver sees it), so the memory outside torch's allocator is known before the job's model and
process groups exist (CUDA context, libraries, the world communicator, what earlier jobs of the
same process left) and after its steps (plus the communicators its groups opened).
"""
from __future__ import annotations

GIB = 2 ** 30
# memory_stats() keys read at every point (bytes or counts; the counts are cumulative per process).
STATS = ("num_alloc_retries", "num_ooms", "inactive_split_bytes.all.current",
         "inactive_split_bytes.all.peak")
PHASES = ("forward_backward", "optimizer")


def point(cuda, device: bool = False) -> dict:
    """The allocator's state now: bytes allocated / reserved, their peaks since the last
    reset_peak_memory_stats, a few memory_stats counters, and with ``device`` the device's used
    bytes (total - free, from cudaMemGetInfo: CUDA context, NCCL and library buffers included)."""
    st = cuda.memory_stats()
    out = {"allocated": cuda.memory_allocated(), "max_allocated": cuda.max_memory_allocated(),
           "reserved": cuda.memory_reserved(), "max_reserved": cuda.max_memory_reserved(),
           **{k: st.get(k, 0) for k in STATS}}
    if device:
        free, total = cuda.mem_get_info()
        out["device_used"] = total - free
    return out


def _gib(b: float | None) -> float | None:
    return None if b is None else b / GIB


def _outside(p: dict) -> float | None:
    return _gib(p["device_used"] - p["reserved"]) if "device_used" in p else None


def summarize(points: dict[str, dict]) -> dict:
    """GiB per phase from ``point`` readings (see the module doc for the names).

    static_gib: allocated between steps (weights, gradient buffers, optimizer states, buffers);
    <phase>_peak_gib: the allocator's peak during the phase, <phase>_transient_gib: that peak
    over static; peak_gib / peak_phase: the step's peak (max over phases, not a sum);
    reserved_peak_gib and reserved_over_peak_gib (reserved minus allocated at the peak: the
    caching allocator's cached, fragmented memory); inactive_split_peak_gib: the largest
    inactive-split bytes of a phase; outside_allocator_gib: device used minus reserved after the
    step (CUDA context, NCCL, libraries' own cudaMalloc); outside_start_gib: the same before the
    model was built (None without a device reading there); num_alloc_retries / num_ooms: allocator retries
    (cudaMalloc failed, cache freed, retried) and OOMs from the job's start to the probe's end."""
    static = points["step_start"]["allocated"]
    out: dict = {"built_gib": _gib(points.get("built", {}).get("allocated")), "static_gib": _gib(static)}
    peaks = {}
    for ph in PHASES:
        p = points[ph]
        peaks[ph] = p["max_allocated"]
        out[f"{ph}_peak_gib"] = _gib(p["max_allocated"])
        out[f"{ph}_transient_gib"] = _gib(p["max_allocated"] - static)
    phase = max(PHASES, key=lambda ph: peaks[ph])
    reserved_peak = max(points[ph]["max_reserved"] for ph in PHASES)
    end = points[PHASES[-1]]
    first = points.get("start", points["step_start"])
    out.update(
        peak_gib=_gib(peaks[phase]), peak_phase=phase,
        reserved_peak_gib=_gib(reserved_peak),
        reserved_over_peak_gib=_gib(reserved_peak - peaks[phase]),
        inactive_split_peak_gib=_gib(max(points[ph]["inactive_split_bytes.all.peak"] for ph in PHASES)),
        device_used_gib=_gib(end.get("device_used")),
        outside_allocator_gib=_outside(end),
        outside_start_gib=_outside(points.get("start", {})),
        num_alloc_retries=end["num_alloc_retries"] - first["num_alloc_retries"],
        num_ooms=end["num_ooms"] - first["num_ooms"])
    return out


def per_stage(ranks: dict[int, dict]) -> list[dict] | None:
    """For each pipeline stage, the summary of its rank with the largest step peak, with that
    rank and stage: ``ranks`` maps rank -> {"stage": int, "memory_phases": summary}."""
    best: dict[int, dict] = {}
    for r in sorted(ranks):
        mp, stage = ranks[r].get("memory_phases"), ranks[r].get("stage")
        if not mp or stage is None or mp.get("peak_gib") is None:
            continue
        if stage not in best or mp["peak_gib"] > best[stage]["peak_gib"]:
            best[stage] = {"stage": stage, "rank": r, **mp}
    return [best[s] for s in sorted(best)] or None


def pressure_plan(cuda, headroom_gib: float) -> dict:
    """Allocator pressure (issue #27): how many bytes a ballast tensor must take so that the rest of
    the job can hold at most its peak allocated so far plus ``headroom_gib`` in torch's allocator.
    Read after the warmup steps (the peak and the memory outside the allocator are then steady):
    ballast = device total - outside the allocator - (peak allocated + headroom), where outside =
    device used - reserved. The allocator can satisfy the ballast only by giving back what it caches
    beyond that (reserved but unallocated): whole free segments with expandable segments off, free
    pages with them on. So a job that then runs its steps without an OOM shows that its cached memory
    was releasable; ``num_alloc_retries`` says how often the allocator had to free its cache."""
    free, total = cuda.mem_get_info()
    reserved, peak = cuda.memory_reserved(), cuda.max_memory_allocated()
    outside = (total - free) - reserved
    limit = peak + headroom_gib * GIB
    page = 2 << 20  # whole 2 MiB pages: the ballast's reserved memory is its size
    ballast = max(0, int(total - outside - limit)) // page * page
    return {"headroom_gib": headroom_gib, "total_gib": _gib(total), "outside_gib": _gib(outside),
            "peak_allocated_gib": _gib(peak), "allocated_gib": _gib(cuda.memory_allocated()),
            "reserved_gib": _gib(reserved), "free_gib": _gib(free), "ballast_gib": _gib(ballast),
            "retries_before": cuda.memory_stats().get("num_alloc_retries", 0)}


def pressure_result(cuda, plan: dict, ballast_bytes: int) -> dict:
    """After the measured steps ran beside the ballast (its peak counters reset once the ballast was
    placed): the steps' own peak allocated / reserved (ballast taken out) and the allocator retries
    since the plan (placing the ballast included)."""
    return {**plan, "steps_peak_allocated_gib": _gib(cuda.max_memory_allocated() - ballast_bytes),
            "steps_peak_reserved_gib": _gib(cuda.max_memory_reserved() - ballast_bytes),
            "retries": cuda.memory_stats().get("num_alloc_retries", 0) - plan["retries_before"]}

"""What the caching allocator holds at a step's peak, block by block (issue #27): a summary of
``torch.cuda.memory._snapshot()`` taken around one train step run after the measured ones with
``torch.cuda.memory._record_memory_history`` on. Part of the GPU worker (never imports ``advisor``
nor torch), so it is testable on CPU with a synthetic snapshot.

The worker takes ``before`` (a snapshot right after recording starts: every segment and block
then) and ``after`` (at the step's end: its ``device_traces`` hold every allocator event since).
Replaying the events on ``before``'s blocks gives the exact state at any moment of the step:
``summarize`` reports it at the peak of allocated bytes and at the peak of reserved bytes.

At each peak: allocated, reserved and the cache (reserved - allocated) split into what sits in
segments that hold a live block (``stranded``: the allocator cannot give those bytes back to
the driver, only reuse them for blocks that fit) and whole free segments (``releasable``: freed
and retried when a cudaMalloc fails), the largest free block, and the live blocks allocated
during the step grouped by the code that allocated them (the first frame in megatron-core or
Transformer Engine, else the first frame outside torch). With expandable segments a segment is
one mapped range that grows and shrinks page by page: its free tail can be unmapped, so the
split is reported for ordinary segments only (``expandable`` says which the job used).
"""
from __future__ import annotations

import bisect
import os

GIB = 2 ** 30
TOP = 12  # allocation sites kept per peak
OWN = ("megatron", "transformer_engine", "apex")  # the code whose allocations are named


def site(frames: list[dict] | None) -> str:
    """The allocating code of a block: its first frame in megatron-core / TE, else the first
    frame outside torch, else the innermost frame, as "file.py:line function"; "?" without frames."""
    frames = frames or []
    pick = next((f for f in frames if any(o in f.get("filename", "") for o in OWN)), None)
    if pick is None:
        pick = next((f for f in frames if "/torch/" not in f.get("filename", "")
                     and not f.get("filename", "").startswith("??")), None)
    if pick is None and frames:
        pick = frames[0]  # torch's own code only (e.g. the optimizer's foreach kernels)
    if pick is None:
        return "?"
    return f"{os.path.basename(pick.get('filename', '?'))}:{pick.get('line', 0)} {pick.get('name', '')}".strip()


def _start(before: dict) -> tuple[dict[int, list], dict[int, tuple[int, str]], dict[int, int], bool]:
    """Segments {address: [size, expandable]}, live blocks {address: (size, site)} and blocks freed
    but still in use by a stream {address: size} of a snapshot."""
    segs, live, pending, expandable = {}, {}, {}, False
    for s in before.get("segments", []):
        segs[s["address"]] = [s["total_size"], bool(s.get("is_expandable"))]
        expandable |= bool(s.get("is_expandable"))
        for b in s.get("blocks", []):
            if b.get("state") == "active_allocated":
                live[b["address"]] = (b["size"], "before the step")
            elif b.get("state") == "active_pending_free":
                pending[b["address"]] = b["size"]
    return segs, live, pending, expandable


def _apply(e: dict, segs: dict, live: dict, pending: dict) -> None:
    """One allocator event. torch counts a block out of the allocated bytes when its free is
    requested (free_requested); a block another stream still uses stays in its segment until
    free_completed (pending)."""
    a, n = e.get("action"), e.get("size", 0)
    if a == "alloc":
        live[e["addr"]] = (n, site(e.get("frames")))
    elif a == "free_requested":
        if live.pop(e["addr"], None) is not None:
            pending[e["addr"]] = n
    elif a == "free_completed":
        pending.pop(e["addr"], None)
    elif a == "segment_alloc":
        segs[e["addr"]] = [n, False]
    elif a == "segment_free":
        segs.pop(e["addr"], None)
    elif a == "segment_map":  # expandable segments: pages mapped at addr (part of a larger range)
        segs[e["addr"]] = [n, True]
    elif a == "segment_unmap":
        segs.pop(e["addr"], None)


def _state(segs: dict, live: dict, pending: dict) -> dict:
    """GiB at one moment: allocated, reserved, the cache split by whether its segment holds a
    live block, the largest free block (ordinary segments: their free bytes are contiguous only
    if one block is live; an upper bound), and the step's live blocks by site."""
    starts = sorted(segs)
    used = {s: 0 for s in starts}
    for addr, n in [(a, v[0]) for a, v in live.items()] + list(pending.items()):
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < starts[i] + segs[starts[i]][0]:
            used[starts[i]] += n
    alloc = sum(n for n, _ in live.values())
    reserved = sum(v[0] for v in segs.values())
    ordinary = [s for s in starts if not segs[s][1]]
    stranded = sum(segs[s][0] - used[s] for s in ordinary if used[s] > 0)
    releasable = sum(segs[s][0] for s in ordinary if used[s] == 0)
    by_site: dict[str, list] = {}
    for n, where in live.values():
        if where != "before the step":
            v = by_site.setdefault(where, [0, 0])
            v[0] += n
            v[1] += 1
    top = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:TOP]
    return {"allocated_gib": alloc / GIB, "reserved_gib": reserved / GIB,
            "cache_gib": (reserved - alloc) / GIB,
            "stranded_gib": stranded / GIB, "releasable_gib": releasable / GIB,
            "pending_free_gib": sum(pending.values()) / GIB,
            "segments": len(segs), "segments_with_live_blocks": sum(1 for s in starts if used[s] > 0),
            "live_before_step_gib": sum(n for n, w in live.values() if w == "before the step") / GIB,
            "sites": [{"site": k, "gib": v[0] / GIB, "blocks": v[1]} for k, v in top]}


def summarize(before: dict, after: dict, device: int = 0) -> dict:
    """The step's state at its allocated peak and at its reserved peak (module doc), replaying
    ``after``'s trace for ``device`` on ``before``'s segments and blocks. A peak that the step never
passes (reserved: the segments were all cached by earlier steps) is the step's start."""
    segs, live, pending, expandable = _start(before)
    trace = (after.get("device_traces") or [[]])[device] if after.get("device_traces") else []
    n0 = len((before.get("device_traces") or [[]])[device]) if before.get("device_traces") else 0
    events = trace[n0:]  # the after-snapshot's trace includes the before-snapshot's events
    alloc = sum(n for n, _ in live.values())
    reserved = sum(v[0] for v in segs.values())
    peak_a, i_a, peak_r, i_r = alloc, -1, reserved, -1
    for i, e in enumerate(events):
        a, n = e.get("action"), e.get("size", 0)
        if a == "alloc":
            alloc += n
        elif a == "free_requested":
            alloc -= n
        elif a in ("segment_alloc", "segment_map"):
            reserved += n
        elif a in ("segment_free", "segment_unmap"):
            reserved -= n
        if alloc > peak_a:
            peak_a, i_a = alloc, i
        if reserved > peak_r:
            peak_r, i_r = reserved, i
    out = {"events": len(events), "expandable": expandable,
           "ooms": sum(1 for e in events if e.get("action") == "oom")}
    for name, stop in (("at_allocated_peak", i_a), ("at_reserved_peak", i_r), ("at_end", len(events) - 1)):
        s, lv, pd = {k: list(v) for k, v in segs.items()}, dict(live), dict(pending)
        for e in events[:stop + 1]:
            _apply(e, s, lv, pd)
        out[name] = _state(s, lv, pd)
    return out

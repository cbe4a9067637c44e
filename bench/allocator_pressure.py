"""What torch's caching allocator gives back when the device fills (issue #27).

    python bench/allocator_pressure.py [data/measurements/pressure/*.jsonl]

The pressure runs (runner batch key ``pressure_headroom_gib``: after the warmup steps a ballast
leaves the job its peak allocated so far plus the headroom; runners/megatron_worker.apply_pressure)
say how much of what the allocator holds reserved but unallocated it can release when an allocation
would otherwise fail: a run that finishes its steps beside the ballast needed at most the headroom,
one that runs out of memory needed more. Per layout (expandable segments on / off), the headroom
bracket of what it could not give back, the unpressed twin's reserved-but-unallocated memory (the
same layout in data/measurements/h100x4-te.jsonl), the allocator retries and the step time against
the twin. ``pressure_cap`` is the smallest headroom at which every pressed layout of an allocator
setting ran: with expandable segments on, what the band's reserved-but-unallocated upper line need
not exceed (models.memory_band.Band.rf_pressure_expandable_gib, written by `python
bench/memory_edge.py --fit`); with them off no cap is drawn unless every pressed layout ran.
"""
from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from advisor.catalog.specs import TrainConfig  # noqa: E402
from advisor.runners.records import read_jsonl  # noqa: E402

PRESSURE = sorted(glob.glob(str(ROOT / "data/measurements/pressure/*.jsonl")))
TWINS = [ROOT / "data/measurements/h100x4-te.jsonl"]


def layout_key(r: dict) -> tuple:
    """Model, layers and the layout (TrainConfig.key: records of other sessions carry fewer keys)
    with its allocator setting."""
    c = TrainConfig.from_dict(r["config"])
    return (r["model_name"], r.get("layers"), c.key(), c.expandable_segments)


def load(paths=None) -> list[dict]:
    """Every pressure record (default: data/measurements/pressure/*.jsonl)."""
    return [r for p in (PRESSURE if paths is None else paths) for r in read_jsonl(p)]


def pressed(records: list[dict]) -> list[dict]:
    """One row per pressure record: its layout, allocator setting, headroom, outcome and retries."""
    out = []
    for r in records:
        p = r.get("pressure") or {}
        if not p or r.get("status") not in ("ok", "oom"):
            continue
        ranks = list(p.values())
        head = ranks[0]["headroom_gib"]
        if r["status"] == "ok":
            retries = max(x.get("retries", 0) for x in ranks)
        else:
            retries = max(v.get("num_alloc_retries") or 0 for v in ((r.get("memory") or {}).get("at_failure") or {}).values()) \
                if (r.get("memory") or {}).get("at_failure") else None
        tput = (r.get("throughput") or {}).get("tokens_per_s_per_gpu")
        out.append({"id": r["id"], "key": layout_key(r), "model": r["model_name"], "layers": r.get("layers"),
                    "expandable": bool(r["config"].get("expandable_segments")), "headroom": float(head),
                    "ran": r["status"] == "ok", "retries": retries, "tok_s_gpu": tput if r["status"] == "ok" else None,
                    "ballast_gib": max(x.get("ballast_gib", 0.0) for x in ranks),
                    "layout": r["config"]})
    return out


def brackets(rows: list[dict]) -> dict:
    """Per layout: (largest headroom it ran out of memory at, smallest headroom it ran at)."""
    out: dict = {}
    for x in rows:
        b = out.setdefault(x["key"], {"expandable": x["expandable"], "model": x["model"], "layers": x["layers"],
                                      "layout": x["layout"], "oom_at": 0.0, "ran_at": None, "runs": []})
        b["runs"].append(x)
        if x["ran"]:
            b["ran_at"] = x["headroom"] if b["ran_at"] is None else min(b["ran_at"], x["headroom"])
        else:
            b["oom_at"] = max(b["oom_at"], x["headroom"])
    return out


def pressure_cap(records: list[dict], expandable: bool = True) -> dict | None:
    """The smallest headroom at which every pressed layout of the allocator setting ran (None if
    one never ran: no bound), with the layouts and architectures behind it."""
    bs = [b for b in brackets(pressed(records)).values() if b["expandable"] == expandable]
    if not bs or any(b["ran_at"] is None for b in bs):
        return None
    return {"cap_gib": max(b["ran_at"] for b in bs), "layouts": len(bs),
            "architectures": len({(b["model"].split("[")[0]) for b in bs}),
            "runs": sorted(x["id"] for b in bs for x in b["runs"])}


def twins(paths=TWINS) -> dict:
    """Unpressed runs by layout: (reserved - allocated peak GiB, tokens/s/GPU)."""
    out = {}
    for p in paths:
        for r in read_jsonl(p):
            if r.get("status") != "ok" or not r.get("memory"):
                continue
            m = r["memory"]
            rf = max((a - b) for a, b in zip(m["peak_reserved_gib_per_rank"], m["peak_allocated_gib_per_rank"]))
            rf0, t0 = out.get(layout_key(r), (0.0, None))  # repeats: the largest stranding, the first speed
            out[layout_key(r)] = (max(rf, rf0), t0 or (r.get("throughput") or {}).get("tokens_per_s_per_gpu"))
    return out


def band_check(paths: list[str]) -> list[dict]:
    """Each pressure record against the band (models.memory_band, recommend's rule without a margin):
    its fullest stage's upper bound (allocated part + reserved-but-unallocated line, with expandable
    segments no more than what the allocator cannot give back, + memory outside the allocator) vs
    what the job had beside its ballast (device total - ballast). An OOM under an
    upper bound at most what it had would be a layout predicted to run that did not."""
    sys.path.insert(0, str(ROOT / "bench"))
    import memory_edge as ME  # noqa: E402  (beside this file)
    from advisor.models import memory_band as MB

    out = []
    records = {x["id"]: x for x in load(paths) if x.get("id")}
    for r in ME.rows(paths):  # (rows skips what it cannot predict: matched by id, not by position)
        pr = list(((records.get(r["id"]) or {}).get("pressure") or {}).values())
        if not pr:
            continue
        b = MB.band(r["stack"], r["moe"])
        up = b.interval(r["predicted"], r["outside_pred"], r["rf"], r["x"], r["periodic"], r["rf_off"],
                        under_pressure=True)[1]  # the verdict's bound (recommend's)
        had = max(x["total_gib"] - x["ballast_gib"] for x in pr)  # the fullest stage's rank has the least ballast
        out.append({"id": r["id"], "status": r["status"], "upper": float(up), "had": had,
                    "headroom": pr[0]["headroom_gib"], "expandable": bool(r["x"])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=PRESSURE)
    a = ap.parse_args(argv)
    if not a.paths:
        print("error: no pressure records (data/measurements/pressure/*.jsonl)", file=sys.stderr)
        return 2
    try:
        records = load(a.paths)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tw = twins()
    print("Allocator pressure: a ballast leaves each job its warmup peak allocated + headroom (GiB)")
    print(f"{'layout':58s} {'exp':>3s} {'unpressed rf':>12s} {'headroom':>8s} {'outcome':>8s} {'retries':>7s} "
          f"{'tok/s/GPU':>9s} {'vs unpressed':>12s}")
    for b in brackets(pressed(records)).values():
        c = b["layout"]
        name = (f"{b['model']}[{b['layers']}L] tp{c['tp']} pp{c['pp']} vp{c['vp']} cp{c['cp']} ep{c['ep']} dp{c['dp']} "
                f"mbs{c['mbs']} {c['precision']}")
        rf, base = tw.get(layout_key({"model_name": b["model"], "layers": b["layers"], "config": c}), (None, None))
        for x in sorted(b["runs"], key=lambda x: x["headroom"]):
            rel = f"{x['tok_s_gpu'] / base - 1:+.1%}" if x["tok_s_gpu"] and base else "-"
            print(f"{name:58s} {'on' if b['expandable'] else 'off':>3s} {rf if rf is not None else float('nan'):12.2f} "
                  f"{x['headroom']:8.1f} {'ran' if x['ran'] else 'OOM':>8s} {x['retries'] if x['retries'] is not None else '-':>7} "
                  f"{x['tok_s_gpu'] or 0:9,.0f} {rel:>12s}")
    checks = band_check(a.paths)
    print()
    print("The band's upper bound (no margin) vs what each pressed job had beside its ballast (GiB)")
    for c in checks:
        verdict = ("predicted to run" if c["upper"] <= c["had"] else "predicted not to") + \
            (", ran" if c["status"] == "ok" else ", OOM")
        print(f"  {c['id']:18s} {'on ' if c['expandable'] else 'off'} headroom {c['headroom']:.1f}  upper {c['upper']:6.1f}"
              f"  had {c['had']:6.1f}  {verdict}")
    wrong = sum(c["status"] == "oom" and c["upper"] <= c["had"] for c in checks)
    print(f"pressed OOMs predicted to run: {wrong} of {sum(c['status'] == 'oom' for c in checks)}; pressed runs the band "
          f"said would not: {sum(c['status'] == 'ok' and c['upper'] > c['had'] for c in checks)} of "
          f"{sum(c['status'] == 'ok' for c in checks)}")
    for on in (True, False):
        cap = pressure_cap(records, on)
        setting = "expandable segments " + ("on" if on else "off")
        if cap:
            print(f"{setting}: every pressed layout ran with {cap['cap_gib']:.1f} GiB of headroom "
                  f"({cap['layouts']} layouts, {cap['architectures']} architectures): the cached memory beyond it was given back")
        else:
            print(f"{setting}: some pressed layout ran out of memory at every headroom tried: no cap")
    return 0


if __name__ == "__main__":
    sys.exit(main())

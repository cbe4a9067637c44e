"""What the caching allocator holds at a step's peaks, from the runs measured with
memory_snapshot_steps (runners/mem_snapshot.py; issue #27): per run and rank, allocated and
reserved at the step's allocated peak, the cache split into segments that hold a live block
(stranded: reusable only by blocks that fit) and whole free segments (releasable: given back when
a cudaMalloc fails), blocks pending free, and the largest allocation sites of the step's live
blocks; the same at the step's start (its reserved peak when the earlier steps cached every segment).

    python bench/memory_snapshot.py [data/measurements/h100x4-te.jsonl ...] [--sites N]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.runners.records import read_jsonl  # noqa: E402
DEFAULT = [ROOT / "data/measurements/h100x4-te.jsonl"]


def runs(paths) -> list[dict]:
    """The records with a memory_snapshot block."""
    return [r for p in paths for r in read_jsonl(p) if r.get("memory_snapshot")]


def row(x: dict) -> str:
    return (f"{x['allocated_gib']:7.2f} {x['reserved_gib']:7.2f} {x['cache_gib']:6.2f} {x['stranded_gib']:8.2f} "
            f"{x['releasable_gib']:10.2f} {x.get('pending_free_gib', 0.0):7.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=DEFAULT)
    ap.add_argument("--sites", type=int, default=5, help="allocation sites printed per run (rank 0)")
    a = ap.parse_args(argv)
    rs = runs(a.paths)
    if not rs:
        print("error: no run with a memory_snapshot in " + ", ".join(map(str, a.paths)), file=sys.stderr)
        return 2
    print("GiB at the snapshot step's allocated peak (and, second line, at its start), per rank; "
          "stranded / releasable: the cache in segments holding a live block / in whole free segments "
          "(expandable segments: not split)")
    print(f"{'id':17} {'model':26} {'layout':36} {'rank':>4} {'alloc':>7} {'resv':>7} {'cache':>6} "
          f"{'stranded':>8} {'releasable':>10} {'pending':>7}")
    for r in rs:
        c = r["config"]
        lay = (f"tp{c['tp']} pp{c['pp']}v{c['vp']} ep{c['ep']}/{c['etp']} dp{c['dp']} mbs{c['mbs']} "
               f"{c['precision']}{' es' if c.get('expandable_segments') else ''}")
        for rank, s in sorted(r["memory_snapshot"].items(), key=lambda kv: int(kv[0])):
            if "error" in s:
                print(f"{r['id']:17} {r['model_name'][:26]:26} {lay:36} {rank:>4}  no summary: {s['error'][:90]}")
                continue
            print(f"{r['id']:17} {r['model_name'][:26]:26} {lay:36} {rank:>4} {row(s['at_allocated_peak'])}")
            print(f"{'':17} {'':26} {'  at the step start':36} {'':>4} {row(s['at_reserved_peak'])}")
        s0 = r["memory_snapshot"].get("0", {})
        for t in (s0.get("at_allocated_peak") or {}).get("sites", [])[:a.sites]:
            print(f"{'':22}rank 0 at its peak: {t['gib']:6.2f} GiB in {t['blocks']:4} blocks  {t['site']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does every usable published row fit in memory as NVIDIA ran it (issue #27: 0 predicted not to fit)?

    python bench/recipes_fit.py            # the rows predicted not to fit, and the count per (GPU, dense / MoE)
    python bench/recipes_fit.py --all      # every usable row
    python bench/recipes_fit.py --why      # also: per row not fitting, whether its recipe was applied,
                                           # read for another config version, or not read

Each row of data/published/published_fit.csv (models/published.py `load`) with its recipe's settings
(models/published_recipes.py RECIPES) over the te stack's layout defaults: the memory band's upper
bound under allocator pressure (models/memory_band.band_upper_gib) against the GPU's usable memory.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from advisor.models import memory_band as MB  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.profiles import apply_layout_defaults  # noqa: E402
from memory_edge import resolve_calibration  # noqa: E402


def row_bound(run: P.PublishedRun, constants) -> tuple[float, float]:
    """(upper bound GiB, usable GiB) of a row."""
    cfg = apply_layout_defaults(run.cfg, "te", run.explicit)
    band = MB.band("te", run.model.is_moe)
    up = MB.band_upper_gib(run.model, cfg, band, constants, under_pressure=True, gpu=run.cluster.gpu)
    usable = constants.usable_memory_gib(run.cluster.gpu.memory_gib)
    return up, usable


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every usable row, not only those predicted not to fit")
    ap.add_argument("--why", action="store_true", help="why the rows not fitting got no recipe settings")
    a = ap.parse_args(argv)
    bad, tot = Counter(), Counter()
    over = []
    print(f"{'row':>4} {'GPU':6} {'model':16} {'layout':52} {'prec':6} {'upper':>6} {'usable':>6}  recipe settings | not modelled")
    for r in P.load():
        if not r.usable:
            continue
        # the te profile of the row's GPU generation (Blackwell's: one FP8 copy per tensor, ...)
        c = resolve_calibration("default", "te", gpu=r.cluster.gpu).screening_constants
        up, usable = row_bound(r, c)
        k = (r.gpu_type, "MoE" if r.moe else "dense")
        tot[k] += 1
        fits = up <= usable
        if not fits:
            bad[k] += 1
            over.append(r)
        if a.all or not fits:
            cfg = r.cfg
            lay = (f"tp{cfg.tp} pp{cfg.pp} vp{cfg.vp} cp{cfg.cp} ep{cfg.ep} dp{cfg.dp} mbs{cfg.mbs} gbs{cfg.gbs}"
                   + (" fsdp" if cfg.fsdp else ""))
            applied = ",".join(f"{f}={getattr(cfg, f)}" for f in sorted(r.explicit)
                               if f not in ("cross_entropy_impl", "expandable_segments")) or "-"
            print(f"{r.row_id:>4} {r.gpu_type:6} {r.model.name:16} {lay:52} {cfg.precision:6} {up:6.1f} {usable:6.1f}"
                  f"{'' if fits else ' !'} {applied} | {'; '.join(u.split(' (')[0] for u in r.unmodelled) or '-'}")
    print("\nnot fitting / usable rows per (GPU, dense/MoE):")
    for k in sorted(tot):
        print(f"  {k[0]:10} {k[1]:5} {bad[k]:3} / {tot[k]:3}")
    print(f"  total            {sum(bad.values()):3} / {sum(tot.values()):3}")
    if a.why:
        why = Counter("recipe not applied (layout of another config version)"
                      if any(x.startswith("recipe read") for x in r.assumptions)
                      else "recipe applied" if r.explicit else "no recipe read" for r in over)
        print("\nrows not fitting:", dict(why))
        for r in over:
            print(f"  {r.row_id:>4} {r.gpu_type:6} {r.model.name:16} {r.raw.get('source_version', '')}: "
                  + next((x for x in r.assumptions if x.startswith("recipe read")),
                         "recipe applied" if r.explicit else "no recipe read"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

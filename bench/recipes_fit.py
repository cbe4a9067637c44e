"""Does every usable published row fit in memory as NVIDIA ran it (issue #27: 0 predicted not to fit)?

    python bench/recipes_fit.py            # the rows predicted not to fit, and the count per (GPU, dense / MoE)
    python bench/recipes_fit.py --all      # every usable row
    python bench/recipes_fit.py --pretend  # also: the not-fitting rows whose recipe has settings the
                                           # advisor cannot model yet, estimated with them

Each row of data/published/published_fit.csv (models/published.py `load`) with its recipe's settings
(models/published_recipes.py RECIPES) over the te stack's layout defaults: the memory band's upper
bound under allocator pressure (models/memory_band.band_upper_gib) against the GPU's usable memory.

--pretend estimates what the recipe's pending settings (RecipeSettings.pending: TrainConfig has no
field for them yet) would save, with the advisor's own recompute modes as the yardstick (no memory
model of these settings exists yet; the estimates say so):
- recompute_modules (selective recompute of named modules): what the modules would have to free to fit,
  against the bound with recompute "selective" (the advisor's selective, core attention) and "full"
  (all that recompute can save): a bracket, not a verdict;
- recompute_layers = N (full recompute of N layers per stage): none - (none - full) x min(1, N / layers
  per pipeline rank);
- cpu_offload_layers = K (the activations of K layers offloaded to the host): none - (none - full) x
  min(1, K / layers per pipeline rank); (none - full) is the activation memory full recompute frees,
  the most offloading can (it keeps each layer's input on the device as full recompute does not).
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
from advisor.models.published_recipes import PENDING_FIELDS  # noqa: E402
from memory_edge import resolve_calibration  # noqa: E402


def row_bound(run: P.PublishedRun, constants, **replace) -> tuple[float, float]:
    """(upper bound GiB, usable GiB) of a row, its config replaced by `replace` where given."""
    cfg = apply_layout_defaults(run.cfg, "te", run.explicit)
    if replace:
        cfg = cfg.replace(**replace)
    band = MB.band("te", run.model.is_moe)
    up = MB.band_upper_gib(run.model, cfg, band, constants, under_pressure=True)
    usable = MB.usable_gib(run.cluster.gpu.memory_gib, MB.default_margin(constants.memory_usable_fraction))
    return up, usable


def pending_of(run: P.PublishedRun) -> dict:
    """The pending settings of the row's recipe that TrainConfig has no field for (as the loader left them)."""
    out = {}
    for u in run.unmodelled:
        k = u.split("=", 1)[0]
        if k in PENDING_FIELDS:
            out[k] = u
    return out


def pretend(run: P.PublishedRun, constants, pending: dict) -> list[str]:
    """The estimates of --pretend for one row (see the module doc)."""
    none, usable = row_bound(run, constants, recompute="none")
    full, _ = row_bound(run, constants, recompute="full")
    per_rank = run.model.num_layers / run.cfg.pp
    out = []
    for k, text in pending.items():
        if k == "recompute_modules":
            # no memory model of per-module recompute yet: the bracket, and what the modules must free
            sel, _ = row_bound(run, constants, recompute="selective")
            est = (f"{text.split(' (')[0]}: must free {none - usable:5.1f} GiB; the advisor's selective "
                   f"{sel:6.1f}, full {full:6.1f} (frees {none - full:5.1f})")
            out.append(f"{est} -> {'fits with full only' if sel > usable >= full else 'fits' if sel <= usable else 'over even with full'}")
            continue
        else:
            n = int(text.split("=", 1)[1].split(" ", 1)[0])
            share = min(1.0, n / per_rank)
            v = none - (none - full) * share
            est = f"{v:6.1f} ({n} of {per_rank:.0f} layers/rank of none-full {none - full:.1f})"
            fits = v <= usable
        out.append(f"{k}: {est} -> {'fits' if fits else 'still over'} {usable:.1f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every usable row, not only those predicted not to fit")
    ap.add_argument("--pretend", action="store_true", help="estimate the pending settings of the rows not fitting")
    a = ap.parse_args(argv)
    c = resolve_calibration("default", "te").screening_constants
    bad, tot = Counter(), Counter()
    over = []
    print(f"{'row':>4} {'GPU':6} {'model':16} {'layout':52} {'prec':6} {'upper':>6} {'usable':>6}  recipe settings | not modelled")
    for r in P.load():
        if not r.usable:
            continue
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
    if a.pretend:
        print("\nrows not fitting whose recipe sets what TrainConfig cannot hold yet (estimates, see the doc):")
        for r in over:
            pend = pending_of(r)
            if pend:
                for line in pretend(r, c, pend):
                    print(f"  {r.row_id:>4} {r.gpu_type:6} {r.model.name:16} {line}")
        rest = [r for r in over if not pending_of(r)]
        why = Counter("recipe not applied (layout of another config version)"
                      if any(x.startswith("recipe read") for x in r.assumptions)
                      else "recipe applied, nothing pending" if r.explicit else "no recipe read" for r in rest)
        print("\nrows not fitting with no pending setting:", dict(why))
        for r in rest:
            print(f"  {r.row_id:>4} {r.gpu_type:6} {r.model.name:16} {r.raw.get('source_version', '')}: "
                  + next((x for x in r.assumptions if x.startswith("recipe read")),
                         "recipe applied" if r.explicit else "no recipe read"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

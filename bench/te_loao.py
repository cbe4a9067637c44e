"""Leave-one-architecture-out on our TE runs, as bench/fit_profiles.py computes it (no write), and
GPT-3 2.7B's per-run errors.

    python bench/te_loao.py [ARCH ...]   # default: every architecture of fit_profiles.ARCHITECTURES
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fit_profiles as fp  # noqa: E402  (beside this file)
from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402


def main(argv: list[str]) -> int:
    only = argv or fp.ARCHITECTURES
    bad = [g for g in only if g not in fp.ARCHITECTURES]
    if bad:
        print(f"error: unknown architecture {bad[0]} (one of {', '.join(fp.ARCHITECTURES)})", file=sys.stderr)
        return 2
    rows, _, _, mine, w = fp.te_fit_set(P.load())
    t = time.time()
    oof, _ = F.cross_validate(rows, F.te_base(), F.architecture, only=only)
    print(f"LOAO in {time.time() - t:.0f} s; our TE runs overall {F.summary(oof[mine], w[mine])['mape']:.1f}% "
          f"(n={int(np.isfinite(oof[mine]).sum())})")
    for g, s in fp.te_runs_by_group(rows, oof, mine, w, F.architecture, only).items():
        print(f"  {g:<12} {s['mape']:.1f}% bias {s['bias']:+.1f}% n={s['n']}")
    for i, x in enumerate(rows):
        if mine[i] and F.architecture(x) == "gpt3" and np.isfinite(oof[i]):
            c = x.cfg
            print(f"    gpt3 tp{c.tp} pp{c.pp} vp{c.vp} cp{c.cp} dp{c.dp} mbs{c.mbs} sp{int(c.sequence_parallel)} "
                  f"{c.precision:5} {math.exp(oof[i]) - 1:+6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

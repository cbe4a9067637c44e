"""Leave-one-architecture-out on our TE runs, as bench/fit_profiles.py computes it (no write), and
GPT-3 2.7B's per-run errors.

    python bench/te_loao.py [ARCH ...]   # default: every architecture of fit_profiles.ARCHITECTURES
"""
import sys, time, math, importlib.util
from pathlib import Path
import numpy as np
ROOT = Path(__file__).resolve().parent.parent; sys.path.insert(0, str(ROOT))
from advisor.models import profile_fit as F
from advisor.models import published as P
spec = importlib.util.spec_from_file_location("fp", ROOT / "bench/fit_profiles.py"); fp = importlib.util.module_from_spec(spec); spec.loader.exec_module(fp)
runs = P.load(); pub, _ = F.fit_rows(runs, "te", fp.in_fit); ours = fp.te_run_rows(); rows = pub + ours
mine = np.array([x.run.source_group == fp.TE_SOURCE for x in rows]); w = np.array([x.weight for x in rows])
t = time.time()
only = sys.argv[1:] or fp.ARCHITECTURES
bad = [g for g in only if g not in fp.ARCHITECTURES]
if bad:
    print(f"error: unknown architecture {bad[0]} (one of {', '.join(fp.ARCHITECTURES)})", file=sys.stderr)
    raise SystemExit(2)
oof, per = F.cross_validate(rows, F.te_base(), F.architecture, only=only)
print(f"LOAO in {time.time()-t:.0f} s; our TE runs overall {F.summary(oof[mine], w[mine])['mape']:.1f}% (n={int(np.isfinite(oof[mine]).sum())})")
for g in only:
    sel = mine & np.array([F.architecture(x) == g for x in rows])
    s = F.summary(oof[sel], w[sel]); print(f"  {g:<12} {s['mape']:.1f}% bias {s['bias']:+.1f}% n={s['n']}")
for i, x in enumerate(rows):
    if mine[i] and F.architecture(x) == "gpt3" and np.isfinite(oof[i]):
        c = x.cfg; print(f"    gpt3 tp{c.tp} pp{c.pp} vp{c.vp} cp{c.cp} dp{c.dp} mbs{c.mbs} sp{int(c.sequence_parallel)} {c.precision:5} {math.exp(oof[i])-1:+6.1%}")

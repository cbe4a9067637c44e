"""recommend on rack-scale Blackwell clusters: wall time per cluster (a table), and where each
dense GB200 row of the published fit set ranks among the layouts recommend scores.

    python bench/blackwell_speed.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor.api import recommend  # noqa: E402
from advisor.models import published as P  # noqa: E402

CASES = [("llama3-70b", "gb200x128", "mxfp8"), ("llama3.1-405b", "gb200x512", "mxfp8"),
         ("llama3-70b", "gb300x72", "nvfp4"), ("llama3-8b", "b200x64", "fp8")]


def main() -> int:
    print(f"{'model':14} {'cluster':10} {'precision':9} {'wall s':>7} {'legal':>6}")
    for m, c, p in CASES:
        recommend(m, c, precision=p, top=1)  # warm: catalog, profile, caches
        t0 = time.perf_counter()
        r = recommend(m, c, precision=p, top=5)
        print(f"{m:14} {c:10} {p:9} {time.perf_counter() - t0:7.2f} {r.candidates_evaluated:6}")
    print("\npublished GB200 rows (dense): the row's layout against recommend's #1")
    for run in P.load():
        if run.usable and run.gpu_type == "GB200" and not run.moe and run.model.name in ("llama3-70b", "llama3.1-405b", "llama3-8b"):
            cfg = run.cfg
            r = recommend(run.model, f"gb200x{run.num_gpus}", seq=cfg.seq, gbs=cfg.gbs, precision=cfg.precision,
                          fp8_recipe=cfg.fp8_recipe, top=1)
            best = r.recommendations[0].prediction.tokens_per_s_per_gpu
            from advisor.api import compare
            vals = {k: getattr(cfg, k) for k in ("tp", "pp", "cp", "vp", "mbs", "recompute", "fsdp",
                                                      "cpu_offload_layers")}
            # the row's uneven pipeline split (405B: the embedding / loss counted as layers)
            vals.update({k: getattr(cfg, k) for k in ("pp_first_layers", "pp_last_layers", "account_for_embedding",
                                                      "account_for_loss", "pipeline_layout", "recompute_layers",
                                                      "recompute_modules") if getattr(cfg, k)})
            try:
                x = compare(r, vals)
                gap = (1 - x.prediction.tokens_per_s_per_gpu / best) * 100
                print(f"  row {run.row_id:>4} {run.model.name:14} x{run.num_gpus:<4} {cfg.quant:14} {cfg.key()[:40]:40} "
                      f"{gap:+6.1f}% below #1" + ("  (FSDP)" if cfg.fsdp else "")
                      + ("" if x.prediction.feasible else "  (predicted not to fit)"))
            except Exception as e:  # noqa: BLE001 - print why the row's layout is not comparable
                print(f"  row {run.row_id:>4} {run.model.name:14} x{run.num_gpus:<4} not compared: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

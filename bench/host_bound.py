"""Where our dense TE runs leave the GPU idle, and which term explains it (issue #22, GPT-3 2.7B).

    python bench/host_bound.py [--calibration te] [--set host_layer_s=5e-3 ...] [--runs RUNS.jsonl] [--loro]

NVML's utilization is the share of time some kernel runs, NCCL's included (a rank waiting for its
peer inside a collective counts as busy), so 1 - utilization is time with no kernel at all: the
GPU waiting for its host. For each distinct dense run (first record of each job) this prints the
measured step, the NVML utilization (mean over GPUs and over the measured steps) and the idle
seconds per step it implies, against two explanations:

  latency  every collective's small-message time on the GPU timeline: TP collectives per layer and
           microbatch (10 with sequence parallelism, 4 without) plus CP's ring send / recv pairs
           (2 x cp per layer and microbatch), x layers x microbatches, x the micro-benchmark's
           median time of a <= 1 MiB all-gather / reduce-scatter (data/microbench/h100x4-nccl-bw.jsonl,
           host issue included);
  host     the model's host issue floor (models.step_time.layer_host_s, Constants.host_*): the
           seconds per step the GPU waits for the host at the clocks the prediction holds,
           m x the busiest stage's host_wait_s.

and the model's predicted tokens/s against the measured. The summary gives each explanation's
mean absolute error of the idle fraction, over all runs and over the GPT-3 runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.dataset import load  # noqa: E402
from advisor.models.profile_fit import on_vm  # noqa: E402
from advisor.models.step_time import step_time  # noqa: E402

RUNS = ROOT / "data/measurements/h100x4-te.jsonl"
NCCL = ROOT / "data/microbench/h100x4-nccl-bw.jsonl"
REPEAT = re.compile(r"-call\d+$")


def small_call_s(path: Path = NCCL, max_bytes: int = 1 << 20) -> float:
    """Median measured time of an all-gather / reduce-scatter of <= max_bytes (groups of 2 and 4)."""
    ts = [d["seconds"] for d in map(json.loads, path.read_text().splitlines())
          if d["op"] in ("all_gather", "reduce_scatter") and d["bytes"] <= max_bytes]
    return statistics.median(ts)


def measured_util(path: Path) -> dict[str, float]:
    """{job id: NVML utilization, mean over the record's GPUs, as a fraction}."""
    out = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        g = (d.get("telemetry") or {}).get("per_gpu") or {}
        u = [v.get("mean_gpu_util_pct") for v in g.values() if v.get("mean_gpu_util_pct") is not None]
        if d.get("status") == "ok" and u:
            out[d["id"]] = float(np.mean(u)) / 100.0
    return out


def calls_per_step(cfg, layers_per_stage: int) -> int:
    tp = (10 if cfg.sequence_parallel else 4) if cfg.tp > 1 else 0
    cp = 2 * cfg.cp if cfg.cp > 1 else 0
    return (tp + cp) * layers_per_stage * cfg.num_microbatches


def rows(runs: Path, cal, lat_s: float) -> list[dict]:
    util = measured_util(runs)
    ds = load([str(runs)])
    out, seen = [], set()
    for r in ds.records:
        job = REPEAT.sub("", r.id)
        if r.stack != "te" or r.model.is_moe or job in seen or r.id not in util:
            continue
        seen.add(job)
        p = cal.predict(r.model, r.cluster, r.cfg, check_legal=False)
        st = step_time(r.model, r.cluster, r.cfg, cal.constants, sm_clock=p.clock_ratio)
        slow = max(st.stages, key=lambda s: s.total_s)
        tokens = r.cfg.gbs * r.cfg.seq / r.cluster.world_size
        step = tokens / r.y["tokens_per_s_per_gpu"]
        lps = r.model.num_layers // r.cfg.pp
        out.append({"id": r.id, "model": r.model.name.split("[")[0], "layout": short(r.cfg), "step": step,
                    "util": util[r.id], "idle": (1 - util[r.id]) * step,
                    "lat_idle": calls_per_step(r.cfg, lps) * lat_s,
                    "host_idle": slow.host_wait_s * st.num_microbatches,
                    "host_per_lmb": slow.host_s / lps,
                    "pred_step": tokens / p.tokens_per_s_per_gpu})
    return out


def leave_one_run_out(cal) -> None:
    """The host costs (profile_fit.HOST, the other constants as `cal` has them) refitted on our TE
    runs without each GPT-3 job in turn: that job's predicted / measured tokens/s. Does the floor's
    form carry to a layout it has not seen, given the machine's costs from the others?"""
    from advisor.models import profile_fit as F

    fitp = _fit_profiles()
    rows = fitp.te_run_rows()
    kw = dict(names=[n for n in F.HOST if n in F.TE_FIT], bounds=F.TE_FIT, priors=F.TE_PRIOR, spread=F.MEASURED_SPREAD)
    print("GPT-3 runs, host costs refitted without each (leave one run out):")
    errs = []
    for job in sorted({REPEAT.sub("", x.run.model_key + " " + x.cfg.key()) for x in rows
                       if F.architecture(x) == "gpt3"}):
        test = [x for x in rows if x.run.model_key + " " + x.cfg.key() == job]
        c, info = F.fit([x for x in rows if x not in test], cal.constants, **kw)
        e = float(np.mean(F.log_errors(test, c)))
        errs.append(abs(math.exp(e) - 1))
        stuck = all(math.isclose(v, F.TE_PRIOR[k][0], rel_tol=1e-3) for k, v in info["fitted"].items())
        print(f"  {job:<80} {math.exp(e) - 1:+6.1%}  (" + ", ".join(f"{k} {v:.3g}" for k, v in info["fitted"].items())
              + ")" + ("  at the priors: the fit found no binding optimum" if stuck else ""))
    print(f"  mean |error| {np.mean(errs):.1%} over {len(errs)} runs")


def _fit_profiles():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_profiles", ROOT / "bench/fit_profiles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def short(cfg) -> str:
    return (f"tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} cp{cfg.cp} mbs{cfg.mbs} m{cfg.num_microbatches}"
            + (" fp8" if cfg.precision != "bf16" else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default="te", help="a profile name or calibration file (default te)")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="override profile constants")
    ap.add_argument("--runs", default=str(RUNS))
    ap.add_argument("--loro", action="store_true",
                    help="also refit the host costs without each GPT-3 run in turn and predict it")
    a = ap.parse_args(argv)
    cal = on_vm(resolve_calibration(a.calibration, "te"))  # our runs: our VM's host issue costs
    if a.set:
        cal = dataclasses.replace(cal, constants=cal.constants.replace(
            **{k: float(v) for k, v in (s.split("=", 1) for s in a.set)}))
    lat = small_call_s()
    rs = rows(Path(a.runs), cal, lat)
    print(f"latency explanation: {lat * 1e6:.0f} us per collective (median <= 1 MiB all-gather / reduce-scatter, "
          f"{NCCL.relative_to(ROOT)})")
    print(f"{'run':<16} {'layout':<30} {'step s':>7} {'util':>6} {'idle s':>7} {'latency':>8} {'host':>7} "
          f"{'host/L ms':>9} {'pred err':>8}")
    for x in rs:
        print(f"{x['id']:<16} {x['layout']:<30} {x['step']:>7.3f} {x['util']:>6.1%} {x['idle']:>7.3f} "
              f"{x['lat_idle']:>8.3f} {x['host_idle']:>7.3f} {x['host_per_lmb'] * 1e3:>9.2f} "
              f"{(x['step'] / x['pred_step'] - 1):>+8.1%}")
    if a.loro:
        leave_one_run_out(cal)
    for name, sel in (("all", rs), ("gpt3", [x for x in rs if x["model"] == "gpt3-2.7b"]),
                      ("others", [x for x in rs if x["model"] != "gpt3-2.7b"])):
        if not sel:
            continue
        f = lambda k: np.mean([abs(x[k] - x["idle"]) / x["step"] for x in sel]) * 100  # noqa: E731
        mape = np.mean([abs(x["pred_step"] / x["step"] - 1) for x in sel]) * 100
        print(f"{name:<7} n={len(sel):<3} idle fraction MAE: latency x calls {f('lat_idle'):5.1f} pt, host floor "
              f"{f('host_idle'):5.1f} pt, measured mean {np.mean([x['idle'] / x['step'] for x in sel]) * 100:4.1f}%; "
              f"step MAPE {mape:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

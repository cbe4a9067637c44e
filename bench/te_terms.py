"""The te profile's communication terms checked one by one (issue #22, item 3).

    python bench/te_terms.py [--calibration te] [--nccl data/microbench/h100x4-nccl-bw.jsonl]
                             [--runs data/measurements/h100x4-te.jsonl]

1. NCCL on the lent 4 x H100 (bench/nccl_bw_gpu.py): for each op and group size, the fit of
   t = alpha + bus_bytes / B (a bandwidth ramp: the algorithm bandwidth reaches half of B at the
   message size alpha * B, the half-bandwidth size), with its error at each size; then the price
   models/step_time.collective_time gives with the profile's constants (one link rate
   intra_node_bw_gbs * nvlink_efficiency, intra_latency_s * sqrt(n - 1)), against the measured time.
2. The TE runs that isolate a term, in pairs of the same model, sequence and global batch: measured
   step-time ratio (b / a) against the profile's predicted ratio, and what the profile's breakdown
   puts in the term that differs (TP, CP, PP, gradient accumulation).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.profile_fit import on_vm  # noqa: E402
from advisor.models.dataset import load  # noqa: E402
from advisor.models.predict import predict  # noqa: E402
from advisor.models.step_time import bus_factor, collective_time  # noqa: E402

NCCL = ROOT / "data/microbench/h100x4-nccl-bw.jsonl"
RUNS = ROOT / "data/measurements/h100x4-te.jsonl"
NVLINK_GBS = 450.0  # H100 SXM NVLink 4, per direction (catalog intra_node_bw_gbs)

# (what it isolates, run a, run b): b differs from a in the one term named
PAIRS = [
    ("SP on vs off, TP2 mbs2", "te-l8b-tp-09", "te-l8b-sp-06"),
    ("TP2+SP vs DP, mbs4", "te-l8b-dp-02", "te-l8b-sp-07"),
    ("TP4 vs TP2 (SP), mbs4", "te-l8b-sp-07", "te-l8b-sp-08"),
    ("TP2+SP vs DP, 70B mbs1", "te-l70b-dp-05", "te-l70b-sp-02"),
    ("TP4 vs TP2 (SP), 70B mbs1", "te-l70b-sp-02", "te-l70b-sp-00"),
    ("TP4 vs TP2 (SP), 70B mbs2", "te-l70b-sp-03", "te-l70b-sp-01"),
    ("TP2+SP vs DP, GPT-3 mbs4", "te-gpt3-dp-01", "te-gpt3-sp-03"),
    ("TP4 vs TP2 (SP), GPT-3", "te-gpt3-sp-03", "te-gpt3-sp-04"),
    ("CP2 vs DP, 4096 tok/GPU", "te-l8b-dp-00", "te-l8b-cp-03"),
    ("CP2 vs DP, 8192 tok/GPU", "te-l8b-dp-01", "te-l8b-cp-04"),
    ("CP4 vs DP, 4096 tok/GPU", "te-l8b-dp-00", "te-l8b-cp-05"),
    ("CP2 vs DP, seq 8192", "te-l8b-dp-23", "te-l8b-cp-24"),
    ("CP2 vs DP, FP8", "te-l8b-fp8-16", "te-l8b-fp8-19"),
    ("CP2 vs DP, GPT-3 4096 tok", "te-gpt3-dp-00", "te-gpt3-cp-06"),
    ("TP2 x CP2 vs TP2, 70B", "te-l70b-sp-02", "te-l70b-spcp-04"),
    ("PP2 vs DP, mbs2", "te-l8b-dp-01", "te-l8b-pp-11"),
    ("PP2 VP2 vs DP, mbs1", "te-l8b-dp-00", "te-l8b-pp-12"),
    ("PP4 VP2 vs DP, mbs1", "te-l8b-dp-00", "te-l8b-pp-13"),
    ("8 vs 2 microbatches (grad acc.)", "te-l8b-dp-02", "te-l8b-dp-00"),
]
TERMS = ("tp_comm_s", "cp_comm_s", "pp_p2p_s", "pipeline_bubble_s", "memory_bound_s", "dp_comm_exposed_s")


def fit_hockney(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(alpha seconds, B bytes/s) of t = alpha + sizes / B, least squares on log t."""
    from scipy.optimize import least_squares

    def res(p):
        return np.log((p[0] * 1e-6 + sizes / (p[1] * 1e9)) / seconds)
    p = least_squares(res, [50.0, 250.0], bounds=([0.0, 1.0], [1000.0, 5000.0])).x
    return p[0] * 1e-6, p[1] * 1e9


def nccl_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def nccl_fits(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """{(op, n): {alpha_s, bus_gbs, half_mib, err: [(bytes, fit / measured - 1)]}}."""
    out = {}
    for op, n in sorted({(r["op"], r["group"]) for r in rows}):
        rs = sorted((r for r in rows if r["op"] == op and r["group"] == n), key=lambda r: r["bytes"])
        s = np.array([r["bytes"] * bus_factor(op, n) for r in rs], float)
        t = np.array([r["seconds"] for r in rs], float)
        a, b = fit_hockney(s, t)
        out[(op, n)] = {"alpha_s": a, "bus_gbs": b / 1e9, "half_mib": a * b / 2**20 / bus_factor(op, n),
                        "err": [(int(r["bytes"]), float((a + x / b) / y - 1)) for r, x, y in zip(rs, s, t)]}
    return out


def profile_time(op: str, nbytes: float, n: int, c) -> float:
    """What the profile charges: collective_time on the NVLink link (the CP ring: `(n - 1)` p2p
    steps of the buffer, models/step_time.layer_forward; one pair's p2p: a p2p)."""
    bw, lat = NVLINK_GBS * c.nvlink_efficiency, c.intra_latency_s
    if op == "ring":
        return collective_time("p2p", nbytes, 2, bw, lat)
    return collective_time(op, nbytes, n, bw, lat)


def print_nccl(rows: list[dict], c) -> None:
    fits = nccl_fits(rows)
    print(f"1. NCCL on 4 x H100 NVLink: t = alpha + bus bytes / B per op and group size "
          f"(profile: B = {NVLINK_GBS:g} x {c.nvlink_efficiency:.3f} = {NVLINK_GBS * c.nvlink_efficiency:.0f} GB/s, "
          f"latency {c.intra_latency_s * 1e6:.1f} us x sqrt(n-1))")
    sizes = sorted({r["bytes"] for r in rows})
    print(f"{'op':<15}{'n':>2}{'alpha us':>9}{'B GB/s':>8}{'half MiB':>9}  fit error at "
          + " ".join(f"{s / 2**20:g}M" for s in sizes))
    for (op, n), f in fits.items():
        print(f"{op:<15}{n:>2}{f['alpha_s'] * 1e6:>9.1f}{f['bus_gbs']:>8.0f}{f['half_mib']:>9.1f}  "
              + " ".join(f"{e * 100:+.0f}%" for _, e in f["err"]))
    print(f"\nthe profile's price / measured time, same sizes\n{'op':<15}{'n':>2}  "
          + " ".join(f"{s / 2**20:>6g}M" for s in sizes))
    for op, n in fits:
        rs = {r["bytes"]: r["seconds"] for r in rows if r["op"] == op and r["group"] == n}
        print(f"{op:<15}{n:>2}  " + " ".join(f"{profile_time(op, b, n, c) / rs[b]:>7.2f}" for b in sizes))


def print_pairs(runs: Path, cal) -> None:
    ds = load([str(runs)])
    recs = {r.id: r for r in ds.records}
    print(f"\n2. TE runs isolating one term ({runs.name}; profile {cal.profile}): step time b / a, "
          "and the profile's seconds per step in the terms that differ")
    print(f"{'isolates':<32}{'a':<15}{'b':<16}{'meas':>6}{'pred':>6}{'err':>7}  predicted b - a per term (ms)")
    errs = []
    for what, a, b in PAIRS:
        if a not in recs or b not in recs:
            continue
        ra, rb = recs[a], recs[b]
        pa = cal.predict(ra.model, ra.cluster, ra.cfg)
        pb = cal.predict(rb.model, rb.cluster, rb.cfg)
        tok = lambda r: r.cfg.gbs * r.cfg.seq / r.cluster.world_size  # noqa: E731  tokens per GPU and step
        meas = (tok(rb) / rb.y["tokens_per_s_per_gpu"]) / (tok(ra) / ra.y["tokens_per_s_per_gpu"])
        pred = (tok(rb) / pb.tokens_per_s_per_gpu) / (tok(ra) / pa.tokens_per_s_per_gpu)
        errs.append(pred / meas - 1)
        ba, bb = pa.breakdown, pb.breakdown
        diff = " ".join(f"{t.replace('_s', '').replace('_comm', '')} {(bb.get(t, 0) - ba.get(t, 0)) * 1e3:+.0f}"
                        for t in TERMS if abs(bb.get(t, 0) - ba.get(t, 0)) > 1e-3)
        print(f"{what:<32}{a[3:]:<15}{b[3:]:<16}{meas:>6.3f}{pred:>6.3f}{(pred / meas - 1) * 100:>+6.1f}%  {diff}")
    if errs:
        print(f"mean |error| of the ratios: {np.mean(np.abs(errs)) * 100:.1f}% over {len(errs)} pairs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default="te", help="a profile name or calibration file (default te)")
    ap.add_argument("--nccl", default=str(NCCL))
    ap.add_argument("--runs", default=str(RUNS))
    a = ap.parse_args(argv)
    cal = on_vm(resolve_calibration("default" if a.calibration == "te" else a.calibration, "te"))  # our runs: our VM's host
    print_nccl(nccl_rows(Path(a.nccl)), cal.screening_constants)
    print_pairs(Path(a.runs), cal)
    return 0 if cal is not None and not math.isnan(cal.screening_constants.nvlink_efficiency) else 1


if __name__ == "__main__":
    raise SystemExit(main())

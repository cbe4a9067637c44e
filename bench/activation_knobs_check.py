"""The activation knobs (TrainConfig.cpu_offload_layers, recompute_layers / recompute_modules) against
the 4 x H100 Transformer Engine records of session 26 (bench/te_campaign.py's x4-te-s26-offload,
x4-te-s26c and x4-te-s26-recompute batches), and the fit of activation offloading's two constants.

    python bench/activation_knobs_check.py data/measurements/h100x4-te.jsonl          # the table
    python bench/activation_knobs_check.py data/measurements/h100x4-te.jsonl --fit    # + the offload fit

Per run: the te profile's predicted step time (models.calibrate.resolve_calibration("default", "te"))
beside the record's median step, and per pipeline stage the predicted allocated memory at the
stage's peak (models.memory.stage_memory with the profile's screening constants: total_gib less the
caching allocator's reserved-but-free share, reserved_free_gib) beside the record's peak allocated
(memory.peak_gib_per_stage). --fit: Constants.host_link_efficiency and Constants.offload_overlap
(models/offload.py) fitted on the offload runs' step times (least squares of log(pred / measured)
over a grid), then leave-one-run-out: each run predicted by the constants fitted on the others.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PREFIXES = ("te-l8bo-offload-", "te-l8b-prc-", "te-qw3-prc-18")
# the grid of the two offload constants: the per-GPU fraction of the host link while every GPU of
# the node copies at once, and the fraction of the other layers' compute the copies run beside
EFFICIENCIES = np.round(np.arange(0.10, 0.905, 0.02), 3)
OVERLAPS = np.round(np.arange(0.0, 1.0001, 0.05), 3)


def measured_records(paths) -> dict[str, dict]:
    """The ok records of the session-26 activation-knob jobs, by id."""
    from advisor.runners.records import read_jsonl

    out = {}
    for p in paths:
        for rec in read_jsonl(p):
            if rec.get("status") == "ok" and rec.get("id", "").startswith(PREFIXES):
                out[rec["id"]] = rec
    return out


def jobs(records: dict[str, dict]) -> list:
    """The campaign's entries (runners.jobs.Entry: id, model, config) that have a record."""
    from advisor.runners.jobs import entry_from_line
    from te_campaign import s26, s26_offload, s26c

    return [e for e in (entry_from_line(line, 4) for gen in (s26_offload, s26c, s26) for line in gen())
            if e.id in records]


def knob(cfg) -> str:
    if cfg.cpu_offload_layers:
        return f"offload {cfg.cpu_offload_layers}"
    if cfg.recompute == "full":
        return f"block {cfg.recompute_layers}"
    if cfg.recompute == "selective":
        return "sel " + "+".join(cfg.recompute_modules or ("core_attn",))
    return "none"


def allocated_gib(model, cfg, c, gpu=None) -> list[float]:
    """Predicted allocated GiB at each stage's peak (what torch's allocator has handed out)."""
    from advisor.models.memory import stage_memory

    return [s.total_gib - s.reserved_free_gib for s in stage_memory(model, cfg, c, gpu=gpu)]


def rows(records: dict[str, dict], cal=None) -> list[dict]:
    from advisor.catalog import load_cluster
    from advisor.models.calibrate import resolve_calibration

    cal = cal or resolve_calibration("default", "te")
    cluster = load_cluster("h100x4")
    out = []
    for e in jobs(records):
        rec, cfg = records[e.id], e.config
        out.append({"id": e.id, "knob": knob(cfg), "seq": cfg.seq, "mbs": cfg.mbs, "pp": cfg.pp,
                    "step_s": cal.predict(e.model, cluster, cfg).step_time_s,
                    "meas_step_s": rec["steps"]["median_s"],
                    "alloc_gib": allocated_gib(e.model, cfg, cal.screening_constants, cluster.gpu),
                    "meas_alloc_gib": list(rec["memory"]["peak_gib_per_stage"])})
    return out


def offload_steps(records: dict[str, dict], cal, eff: float, overlap: float) -> dict[str, float]:
    """Predicted step seconds of the offload runs with the two constants set."""
    from advisor.catalog import load_cluster

    cluster = load_cluster("h100x4")
    c = cal.constants.replace(host_link_efficiency=float(eff), offload_overlap=float(overlap))
    trial = dataclasses.replace(cal, constants=c)
    return {e.id: trial.predict(e.model, cluster, e.config).step_time_s
            for e in jobs(records) if e.config.cpu_offload_layers}


def fit_offload(records: dict[str, dict], cal=None, held_out: str | None = None) -> dict:
    """Grid least squares of log(pred / measured) step time over the offload runs with at least one
    layer offloaded (`held_out` left out). Returns eff, overlap, rms and the grid's log errors."""
    from advisor.models.calibrate import resolve_calibration

    cal = cal or resolve_calibration("default", "te")
    grid = fit_grid(records, cal)
    return best_of(grid, records, held_out)


def fit_grid(records: dict[str, dict], cal, effs=EFFICIENCIES, overlaps=OVERLAPS) -> dict:
    """{(eff, overlap): {id: log(pred / measured)}} over effs x overlaps (the bench's grid)."""
    meas = {k: r["steps"]["median_s"] for k, r in records.items()}
    return {(float(e), float(o)): {k: float(np.log(v / meas[k])) for k, v in offload_steps(records, cal, e, o).items()}
            for e in effs for o in overlaps}


def best_of(grid: dict, records: dict[str, dict], held_out: str | None = None) -> dict:
    def loss(errs):
        return float(np.mean([v ** 2 for k, v in errs.items() if k != held_out]))

    (eff, ov), errs = min(grid.items(), key=lambda kv: loss(kv[1]))
    return {"eff": float(eff), "overlap": float(ov), "rms": float(np.sqrt(loss(errs))), "errs": errs}


def leave_one_out(records: dict[str, dict], cal=None) -> list[dict]:
    """Each offload run's step predicted by the constants fitted on the other runs."""
    from advisor.models.calibrate import resolve_calibration

    cal = cal or resolve_calibration("default", "te")
    grid = fit_grid(records, cal)
    ids = sorted(next(iter(grid.values())))
    out = []
    for k in ids:
        b = best_of(grid, records, held_out=k)
        out.append({"id": k, "eff": b["eff"], "overlap": b["overlap"],
                    "err": float(np.exp(b["errs"][k]) - 1.0)})
    return out


def _gib(xs) -> str:
    return "/".join(f"{x:4.1f}" for x in xs)


def main(argv: list[str]) -> int:
    fit = "--fit" in argv
    paths = [a for a in argv if not a.startswith("--")]
    if not paths:
        print("error: give the measurement JSONL (data/measurements/h100x4-te.jsonl)", file=sys.stderr)
        return 2
    records = measured_records(paths)
    print(f"{'id':19} {'knob':22} {'seq':>5} {'mbs':>3} {'pp':>2}  {'step s pred':>11} {'meas':>6} {'err':>6}"
          f"  alloc GiB per stage pred | meas")
    for r in rows(records):
        err = r["step_s"] / r["meas_step_s"] - 1.0
        print(f"{r['id']:19} {r['knob']:22} {r['seq']:>5} {r['mbs']:>3} {r['pp']:>2}  {r['step_s']:11.3f} "
              f"{r['meas_step_s']:6.3f} {err:+6.1%}  {_gib(r['alloc_gib']):>11} | {_gib(r['meas_alloc_gib'])}")
    if fit:
        b = fit_offload(records)
        print(f"\noffload fit (all runs): host_link_efficiency {b['eff']:.2f}, offload_overlap {b['overlap']:.2f}, "
              f"rms log error {b['rms']:.3f}")
        print(f"{'held out':19} {'eff':>5} {'overlap':>7} {'step err':>8}")
        loo = leave_one_out(records)
        for r in loo:
            print(f"{r['id']:19} {r['eff']:5.2f} {r['overlap']:7.2f} {r['err']:+8.1%}")
        print(f"leave-one-run-out mean |err| {np.mean([abs(r['err']) for r in loo]):.1%}, "
              f"max {max(abs(r['err']) for r in loo):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Thermal simulation of pipeline-stage placement: slot profiles × per-stage power from
advisor.models × the throttle curve of advisor.placement.assign.

    python bench/thermal_sim.py            # the table in docs/placement.md
    python bench/thermal_sim.py --leak-per-c 0.0014 --rear-ratio 1.20   # sensitivity

Chassis:
- hgx8-air: 8-GPU air-cooled HGX, GPUs 0-3 in the front row, 4-7 behind them in their exhaust.
  Front slots = the mean of the 4 measured H200 slots (data/profiles/h200x4-burn.json: ambient
  34.8 °C, 0.044 °C/W, so 65.6 °C at 700 W). Rear slots run `rear_ratio` (paper: "up to 27%") hotter at 700 W: +10 °C preheated
  intake and a higher °C/W. Which indices are in front is an ASSUMPTION (not public for HGX);
  0-3 is what the paper's repo implies (even stages on GPUs 0-3 get the extra layer).
- hgx8-uniform: the same box with every slot like the front row (control: nothing to gain).
- h200x4-burn: the measured 4 × H200 profile (data/profiles/h200x4-burn.json).

Strategies: identity (even split, rank r on GPU r); the paper's asymmetric split (even stages
+1 layer, odd stages -1, placed as identity so the +1 stages sit on the front row); the
planner placing GPUs only; the planner also moving layers (--uneven). Gains are predicted
throughput vs identity.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from advisor.catalog import TrainConfig, load_cluster, load_model  # noqa: E402
from advisor.placement import (NodeProfile, Planner, ThrottleCurve, load_profile, node_profiles,  # noqa: E402
                               plan, profile_from_dict)

BURN = load_profile(ROOT / "data" / "profiles" / "h200x4-burn.json")
# Front-row slot: the mean of the 4 measured H200 slots (ambient °C, °C/W).
FRONT = (sum(g.ambient_c for g in BURN.gpus) / len(BURN.gpus), sum(g.c_per_w for g in BURN.gpus) / len(BURN.gpus))
PREHEAT_C = 10.0       # rear intake preheated by the front row's exhaust (assumed; below the thermal target it
                       # does not change results: only T at the stage's power matters)


def hgx8(rear_ratio: float = 1.27, uniform: bool = False) -> NodeProfile:
    t_front = FRONT[0] + FRONT[1] * 700.0
    rear_amb = FRONT[0] + PREHEAT_C
    rear = (rear_amb, (rear_ratio * t_front - rear_amb) / 700.0)
    gpus = []
    for i in range(8):
        amb, c = FRONT if uniform or i < 4 else rear
        gpus.append({"index": i, "uuid": f"GPU-sim-hgx8-{i}", "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                     "ambient_c": amb, "c_per_w": round(c, 5), "row": "front" if i < 4 else "rear"})
    name = "hgx8-uniform" if uniform else f"hgx8-air(rear x{rear_ratio:g})"
    return profile_from_dict({"node": name, "gpus": gpus, "note": "simulated chassis, see bench/thermal_sim.py"})


def alternating(num_layers: int, pp: int) -> list[int]:
    """The paper's asymmetric split (CharLLM-PPT CHARLLM_UNEVEN_PIPELINE): even stages base+1, odd base-1."""
    base = num_layers // pp
    counts = [base + 1 if k % 2 == 0 else base - 1 for k in range(pp)]
    counts[-1] += num_layers - sum(counts)
    return counts


CASES = [
    # (label, model, cluster, layout, paper's number for its asymmetric split)
    ("Llama3-70B PP4 TP4", "llama3-70b", "h200x16",
     TrainConfig(tp=4, pp=4, dp=1, mbs=1, gbs=128, seq=8192, sequence_parallel=True), "+4%"),
    ("GPT3-175B PP8 TP4", "gpt3-175b", "h200x32",
     TrainConfig(tp=4, pp=8, dp=1, mbs=1, gbs=128, seq=2048, sequence_parallel=True), "-7%"),
    ("GPT3-175B PP8 TP8", "gpt3-175b", "h200x64",
     TrainConfig(tp=8, pp=8, dp=1, mbs=1, gbs=128, seq=2048, sequence_parallel=True), "-7%"),
]
BURN_CASES = [
    ("Llama3-70B PP4 TP1 (full recompute)", "llama3-70b", "h200x4",
     TrainConfig(tp=1, pp=4, dp=1, mbs=1, gbs=64, seq=4096, recompute="full"), "-"),
    ("Llama3-8B PP4 TP1", "llama3-8b", "h200x4", TrainConfig(tp=1, pp=4, dp=1, mbs=1, gbs=64, seq=8192), "-"),
]


def rows_for(label, model, cluster, cfg, paper, prof: NodeProfile, curve: ThrottleCurve, margin: float):
    m, c = load_model(model), load_cluster(cluster)
    profs = node_profiles([prof], c.num_nodes)
    pl = Planner(m, c, cfg, profs, curve)
    even = pl.costs.default_counts()
    ident = pl.assigner(even).identity()

    def temps(p):
        hot = [t for row in p.temps for g, t in enumerate(row) if prof.gpus[g].extra.get("row") == "rear"]
        cool = [t for row in p.temps for g, t in enumerate(row) if prof.gpus[g].extra.get("row") != "rear"]
        return f"{max(cool):.0f} / {max(hot):.0f}" if hot else f"{max(cool):.0f}"

    def gain(p):
        return (ident.step_s / p.step_s - 1.0) * 100.0

    out = [(label, prof.node, "identity (even split)", even, ident.step_s, 0.0, temps(ident), "baseline")]
    alt = alternating(m.num_layers, cfg.pp)
    naive = pl.assigner(alt).identity()
    fits = "" if pl.fits(alt) else " (does NOT fit in memory)"
    out.append((label, prof.node, f"paper asymmetric, naive (paper: {paper})", alt, naive.step_s, gain(naive),
                temps(naive), "applied blindly" + fits))
    for uneven in (False, True):
        p = plan(m, c, cfg, profs, margin_pct=margin, uneven=uneven, curve=curve)
        run = p.candidate if p.applied else p.identity
        what = "planner, placement + split" if uneven else "planner, placement only"
        decision = ("APPLIED" if p.applied else "declined") + f" (candidate {p.predicted_gain_pct:+.2f}%)"
        out.append((label, prof.node, what, p.layer_counts, run.step_s, gain(run), temps(run), decision))
    return out


def table(rows, markdown: bool) -> str:
    head = ("case", "chassis", "strategy", "layers per stage", "step s", "vs identity", "max °C front/rear", "decision")
    body = [(a, b, s, ",".join(map(str, k)) if len(set(k)) > 1 else f"{k[0]}×{len(k)}", f"{t:.3f}", f"{g:+.2f}%", temp, d)
            for a, b, s, k, t, g, temp, d in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leak-per-c", type=float, default=ThrottleCurve().leak_per_c)
    ap.add_argument("--rear-ratio", type=float, default=1.27)
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    curve = ThrottleCurve(leak_per_c=a.leak_per_c)
    rows = []
    for case in CASES:
        rows += rows_for(*case, hgx8(a.rear_ratio), curve, a.margin)
    rows += rows_for(*CASES[0], hgx8(uniform=True), curve, a.margin)
    for case in BURN_CASES:
        rows += rows_for(*case, BURN, curve, a.margin)
    print(f"leak_per_c={a.leak_per_c:g}/°C, rear_ratio={a.rear_ratio:g}, margin={a.margin:g}%, "
          f"thermal target {curve.target_c(load_cluster('h200x8')):.0f} °C")
    print(table(rows, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())

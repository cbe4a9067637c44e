"""The same layouts measured by the built-in runner and by the command runner around Megatron-LM's
own training loop (bench/megatron_lm_pretrain.py): do they agree?

    python bench/compare_runners.py BUILTIN.jsonl COMMAND.jsonl [--tolerance 0.05]

Pairs records by layout (config key and model) and prints, per layout, tokens/s of each runner,
their ratio, the median step times, peak memory (the built-in runner: torch's max allocated over
the whole job; the command runner: Megatron-LM's report after its first iterations) and mean
power; exits 1 if a pair differs by more than the tolerance in tokens/s."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.catalog.specs import TrainConfig
from advisor.runners.measure import read_jsonl


def _key(r: dict) -> tuple[str, str]:
    return r["model"]["name"], TrainConfig.from_dict(r["config"]).key()


def pairs(builtin: list[dict], command: list[dict]) -> list[tuple[dict, dict]]:
    b = {_key(r): r for r in builtin if r.get("status") == "ok"}
    return [(b[_key(r)], r) for r in command if r.get("status") == "ok" and _key(r) in b]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builtin")
    ap.add_argument("command")
    ap.add_argument("--tolerance", type=float, default=0.05)
    o = ap.parse_args(argv)
    builtin, command = read_jsonl(o.builtin), read_jsonl(o.command)
    for name, recs in (("built-in", builtin), ("command", command)):
        bad = [(r["config"].get("mbs"), r["config"].get("recompute"), r["status"], (r.get("error") or "")[:200])
               for r in recs if r.get("status") != "ok"]
        if bad:
            print(f"{name} runner, not ok: {bad}")
    ps = pairs(builtin, command)
    print(f"{'model':16s} {'layout':58s} {'built-in tok/s':>14s} {'command tok/s':>14s} {'cmd/built':>9s} "
          f"{'step s (b/c)':>13s} {'GiB (b/c)':>11s} {'W (b/c)':>9s}")
    worst = 0.0
    for b, c in ps:
        tb, tc = b["throughput"]["tokens_per_s"], c["throughput"]["tokens_per_s"]
        ratio = tc / tb
        worst = max(worst, abs(ratio - 1))
        mb, mc = (b.get("memory") or {}).get("max_gib"), (c.get("memory") or {}).get("max_gib")
        wb, wc = ((b.get("telemetry") or {}).get("mean_power_w"), (c.get("telemetry") or {}).get("mean_power_w"))
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"{b['model']['name']:16s} {_key(b)[1]:58s} {tb:14,.0f} {tc:14,.0f} {ratio:9.3f} "
              f"{b['steps']['median_s']:6.3f}/{c['steps']['median_s']:6.3f} {fmt(mb, '5.1f')}/{fmt(mc, '5.1f')} "
              f"{fmt(wb, '4.0f')}/{fmt(wc, '4.0f')}")
    print(f"{len(ps)} layout(s) measured by both; largest tokens/s gap {100 * worst:.1f}% "
          f"(tolerance {100 * o.tolerance:.0f}%)")
    return 0 if ps and worst <= o.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())

"""Freeze the analytical model's predictions for a few thousand layouts, or check this tree against
the frozen file (issue #23: "one model, one way down" must not change a number).

    python bench/freeze_predictions.py --write     # (re)write tests/data/frozen_predictions.json.gz
    python bench/freeze_predictions.py             # check: exit 1 and the first differences
    python bench/freeze_predictions.py --check -k deepseek   # only the entries whose id holds it

Every entry is one call of the per-layout API that callers use (models.predict.predict,
models.power.estimate_power / power_at_step / stage_caps, models.step_time.step_time at given
clocks, models.memory.stage_memory with another split, placement.stage_heat.stage_heat, a
calibration profile's predict_many) with its arguments (model, cluster, TrainConfig fields that
differ from the defaults, caps ...) and every field its return value carries (to_dict: tokens/s,
step, per-stage memory, per-stage times with their breakdown, power, clocks, throttle risk,
energy). The spaces: dense and MoE models, FP8 / MXFP8 / NVFP4, CP, uneven and explicit pipeline
splits, VP, every recompute mode, power caps per GPU and per stage, the stacks' profiles (local,
te, te's Blackwell one), H100, H200, B200 and GB200 clusters. tests/test_frozen_predictions.py
holds the code to the file at RTOL (relative) for floats, exactly for everything else.

Re-runnable: the lead re-freezes on main (--write) after merging physics changes, before merging a
refactor that must not change a number.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's code, not whichever copy is installed

FILE = ROOT / "tests" / "data" / "frozen_predictions.json.gz"
HF = Path("tests") / "data" / "hf_configs"  # relative to ROOT in the file: any checkout reads it (model_path)
RTOL = 1e-9

# (model, cluster, workload overrides, space options (SpaceOptions keyword arguments), layouts taken
# evenly from the space)
SPACES = [
    ("llama3-70b", "h100x16", {}, {"wide": True}, 160),
    ("llama3-70b", "h100x32", {"precision": "fp8"}, {"wide": True}, 120),
    ("llama3-70b", "h100x16", {"seq": 32768, "gbs": 64}, {"wide": True}, 120),
    ("llama3.1-405b", "h100x64", {}, {"wide": True, "mbs": (1, 2)}, 160),
    ("gpt3-175b", "h100x32", {"seq": 2048, "gbs": 256}, {"mbs": (1, 4)}, 80),
    ("deepseek-v3", "h100x64", {"gbs": 256}, {"wide": True, "mbs": (1, 2)}, 160),
    ("qwen3-235b-a22b", "h100x32", {}, {"mbs": (1, 4)}, 120),
    ("mixtral-8x22b", "h200x16", {"precision": "fp8"}, {"mbs": (1, 2)}, 100),
    ("gpt-oss-120b", "h100x16", {"seq": 32768, "gbs": 32}, {"mbs": (1,)}, 80),
    (str(HF / "gemma-3-27b.json"), "h100x32", {"seq": 32768, "gbs": 64}, {"mbs": (1,)}, 60),
    (str(HF / "gemma-2-9b.json"), "h100x16", {"seq": 16384, "gbs": 64}, {"mbs": (1, 2)}, 60),
    (str(HF / "olmo-2-7b.json"), "h100x8", {}, {"mbs": (1, 2)}, 50),
    (str(HF / "llama-4-maverick.json"), "h100x64", {"seq": 16384, "gbs": 128}, {"mbs": (1,)}, 60),
    ("llama3-8b", "h200x8", {}, {"wide": True}, 60),
    ("llama3-70b", "gb200x72", {"precision": "mxfp8"}, {"mbs": (1, 2)}, 100),
    ("qwen3-30b-a3b", "gb200x72", {"precision": "nvfp4", "gbs": 512}, {"mbs": (1, 2)}, 80),
    ("llama3.1-8b", "b200x8", {"precision": "fp8"}, {"mbs": (1, 2)}, 60),
    ("mixtral-8x7b", "h100x32", {}, {"mbs": (1, 2)}, 60),
]

# explicit pipeline splits (TrainConfig fields) on top of the spaces
SPLITS = [
    ("llama3.1-405b", "h100x1024", {"tp": 8, "pp": 8, "cp": 2, "vp": 8, "gbs": 1536, "account_for_embedding": True,
                                    "account_for_loss": True}),
    ("deepseek-v3", "h100x1024", {"tp": 2, "pp": 8, "ep": 64, "seq": 4096, "gbs": 8192,
                                  "vp": 4, "pipeline_layout": "Et|(tt|)*30L", "recompute": "full"}),
    ("llama3-70b", "h100x64", {"tp": 8, "pp": 4, "vp": 5, "gbs": 128}),
    ("llama3-70b", "h100x64", {"tp": 4, "pp": 4, "gbs": 256, "pp_first_layers": 18, "pp_last_layers": 18}),
    ("llama3-70b", "h100x64", {"tp": 8, "pp": 8, "gbs": 256, "pp_first_layers": 7, "pp_last_layers": 7,
                               "recompute": "selective"}),
]

STACKS = [("local", "h100"), ("te", "h100"), ("te", "gb200")]


def resolve_space(model: str, cluster: str, wl_over: dict, opts: dict):
    from advisor.api import default_workload, resolve
    from advisor.search_spaces.space import SpaceOptions, Workload, enumerate_layouts

    m, c = resolve(model_path(model), cluster)
    base = default_workload(m, c)
    wl = Workload(seq=wl_over.get("seq", base.seq), gbs=wl_over.get("gbs", base.gbs),
                  precision=wl_over.get("precision", base.precision))
    o = dict(opts)
    options = SpaceOptions.wide(**{k: v for k, v in o.items() if k != "wide"}) if o.pop("wide", False) else \
        SpaceOptions(**o)
    return m, c, list(enumerate_layouts(m, c, wl, options))


def cfg_fields(cfg) -> dict:
    """The TrainConfig fields that differ from the defaults (enough to build it again)."""
    from advisor.catalog.specs import TrainConfig

    dft = TrainConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(dft, f.name)}


def pick(cfgs: list, n: int) -> list:
    if len(cfgs) <= n:
        return list(cfgs)
    step = len(cfgs) / n
    return [cfgs[int(i * step)] for i in range(n)]


def entries() -> list[dict]:
    """Every entry's arguments (no results): what --write computes and the test recomputes."""
    out = []
    for model, cluster, wl, opts, n in SPACES:
        m, c, cfgs = resolve_space(model, cluster, wl, opts)
        name = Path(model).stem
        chosen = pick(cfgs, n)
        for i, cfg in enumerate(chosen):
            base = {"model": model, "cluster": cluster, "cfg": cfg_fields(cfg)}
            out.append({"id": f"predict/{name}/{cluster}/{cfg.key()}", "call": "predict", **base})
            if cfg.pp > 1 and i % 6 == 0:  # several caps; one cap per stage
                cap = (250.0, 400.0, 550.0)[(i // 6) % 3]
                out.append({"id": f"capped/{name}/{cluster}/{cap:.0f}/{cfg.key()}", "call": "predict", "cap": cap,
                            **base})
                lo, hi = c.gpu.min_power_limit_w, c.gpu.max_power_limit_w
                caps = [lo + (hi - lo) * ((k * 7 + i) % 5) / 4 for k in range(cfg.pp)]
                out.append({"id": f"stage_caps_power/{name}/{cluster}/{cfg.key()}", "call": "estimate_power",
                            "caps": caps, **base})
            if cfg.pp > 1 and i % 20 == 3:
                out.append({"id": f"stage_caps/{name}/{cluster}/{cfg.key()}", "call": "stage_caps", **base})
            if i % 10 == 5:
                for f in (1.15, 0.97):
                    out.append({"id": f"power_at_step/{name}/{cluster}/{f}/{cfg.key()}", "call": "power_at_step",
                                "factor": f, **base})
            if i % 10 == 7:
                sm = [0.6 + 0.4 * ((k * 3 + i) % 4) / 3 for k in range(cfg.pp)]
                mem = [1.0 if k % 2 else 0.85 for k in range(cfg.pp)]
                out.append({"id": f"clocks/{name}/{cluster}/{cfg.key()}", "call": "step_time", "sm_clock": sm,
                            "mem_clock": mem, **base})
            if cfg.pp > 1 and cfg.vp == 1 and i % 15 == 2 and m.num_layers > cfg.pp:
                counts = list(_uneven(m.num_layers, cfg.pp))
                out.append({"id": f"split_memory/{name}/{cluster}/{cfg.key()}", "call": "stage_memory",
                            "layer_counts": counts, **base})
            if cfg.pp > 1 and i % 40 == 11:
                out.append({"id": f"stage_heat/{name}/{cluster}/{cfg.key()}", "call": "stage_heat", **base})
    for model, cluster, fields in SPLITS:
        from advisor.catalog.specs import TrainConfig

        from advisor.api import resolve

        m, c = resolve(model_path(model), cluster)
        cfg = TrainConfig(dp=c.world_size // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)),
                          **fields)
        base = {"model": model, "cluster": cluster, "cfg": cfg_fields(cfg)}
        out.append({"id": f"predict/{model}/{cluster}/{cfg.key()}", "call": "predict", **base})
        out.append({"id": f"stage_caps/{model}/{cluster}/{cfg.key()}", "call": "stage_caps", **base})
    for stack, gpu in STACKS:
        for model, cluster, wl, opts in (("llama3-70b", f"{gpu}x32", {}, {"mbs": (1, 2)}),
                                         ("mixtral-8x22b", f"{gpu}x16", {}, {"mbs": (1, 2)})):
            if gpu == "gb200":
                cluster = "gb200x72"
            m, c, cfgs = resolve_space(model, cluster, wl, dict(opts, tp_comm_overlap=stack == "te"))
            out.append({"id": f"calibrated/{stack}/{model}/{cluster}", "call": "calibrated", "stack": stack,
                        "model": model, "cluster": cluster, "cfgs": [cfg_fields(x) for x in pick(cfgs, 40)]})
    return out


def _uneven(n: int, pp: int) -> list[int]:
    """A split other than the even one: one layer less on the first and last stage."""
    base = [n // pp] * pp
    for k in range(n - sum(base)):
        base[k % pp] += 1
    if pp > 2 and base[0] > 1 and base[-1] > 1:
        base[0] -= 1
        base[-1] -= 1
        base[1] += 1
        base[-2] += 1
    return base


def run(entry: dict):
    """The entry's call on this tree, as plain JSON values."""
    from advisor.api import resolve
    from advisor.catalog import with_power_cap
    from advisor.catalog.specs import TrainConfig
    from advisor.models import DEFAULT
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.memory import peak_memory_gib, stage_memory
    from advisor.models.power import estimate_power, power_at_step, stage_caps
    from advisor.models.predict import predict
    from advisor.models.step_time import stage_times, step_time
    from advisor.placement.stage_heat import stage_heat

    m, c = resolve(model_path(entry["model"]), entry["cluster"])
    call = entry["call"]
    if call == "calibrated":
        cal = resolve_calibration("default", entry["stack"], c.gpu)
        cfgs = [TrainConfig(**f) for f in entry["cfgs"]]
        return [p.to_dict() for p in cal.predict_many(m, c, cfgs, check_legal=False)]
    cfg = TrainConfig(**entry["cfg"])
    if call == "predict":
        cl = with_power_cap(c, entry["cap"]) if "cap" in entry else c
        p = predict(m, cl, cfg, DEFAULT, check_legal=False)
        out = {"prediction": p.to_dict(), "peak_memory_gib": peak_memory_gib(m, cfg, DEFAULT, gpu=c.gpu)}
        if "cap" not in entry:  # every stage's times and memory, at the maximum clocks
            out["step"] = step_time(m, c, cfg, DEFAULT).to_dict()
            out["memory"] = [s.to_dict() for s in stage_memory(m, cfg, DEFAULT, gpu=c.gpu)]
        return out
    if call == "estimate_power":
        return estimate_power(m, c, cfg, DEFAULT, caps=entry["caps"]).to_dict()
    if call == "stage_caps":
        return stage_caps(m, c, cfg, DEFAULT).to_dict()
    if call == "power_at_step":
        step = step_time(m, c, cfg, DEFAULT).step_time_s * entry["factor"]
        e = power_at_step(m, c, cfg, step, DEFAULT)
        return {"power": e.to_dict(), "step": e.step.to_dict()}
    if call == "step_time":
        return step_time(m, c, cfg, DEFAULT, sm_clock=entry["sm_clock"], mem_clock=entry["mem_clock"],
                         stages=stage_times(m, c, cfg, DEFAULT)).to_dict()
    if call == "stage_memory":
        return [s.to_dict() for s in stage_memory(m, cfg, DEFAULT, layer_counts=entry["layer_counts"], gpu=c.gpu)]
    if call == "stage_heat":
        return [h.to_dict() for h in stage_heat(m, c, cfg, DEFAULT)]
    raise ValueError(call)


def model_path(name: str) -> str:
    """A frozen entry's model: a catalog name, or an HF config path relative to this checkout."""
    return str(ROOT / name) if name.endswith(".json") and not Path(name).is_absolute() else name


def plain(v):
    """JSON round trip (tuples become lists, as in the file); paths inside this checkout (a
    calibrated prediction's profile file) relative to it, so any checkout or worktree compares."""
    root = json.dumps(str(ROOT) + "/")[1:-1]
    return json.loads(json.dumps(v).replace(root, ""))


def diff(a, b, path="") -> list[str]:
    """Where two JSON values differ: floats beyond RTOL (relative), anything else at all."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        if (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= RTOL * max(abs(a), abs(b)):
            return []
        return [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


def load(path: Path = FILE) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["entries"]


def checkout_relative(v):
    """A JSON value with the paths of a packaged file (a calibration profile's `file`) taken from
    the checkout's root on: the file written on one checkout holds on another."""
    if isinstance(v, dict):
        return {k: checkout_relative(x) for k, x in v.items()}
    if isinstance(v, list):
        return [checkout_relative(x) for x in v]
    if isinstance(v, str) and v.startswith("/") and "/models/data/" in v:
        return "<ROOT>/models/data/" + v.split("/models/data/", 1)[1]
    return v


def check(frozen: list[dict], only: str | None = None) -> list[str]:
    bad = []
    for e in frozen:
        if only and only not in e["id"]:
            continue
        args = {k: v for k, v in e.items() if k != "out"}
        bad += [f"{e['id']}{d}" for d in diff(checkout_relative(plain(run(args))), checkout_relative(e["out"]))]
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="write the frozen file from this tree")
    ap.add_argument("--check", action="store_true", help="compare this tree with the frozen file (the default)")
    ap.add_argument("-k", default=None, help="only the entries whose id contains this")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.write:
        es = entries()
        for e in es:
            e["out"] = plain(run(e))
        FILE.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(FILE, "wt", compresslevel=9) as f:
            json.dump({"rtol": RTOL, "entries": es}, f, separators=(",", ":"))
        kinds = {}
        for e in es:
            kinds[e["call"]] = kinds.get(e["call"], 0) + 1
        print(f"{len(es)} entries {kinds} -> {FILE.relative_to(ROOT)} ({FILE.stat().st_size / 1e6:.2f} MB, "
              f"{time.perf_counter() - t0:.0f} s)")
        return 0
    frozen = load()
    bad = check(frozen, a.k)
    n = sum(1 for e in frozen if not a.k or a.k in e["id"])
    if bad:
        print(f"{len(bad)} differences in {n} entries (first 20):\n" + "\n".join(bad[:20]))
        return 1
    print(f"{n} entries match at rtol {RTOL} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

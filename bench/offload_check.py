"""Activation offloading to host memory (TrainConfig.cpu_offload_layers, issues #27 / #25): the
published GB200 recipe that offloads, and the 4 x H100 campaign batch, predicted (and measured).

    python bench/offload_check.py                    # GB200 row 161 with 0 / 20 / 40 layers offloaded,
                                                     # then bench/te_campaign.py's x4-te-s26-offload jobs
    python bench/offload_check.py DATA.jsonl ...     # the same jobs beside their measured records

Row 161 (llama3-70b, 64 x GB200, Megatron FSDP, mbs 2, seq 8192, FP8; NVIDIA's recipe
LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS_V1 sets cpu_offloading_num_layers=40) with the te stack's
layout defaults, as the row gives its FP8 recipe and with current scaling (tensorwise, "CS").
Memory: models.memory's fullest stage with the te profile's screening constants (what the
recommend screen uses: StageMemory.total_gib, in torch's allocator); speed: the te profile's
calibrated prediction. The campaign's jobs as the runner runs them (runners/megatron_args.runner_config);
"wait" is the exposed copy time per microbatch (models/offload.py, in the stage's overhead).
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _copy_terms(model, cluster, cfg, c) -> dict:
    """The exposed wait per microbatch (ms), one layer's activations (GB), its copy over the host
    link (ms) and one layer's forward (ms): the stage's forward over its layers."""
    from advisor.models.memory import layer_activation_bytes
    from advisor.models.step_time import stage_times

    on, off = stage_times(model, cluster, cfg, c)[0], stage_times(model, cluster, cfg.replace(cpu_offload_layers=0), c)[0]
    b = layer_activation_bytes(model, 0, cfg, c)
    return {"wait_ms": 1e3 * (on.overhead_s - off.overhead_s), "layer_gb": b / 1e9,
            "copy_ms": 1e3 * b / (cluster.gpu.host_link_gbs * 1e9 * c.host_link_efficiency),
            "fwd_ms": 1e3 * off.forward_s / model.num_layers}


def recipe_rows(row_id: str = "161") -> list[dict]:
    from advisor.models import published
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.memory import peak_memory_gib
    from advisor.models.profiles import apply_layout_defaults

    r = next(x for x in published.load() if x.row_id == row_id)
    cal = resolve_calibration("default", "te")
    c = cal.screening_constants
    base = apply_layout_defaults(r.cfg, "te", r.explicit)
    out = []
    for recipe in dict.fromkeys((base.fp8_recipe, "tensorwise")):
        for n in (0, 20, 40):
            cfg = base.replace(fp8_recipe=recipe, cpu_offload_layers=n)
            p = cal.predict(r.model, r.cluster, cfg)
            out.append({"row": row_id, "gpu": r.gpu_type, "recipe": recipe, "offload": n,
                        "gib": peak_memory_gib(r.model, cfg, c, gpu=r.cluster.gpu), "usable_of": r.cluster.gpu.memory_gib,
                        "tok_s_gpu": p.tokens_per_s_per_gpu, "measured_tok_s_gpu": r.tokens_per_s_per_gpu,
                        **_copy_terms(r.model, r.cluster, cfg, c)})
    return out


def campaign_rows(paths: list[str]) -> list[dict]:
    from advisor.catalog import load_cluster
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.memory import peak_memory_gib
    from advisor.runners import measure as M
    from te_campaign import s26_offload

    from advisor.runners.records import read_jsonl

    measured = {rec["id"]: rec for p in paths for rec in read_jsonl(p) if rec.get("id", "").startswith("te-l8bo-")}
    cal = resolve_calibration("default", "te")
    c = cal.screening_constants
    cluster = load_cluster("h100x4")
    out = []
    for line in s26_offload():
        e = M.entry_from_line(line, 4)
        cfg = e.config
        p = cal.predict(e.model, cluster, cfg)
        rec = measured.get(e.id) or {}
        out.append({"id": e.id, "seq": cfg.seq, "mbs": cfg.mbs, "offload": cfg.cpu_offload_layers,
                    "gib": peak_memory_gib(e.model, cfg, c, gpu=cluster.gpu), "step_s": p.step_time_s,
                    **_copy_terms(e.model, cluster, cfg, c), "status": rec.get("status", "-"),
                    "meas_gib": (rec.get("memory") or {}).get("max_reserved_gib"),
                    "meas_step_s": (rec.get("steps") or {}).get("median_s")})
    return out


def _copy_cells(r: dict) -> str:
    return f"{r['layer_gb']:8.2f} {r['copy_ms']:8.1f} {r['fwd_ms']:13.1f} {r['wait_ms']:19.1f}"


def main(argv: list[str]) -> int:
    copy = "layer GB  copy ms  fwd ms/layer  wait ms/microbatch"
    print(f"row  gpu    fp8 recipe  offload  GiB (of)        tok/s/GPU (measured)  {copy}")
    for r in recipe_rows():
        print(f"{r['row']:<4} {r['gpu']:<6} {r['recipe']:<11} {r['offload']:>7}  {r['gib']:6.1f} ({r['usable_of']:.0f})"
              f"  {r['tok_s_gpu']:9,.0f} ({r['measured_tok_s_gpu']:,.0f})  {_copy_cells(r)}")
    print(f"\nid                  seq   mbs offload  GiB   step s  {copy}  | measured: status  GiB   step s")
    for r in campaign_rows(argv):
        mg = f"{r['meas_gib']:5.1f}" if r["meas_gib"] is not None else "    -"
        ms = f"{r['meas_step_s']:7.3f}" if r["meas_step_s"] is not None else "      -"
        print(f"{r['id']:<19} {r['seq']:>5} {r['mbs']:>4} {r['offload']:>7} {r['gib']:5.1f} {r['step_s']:7.3f}  "
              f"{_copy_cells(r)}  | {r['status']:>8} {mg} {ms}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

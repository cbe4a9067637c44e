"""Predicted memory and step time of the fit set's H100 Qwen3-30B-A3B and DeepSeek-V3 rows
(models.published.load()) with selective recompute of named modules (TrainConfig.recompute_modules,
issue #27), each row with the te stack's layout defaults and the te profile, as bench/memory_edge.py
predicts the recipes. Megatron-Bridge's H100 recipes: DeepSeek-V3 1024 GPUs ["mla_up_proj", "mlp"]
(src/megatron/bridge/recipes/deepseek/h100/deepseek_v3.py); Qwen3-30B-A3B 16 GPUs no recompute
(qwen/h100/qwen3_moe.py), so its module sets here are the MoE ones other recipes name.

    python bench/recompute_recipes.py
"""
from __future__ import annotations

from advisor.models import published as P
from advisor.models.calibrate import resolve_calibration
from advisor.models.memory import peak_memory_gib, stage_memory
from advisor.models.profiles import apply_layout_defaults
from advisor.models.step_time import step_time
from advisor.search_spaces.layout import violations

MODULES = {"qwen3_30b_a3b": [(), ("moe_act",), ("layernorm", "moe_act"), ("moe",)],
           "deepseek_v3": [(), ("mla_up_proj",), ("mla_up_proj", "mlp"), ("mla_up_proj", "layernorm", "moe_act")]}


def main() -> int:
    c = resolve_calibration("default", "te").screening_constants
    seen = set()
    for r in P.load():
        if not (r.usable and r.gpu_type == "H100" and r.model_key in MODULES):
            continue
        base = apply_layout_defaults(r.cfg, "te", r.explicit)
        if base.key() in seen:
            continue
        seen.add(base.key())
        print(f"row {r.row_id} {r.model.name} {base.key()}")
        for rc, mods in [("none", ())] + [("selective", m) for m in MODULES[r.model_key]]:
            cfg = base.replace(recompute=rc, recompute_modules=mods)
            bad = violations(r.model, None, cfg)
            top = max(stage_memory(r.model, cfg, c, gpu=r.cluster.gpu), key=lambda s: s.total_gib)
            name = ("+".join(mods) or "(default: core_attn)") if rc == "selective" else ""
            print(f"  {rc:9} {name:30} peak {peak_memory_gib(r.model, cfg, c, gpu=r.cluster.gpu):5.1f} GiB (stage {top.stage}: "
                  f"activations {top.activations_gib:4.1f})  step {step_time(r.model, r.cluster, cfg, c).step_time_s:6.2f} s"
                  + (f"  illegal: {bad[0]}" if bad else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

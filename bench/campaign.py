"""Measurement campaign: write the config batches, run one on the local GPUs, summarise a dataset.

    python bench/campaign.py write                      # bench/campaign_configs/*.jsonl
    python bench/campaign.py run h200x4-a --out DIR     # advisor measure --batch ... (on GPUs)
    python bench/campaign.py table data/measurements/h200x4-campaign.jsonl

Each batch line is {"model": name | ModelSpec dict, "layers": n, <TrainConfig keys>, steps,
warmup, min_seconds, save_trace}; all lines of one batch use the same world size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "campaign_configs"

# gpt3-2.7b (Brown et al. 2020, Table 2.1): not in the catalog, given inline.
GPT3_2_7B = {"name": "gpt3-2.7b", "num_layers": 32, "hidden_size": 2560, "ffn_hidden_size": 10240,
             "num_attention_heads": 32, "vocab_size": 50257, "activation": "gelu",
             "normalization": "layernorm", "position_embedding": "learned",
             "max_position_embeddings": 2048, "add_bias_linear": True, "tied_embeddings": True,
             "family": "gpt", "source": "Brown et al. 2020 (GPT-3 paper), Table 2.1"}

QUICK = {"warmup": 2, "steps": 4}
SWEEP = {"warmup": 2, "steps": 6, "min_seconds": 18.0, "max_steps": 200, "save_trace": True}


def h200x4_a() -> list[dict]:
    """Feature coverage and a layout grid on a llama3-8b proxy (full width, 8 layers)."""
    L = {"model": "llama3-8b", "layers": 8, "seq": 4096, "gbs": 32, **QUICK}
    rows = [
        dict(L, dp=4, mbs=1),
        dict(L, dp=4, mbs=1, distributed_optimizer=False),
        dict(L, dp=4, mbs=2),
        dict(L, dp=4, mbs=4),
        dict(L, tp=2, dp=2, mbs=1),
        dict(L, tp=2, dp=2, mbs=2),
        dict(L, tp=4, dp=1, mbs=1),
        dict(L, tp=4, dp=1, mbs=4),
        dict(L, pp=2, dp=2, mbs=1),
        dict(L, pp=2, dp=2, mbs=1, vp=2),
        dict(L, pp=4, dp=1, mbs=1),
        dict(L, pp=4, dp=1, mbs=1, vp=2),
        dict(L, tp=2, pp=2, dp=1, mbs=1, save_trace=True),
        dict(L, tp=2, pp=2, dp=1, mbs=2, vp=2),
        dict(L, dp=4, mbs=2, recompute="selective"),
        dict(L, dp=4, mbs=2, recompute="full"),
        dict(L, tp=2, pp=2, dp=1, mbs=2, recompute="full"),
        dict(L, tp=2, dp=2, mbs=1, recompute="selective"),
        dict(L, dp=4, mbs=1, seq=8192, gbs=16),
        # refused before launch (megatron-core without TE)
        dict(L, tp=2, dp=2, mbs=1, sequence_parallel=True),
        dict(L, cp=2, dp=2, mbs=1),
        # OOM provocation: full 32-layer llama3-8b, plain Adam (16 B/param = 128 GB) + activations
        {"model": "llama3-8b", "seq": 4096, "dp": 4, "mbs": 2, "gbs": 8,
         "distributed_optimizer": False, **QUICK},
        # the run goes on after the OOM (restart at the next job)
        dict(L, tp=2, pp=2, dp=1, mbs=2),
        # MoE: mixtral-8x7b proxy (4 layers, 8 experts top-2), expert parallel
        {"model": "mixtral-8x7b", "layers": 4, "seq": 4096, "gbs": 16, "dp": 4, "ep": 4, "mbs": 1,
         "save_trace": True, **QUICK},
        {"model": "mixtral-8x7b", "layers": 4, "seq": 4096, "gbs": 16, "dp": 4, "ep": 2, "mbs": 1, **QUICK},
        {"model": "mixtral-8x7b", "layers": 4, "seq": 4096, "gbs": 16, "tp": 2, "dp": 2, "ep": 2, "mbs": 1, **QUICK},
    ]
    return rows


def h200x4_b() -> list[dict]:
    """A GPT-3-style shape (gelu, LayerNorm, MHA, learned positions, tied embeddings) and long
    micro-batch sweeps (>= 18 s of steady load each) that show power-cap throttling."""
    G = {"model": GPT3_2_7B, "layers": 8, "seq": 2048, "gbs": 64, **QUICK}
    rows = [
        dict(G, dp=4, mbs=1), dict(G, dp=4, mbs=2), dict(G, dp=4, mbs=4), dict(G, dp=4, mbs=8),
        dict(G, tp=2, dp=2, mbs=2), dict(G, tp=2, dp=2, mbs=4), dict(G, tp=4, dp=1, mbs=4),
        dict(G, pp=2, dp=2, mbs=2), dict(G, pp=2, dp=2, mbs=2, vp=2), dict(G, pp=4, dp=1, mbs=2, vp=2),
        dict(G, dp=4, mbs=4, recompute="selective"), dict(G, dp=4, mbs=4, recompute="full"),
    ]
    S = {"model": "llama3-8b", "layers": 8, "seq": 4096, "gbs": 64, **SWEEP}
    sweeps = [dict(S, dp=4, mbs=m) for m in (1, 2, 4, 8)] + [dict(S, tp=2, dp=2, mbs=m) for m in (1, 4)]
    return sweeps + rows


def h100x1() -> list[dict]:
    """One H100: llama3-8b proxy (4 layers) micro-batch sweep; the largest may OOM in-process."""
    S = {"model": "llama3-8b", "layers": 4, "seq": 4096, "gbs": 16, "dp": 1,
         "distributed_optimizer": False, "overlap_grad_reduce": False, **SWEEP, "min_seconds": 12.0}
    rows = [dict(S, mbs=m) for m in (1, 2, 4, 8)]
    rows += [dict(S, mbs=4, recompute="selective"), dict(S, mbs=8, recompute="full"),
             dict(S, mbs=16, save_trace=False)]
    return rows


RERUN = ["a-23", "a-24", "a-25", "a-22", "b-13", "b-14", "b-15", "b-16", "b-17", "a-01", "a-03",
         "a-04", "a-06", "a-07", "a-09", "a-11", "a-12", "a-14", "a-16", "a-18", "b-08", "b-11"]


def h200x4_rerun() -> list[dict]:
    """Second call: jobs the first call did not reach, and the jobs whose peak memory included
    memory leaked by earlier jobs of the same worker (fixed in megatron_worker.release)."""
    rows = {f"a-{i:02d}": r for i, r in enumerate(h200x4_a())}
    rows.update({f"b-{i:02d}": r for i, r in enumerate(h200x4_b())})
    return [dict(rows[k], id=f"h200x4-{k}") for k in RERUN]


def h200x4_full() -> list[dict]:
    """llama3-8b at full depth (32 layers) on one 4-GPU node: TP=4 and TP x PP inside NVLink (the
    4-GPU version of the 8-GPU full-node issue's TP=8 / TP x PP runs)."""
    L = {"model": "llama3-8b", "seq": 4096, "gbs": 32, **QUICK}
    return [
        dict(L, tp=4, mbs=1),
        dict(L, tp=4, mbs=2),
        dict(L, tp=2, pp=2, mbs=1),
        dict(L, tp=2, pp=2, vp=2, mbs=1),
        dict(L, pp=4, mbs=1),
        dict(L, pp=4, vp=2, mbs=1),
        dict(L, tp=2, dp=2, mbs=1),
        dict(L, dp=4, mbs=1),
    ]


# ---- mixture of experts (docs/moe.md): three proxy shapes at full width, few layers, the
# vocabulary cut to 32000 so that the MoE layers dominate the step. Each MoE job also times its
# router / permute / dispatch / experts sub-steps (runners/moe_probe.py).
_MOE_SRC = " (proxy: layers cut, vocabulary 32000 instead of {v})"
MIXTRAL_PROXY = {"name": "mixtral-8x7b-proxy", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
                 "num_attention_heads": 32, "num_query_groups": 8, "vocab_size": 32000,
                 "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 14336}, "family": "mixtral",
                 "source": "mistralai/Mixtral-8x7B-v0.1 config.json" + _MOE_SRC.format(v=32000)}
QWEN3_PROXY = {"name": "qwen3-30b-a3b-proxy", "num_layers": 48, "hidden_size": 2048, "ffn_hidden_size": 6144,
               "num_attention_heads": 32, "num_query_groups": 4, "kv_channels": 128, "vocab_size": 32000,
               "moe": {"num_experts": 128, "top_k": 8, "ffn_hidden_size": 768}, "family": "qwen3",
               "source": "Qwen/Qwen3-30B-A3B config.json" + _MOE_SRC.format(v=151936)}
DEEPSEEK_PROXY = {"name": "deepseek-v2-lite-proxy", "num_layers": 27, "hidden_size": 2048, "ffn_hidden_size": 10944,
                  "num_attention_heads": 16, "kv_channels": 128, "vocab_size": 32000,
                  "moe": {"num_experts": 64, "top_k": 6, "ffn_hidden_size": 1408, "num_shared_experts": 2,
                          "shared_ffn_hidden_size": 2816, "first_dense_layers": 1, "dense_ffn_hidden_size": 10944},
                  "mla": {"q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                          "v_head_dim": 128},
                  "family": "deepseek",
                  "source": "deepseek-ai/DeepSeek-V2-Lite config.json (MLA, 2 shared experts, first layer dense)"
                            + _MOE_SRC.format(v=102400)}
# a fourth MoE shape, measured first on the te stack (session 29): 64 fine-grained experts top-8,
# no shared expert, full multi-head attention (16 heads, 16 key-value groups); OLMoE's QK-norm left
# out, as the Qwen3 proxy's is
OLMOE_PROXY = {"name": "olmoe-1b-7b-proxy", "num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 1024,
               "num_attention_heads": 16, "num_query_groups": 16, "kv_channels": 128, "vocab_size": 32000,
               "moe": {"num_experts": 64, "top_k": 8, "ffn_hidden_size": 1024}, "family": "olmoe",
               "source": "allenai/OLMoE-1B-7B-0924 config.json (QK-norm left out)" + _MOE_SRC.format(v=50304)}
# gpt-oss-120b at full width with its own features (a 128-token sliding window on every other
# layer, a learned sink logit per head, the clamped quick-GeGLU, biases on every linear) and 16 of
# its 128 experts, top-4: on one GPU a micro-batch of 4096 tokens gives each expert 1,024 tokens,
# the shape one GPU of NVIDIA's published H100 recipe (EP8: 16 local experts, each fed by 8 ranks'
# 4096 x 4 / 128 tokens) runs (session 34, issue #24)
GPTOSS_PROXY = {"name": "gpt-oss-120b-proxy", "num_layers": 36, "hidden_size": 2880, "ffn_hidden_size": 2880,
                "num_attention_heads": 64, "num_query_groups": 8, "kv_channels": 64, "vocab_size": 32000,
                "add_bias_linear": True, "qkv_bias": True, "window_size": 128, "window_pattern": [1, 0],
                "attention_sinks": True, "activation_clamp": 7.0,
                "moe": {"num_experts": 16, "top_k": 4, "ffn_hidden_size": 2880}, "family": "gpt-oss",
                "source": "openai/gpt-oss-120b config.json, 16 of its 128 experts (EP8's local share)"
                          + _MOE_SRC.format(v=201088)}
MOE_RUN = {"seq": 4096, "dp": 1, "distributed_optimizer": False, "overlap_grad_reduce": False,
           "warmup": 2, "steps": 4}


def _moe_shape(model: dict, layers: int, **kw) -> dict:
    return {"model": model, "layers": layers, **MOE_RUN, **kw}


def _moe_variants(base: dict, grouped: bool) -> list[dict]:
    """Micro-batch, sequence, router and dispatcher variants of one shape on one GPU."""
    g = {"moe_grouped_gemm": grouped}
    return [dict(base, mbs=1, gbs=4, **g), dict(base, mbs=2, gbs=8, **g), dict(base, mbs=4, gbs=8, **g),
            dict(base, seq=2048, mbs=2, gbs=8, **g), dict(base, mbs=2, gbs=8, moe_router="forced", **g),
            dict(base, mbs=2, gbs=8, moe_dispatcher="allgather", **g)]


def h100x1_moe_a() -> list[dict]:
    """Mixtral- and Qwen3-MoE-like proxies, megatron-core's SequentialMLP (one GEMM per expert)."""
    return (_moe_variants(_moe_shape(MIXTRAL_PROXY, 2), False)
            + _moe_variants(_moe_shape(QWEN3_PROXY, 3), False))


def h100x1_moe_b() -> list[dict]:
    """The same with grouped-GEMM experts (torch._grouped_mm)."""
    return (_moe_variants(_moe_shape(MIXTRAL_PROXY, 2), True)[:4]
            + _moe_variants(_moe_shape(QWEN3_PROXY, 3), True)[:5])


def h100x1_moe_c() -> list[dict]:
    """DeepSeek-like proxy: multi-latent attention, 2 shared experts, first layer dense."""
    d = _moe_shape(DEEPSEEK_PROXY, 4)
    return _moe_variants(d, False)[:5] + _moe_variants(d, True)[:4]


# A fourth shape between Mixtral and Qwen3: Mixtral's width with 32 fine-grained experts, top-4
# (each a quarter of Mixtral's FFN): the same active FLOPs as Mixtral, 4x the experts.
FINE_PROXY = {"name": "mixtral-fine32-proxy", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
              "num_attention_heads": 32, "num_query_groups": 8, "vocab_size": 32000,
              "moe": {"num_experts": 32, "top_k": 4, "ffn_hidden_size": 3584}, "family": "mixtral",
              "source": "Mixtral-8x7B's attention and width with its experts split in four (fine-grained, "
                        "as Dai et al. 2024 DeepSeekMoE §3.1); vocabulary 32000"}


def h100x1_moe_d() -> list[dict]:
    """Second call: grouped-GEMM experts for real (the first call's 'grouped' jobs ran
    SequentialMLP: the spec patch missed megatron-core 0.19.2's partial(MoELayer) spec), the jobs
    the first call did not reach, and a fourth shape. Jobs that may run out of memory go last."""
    M, Q, D, F = (_moe_shape(MIXTRAL_PROXY, 2), _moe_shape(QWEN3_PROXY, 3), _moe_shape(DEEPSEEK_PROXY, 4),
                  _moe_shape(FINE_PROXY, 2))
    g = {"moe_grouped_gemm": True}
    s = {"moe_grouped_gemm": False}
    return [
        dict(Q, mbs=1, gbs=4, **g), dict(Q, mbs=2, gbs=8, **g), dict(Q, mbs=4, gbs=8, **g),
        dict(Q, seq=2048, mbs=2, gbs=8, **g), dict(Q, mbs=2, gbs=8, moe_router="forced", **g),
        dict(D, mbs=1, gbs=4, **g), dict(D, mbs=2, gbs=8, **g), dict(D, mbs=4, gbs=8, **g),
        dict(D, mbs=2, gbs=8, moe_router="forced", **g), dict(D, mbs=2, gbs=8, moe_dispatcher="allgather", **g),
        dict(M, mbs=1, gbs=4, **g), dict(M, mbs=1, gbs=4, moe_router="forced", **g),
        dict(F, mbs=1, gbs=4, **g), dict(F, mbs=2, gbs=8, **g), dict(F, mbs=1, gbs=4, **s),
        dict(F, mbs=2, gbs=8, moe_router="forced", **g),
        dict(Q, mbs=2, gbs=8, moe_dispatcher="allgather", **s), dict(D, seq=2048, mbs=2, gbs=8, **s),
        dict(M, seq=2048, mbs=2, gbs=8, **s), dict(M, mbs=1, gbs=4, moe_dispatcher="allgather", **s),
        dict(M, mbs=2, gbs=8, **g), dict(F, mbs=4, gbs=8, **g),
    ]


def moe_ep(world: int) -> list[dict]:
    """Expert parallelism over `world` GPUs of one node, in rounds so that a run cut short by its
    time budget still has every proxy at every EP: first EP 1 / 2 / 4 with the all-to-all
    dispatcher (the EP sweep), then the allgather dispatcher at the largest EP, micro-batch 2,
    allgather at EP world/2, SequentialMLP experts (grouped GEMM off), and EP 1 at micro-batch 2.
    Needs a multi-GPU kind (nvidia-h100-x2 / -x4 or H200)."""
    shapes = ((MIXTRAL_PROXY, 4), (QWEN3_PROXY, 6), (DEEPSEEK_PROXY, 5))
    eps = [e for e in (1, 2, 4, 8) if e <= world]
    top, half = world, max(1, world // 2)
    rounds = [dict(ep=e, mbs=1) for e in eps]
    rounds += [dict(ep=top, mbs=1, moe_dispatcher="allgather"), dict(ep=top, mbs=2),
               dict(ep=half, mbs=1, moe_dispatcher="allgather"), dict(ep=top, mbs=1, moe_grouped_gemm=False),
               dict(ep=1, mbs=2)]
    rows = []
    for knobs in rounds:
        for model, layers in shapes:
            base = {"model": model, "layers": layers, "seq": 4096, "dp": world, "warmup": 2, "steps": 4}
            rows.append(dict(base, gbs=4 * world * knobs["mbs"], **knobs))
    seen, out = set(), []
    for r in rows:  # at world 2 some rounds coincide (half == 1)
        k = json.dumps({k: v for k, v in r.items() if k != "model"} | {"m": r["model"]["name"]}, sort_keys=True)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def moe_mix() -> list[dict]:
    """MoE beside the EP sweep on 4 GPUs: PP 2 x EP 2, sequence 8K and 2K (micro-batch 4) at EP 4,
    the distributed optimizer at EP 4, and MoE under TP 2 (refused by the runner: megatron-core
    needs sequence parallelism for it, which needs Transformer Engine)."""
    shapes = ((MIXTRAL_PROXY, 4), (QWEN3_PROXY, 6), (DEEPSEEK_PROXY, 6))
    rounds = [dict(pp=2, dp=2, ep=2, mbs=1, gbs=16), dict(dp=4, ep=4, mbs=1, gbs=16, seq=8192),
              dict(dp=4, ep=4, mbs=4, gbs=64, seq=2048), dict(dp=4, ep=4, mbs=1, gbs=16, distributed_optimizer=True)]
    rows = [dict({"model": m, "layers": n, "seq": 4096, "warmup": 2, "steps": 4}, **k) for k in rounds for m, n in shapes]
    rows += [dict(model=m, layers=n, seq=4096, warmup=2, steps=4, tp=2, dp=2, ep=2, mbs=1, gbs=16) for m, n in shapes[:2]]
    rows.append(dict(model=MIXTRAL_PROXY, layers=4, seq=4096, warmup=2, steps=4, tp=2, dp=2, ep=2, etp=1, mbs=1, gbs=16))
    return rows


BATCHES = {"h200x4-a": h200x4_a, "h200x4-b": h200x4_b, "h200x4-rerun": h200x4_rerun, "h100x1": h100x1,
           "h200x4-full": h200x4_full, "h100x1-moe-a": h100x1_moe_a, "h100x1-moe-b": h100x1_moe_b,
           "h100x1-moe-c": h100x1_moe_c, "h100x1-moe-d": h100x1_moe_d, "x2-moe-ep": lambda: moe_ep(2), "x4-moe-ep": lambda: moe_ep(4),
           "x4-moe-mix": moe_mix}


def write(names: list[str] | None = None) -> None:
    CONFIGS.mkdir(exist_ok=True)
    for name, fn in BATCHES.items():
        if names and name not in names:
            continue
        rows = fn()
        with open(CONFIGS / f"{name}.jsonl", "w") as f:
            for i, r in enumerate(rows):
                f.write(json.dumps({"id": f"{name}-{i:02d}", **r}) + "\n")  # rerun rows keep theirs
        print(f"{CONFIGS / f'{name}.jsonl'}: {len(rows)} configs")


def run(name: str, out: Path, max_seconds: float | None, timeout: float,
        skip: list[Path] | None = None) -> int:
    """Run one batch through the launcher's Python API (the CLI's `measure --batch` does the same)."""
    from advisor.runners import measure as M

    out.mkdir(parents=True, exist_ok=True)
    world = M.local_gpu_count()
    entries = M.load_batch(CONFIGS / f"{name}.jsonl", world)
    done = {r["id"] for p in (skip or []) if p.exists() for r in M.read_jsonl(p)}
    entries = [e for e in entries if e.id not in done]
    t0 = time.time()

    def show(r):
        th, m, t = r.get("throughput") or {}, r.get("memory") or {}, r.get("telemetry") or {}
        print(f"[{time.time() - t0:5.0f}s] {r['status']:8s} {r['model']['name']:16s} {r['config']['tp']}/"
              f"{r['config']['pp']}/{r['config']['vp']}/{r['config']['dp']}/{r['config']['ep']} "
              f"mbs{r['config']['mbs']} {r['config']['recompute']:9s} "
              f"tok/s={th.get('tokens_per_s') or 0:9.0f} mfu={th.get('mfu') or 0:.3f} "
              f"mem={m.get('max_gib') or 0:6.1f} W={t.get('mean_power_w') or 0:4.0f} "
              f"minclk={t.get('min_sm_clock_mhz') or 0:5.0f} {(r.get('error') or '')[:150]}", flush=True)

    recs = M.run_batch(entries, out / f"{name}.jsonl", world, run_dir=out / "run", timeout=timeout,
                       trace_dir=out / "traces", max_seconds=max_seconds, on_record=show)
    print(f"[campaign] {name}: {len(recs)} records in {time.time() - t0:.0f} s", flush=True)
    with tarfile.open(out / f"{name}-files.tar.gz", "w:gz") as tar:
        for sub in ("run", "traces"):
            if (out / sub).exists():
                tar.add(out / sub, arcname=f"{name}/{sub}")
    return 0


def table(path: Path) -> None:
    rows = [json.loads(l) for l in open(path) if l.strip()]
    print("| model | tp | pp | vp | dp | ep | mbs | gbs | seq | recompute | status | step s | tokens/s | MFU | max GiB | mean W/GPU | peak W | min SM MHz | power-cap frac |")
    print("|" + "---|" * 19)
    for r in rows:
        c, th, m, t = r["config"], r.get("throughput") or {}, r.get("memory") or {}, r.get("telemetry") or {}
        st = r.get("steps") or {}
        thr = (t.get("throttle_fraction") or {}).get("sw_power_cap")

        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) else "-"
        print(f"| {r['model']['name']} | {c['tp']} | {c['pp']} | {c['vp']} | {c['dp']} | {c['ep']} | {c['mbs']} | "
              f"{c['gbs']} | {c['seq']} | {c['recompute']} | {r['status']} | {f(st.get('median_s'), '.3f')} | "
              f"{f(th.get('tokens_per_s'), ',.0f')} | {f(th.get('mfu'), '.3f')} | {f(m.get('max_gib'), '.1f')} | "
              f"{f(t.get('mean_power_w'), '.0f')} | {f(t.get('peak_power_w'), '.0f')} | "
              f"{f(t.get('min_sm_clock_mhz'), '.0f')} | {f(thr, '.2f')} |")
    tm = [r["timing"] for r in rows if isinstance(r.get("timing"), dict)]
    if tm:  # where the wall time went (records written since the timing block exists)
        def med(key):
            xs = [x[key] for x in tm if isinstance(x.get(key), (int, float))]
            return f"{statistics.median(xs):.1f} s (n={len(xs)})" if xs else "-"
        print(f"\nmedian torchrun start-up (first job of each torchrun) {med('startup_s')}; "
              f"model build per job {med('build_s')}; steps per job {med('run_s')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("names", nargs="*", help="only these batches (default: all)")
    r = sub.add_parser("run")
    r.add_argument("name", choices=sorted(BATCHES))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--max-seconds", type=float)
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--skip", type=Path, nargs="*", help="datasets whose ids are not run again")
    t = sub.add_parser("table")
    t.add_argument("path", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "write":
        write(a.names)
    elif a.cmd == "run":
        return run(a.name, a.out, a.max_seconds, a.timeout, a.skip)
    else:
        table(a.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

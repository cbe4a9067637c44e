"""Time Transformer Engine's fused attention with and without a sliding window (GPU).

For each head shape, sequence (8K / 16K / 32K) and window (1024 / 2048 / 4096, and none = full
causal), times forward + backward of ``transformer_engine.pytorch.DotProductAttention`` (bf16,
causal, ``window_size=(w - 1, 0)``: a query sees itself and w - 1 keys before it, HF's
``sliding_window = w``) with CUDA events: warmup, then the median of N. One JSON line per case to
the path given, and a table on stdout. Self-contained (torch + transformer_engine)::

    python bench/window_attention_gpu.py OUT.jsonl [--iters 20] [--batch 1]

bench/window_attention_check.py compares the advisor's predicted attention time with this file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# (name, query heads, kv heads, head dim): Llama-3-8B-like GQA; Gemma 2 9B; Gemma 3 27B
SHAPES = [("gqa-32q-8kv-128", 32, 8, 128), ("gemma2-9b-16q-8kv-256", 16, 8, 256),
          ("gemma3-27b-32q-16kv-128", 32, 16, 128)]
SEQS = (8192, 16384, 32768)
WINDOWS = (1024, 2048, 4096, 0)  # 0 = full causal attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSONL output path")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations (median taken)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    o = ap.parse_args(argv)
    os.environ.setdefault("NVTE_FUSED_ATTN", "1")  # cuDNN fused attention, what Megatron + TE runs
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te

    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name()
    rows = []
    with open(o.out, "w") as f:
        for name, hq, hkv, d in SHAPES:
            for seq in SEQS:
                for w in WINDOWS:
                    row = dict(shape=name, q_heads=hq, kv_heads=hkv, head_dim=d, seq=seq, window=w, batch=o.batch,
                               device=dev, te_version=transformer_engine.__version__, torch_version=torch.__version__)
                    try:
                        row.update(_time_case(torch, te, hq, hkv, d, seq, w, o.batch, o.warmup, o.iters))
                    except Exception as e:  # noqa: BLE001 - one case's failure (OOM, unsupported) is its row
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                        torch.cuda.empty_cache()
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    _print_row(row)
    return 0


def _time_case(torch, te, hq, hkv, d, seq, w, batch, warmup, iters) -> dict:
    attn = te.DotProductAttention(hq, d, num_gqa_groups=hkv, attention_dropout=0.0, qkv_format="bshd",
                                  attn_mask_type="causal", window_size=(w - 1, 0) if w else (-1, 0))
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(batch, seq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen,  # noqa: E731
                               requires_grad=True)
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    dout = torch.randn(batch, seq, hq * d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def fwd():
        return attn(q, k, v)

    def step():
        out = fwd()
        out.backward(dout)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = {"fwd": [], "fwd_bwd": []}
    for kind, fn in (("fwd", fwd), ("fwd_bwd", step)):
        for _ in range(iters):
            q.grad = k.grad = v.grad = None  # no gradient accumulation kernel in the timed backward
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if kind == "fwd":
                with torch.no_grad():
                    a.record()
                    fn()
                    b.record()
            else:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            times[kind].append(a.elapsed_time(b) / 1e3)
    fwd_s, fb_s = statistics.median(times["fwd"]), statistics.median(times["fwd_bwd"])
    return {"fwd_s": fwd_s, "fwd_bwd_s": fb_s, "bwd_s": fb_s - fwd_s,
            "fwd_s_min": min(times["fwd"]), "fwd_bwd_s_min": min(times["fwd_bwd"]), "iters": iters}


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['shape']:26s} seq {r['seq']:6d} window {r['window'] or 'full':>5} error: {r['error']}", flush=True)
        return
    print(f"{r['shape']:26s} seq {r['seq']:6d} window {r['window'] or 'full':>5}  fwd {r['fwd_s'] * 1e3:8.3f} ms"
          f"  fwd+bwd {r['fwd_bwd_s'] * 1e3:8.3f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())

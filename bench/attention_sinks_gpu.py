"""Transformer Engine's attention with gpt-oss's features, on one GPU: learnable softmax offsets
(attention sinks: TE's softmax_type="learnable"), a 128-token sliding window, both, against the plain
causal attention the model prices (issue #24: the published gpt-oss-120b rows run 30-50% slower than
the per-shape experts model predicts; docs/moe.md). Each case is TE DotProductAttention (GQA, sbhd),
forward + backward, in BF16, timed with CUDA events over back-to-back iterations, with its top GPU
kernels from torch.profiler (which backend TE chose: cuDNN's sm90 flash kernels, flash-attn, or the
unfused path's GEMMs and softmax kernels).

    python bench/attention_sinks_gpu.py OUT.jsonl       # on a GPU with TE; ~1 minute

One JSON line per case: shape, window, softmax type, ms per forward + backward, TFLOP/s of the causal
(or windowed) work, the kernels, the environment; a case TE refuses is recorded with its error.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# (label, heads, kv groups, head dim, seq, micro-batch)
SHAPES = [("gpt-oss-120b", 64, 8, 64, 4096, 1), ("gpt-oss-120b", 64, 8, 64, 8192, 1),
          ("llama3-8b", 32, 8, 128, 4096, 1)]
CASES = [("vanilla", None), ("learnable", None), ("vanilla", (128, 0)), ("learnable", (128, 0)),
         ("off-by-one", None)]


def attended_pairs(s: int, window) -> float:
    """Query-key pairs a causal (windowed) attention computes: s(s+1)/2, or ~s x (w+1)."""
    if window is None:
        return s * (s + 1) / 2.0
    w = window[0]
    return sum(min(i + 1, w + 1) for i in range(s))


def main(argv=None) -> int:
    from kernel_rates import te_out_path

    out = te_out_path(__doc__, Path(__file__).name, "sinks", argv)
    if out is None:
        return 2
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te

    from kernel_rates import timed_us

    from advisor.runners.kernel_probe import run_profiled, summarize

    try:  # torch's own cuDNN check fails where TE's cuDNN (the one attention runs) is older
        cudnn = torch.backends.cudnn.version()
    except RuntimeError as ex:
        cudnn = str(ex).split("found runtime version")[-1].split(".")[0].strip(" ()") or None
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformer_engine": getattr(transformer_engine, "__version__", None), "cudnn_runtime": cudnn}
    dev = torch.device("cuda:0")
    with out.open("a") as fh:
        for label, heads, groups, d, s, b in SHAPES:
            for softmax, window in CASES:
                row = {"shape": label, "heads": heads, "kv_groups": groups, "head_dim": d, "seq": s, "mbs": b,
                       "softmax_type": softmax, "window": window, "env": env}
                try:
                    kw = {"softmax_type": softmax} if softmax != "vanilla" else {}
                    attn = te.DotProductAttention(heads, d, num_gqa_groups=groups, attention_dropout=0.0,
                                                  qkv_format="sbhd", attn_mask_type="causal",
                                                  window_size=window, **kw).to(dev)
                    q = torch.randn(s, b, heads, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    k = torch.randn(s, b, groups, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    v = torch.randn(s, b, groups, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    g = torch.randn(s, b, heads * d, device=dev, dtype=torch.bfloat16)

                    def it():
                        o = attn(q, k, v)
                        o.backward(g.view_as(o))

                    ms = timed_us(torch, it, reps=20) / 1e3
                    events, walls, _ = run_profiled(it, 2, torch.cuda.synchronize)
                    summ = summarize(events, 2, walls, top=6)
                    flops = 4.0 * b * heads * d * attended_pairs(s, window) * 3.5  # fwd 2 GEMMs, bwd 2.5x
                    row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                               top=[(t["name"][:90], t["ms"]) for t in summ["top"]],
                               categories={c: v["ms"] for c, v in summ["categories"].items()})
                    del attn, q, k, v, g
                except Exception as ex:  # noqa: BLE001 - recorded, the next case goes on
                    row["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                torch.cuda.empty_cache()
                print(f"{label:13} s{s:<5} {softmax:10} window {str(window):9} "
                      + (f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TF/s  {row['top'][0][0][:60]}" if "ms" in row
                         else row["error"][:150]), flush=True)
                time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

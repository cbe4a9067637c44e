"""The Transformer Engine campaign (issue #22): the stack users run (TE layers and fused attention,
sequence parallelism, context parallelism, FP8, MoE with TP), measured on one 4-GPU node.

    python bench/te_campaign.py write            # bench/campaign_configs/x4-te-*.jsonl
    python bench/te_campaign.py rehearse         # CPU: every job's TransformerConfig is built
                                                 # by megatron-core (needs $REHEARSAL_PYTHON:
                                                 # Python 3.12 with torch + megatron-core)
    python bench/te_campaign.py run --budget 520 --out DIR   # on the GPUs, after TE is installed:
                                                 # the canary batch, then the main batches minus
                                                 # the features whose canary failed
    python bench/te_campaign.py predict [BATCH ...]  # te profile's predicted peak per job (default x4-te-edge)
    python bench/te_campaign.py table DATASET.jsonl ...
    python bench/te_campaign.py estimate [BATCH ...] [--budget 500]   # expected seconds per job
                                                 # and per batch, from the committed records

Every job is a batch line with "stack": "te". Its id names the model and the feature it covers
(te-<model>-<feature>-<n>), so a failed canary drops the jobs of its feature.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from campaign import DEEPSEEK_PROXY, GPT3_2_7B, GPTOSS_PROXY, MIXTRAL_PROXY, OLMOE_PROXY, QWEN3_PROXY  # noqa: E402  (beside this file)

CONFIGS = HERE / "campaign_configs"
RUN = {"warmup": 2, "steps": 5, "stack": "te"}


def _jobs(model, tag, rows, first=0, prefix="te", **common):
    """Batch lines <prefix>-<tag>-<feature>-<n>, n counting from `first` (later batches go on
    numbering where the earlier ones stopped: te_device.sh skips ids already measured)."""
    out = []
    for n, (feature, kw) in enumerate(rows, first):
        out.append({"model": model, **common, **RUN, **kw, "id": f"{prefix}-{tag}-{feature}-{n:02d}"})
    return out


def llama8b() -> list[dict]:
    """llama3-8b at full width, 8 layers, seq 4096, gbs 32: the dense grid and FP8."""
    rows = [
        ("dp", dict(dp=4, mbs=1)), ("dp", dict(dp=4, mbs=2)), ("dp", dict(dp=4, mbs=4)),
        ("cp", dict(cp=2, dp=2, mbs=2)), ("cp", dict(cp=2, dp=2, mbs=4)), ("cp", dict(cp=4, dp=1, mbs=4)),
        ("sp", dict(tp=2, dp=2, mbs=2, sequence_parallel=True)),
        ("sp", dict(tp=2, dp=2, mbs=4, sequence_parallel=True)),
        ("sp", dict(tp=4, dp=1, mbs=4, sequence_parallel=True)),
        ("tp", dict(tp=2, dp=2, mbs=2)),
        ("spcp", dict(tp=2, cp=2, dp=1, mbs=4, sequence_parallel=True)),
        ("pp", dict(pp=2, dp=2, mbs=2)), ("pp", dict(pp=2, vp=2, dp=2, mbs=1)),
        ("pp", dict(pp=4, vp=2, dp=1, mbs=1)),
        ("rc", dict(dp=4, mbs=4, recompute="selective")), ("rc", dict(dp=4, mbs=4, recompute="full")),
        ("fp8", dict(dp=4, mbs=2, precision="fp8")), ("fp8", dict(dp=4, mbs=4, precision="fp8")),
        ("fp8", dict(tp=2, dp=2, mbs=4, sequence_parallel=True, precision="fp8")),
        ("fp8", dict(cp=2, dp=2, mbs=4, precision="fp8")),
        ("fp8", dict(pp=2, dp=2, mbs=2, precision="fp8")),
        ("fp8", dict(tp=4, dp=1, mbs=4, sequence_parallel=True, precision="fp8")),
        ("fp8cs", dict(dp=4, mbs=4, precision="fp8", fp8_recipe="tensorwise")),
        ("dp", dict(dp=4, mbs=2, seq=8192, gbs=16)),
        ("cp", dict(cp=2, dp=2, mbs=1, seq=8192, gbs=16)),
    ]
    return _jobs("llama3-8b", "l8b", rows, layers=8, seq=4096, gbs=32)


def llama70b() -> list[dict]:
    """llama3-70b at full width (hidden 8192, 64 / 8 heads, FFN 28672), 4 layers, seq 4096, gbs 16."""
    rows = [
        ("sp", dict(tp=4, dp=1, mbs=1, sequence_parallel=True)),
        ("sp", dict(tp=4, dp=1, mbs=2, sequence_parallel=True)),
        ("sp", dict(tp=2, dp=2, mbs=1, sequence_parallel=True)),
        ("sp", dict(tp=2, dp=2, mbs=2, sequence_parallel=True)),
        ("spcp", dict(tp=2, cp=2, dp=1, mbs=1, sequence_parallel=True)),
        ("dp", dict(dp=4, mbs=1)),
        ("pp", dict(tp=2, pp=2, dp=1, mbs=1, sequence_parallel=True)),
        ("fp8", dict(tp=4, dp=1, mbs=2, sequence_parallel=True, precision="fp8")),
        ("fp8", dict(tp=2, dp=2, mbs=1, sequence_parallel=True, precision="fp8")),
        ("fp8", dict(dp=4, mbs=1, precision="fp8")),
    ]
    return _jobs("llama3-70b", "l70b", rows, layers=4, seq=4096, gbs=16)


def gpt3() -> list[dict]:
    """GPT-3 2.7B whole (32 layers; gelu, LayerNorm, MHA, learned positions), seq 2048, gbs 64."""
    rows = [
        ("dp", dict(dp=4, mbs=2)), ("dp", dict(dp=4, mbs=4)), ("dp", dict(dp=4, mbs=8)),
        ("sp", dict(tp=2, dp=2, mbs=4, sequence_parallel=True)),
        ("sp", dict(tp=4, dp=1, mbs=8, sequence_parallel=True)),
        ("pp", dict(pp=2, dp=2, mbs=4)),
        ("cp", dict(cp=2, dp=2, mbs=4)),
        ("fp8", dict(dp=4, mbs=4, precision="fp8")),
        ("fp8", dict(tp=2, dp=2, mbs=8, sequence_parallel=True, precision="fp8")),
    ]
    return _jobs(GPT3_2_7B, "gpt3", rows, seq=2048, gbs=64)


def nemotron() -> list[dict]:
    """nemotron4-15b at full width (squared ReLU, LayerNorm, 256K vocabulary), 8 layers, seq 4096."""
    rows = [
        ("dp", dict(dp=4, mbs=1)), ("dp", dict(dp=4, mbs=2)),
        ("sp", dict(tp=2, dp=2, mbs=2, sequence_parallel=True)),
        ("sp", dict(tp=4, dp=1, mbs=4, sequence_parallel=True)),
        ("pp", dict(pp=2, dp=2, mbs=2)),
        ("fp8", dict(dp=4, mbs=2, precision="fp8")),
    ]
    return _jobs("nemotron4-15b", "nem15", rows, layers=8, seq=4096, gbs=32)


def moe() -> list[dict]:
    """MoE proxies (full width, vocabulary 32000): Mixtral 8x7B (4 layers) and Qwen3-30B-A3B
    (6 layers): EP, MoE with TP (sequence parallel, expert TP), FP8, the allgather dispatcher."""
    mix = [
        ("ep", dict(dp=4, ep=4, mbs=1)), ("ep", dict(dp=4, ep=4, mbs=2)), ("ep", dict(dp=4, ep=2, mbs=1)),
        ("moetp", dict(tp=2, dp=2, ep=2, mbs=1, sequence_parallel=True)),
        ("moetp", dict(tp=2, dp=2, ep=2, etp=2, mbs=1, sequence_parallel=True)),
        ("moetp", dict(tp=4, dp=1, ep=1, etp=4, mbs=2, sequence_parallel=True)),
        ("fp8", dict(dp=4, ep=4, mbs=1, precision="fp8")),
        ("ag", dict(dp=4, ep=4, mbs=1, moe_dispatcher="allgather")),
        ("cp", dict(cp=2, dp=2, ep=2, mbs=1)),
    ]
    qw = [
        ("ep", dict(dp=4, ep=4, mbs=1)), ("ep", dict(dp=4, ep=4, mbs=2)), ("ep", dict(dp=4, ep=2, mbs=2)),
        ("moetp", dict(tp=2, dp=2, ep=2, mbs=2, sequence_parallel=True)),
        ("fp8", dict(dp=4, ep=4, mbs=2, precision="fp8")),
    ]
    return (_jobs(MIXTRAL_PROXY, "mix", mix, layers=4, seq=4096, gbs=16)
            + _jobs(QWEN3_PROXY, "qw3", qw, layers=6, seq=4096, gbs=32))


def edge() -> list[dict]:
    """Issue #27 item 4: walk the campaign's shapes to the OOM edge (by micro-batch, layers,
    recompute, PP with VP, EP), two or three points per walk straddling the te profile's
    predicted edge (`python bench/te_campaign.py predict x4-te-edge`); an OOM is a record."""
    dense = [
        ("rc", dict(dp=4, mbs=8, recompute="full")), ("rc", dict(dp=4, mbs=8, recompute="selective")),
        ("seq", dict(dp=4, mbs=4, seq=8192, gbs=16, recompute="full")),
        ("seq", dict(dp=4, mbs=4, seq=8192, gbs=16)),
        ("layers", dict(dp=4, mbs=4, layers=12)), ("layers", dict(dp=4, mbs=4, layers=16)),
        ("pp", dict(pp=4, vp=2, dp=1, mbs=4, layers=16, gbs=16)),
        ("pp", dict(pp=2, vp=2, dp=2, mbs=4, layers=16)),
        ("pp", dict(pp=4, vp=2, dp=1, mbs=4, layers=24, gbs=16)),
    ]
    mix = [
        ("ep", dict(dp=4, ep=4, mbs=8)), ("ep", dict(dp=4, ep=2, mbs=8)), ("ep", dict(dp=4, ep=1, mbs=8)),
        ("rc", dict(dp=4, ep=4, mbs=4, layers=8, recompute="full")), ("rc", dict(dp=4, ep=4, mbs=4, layers=8)),
        ("pp", dict(pp=2, vp=2, dp=2, ep=2, mbs=2, layers=8)),
    ]
    qw = [
        ("rc", dict(dp=4, ep=4, mbs=8, recompute="full")), ("rc", dict(dp=4, ep=4, mbs=8, recompute="selective")),
        ("ep", dict(dp=4, ep=2, mbs=4)), ("ep", dict(dp=4, ep=1, mbs=4)),
    ]
    return (_jobs("llama3-8b", "e8b", dense, layers=8, seq=4096, gbs=32)
            + _jobs(MIXTRAL_PROXY, "emix", mix, layers=4, seq=4096, gbs=32)
            + _jobs(QWEN3_PROXY, "eqw3", qw, layers=12, seq=4096, gbs=32))


def top() -> list[dict]:
    """Issue #22's check of recommend's #1 (`python bench/te_recommend_check.py`): the #1 layouts of
    `recommend --stack te` (with the stack's and the runner's settings) that no run had measured."""
    gpt = [("top", dict(tp=2, dp=2, mbs=16, sequence_parallel=True, precision="fp8")),
           ("top", dict(pp=2, vp=16, dp=2, mbs=8, precision="fp8"))]
    l70 = [("top", dict(dp=4, mbs=2)), ("top", dict(dp=4, mbs=2, precision="fp8"))]
    mix = [("top", dict(tp=2, dp=2, ep=1, etp=2, mbs=8, sequence_parallel=True))]
    qw = [("top", dict(dp=4, ep=4, mbs=8))]
    return (_jobs(GPT3_2_7B, "gpt3", gpt, seq=2048, gbs=64)
            + _jobs("llama3-70b", "l70b", l70, layers=4, seq=4096, gbs=16)
            + _jobs(MIXTRAL_PROXY, "mix", mix, layers=4, seq=4096, gbs=16)
            + _jobs(QWEN3_PROXY, "qw3", qw, layers=6, seq=4096, gbs=32))


def s24() -> list[dict]:
    """Issue #22, the instrument side: the FP8 / BF16 pairs whose FP8 speed-up the te profile
    over-predicts at small micro-batch (`python bench/te_check.py`), each with a kernel profile of
    2 more steps (runners/kernel_probe.py; read with `python bench/kernel_profile.py`); then,
    without it, the #1 layouts of `recommend --stack te` no run had measured (`python
    bench/te_recommend_check.py`: the runner's #1 for the Mixtral proxy, the stack's and the
    runner's for the Qwen3 proxy at 12 layers, the stack's elsewhere); then llama3-8b DP4 mbs4
    with torch's allocator as it comes and with expandable segments (megatron_worker.set_allocator)."""
    kp = {"kernel_profile_steps": 2}
    l8 = [("kp", dict(dp=4, mbs=2, **kp)), ("kp", dict(dp=4, mbs=2, precision="fp8", **kp)),
          ("kp", dict(dp=4, mbs=4, **kp)), ("kp", dict(dp=4, mbs=4, precision="fp8", **kp)),
          ("kp", dict(cp=2, dp=2, mbs=2, **kp)), ("kp", dict(cp=2, dp=2, mbs=2, precision="fp8", **kp))]
    mix = [("kp", dict(dp=4, ep=4, mbs=1, **kp)), ("kp", dict(dp=4, ep=4, mbs=1, precision="fp8", **kp))]
    mix1 = [("top", dict(dp=4, ep=2, etp=1, mbs=4))]
    qw = [("top", dict(dp=4, ep=4, mbs=2)), ("top", dict(dp=4, ep=4, mbs=4)),
          ("top", dict(tp=4, dp=1, ep=4, etp=1, mbs=16, sequence_parallel=True))]
    l8top = [("top", dict(dp=4, mbs=8, precision="fp8"))]
    l70 = [("top", dict(dp=4, mbs=4)), ("top", dict(dp=4, mbs=4, precision="fp8"))]
    gpt = [("top", dict(dp=4, mbs=8, precision="fp8"))]
    alloc = [("alloc", dict(dp=4, mbs=4, expandable_segments=False)),
             ("alloc", dict(dp=4, mbs=4, expandable_segments=True))]
    return (_jobs("llama3-8b", "l8b", l8, layers=8, seq=4096, gbs=32, first=25)
            + _jobs(MIXTRAL_PROXY, "mix", mix, layers=4, seq=4096, gbs=16, first=10)
            + _jobs(MIXTRAL_PROXY, "mix", mix1, layers=4, seq=4096, gbs=16, first=12)
            + _jobs(QWEN3_PROXY, "qw3", qw, layers=12, seq=4096, gbs=32, first=10)
            + _jobs("llama3-8b", "l8b", l8top, layers=8, seq=4096, gbs=32, first=31)
            + _jobs("llama3-70b", "l70b", l70, layers=4, seq=4096, gbs=16, first=10)
            + _jobs(GPT3_2_7B, "gpt3", gpt, seq=2048, gbs=64, first=10)
            + _jobs("llama3-8b", "l8b", alloc, layers=8, seq=4096, gbs=32, first=32))



def s24c() -> list[dict]:
    """Session 24's second call, every job with the kernel profile: the dense FP8 / BF16 pairs
    again, both precisions on one machine (session 22 measured most pairs' BF16 and FP8 runs on
    two machines, and its one same-machine DP4 mbs2 pair read 1.182 where s24a's read 1.254): DP4
    mbs2, CP2 DP2 mbs4, PP2 DP2 mbs2, TP2 and TP4 with SP at mbs4; GPT-3 2.7B (host-bound: its
    launches per step) at DP4 and TP2 SP; the FP8 twins of the Mixtral and Qwen3 (12 layers) #1s
    of s24b."""
    kp = {"kernel_profile_steps": 2}
    pair = lambda **kw: [("kp", dict(kw, **kp)), ("kp", dict(kw, precision="fp8", **kp))]  # noqa: E731
    l8 = (pair(dp=4, mbs=2) + pair(cp=2, dp=2, mbs=4) + pair(pp=2, dp=2, mbs=2)
          + pair(tp=2, dp=2, mbs=4, sequence_parallel=True) + pair(tp=4, dp=1, mbs=4, sequence_parallel=True))
    gpt = [("kp", dict(dp=4, mbs=4, **kp)), ("kp", dict(tp=2, dp=2, mbs=4, sequence_parallel=True, **kp))]
    mix = [("kp", dict(dp=4, ep=2, etp=1, mbs=4, precision="fp8", **kp))]
    qw = [("kp", dict(dp=4, ep=4, mbs=4, precision="fp8", **kp))]
    return (_jobs("llama3-8b", "l8b", l8, layers=8, seq=4096, gbs=32, first=34)
            + _jobs(GPT3_2_7B, "gpt3", gpt, seq=2048, gbs=64, first=11)
            + _jobs(MIXTRAL_PROXY, "mix", mix, layers=4, seq=4096, gbs=16, first=13)
            + _jobs(QWEN3_PROXY, "qw3", qw, layers=12, seq=4096, gbs=32, first=13))


def s24d() -> list[dict]:
    """Session 24's third call: expandable segments on (PYTORCH_CUDA_ALLOC_CONF, the te stack's
    default; the runner's other jobs ran without), issue #27: the layouts `recommend --stack te`
    ranks #1 with the stack's settings that ran out of memory under the runner's (llama3-70b[4L]
    FP8 mbs4, nemotron4-15b mbs2, llama3-8b FP8 mbs8), and the runs whose reserved-but-unallocated
    memory set the band's spread with expandable segments off (llama3-8b CP2 mbs8, GPT-3 PP2 VP16,
    GPT-3 DP4 mbs8, the Mixtral and Qwen3 #1s, llama3-70b[4L] mbs2): their peaks with it on."""
    es = {"expandable_segments": True}
    l70 = [("alloc", dict(dp=4, mbs=4, precision="fp8", **es)), ("alloc", dict(dp=4, mbs=2, **es))]
    nem = [("alloc", dict(dp=4, mbs=2, **es))]
    l8 = [("alloc", dict(dp=4, mbs=8, precision="fp8", **es)), ("alloc", dict(cp=2, dp=2, mbs=8, **es))]
    gpt = [("alloc", dict(pp=2, vp=16, dp=2, mbs=8, precision="fp8", **es)), ("alloc", dict(dp=4, mbs=8, **es))]
    mix = [("alloc", dict(dp=4, ep=2, etp=1, mbs=4, **es))]
    qw = [("alloc", dict(dp=4, ep=4, mbs=4, **es))]
    return (_jobs("llama3-70b", "l70b", l70, layers=4, seq=4096, gbs=16, first=12)
            + _jobs("nemotron4-15b", "nem15", nem, layers=8, seq=4096, gbs=32, first=6)
            + _jobs("llama3-8b", "l8b", l8, layers=8, seq=4096, gbs=32, first=44)
            + _jobs(GPT3_2_7B, "gpt3", gpt, seq=2048, gbs=64, first=13)
            + _jobs(MIXTRAL_PROXY, "mix", mix, layers=4, seq=4096, gbs=16, first=14)
            + _jobs(QWEN3_PROXY, "qw3", qw, layers=12, seq=4096, gbs=32, first=14))


def s24e() -> list[dict]:
    """Session 24's last call, issue #27: does an interleaved pipeline still strand memory when it
    frees each stage output once sent (deallocate_pipeline_outputs, as Megatron-LM's training and
    NVIDIA's recipes run)? GPT-3 2.7B PP2 VP16 mbs8 FP8, whose reserved-but-unallocated memory
    was 8.1 GiB (expandable segments off) and 6.6 GiB (on) with the outputs kept: the same with
    them freed, expandable segments on and off."""
    dpo = {"deallocate_pipeline_outputs": True}
    gpt = [("dpo", dict(pp=2, vp=16, dp=2, mbs=8, precision="fp8", expandable_segments=True, **dpo)),
           ("dpo", dict(pp=2, vp=16, dp=2, mbs=8, precision="fp8", **dpo))]
    return _jobs(GPT3_2_7B, "gpt3", gpt, seq=2048, gbs=64, first=15)

# Session 25's pressed layouts (issue #27: x4-te-s25, -s25c, -s25d), each with the model arguments
# of its _jobs call: GPT-3 2.7B PP2 VP16 mbs8 FP8, llama3-70b[8L] PP4 VP2 FP8, llama3-8b[32L] PP4 VP4,
# llama3-8b[8L] CP2 mbs8, the Mixtral proxy EP4 mbs1
ES = {"expandable_segments": True}
DPO = {"deallocate_pipeline_outputs": True}
GPT3_VP16 = dict(pp=2, vp=16, dp=2, mbs=8, precision="fp8")
L70_VP2 = dict(pp=4, vp=2, dp=1, mbs=1, precision="fp8")
L8_VP4 = dict(pp=4, vp=4, dp=1, mbs=1)
L8_CP2 = dict(cp=2, dp=2, mbs=8)
MIX_EP4 = dict(dp=4, ep=4, mbs=1)


# the models of sessions 25's and 26's batches: (model, id tag, _jobs keywords)
GPT3 = (GPT3_2_7B, "gpt3", dict(seq=2048, gbs=64))
L70_8L = ("llama3-70b", "l70b", dict(layers=8, seq=4096, gbs=16))
L8_32L = ("llama3-8b", "l8b", dict(layers=32, seq=4096, gbs=16))
L8_8L = ("llama3-8b", "l8b", dict(layers=8, seq=4096, gbs=32))
MIX_4L = (MIXTRAL_PROXY, "mix", dict(layers=4, seq=4096, gbs=16))


def qw3(layers: int) -> tuple:
    return (QWEN3_PROXY, "qw3", dict(layers=layers, seq=4096, gbs=32))


def _on(model: tuple, rows: list, first: int, prefix: str = "te") -> list[dict]:
    """_jobs of `rows` on one of the models above, numbered from `first`."""
    name, tag, kw = model
    return _jobs(name, tag, rows, first=first, prefix=prefix, **kw)


def _press(layout: dict, headroom: float, *settings: dict) -> tuple[str, dict]:
    """A "press" row: the layout with its allocator settings and pressure_headroom_gib."""
    return ("press", {**layout, **{k: v for d in settings for k, v in d.items()}, "pressure_headroom_gib": headroom})


def s25() -> list[dict]:
    """Session 25, issue #27: is what torch's caching allocator holds beyond the allocated peak
    (reserved but unallocated) given back when the device fills? Each "press" job runs its warmup,
    then a ballast leaves it its peak allocated so far plus 1 GiB (pressure_headroom_gib,
    megatron_worker.apply_pressure) for the measured steps: an OOM says the cached memory was
    stranded, a run says it was releasable (and its allocator retries and step time say at what
    cost). GPT-3 2.7B PP2 VP16 mbs8 (stranded 6.5 / 7.5 GiB unpressed, expandable segments on / off),
    llama3-8b CP2 mbs8 (3.9 / 12.1), the Mixtral proxy EP4 mbs1 (7.5-10.8, off). Then interleaved
    pipelines like the published llama3-70b recipe's (PP with VP, outputs freed, FP8): llama3-70b[8L]
    PP4 VP2 and llama3-8b[32L] PP4 VP4, expandable segments off and on, unpressed and pressed (on);
    and nemotron4-15b's runner #1 (bench/te_recommend_check.py)."""
    gpt = [_press(GPT3_VP16, 1.0, ES, DPO), _press(GPT3_VP16, 1.0, DPO)]
    l70 = [("vpp", {**L70_VP2, **DPO}), ("vpp", {**L70_VP2, **ES, **DPO}), _press(L70_VP2, 1.0, ES, DPO)]
    l8pp = [("vpp", {**L8_VP4, **DPO}), ("vpp", {**L8_VP4, **ES, **DPO}), _press(L8_VP4, 1.0, ES, DPO)]
    l8 = [_press(L8_CP2, 1.0, ES), _press(L8_CP2, 1.0)]
    mix = [_press(MIX_EP4, 1.0)]
    return (_on(GPT3, gpt, 17) + _on(L70_8L, l70, 14) + _on(L8_32L, l8pp, 46)
            + _on(L8_8L, l8, 49) + _on(MIX_4L, mix, 15))


def s25b() -> list[dict]:
    """Session 25, issue #22: the #1 layouts of `recommend --stack te` no run had measured (`python
    bench/te_recommend_check.py`), with the runner's settings (nemotron4-15b, the Mixtral proxy in
    FP8) and with the stack's (expandable segments on: the Mixtral proxy in FP8, the Qwen3 proxy at
    6 layers). llama3-8b's stack #1s (BF16 mbs8 at seq 4096, mbs4 at 8192) are left out: under the
    runner's settings they are predicted at 76.3 GiB allocated, over the usable 75.7."""
    nem = [("top", dict(tp=2, dp=2, mbs=4, sequence_parallel=True))]
    mix = [("top", dict(dp=4, ep=4, etp=1, mbs=4, precision="fp8")),
           ("top", dict(tp=2, dp=2, ep=1, etp=2, mbs=8, sequence_parallel=True, precision="fp8", **ES))]
    qw = [("top", dict(dp=4, ep=2, etp=1, mbs=8, **ES))]
    return (_jobs("nemotron4-15b", "nem15", nem, layers=8, seq=4096, gbs=32, first=7)
            + _on(MIX_4L, mix, 16)
            + _on(qw3(6), qw, 15))


def s25c() -> list[dict]:
    """Session 25's second call, issue #27: x4-te-s25's pressure runs again with 2.5 GiB of headroom
    (at 1 GiB six of seven ran out of memory, the allocator holding 1.0-2.9 GiB it could not give
    back), and llama3-70b[8L] PP4 VP2 FP8 pressed with expandable segments off (x4-te-s25b's two
    #1s that had no time run after it in the same call)."""
    gpt = [_press(GPT3_VP16, 2.5, ES, DPO), _press(GPT3_VP16, 2.5, DPO)]
    l70 = [_press(L70_VP2, 2.5, ES, DPO), _press(L70_VP2, 2.5, DPO)]
    l8pp = [_press(L8_VP4, 2.5, ES, DPO)]
    l8 = [_press(L8_CP2, 2.5)]
    mix = [_press(MIX_EP4, 2.5)]
    return (_on(GPT3, gpt, 19) + _on(L70_8L, l70, 17) + _on(L8_32L, l8pp, 51)
            + _on(L8_8L, l8, 52) + _on(MIX_4L, mix, 18))


def s25d() -> list[dict]:
    """Session 25's third call: the #1s of the runner's settings that the band refit moved to
    unmeasured layouts (the Qwen3 proxy at 6 layers EP4 mbs4, the Mixtral proxy EP4 mbs2 FP8), then
    issue #27's pressure runs with expandable segments off at 4 GiB of headroom (the three dense
    layouts that ran out at 2.5) and a second MoE layout pressed with them off (the Qwen3 proxy 12L
    EP4 mbs4, 2.5 GiB)."""
    qw = [("top", dict(dp=4, ep=4, etp=1, mbs=4))]
    mix = [("top", dict(dp=4, ep=4, etp=1, mbs=2, precision="fp8"))]
    gpt = [_press(GPT3_VP16, 4.0, DPO)]
    l70 = [_press(L70_VP2, 4.0, DPO)]
    l8 = [_press(L8_CP2, 4.0)]
    qw12 = [_press(dict(dp=4, ep=4, etp=1, mbs=4), 2.5)]
    return (_on(qw3(6), qw, 16) + _on(MIX_4L, mix, 19) + _on(GPT3, gpt, 21)
            + _on(L70_8L, l70, 19) + _on(L8_8L, l8, 53) + _on(qw3(12), qw12, 17))


SNAP = {"memory_snapshot_steps": 1}


def s26snap() -> list[dict]:
    """Session 26, issue #27: where the caching allocator's reserved-but-unallocated memory sits at
    a step's peaks (memory_snapshot_steps: one more step with torch's allocator history on, replayed
    block by block, runners/mem_snapshot.py), on the layouts whose cache the band misses most: the
    Mixtral proxy EP4 mbs1 (4-5 GiB over the predicted R, expandable segments off) and TP2 ETP2 mbs8
    FP8 (on), the Qwen3 proxy 12L EP4 mbs4 (off), and the dense layouts holding the largest cache:
    llama3-70b[8L] PP4 VP2 FP8 outputs freed (10 GiB, off), GPT-3 2.7B PP2 VP16 mbs8 FP8 (8.1, off)."""
    mix = [("snap", {**MIX_EP4, **SNAP}),
           ("snap", dict(tp=2, dp=2, ep=1, etp=2, mbs=8, sequence_parallel=True, precision="fp8", **ES, **SNAP))]
    qw = [("snap", dict(dp=4, ep=4, etp=1, mbs=4, **SNAP))]
    l70 = [("snap", {**L70_VP2, **DPO, **SNAP})]
    gpt = [("snap", {**GPT3_VP16, **DPO, **SNAP})]
    return (_on(MIX_4L, mix, 20) + _on(qw3(12), qw, 18) + _on(L70_8L, l70, 20) + _on(GPT3, gpt, 22))


def s26b() -> list[dict]:
    """Session 26's second call. Issue #27: the two pipeline layouts of x4-te-s26-snap again (their
    snapshot summaries predate mem_snapshot's free_requested fix). Issue #22: the FP8 / BF16 pairs
    of the MoE proxies whose FP8 speed-up the te profile over-predicts while the GPUs stay busy
    (`python bench/te_check.py`: the Mixtral proxy EP2 mbs4 +7.5%, TP2 ETP2 SP mbs8 +10.3%), each
    half with a kernel profile (the FP8 halves of EP2 mbs4 and the Qwen3 proxy 12L EP4 mbs4 have
    one from x4-te-s24c: their BF16 twins here)."""
    kp = {"kernel_profile_steps": 2}
    l70 = [("snap", {**L70_VP2, **DPO, **SNAP})]
    gpt = [("snap", {**GPT3_VP16, **DPO, **SNAP})]
    etp = dict(tp=2, dp=2, ep=1, etp=2, mbs=8, sequence_parallel=True, **kp)
    mix = [("kp", dict(dp=4, ep=2, etp=1, mbs=4, **kp)), ("kp", etp), ("kp", dict(etp, precision="fp8"))]
    qw = [("kp", dict(dp=4, ep=4, mbs=4, **kp))]
    return (_on(L70_8L, l70, 21) + _on(GPT3, gpt, 23) + _on(MIX_4L, mix, 22) + _on(qw3(12), qw, 19))


def s26_offload() -> list[dict]:
    """Session 26, issues #27 / #25: activation offloading to host memory (TrainConfig.cpu_offload_layers,
    megatron-core cpu_offloading through TE's get_cpu_offload_context; PP 1, no recompute) on
    llama3-8b[16L] TP1 PP1 DP4 BF16 over the H100s' PCIe Gen5 x16: 0 / 4 / 8 of the 16 layers at
    seq 8192 mbs1 (memory falls by the offloaded layers' activations, the D2H / H2D copies hide
    behind the other layers' compute: models/offload.py), 0 / 8 at seq 4096 mbs2 (the same tokens per
    microbatch, half the attention), and 8 at seq 8192 mbs2 (twice the bytes per layer against the
    same link)."""
    rows = [("offload", dict(dp=4, mbs=1, seq=8192, gbs=16, cpu_offload_layers=n)) for n in (0, 4, 8)]
    rows += [("offload", dict(dp=4, mbs=2, seq=4096, gbs=32, cpu_offload_layers=n)) for n in (0, 8)]
    rows += [("offload", dict(dp=4, mbs=2, seq=8192, gbs=16, cpu_offload_layers=8))]
    return _jobs("llama3-8b", "l8bo", rows, layers=16)


def s26c() -> list[dict]:
    """Session 26's third call: x4-te-s26-offload's seq 8192 mbs1 line at 2, 6 and 12 offloaded
    layers (measured: 4 layers -16% tokens/s, 8 layers -45%, where the te profile's copies hid
    behind the other layers' forward until 8)."""
    rows = [("offload", dict(dp=4, mbs=1, seq=8192, gbs=16, cpu_offload_layers=n)) for n in (2, 6, 12)]
    return _jobs("llama3-8b", "l8bo", rows, layers=16, first=6)


def s26() -> list[dict]:
    """Session 26, issue #27: partial recompute. llama3-8b[16L] PP2 DP2 mbs2 with Megatron's block
    method on 0, 4 and 8 of each stage's 8 layers (TrainConfig.recompute_layers: 0 keeps everything,
    8 is every layer) and selective recompute of the dense MLP, then of the norms and the MLP (the
    te stack fuses a dense layer's norms into its GEMMs: the norms add nothing); the Qwen3 proxy's
    measured EP4 mbs2 layout (te-qw3-ep-01) with the experts' activation recomputed (moe_act)."""
    l8 = [("prc", dict(pp=2, dp=2, mbs=2, recompute="full", recompute_layers=n)) for n in (0, 4, 8)]
    l8 += [("prc", dict(pp=2, dp=2, mbs=2, recompute="selective", recompute_modules=mods))
           for mods in (["mlp"], ["layernorm", "mlp"])]
    qw = [("prc", dict(dp=4, ep=4, mbs=2, recompute="selective", recompute_modules=["moe_act"]))]
    return (_jobs("llama3-8b", "l8b", l8, layers=16, seq=4096, gbs=32, first=54)
            + _jobs(QWEN3_PROXY, "qw3", qw, layers=6, seq=4096, gbs=32, first=18))


# the te stack's own settings a runner job can take (runners.megatron_args.runner_config with a
# batch line's keys): torch's allocator with expandable segments, and FP8 primary weights where FP8
STACK = dict(ES)
FPG = {"fp8_param_gather": True}
STACK_TE_CE = dict(STACK, cross_entropy_impl="te")  # ... with TE's cross entropy, the stack's default
L70_4L = ("llama3-70b", "l70b", dict(layers=4, seq=4096, gbs=16))
L8_16L = ("llama3-8b", "l8b", dict(layers=16, seq=4096, gbs=32))


def s27() -> list[dict]:
    """Session 27, issue #22: recommend --stack te's #1 of each measured group, run with the stack's
    settings (expandable segments on; FP8 primary weights for FP8: the runner builds them now), and
    the group's best measured layout again with the same settings: the check compares like with like
    (`python bench/te_recommend_check.py`). llama3-70b[4L] FP8 mbs4 (measured at 68.9% of the best
    with the runner's settings: 7 allocator retries) and llama3-8b[8L] FP8 mbs8 (OOM with them) first."""
    fp8 = dict(precision="fp8", **STACK, **FPG)
    l70 = [("stack", dict(dp=4, mbs=4, **fp8)), ("stack", dict(dp=4, mbs=2, **fp8)),
           ("stack", dict(dp=4, mbs=4, **STACK)), ("stack", dict(dp=4, mbs=2, **STACK))]
    l8 = [("stack", dict(dp=4, mbs=8, **fp8)), ("stack", dict(dp=4, mbs=4, **fp8)),
          ("stack", dict(dp=4, mbs=8, **STACK)), ("stack", dict(dp=4, mbs=4, **STACK)),
          ("stack", dict(dp=4, mbs=4, seq=8192, gbs=16, **STACK)), ("stack", dict(dp=4, mbs=2, seq=8192, gbs=16, **STACK))]
    l16 = [("stack", dict(dp=4, mbs=4, **STACK)), ("stack", dict(dp=4, mbs=2, **STACK)),
           ("stack", dict(dp=4, mbs=2, seq=8192, gbs=16, **STACK)), ("stack", dict(dp=4, mbs=1, seq=8192, gbs=16, **STACK))]
    nem = [("stack", dict(dp=4, mbs=4, **STACK)), ("stack", dict(dp=4, mbs=2, **STACK))]
    mix = [("stack", dict(dp=4, ep=4, mbs=4, **STACK)), ("stack", dict(dp=4, ep=2, mbs=4, **STACK)),
           ("stack", dict(dp=4, ep=1, mbs=4, **fp8)), ("stack", dict(dp=4, ep=4, mbs=4, **fp8))]
    return (_on(L70_4L, l70, 22) + _on(L8_8L, l8, 59) + _on(L8_16L, l16, 65)
            + _jobs("nemotron4-15b", "nem15", nem, layers=8, seq=4096, gbs=32, first=8) + _on(MIX_4L, mix, 25))


def s27c() -> list[dict]:
    """Session 27's second call: the stack's #1s that ran out of memory in x4-te-s27a/b (llama3-8b at
    mbs8 / seq 8192 mbs4 / 16 layers mbs4: each died allocating the FP32 logits, 15.7 GiB at mbs8)
    ran megatron-core's native cross entropy, while recommend --stack te ranks them with TE's
    (TrainConfig.cross_entropy_impl "te", the stack's default): again with it, each beside the
    group's best measured layout with the same settings; llama3-70b[4L] FP8 mbs2 with TE's cross
    entropy with and without FP8 primary weights (with them it measured 24,020 tok/s/GPU against
    26,332 without them and with the runner's settings); then the groups s27b had no time for."""
    te = STACK_TE_CE
    fp8 = dict(te, precision="fp8", **FPG)
    l8 = [("stack", dict(dp=4, mbs=8, **fp8)), ("stack", dict(dp=4, mbs=4, **fp8)),
          ("stack", dict(dp=4, mbs=8, **te)), ("stack", dict(dp=4, mbs=4, **te)),
          ("stack", dict(dp=4, mbs=4, seq=8192, gbs=16, **te)), ("stack", dict(dp=4, mbs=2, seq=8192, gbs=16, **te))]
    l16 = [("stack", dict(dp=4, mbs=4, **te)), ("stack", dict(dp=4, mbs=2, **te)),
           ("stack", dict(dp=4, mbs=2, seq=8192, gbs=16, **te)), ("stack", dict(dp=4, mbs=1, seq=8192, gbs=16, **te))]
    l70 = [("stack", dict(dp=4, mbs=2, **fp8)), ("stack", dict(dp=4, mbs=2, precision="fp8", **te))]
    nem = [("stack", dict(dp=4, mbs=4, **te)), ("stack", dict(dp=4, mbs=2, **te))]
    mix = [("stack", dict(dp=4, ep=4, mbs=4, **te)), ("stack", dict(dp=4, ep=2, mbs=4, **te))]
    return (_on(L8_8L, l8, 69) + _on(L8_16L, l16, 75) + _on(L70_4L, l70, 26)
            + _jobs("nemotron4-15b", "nem15", nem, layers=8, seq=4096, gbs=32, first=10) + _on(MIX_4L, mix, 29))


def s27d() -> list[dict]:
    """Session 27's third call: what FP8 primary weights cost. llama3-70b[4L] FP8 DP4 mbs2 with TE's
    cross entropy measured 24,271 tok/s/GPU with them and 26,640 without (x4-te-s27c): the pair again
    with the kernel profile (kernel_profile_steps 2: where the time goes), and llama3-8b[8L] FP8
    mbs4 / mbs8 without them (their twins with them: te-l8b-stack-69 / -70)."""
    te = dict(STACK_TE_CE, precision="fp8")
    kp = {"kernel_profile_steps": 2}
    l70 = [("fpg", dict(dp=4, mbs=2, **te, **kp)), ("fpg", dict(dp=4, mbs=2, **te, **FPG, **kp))]
    l8 = [("fpg", dict(dp=4, mbs=4, **te)), ("fpg", dict(dp=4, mbs=8, **te))]
    return _on(L70_4L, l70, 28) + _on(L8_8L, l8, 79)


def s27e() -> list[dict]:
    """Session 27's fourth call: llama3-8b[8L] FP8 DP4 mbs4 with and without FP8 primary weights, both
    kernel-profiled: does the 70B-wide model's +65 ms of TE cast_transpose_general per step (x4-te-s27d)
    scale with the linear weights (1.75 B here against 3.42 B there), where the 8B twins measured
    +0.8% / +2.2% faster with them?"""
    te = dict(STACK_TE_CE, precision="fp8", kernel_profile_steps=2)
    return _on(L8_8L, [("fpg", dict(dp=4, mbs=4, **te)), ("fpg", dict(dp=4, mbs=4, **te, **FPG))], 81)


DSV2_12L = (DEEPSEEK_PROXY, "dsv2", dict(layers=12, seq=4096, gbs=32))


def s28() -> list[dict]:
    """Session 28: (1) megatron-core's native fused cross entropy beside the unfused and TE twins
    already measured (llama3-8b[8L] DP4 mbs4, BF16 and FP8; step_time.LOSS_BYTES_PER_LOGIT reads
    36 B per logit for it off its kernels, unmeasured); (2) a third MoE architecture on the te
    stack: the DeepSeek-V2-Lite proxy (multi-latent attention, 64 fine-grained experts top-6, 2
    shared experts, first layer dense; measured before only with the local runner), with the
    stack's settings: expert parallelism 1 / 2 / 4, the micro-batch, FP8, TP with expert TP 1."""
    te = STACK_TE_CE
    ce = [("ce", dict(dp=4, mbs=4, **STACK, cross_entropy_impl="native")),
          ("ce", dict(dp=4, mbs=4, precision="fp8", **STACK, cross_entropy_impl="native", **FPG))]
    ds = [("ep", dict(dp=4, ep=4, mbs=2, **te)), ("ep", dict(dp=4, ep=4, mbs=4, **te)),
          ("ep", dict(dp=4, ep=2, mbs=2, **te)), ("ep", dict(dp=4, ep=1, mbs=2, **te)),
          ("fp8", dict(dp=4, ep=4, mbs=2, precision="fp8", **te, **FPG)),
          ("moetp", dict(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True, mbs=4, **te)),
          ("ep", dict(dp=4, ep=4, mbs=1, **te))]
    return _on(L8_8L, ce, 83) + _on(DSV2_12L, ds, 0)


def s28b() -> list[dict]:
    """Session 28's second call: recommend --stack te's unmeasured #1s (python bench/te_recommend_check.py):
    llama3-70b[4L] FP8 TP4 SP mbs16 and the Mixtral proxy FP8 TP4 SP EP4 mbs16 with the stack's
    settings, llama3-70b[4L] FP8 TP2 SP DP2 mbs4 with the runner's; then the DeepSeek-V2-Lite proxy
    kernel-profiled at EP4 mbs1 / mbs4 (x4-te-s28a measured 12,913 / 37,955 tok/s/GPU: ~24 ms per layer
    and micro-batch that no GPU work explains, the te profile 34-83% optimistic at mbs 1-2)."""
    fp8 = dict(STACK_TE_CE, precision="fp8", **FPG)
    kp = {"kernel_profile_steps": 2}
    l70 = [("top", dict(tp=4, dp=1, mbs=16, sequence_parallel=True, **fp8)),
           ("top", dict(tp=2, dp=2, mbs=4, sequence_parallel=True, precision="fp8"))]
    mix = [("top", dict(tp=4, dp=1, ep=4, etp=1, mbs=16, sequence_parallel=True, **fp8))]
    ds = [("kp", dict(dp=4, ep=4, mbs=1, **STACK_TE_CE, **kp)), ("kp", dict(dp=4, ep=4, mbs=4, **STACK_TE_CE, **kp))]
    return _on(L70_4L, l70, 30) + _on(MIX_4L, mix, 31) + _on(DSV2_12L, ds, 7)


def s28c() -> list[dict]:
    """Session 28's third call: GPT-3 2.7B in FP8 kernel-profiled, the twins of te-gpt3-kp-11 / -12
    (BF16, DP4 mbs4 and TP2 SP DP2 mbs4): the te refit puts our VM's host issue cost per FP8 GEMM
    (host_fp8_gemm_s) at 205 us, where llama3-8b's PP2 pairs measured 58-106 us, and only GPT-3's
    two FP8 runs (host-bound) pull it there: measure it on GPT-3 itself (bench/host_issue.py)."""
    kp = {"kernel_profile_steps": 2}
    gpt = [("kp", dict(dp=4, mbs=4, precision="fp8", **kp)),
           ("kp", dict(tp=2, dp=2, mbs=4, sequence_parallel=True, precision="fp8", **kp))]
    return _on(GPT3, gpt, 24)


OLMOE_8L = (OLMOE_PROXY, "olm", dict(layers=8, seq=4096, gbs=32))
# session 29's MoE jobs warm up 8 steps and measure 6 (RUN: 2 and 5): an untrained router's skew
# falls over the first steps, and with it the step
STEADY = dict(warmup=8, steps=6)


def s29() -> list[dict]:
    """Session 29: (1) a fourth MoE architecture on the te stack, in no fit and predicted before it
    ran (bench/campaign_configs/x4-te-s29.predicted.txt): the OLMoE-1B-7B proxy (64 experts top-8,
    no shared expert, multi-head attention) at EP 1 / 2 / 4, micro-batch 1-8, FP8, TP2 SP with EP2;
    (2) the MoE host issue model (models/moe.py MOE_TE_VM_HOST: a MoE layer's fixed host time, now in
    the stage's host issue time) where host and GPU time are near each other: the DeepSeek-V2-Lite
    proxy EP4 mbs2 kernel-profiled, BF16 and FP8 (measured 30.1 ms per layer-microbatch, predicted
    24.4); the Qwen3 proxy 6L EP4 mbs1 BF16 / FP8 on the same GPUs (the FP8 / BF16 ratio host-bound).
    Every job warms up 8 steps and measures 6 (2 and 5 before): an untrained router's skew falls
    over the first steps, and with it the step (te-qw3-top-15: 1.07, 0.85, 0.74, 0.72, 0.74, 0.68 s
    over its 6 measured steps)."""
    te = dict(STACK_TE_CE, **STEADY)
    kp = {"kernel_profile_steps": 2}
    f8 = dict(precision="fp8", **FPG)
    olm = [("ep", dict(dp=4, ep=4, mbs=1, **te)), ("kp", dict(dp=4, ep=4, mbs=2, **te, **kp)),
           ("ep", dict(dp=4, ep=4, mbs=4, **te)), ("ep", dict(dp=4, ep=4, mbs=8, **te)),
           ("ep", dict(dp=4, ep=2, mbs=2, **te)), ("ep", dict(dp=4, ep=1, mbs=2, **te)),
           ("kp", dict(dp=4, ep=4, mbs=2, **te, **f8, **kp)),
           ("moetp", dict(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True, mbs=4, **te))]
    ds = [("kp", dict(dp=4, ep=4, mbs=2, **te, **kp)), ("kp", dict(dp=4, ep=4, mbs=2, **te, **f8, **kp))]
    qw = [("fp8", dict(dp=4, ep=4, mbs=1, **STEADY)), ("fp8", dict(dp=4, ep=4, mbs=1, precision="fp8", **STEADY))]
    return _on(OLMOE_8L, olm, 0) + _on(DSV2_12L, ds, 9) + _on(qw3(6), qw, 20)


def s29b() -> list[dict]:
    """Session 29's second call, on another machine, every job's hello now timing its host
    (kernel_probe.host_speed: CPU model, host microseconds per eager op): repeats of x4-te-s29's
    host-bound layouts (the OLMoE proxy EP4 mbs1 and EP1 mbs2, the Qwen3 proxy 6L EP4 mbs1 and its
    FP8 twin: x4-te-s29 did not reach te-qw3-fp8-21) and the DeepSeek-V2-Lite proxy EP4 mbs1, and GPT-3 2.7B
    TP2 SP DP2 mbs4 (dense, host-bound: 15,910 / 17,531 tok/s/GPU on two earlier machines). Does the
    host's issue time per op explain one machine's host-bound steps against another's?"""
    te = dict(STACK_TE_CE, **STEADY)
    olm = [("rep", dict(dp=4, ep=4, mbs=1, **te)), ("rep", dict(dp=4, ep=1, mbs=2, **te))]
    qw = [("fp8", dict(dp=4, ep=4, mbs=1, precision="fp8", **STEADY)), ("fp8", dict(dp=4, ep=4, mbs=1, **STEADY))]
    ds = [("rep", dict(dp=4, ep=4, mbs=1, **te))]
    gpt = [("host", dict(tp=2, dp=2, mbs=4, sequence_parallel=True))]
    return _on(OLMOE_8L, olm, 8) + _on(qw3(6), qw, 22) + _on(DSV2_12L, ds, 11) + _on(GPT3, gpt, 26)


def s29c() -> list[dict]:
    """Session 29's third call: recommend --stack te's unmeasured #1s (python bench/te_recommend_check.py,
    after x4-te-s29): the OLMoE proxy and the Qwen3 proxy 6L at EP 1 mbs8 (all experts on every
    GPU: no all-to-all; predicted 1 / 0.734 and 1 / 0.790 of the measured best, EP4 mbs8), and the
    Qwen3 proxy 6L FP8 EP2 mbs8 (predicted 1 / 0.460 of the measured best, EP4 mbs2)."""
    te = dict(STACK_TE_CE, **STEADY)
    olm = [("top", dict(dp=4, ep=1, mbs=8, **te))]
    qw = [("top", dict(dp=4, ep=1, mbs=8, **te)), ("top", dict(dp=4, ep=2, mbs=8, precision="fp8", **te, **FPG))]
    return _on(OLMOE_8L, olm, 10) + _on(qw3(6), qw, 24)


def s29d() -> list[dict]:
    """Session 29's last call: x4-te-s29b's host-bound set again on a third machine (its host timed
    in every record's env.host_op_us), toward host speed as an input of the VM host costs."""
    te = dict(STACK_TE_CE, **STEADY)
    olm = [("rep", dict(dp=4, ep=4, mbs=1, **te))]
    qw = [("fp8", dict(dp=4, ep=4, mbs=1, **STEADY))]
    ds = [("rep", dict(dp=4, ep=4, mbs=1, **te))]
    gpt = [("host", dict(tp=2, dp=2, mbs=4, sequence_parallel=True))]
    return _on(OLMOE_8L, olm, 11) + _on(qw3(6), qw, 26) + _on(DSV2_12L, ds, 12) + _on(GPT3, gpt, 27)


def s30() -> list[dict]:
    """Session 30: why all experts on one GPU runs slow on our VM. `recommend --stack te` ranks EP 1
    mbs 8 first for the OLMoE proxy and the Qwen3 proxy 6L, which measured 62% / 63% of EP 4 mbs 8
    (te-olm-top-10 41,785 against te-olm-ep-03 67,448; te-qw3-top-24 35,322 against te-qw3-top-00
    55,929 tok/s/GPU): the four layouts kernel-profiled (kernel_profile_steps 2: GPU busy time, each
    host thread's issue time and launches; bench/host_issue.py, bench/kernel_profile.py). TE's
    GroupedLinear keeps one weight per expert and linear, so EP 1 hands the optimizer and DDP 2 x 64
    / 2 x 128 expert tensors per layer where EP 4 hands 2 x 16 / 2 x 32. Then the run that sets the te
    MoE memory band's upper ratio (te-eqw3-rc-00: the Qwen3 proxy 12L EP4 mbs8 full recompute, 41.6
    GiB allocated against 37.1 predicted, x1.122) again with its own settings: is it the layout or
    that run's router?"""
    te = dict(STACK_TE_CE, **STEADY)
    kp = {"kernel_profile_steps": 2}
    qw = [("kp", dict(dp=4, ep=1, mbs=8, **te, **kp)), ("kp", dict(dp=4, ep=4, mbs=8, **te, **kp))]
    olm = [("kp", dict(dp=4, ep=1, mbs=8, **te, **kp)), ("kp", dict(dp=4, ep=4, mbs=8, **te, **kp))]
    rc = [("rc", dict(dp=4, ep=4, mbs=8, recompute="full", cross_entropy_impl="unfused"))]
    return _on(qw3(6), qw, 27) + _on(OLMOE_8L, olm, 12) + _on(qw3(12), rc, 29)


def s30b() -> list[dict]:
    """Session 30's second call: is the host time all experts on one GPU add per micro-batch or per
    step? x4-te-s30's EP 1 mbs 8 profiles (one micro-batch a step) put ~0.9 ms of host issue per
    local expert and layer beyond EP 4's, nearly all in the backward's thread: per micro-batch
    (TE GroupedLinear's per-expert GEMM launches, the main-grad adds) or per step (megatron-core DDP's
    per-parameter bucket registration on the last micro-batch, the optimizer's per-tensor loops)?
    The same pairs at mbs 2 (four micro-batches a step), kernel-profiled: per micro-batch makes the
    EP 1 - EP 4 host difference per step four times mbs 8's, per step leaves it as it was."""
    te = dict(STACK_TE_CE, **STEADY)
    kp = {"kernel_profile_steps": 2}
    pair = [("kp", dict(dp=4, ep=1, mbs=2, **te, **kp)), ("kp", dict(dp=4, ep=4, mbs=2, **te, **kp))]
    return _on(OLMOE_8L, pair, 14) + _on(qw3(6), pair, 30)


def s30c() -> list[dict]:
    """Session 30's third call: GPT-3 2.7B TP2 SP DP2, BF16 against FP8 on the same four GPUs. Its
    only FP8 / BF16 pairs so far ran on different machines (te-gpt3-kp-12 / -kp-25 and te-gpt3-sp-03 /
    -host-26 against -kp-25: 1.02 / 1.08 measured, 0.889 predicted), and the layout is host-bound, so a
    machine's host speed is in those ratios. mbs 4 and mbs 8, each in both precisions, back to back."""
    ce = dict(cross_entropy_impl="unfused", **STEADY)
    sp = dict(tp=2, dp=2, sequence_parallel=True, **ce)
    rows = [("pair", dict(mbs=4, **sp)), ("pair", dict(mbs=4, precision="fp8", **sp)),
            ("pair", dict(mbs=8, **sp)), ("pair", dict(mbs=8, precision="fp8", **sp))]
    return _on(GPT3, rows, 28)


def s30d() -> list[dict]:
    """Session 30's last call: te-qw3-rc-29 (the Qwen3 proxy 12L EP4 mbs8 full recompute, unfused
    cross entropy, expandable segments off: 41.7 GiB allocated, 37.1 predicted, the te MoE band's
    largest ratio) with one more step under torch's allocator history (memory_snapshot_steps,
    bench/memory_snapshot.py): it holds 39.8 GiB at the step's start against 29.4 GiB of weights,
    gradients and optimizer states and the previous step's 7.1 GiB of fp32 main grads. What are the
    other 3.1 GiB?"""
    return _on(qw3(12), [("snap", dict(dp=4, ep=4, mbs=8, recompute="full", cross_entropy_impl="unfused", **SNAP))], 32)


def s30e() -> list[dict]:
    """Session 30's fifth call: is the te MoE band's spread the untrained router's? The Qwen3 proxy
    12L EP4 layouts whose peaks the model under-predicts (te-qw3-alloc-14, mbs4: 55.1 GiB allocated
    against 52.2; te-qw3-rc-29, mbs8 full recompute: 41.5 against 38.4) again with megatron-core's
    forced load balancing (moe_router "forced": every expert gets its share, as NVIDIA's MoE
    benchmarks route): at the snapshot steps those layouts held what the model predicts (22.2 GiB
    live against 22.6; x4-te-s30d), and the runs' peaks came from the first steps, when the untrained
    router is most skewed."""
    rows = [("forced", dict(dp=4, ep=4, mbs=4, moe_router="forced", cross_entropy_impl="unfused", **ES)),
            ("forced", dict(dp=4, ep=4, mbs=8, recompute="full", moe_router="forced", cross_entropy_impl="unfused"))]
    return _on(qw3(12), rows, 33)


# Batches named x2-h200-* run on two H200s (the device tool's nvidia-h200-x2; ids h2te-*, records
# data/measurements/h200x2-te.jsonl); the others on four H100s.
def where(batch: str) -> tuple[str, int]:
    """(cluster, GPUs) a batch runs on."""
    if batch.startswith("x1-h200"):
        return ("h200x1", 1)
    return ("h200x2", 2) if batch.startswith("x2-h200") else ("h100x4", 4)


def s32() -> list[dict]:
    """Session 32, issues #22 / #27: the te stack on a GPU it was never fitted or checked on, two
    H200s (141 GB HBM3e at 4.8 TB/s against the H100's 80 GB at 3.35; the same 989 dense BF16
    TFLOP/s; the same 700 W cap), every layout predicted before it ran (bench/campaign_configs/
    x2-h200-te-*.predicted.txt): llama3-8b 8L and GPT-3 2.7B (DP, TP2 SP, CP2, PP2, FP8),
    llama3-70b 4L (TP2 SP, DP2), the Qwen3 / OLMoE / Mixtral proxies (EP 1 / 2, FP8, TP2 SP with EP),
    `recommend --stack te`'s #1 on h200x2 for each model (llama3-8b DP2 mbs16 at 126.9 GiB of 136.4
    usable: the memory edge of a 141 GB GPU), and the power model's claim that these layouts hold
    the H200 at its 700 W cap (llama3-8b DP2 mbs16: 836 W at full clock, 100% throttled)."""
    h2 = "h2te"
    st = dict(STACK_TE_CE)
    f8 = dict(precision="fp8", **FPG)
    l8 = [("dp", dict(dp=2, mbs=2, **st)), ("dp", dict(dp=2, mbs=4, **st)), ("dp", dict(dp=2, mbs=8, **st)),
          ("top", dict(dp=2, mbs=16, **st)),
          ("sp", dict(tp=2, dp=1, mbs=4, sequence_parallel=True, **st)),
          ("cp", dict(cp=2, dp=1, mbs=4, **st)), ("pp", dict(pp=2, dp=1, mbs=2, **st)),
          ("fp8", dict(dp=2, mbs=4, **f8, **st)), ("fp8", dict(dp=2, mbs=8, **f8, **st)),
          ("fp8", dict(tp=2, dp=1, mbs=4, sequence_parallel=True, **f8, **st)),
          ("top", dict(dp=2, mbs=16, **f8, **st)), ("rc", dict(dp=2, mbs=16, recompute="selective", **st))]
    gpt = [("dp", dict(dp=2, mbs=8, **st)), ("dp", dict(dp=2, mbs=16, **st)),
           ("sp", dict(tp=2, dp=1, mbs=8, sequence_parallel=True, **st)), ("fp8", dict(dp=2, mbs=8, **f8, **st)),
           ("top", dict(dp=2, mbs=16, **f8, **st))]
    l70 = [("sp", dict(tp=2, dp=1, mbs=1, sequence_parallel=True, **st)),
           ("sp", dict(tp=2, dp=1, mbs=2, sequence_parallel=True, **st)),
           ("dp", dict(dp=2, mbs=1, **st)), ("top", dict(dp=2, mbs=8, **st)),
           ("fp8", dict(tp=2, dp=1, mbs=2, sequence_parallel=True, **f8, **st)),
           ("top", dict(tp=2, dp=1, mbs=16, sequence_parallel=True, **f8, **st))]
    te = dict(st, **STEADY)
    qw = [("ep", dict(dp=2, ep=2, mbs=1, **te)), ("ep", dict(dp=2, ep=2, mbs=4, **te)),
          ("ep", dict(dp=2, ep=1, mbs=4, **te)), ("fp8", dict(dp=2, ep=2, mbs=4, **f8, **te)),
          ("moetp", dict(tp=2, dp=1, ep=2, etp=1, mbs=4, sequence_parallel=True, **te)),
          ("top", dict(dp=2, ep=1, mbs=16, **te)), ("top", dict(dp=2, ep=2, mbs=16, **te)),
          ("top", dict(dp=2, ep=1, mbs=16, **f8, **te))]
    olm = [("ep", dict(dp=2, ep=2, mbs=4, **te)), ("ep", dict(dp=2, ep=1, mbs=8, **te)),
           ("top", dict(dp=2, ep=1, mbs=16, **te)), ("top", dict(dp=2, ep=2, mbs=16, **te))]
    mix = [("ep", dict(dp=2, ep=2, mbs=1, **te)), ("ep", dict(dp=2, ep=2, mbs=2, **te)),
           ("top", dict(dp=2, ep=1, mbs=8, **te))]
    return (_on(L8_8L, l8, 0, h2) + _on(GPT3, gpt, 0, h2) + _on(("llama3-70b", "l70b", dict(layers=4, seq=4096, gbs=16)), l70, 0, h2)
            + _on(qw3(6), qw, 0, h2) + _on(OLMOE_8L, olm, 0, h2) + _on(MIX_4L, mix, 0, h2))


def s32d() -> list[dict]:
    """Session 32's fourth call, issue #27: the memory edge of a 141 GB GPU, predicted before it ran
    (x2-h200-te-d.predicted.txt). Five layouts recommend's screen passes just under the H200's
    usable 136.4 GiB (band upper 119-132 GiB: llama3-8b 15L DP2 mbs8, llama3-70b 5L DP2 mbs8, the
    Qwen3 proxy EP 1 / 2 mbs24, Mixtral EP2 mbs12): none may run out of memory. Five it rejects
    though their point prediction is 117-135 GiB (llama3-8b 16L mbs8, llama3-70b 6L mbs8, Mixtral
    EP2 mbs16, Qwen3 EP2 mbs32, OLMoE EP2 mbs24): how much of the band's width a large GPU needs.
    Two warmup steps and three measured: the peak, not the speed, is the point (an untrained
    router's first steps are its most skewed)."""
    h2, short = "h2te", dict(warmup=2, steps=3)
    st = dict(STACK_TE_CE, **short)
    fit = (_jobs("llama3-8b", "l8b", [("edge", dict(dp=2, mbs=8, **st))], 12, h2, layers=15, seq=4096, gbs=32)
           + _jobs("llama3-70b", "l70b", [("edge", dict(dp=2, mbs=8, **st))], 6, h2, layers=5, seq=4096, gbs=32)
           + _jobs(QWEN3_PROXY, "qw3", [("edge", dict(dp=2, ep=1, mbs=24, **st)), ("edge", dict(dp=2, ep=2, mbs=24, **st))],
                   8, h2, layers=6, seq=4096, gbs=48)
           + _jobs(MIXTRAL_PROXY, "mix", [("edge", dict(dp=2, ep=2, mbs=12, **st))], 3, h2, layers=4, seq=4096, gbs=24))
    over = (_jobs("llama3-8b", "l8b", [("edge", dict(dp=2, mbs=8, **st))], 13, h2, layers=16, seq=4096, gbs=32)
            + _jobs("llama3-70b", "l70b", [("edge", dict(dp=2, mbs=8, **st))], 7, h2, layers=6, seq=4096, gbs=32)
            + _jobs(MIXTRAL_PROXY, "mix", [("edge", dict(dp=2, ep=2, mbs=16, **st))], 4, h2, layers=4, seq=4096, gbs=32)
            + _jobs(QWEN3_PROXY, "qw3", [("edge", dict(dp=2, ep=2, mbs=32, **st))], 10, h2, layers=6, seq=4096, gbs=64)
            + _jobs(OLMOE_PROXY, "olm", [("edge", dict(dp=2, ep=2, mbs=24, **st))], 4, h2, layers=8, seq=4096, gbs=48))
    return fit + over


# the gpt-oss proxy's batches (session 34): 8 layers, 8 sequences of 4096 a step, ids h1te-oss-*, and
# the proxy with features of its own turned off (each a model of its own name)
OSS = dict(layers=8, seq=4096, gbs=8)


def _oss(suffix: str = "", **off) -> dict:
    return {**GPTOSS_PROXY, "name": f"gpt-oss-120b-proxy{suffix}", **off} if suffix else GPTOSS_PROXY


OSS_PLAIN = _oss("-plain", attention_sinks=False, window_size=0, window_pattern=[], activation_clamp=0.0)


def s34() -> list[dict]:
    """Session 34, issue #24: what a gpt-oss layer costs, on one H200 (the device tool lent no more).
    The published gpt-oss-120b rows are the MoE model's worst (per-shape experts, branch
    moe-per-shape: +50% too fast on H100); microbenchmarks found its attention sinks and expert biases
    ~3% of its step. Here the whole layer, its features on and off one at a time: the gpt-oss proxy
    (campaign.GPTOSS_PROXY: 8 layers, 16 experts top-4, 1,024 tokens per expert per micro-batch as
    on one GPU of the published EP8 recipe), BF16 micro-batch 1 / 2, the recipe's selective
    recompute (layernorm, moe_act), FP8, and without the sinks, without the window, with plain
    SwiGLU for the clamped quick-GeGLU; one kernel-profiled. Predicted before it ran
    (bench/campaign_configs/x1-h200-te-s34.predicted.txt)."""
    te = dict(STACK_TE_CE, warmup=6, steps=5)
    rows = [("base", dict(mbs=1, **te)), ("base", dict(mbs=2, **te)),
            ("rc", dict(mbs=1, recompute="selective", recompute_modules=["layernorm", "moe_act"], **te)),
            ("fp8", dict(mbs=1, precision="fp8", **FPG, **te)),
            ("kp", dict(mbs=1, kernel_profile_steps=2, **te))]
    variants = [(_oss("-nosinks", attention_sinks=False), "nosink"),
                (_oss("-nowindow", window_size=0, window_pattern=[]), "nowin"),
                (_oss("-swiglu", activation_clamp=0.0), "swiglu"), (OSS_PLAIN, "plain")]
    return _jobs(GPTOSS_PROXY, "oss", rows, 0, "h1te", **OSS) + [
        j for n, (model, feature) in enumerate(variants, 5)
        for j in _jobs(model, "oss", [(feature, dict(mbs=1, **te))], n, "h1te", **OSS)]


def s34b() -> list[dict]:
    """Session 34's second call: the gpt-oss proxy kernel-profiled where the host binds less (micro-
    batch 2 and 4: one GPU's GPU work by kernel category against the model's terms), its features
    off at micro-batch 2 (plain: no sinks, no window, SwiGLU), and FP8 at micro-batch 2 (the H200's
    FP8 / BF16 excess, session 33)."""
    te = dict(STACK_TE_CE, warmup=6, steps=5, kernel_profile_steps=2)
    rows = [("kp", dict(mbs=2, **te)), ("kp", dict(mbs=4, **te)),
            ("kp", dict(mbs=2, precision="fp8", **FPG, **te))]
    return (_jobs(GPTOSS_PROXY, "oss", rows, 9, "h1te", **OSS)
            + _jobs(OSS_PLAIN, "oss", [("kp", dict(mbs=2, **te))], 12, "h1te", **OSS))


def s34c() -> list[dict]:
    """Session 34's third call, issue #22: the H200's FP8 / BF16 excess (2 x H200, session 32: the te
    profile predicts FP8's speed-up 5-6% high on llama3-8b / 70b although the clocks (within 2%), the
    GEMM rates and the casts' bandwidth are right) on one H200, kernel by kernel: llama3-8b 8L,
    micro-batch 4, BF16 and FP8 (FP8 primary weights, the stack's), kernel-profiled; and micro-batch
    8 both ways without the profiler (the ratio itself on one GPU)."""
    h1 = "h1te"
    te = dict(STACK_TE_CE, warmup=4, steps=6)
    f8 = dict(precision="fp8", **FPG)
    rows = [("kp", dict(dp=1, mbs=4, kernel_profile_steps=2, **te)),
            ("kp", dict(dp=1, mbs=4, kernel_profile_steps=2, **f8, **te)),
            ("fp8", dict(dp=1, mbs=8, **te)), ("fp8", dict(dp=1, mbs=8, **f8, **te))]
    return _on(("llama3-8b", "l8b", dict(layers=8, seq=4096, gbs=32)), rows, 0, h1)


def s34d() -> list[dict]:
    """Session 34's fourth call, issue #24: the gpt-oss proxy at micro-batch 4 (the GPU binds) with
    NVIDIA's recipe settings for MoE (TE's fused permute / unpermute and fused router: the published
    H100 rows' "rfuse-pfuse"), with the aux-loss router and with forced load balancing (the
    published rows' routing), kernel-profiled: how much of the 269 ms of memory-bound kernels a step
    (s34b's h1te-oss-kp-10, unfused) the recipe's kernels remove."""
    te = dict(STACK_TE_CE, warmup=6, steps=5, kernel_profile_steps=2, moe_permute_fusion=True,
              moe_router_fusion=True)
    rows = [("fuse", dict(mbs=4, **te)), ("fuse", dict(mbs=4, moe_router="forced", **te))]
    return _jobs(GPTOSS_PROXY, "oss", rows, 13, "h1te", **OSS)


def s34e() -> list[dict]:
    """Session 34's fifth call, issue #22: llama3-70b 4L on one H200, BF16 and FP8 (FP8 primary
    weights) at micro-batch 2: on 2 x H200 its TP2 SP FP8 / BF16 ratio was 5.7% under the predicted
    one (h2te-l70b-sp-01 / fp8-04); llama3-8b's alone is within 0.4% (s34c). The 70b shape alone
    says whether its excess needs a second GPU."""
    return _l70b_pair("fp8", 0, steps=6)


def s34f() -> list[dict]:
    """Session 34's sixth call, issue #22: s34e's llama3-70b 4L pair (its FP8 4.0% slower than predicted
    on one H200, at the predicted clock) again, kernel-profiled: which kernels FP8 spends the 4% on."""
    return _l70b_pair("kp", 2, steps=4, kernel_profile_steps=2)


def _l70b_pair(feature: str, first: int, **run) -> list[dict]:
    """llama3-70b 4L on one H200, micro-batch 2, BF16 then FP8 with FP8 primary weights (s34e / s34f)."""
    te = dict(STACK_TE_CE, warmup=4, **run)
    rows = [(feature, dict(dp=1, mbs=2, **te)), (feature, dict(dp=1, mbs=2, precision="fp8", **FPG, **te))]
    return _on(("llama3-70b", "l70b", dict(layers=4, seq=4096, gbs=16)), rows, first, "h1te")


def predict(names: list[str]) -> int:
    """Each job's predicted peak GiB per GPU with the te profile (models.memory's fullest stage), the
    te band's upper bound, as pressed (recommend's screen, its verdict) and the usable memory of the
    batch's GPU (`where`); and
    its tokens/s/GPU and step time as the te profile predicts our runs (profile_fit.on_vm: our VM's
    host issue costs; the router skew the profile ships, none measured for a new shape)."""
    from advisor.catalog import load_cluster, load_gpu
    from advisor.models import memory_band as MB
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.memory import peak_memory_gib
    from advisor.models.memory_band import band_upper_gib
    from advisor.models.predict import predict as predict_one
    from advisor.models.profile_fit import on_vm
    from advisor.runners import measure as M

    vm = on_vm(resolve_calibration("te")).constants
    for name in names:
        cluster = load_cluster(where(name)[0])
        c = resolve_calibration("default", "te", gpu=cluster.gpu).screening_constants
        gib = cluster.gpu.memory_gib
        usable = c.usable_memory_gib(gib)
        print(f"== {name}: {cluster.name}, {gib:.0f} GiB, usable {usable:.1f} GiB (te profile, default margin)")
        print(f"{'id':18} {'layout':44} {'pred':>6} {'upper':>6} {'press':>6}  verdict  {'tok/s/GPU':>9} {'step s':>7}")
        for line in (CONFIGS / f"{name}.jsonl").read_text().splitlines():
            e = M.entry_from_line(json.loads(line), where(name)[1])
            if e.refused:
                print(f"{e.id:18} REFUSED {e.refused}")
                continue
            k, g = e.config, peak_memory_gib(e.model, e.config, c, gpu=cluster.gpu)
            up = band_upper_gib(e.model, k, MB.band("te", e.model.is_moe), c, gpu=cluster.gpu)  # each stage with its own terms
            # recommend's screen: with expandable segments, less the cache the allocator gives back when pressed
            upp = band_upper_gib(e.model, k, MB.band("te", e.model.is_moe), c, under_pressure=True, gpu=cluster.gpu)
            lay = (f"L{e.model.num_layers} s{k.seq} TP{k.tp} PP{k.pp}v{k.vp} EP{k.ep} DP{k.dp} "
                   f"mbs{k.mbs} rc={k.recompute}")
            p = predict_one(e.model, cluster, k, vm, check_legal=False)
            print(f"{e.id:18} {lay:44} {g:6.1f} {up:6.1f} {upp:6.1f}  {'fits' if upp <= usable else 'OVER':7}  "
                  f"{p.tokens_per_s_per_gpu:9.0f} {p.step_time_s:7.3f}")
    return 0


# What `estimate` adds for a kernel-profiled job: allowances, NOT measured (no profiled run existed
# when they were set): each profiled step at this many times a measured step (CUPTI's per-launch
# cost), plus the profiler's stop and the summary (Kineto turning its buffers into events). The
# first profiled records' timing.run_s replace them.
PROFILED_STEP_FACTOR = 1.5
PROFILE_FIXED_S = 20.0
# Steps a job runs besides warmup + steps: the memory probe's step (megatron_worker.probe_memory)
# and, for MoE models, the MoE sub-step timing's (megatron_args.MOE_PROFILE_STEPS).
MEMORY_PROBE_STEPS, MOE_PROBE_STEPS = 1, 2
PRIOR = sorted((HERE.parent / "data/measurements").glob("h100x4-te*.jsonl")) + sorted(
    (HERE.parent / "data/measurements").glob("h200x2-te*.jsonl"))


def _layout_key(c: dict) -> tuple:
    return tuple(c.get(k) for k in ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "mbs", "precision",
                                    "recompute", "sequence_parallel"))


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def estimate(names: list[str], budget: float) -> int:
    """Each job's expected seconds from the committed H100x4 te records (data/measurements/
    h100x4-te*.jsonl, their `timing` and step times): build + the first step's excess over the
    median + median step x (warmup + steps + memory probe + MoE probe + profiled steps x
    PROFILED_STEP_FACTOR) + PROFILE_FIXED_S if profiled, plus one torchrun start per batch. The
    median step is the same layout's where it was measured, else the median over the records of
    the model (layers, seq, gbs) in the job's precision (in any precision if none). Jobs already
    measured (te_device.sh skips them) count 0."""
    from statistics import median

    recs = [json.loads(x) for p in PRIOR for x in p.read_text().splitlines() if x.strip()]
    measured = {r["id"] for r in recs if r.get("status") in ("ok", "oom")}
    ok = [r for r in recs if r.get("status") == "ok" and (r.get("timing") or {}).get("build_s") is not None
          and (r.get("steps") or {}).get("median_s")]
    first_excess = _quantile([r["steps"]["step_times_s"][0] - r["steps"]["median_s"] for r in ok], 0.75)
    build = median(r["timing"]["build_s"] for r in ok)
    startup = median(r["timing"]["startup_s"] for r in ok if r["timing"].get("startup_s"))
    print(f"from {len(ok)} records: build {build:.1f} s, first step's excess (75th pct) {first_excess:.1f} s, "
          f"torchrun start {startup:.1f} s; profiled steps x{PROFILED_STEP_FACTOR} + {PROFILE_FIXED_S:.0f} s (allowances)")
    from advisor.runners import measure as M

    total_all = 0.0
    for name in names:
        total = startup
        print(f"== {name}")
        for line in (CONFIGS / f"{name}.jsonl").read_text().splitlines():
            j = json.loads(line)
            e = M.entry_from_line(j, where(name)[1])
            c = e.config.to_dict()
            group = [r for r in ok if (r["model_name"], r.get("layers"), r["config"]["seq"], r["config"]["gbs"])
                     == (e.model_name, e.model.num_layers, c["seq"], c["gbs"])]
            same = [r for r in group if _layout_key(r["config"]) == _layout_key(c)]
            prec = [r for r in group if r["config"]["precision"] == c["precision"]] or group
            src = same or prec
            if e.refused or not src or j["id"] in measured:
                why = ("REFUSED " + e.refused if e.refused else "already measured: skipped" if j["id"] in measured
                       else "no record of this model to estimate from")
                print(f"  {j['id']:<16} {why}")
                continue
            step = median(r["steps"]["median_s"] for r in src)
            first = (median(r["steps"]["step_times_s"][0] - r["steps"]["median_s"] for r in same)
                     if same else first_excess)
            kp = j.get("kernel_profile_steps", 0)
            n = (e.warmup + e.steps + MEMORY_PROBE_STEPS + (MOE_PROBE_STEPS if e.model.is_moe else 0)
                 + kp * PROFILED_STEP_FACTOR)
            t = build + first + step * n + (PROFILE_FIXED_S if kp else 0.0)
            total += t
            print(f"  {j['id']:<16} step {step:5.2f} s ({'this layout' if same else f'{len(src)} records of the model'})"
                  f"  ~{t:5.1f} s")
        print(f"  total ~{total:.0f} s (budget {budget:.0f} s){'' if total <= budget else '  OVER: split the batch'}")
        total_all += total
    return 0 if total_all <= budget * len(names) else 1


BATCHES = {"x4-te-dense-a": llama8b, "x4-te-dense-b": lambda: llama70b() + gpt3() + nemotron(),
           "x4-te-moe": moe, "x4-te-edge": edge, "x4-te-top": top,
           # s24 in two calls (`python bench/te_campaign.py estimate x4-te-s24a x4-te-s24b`: one
           # batch was ~620 s): the kernel-profiled pairs first, then the #1s and the allocator pair
           "x4-te-s24a": lambda: [j for j in s24() if j.get("kernel_profile_steps")],
           "x4-te-s24b": lambda: [j for j in s24() if not j.get("kernel_profile_steps")],
           "x4-te-s24c": s24c, "x4-te-s24d": s24d, "x4-te-s24e": s24e, "x4-te-s25": s25, "x4-te-s25b": s25b, "x4-te-s25c": s25c, "x4-te-s25d": s25d,
           "x4-te-s26-snap": s26snap, "x4-te-s26b": s26b, "x4-te-s26-offload": s26_offload,
           "x4-te-s26-recompute": s26, "x4-te-s26c": s26c,
           "x4-te-s27a": lambda: s27()[:10], "x4-te-s27b": lambda: s27()[10:],
           "x4-te-s27c": s27c, "x4-te-s27d": s27d, "x4-te-s27e": s27e,
           "x4-te-s28a": s28, "x4-te-s28b": s28b, "x4-te-s28c": s28c, "x4-te-s29": s29, "x4-te-s29b": s29b, "x4-te-s29c": s29c, "x4-te-s29d": s29d,
           "x4-te-s30": s30, "x4-te-s30b": s30b, "x4-te-s30c": s30c, "x4-te-s30d": s30d,
           "x4-te-s30e": s30e,
           # three calls on nvidia-h200-x2: llama3-8b and GPT-3, then llama3-70b and Qwen3, then OLMoE and Mixtral
           "x2-h200-te-a": lambda: [j for j in s32() if j["id"].startswith(("h2te-l8b", "h2te-gpt3"))],
           "x2-h200-te-b": lambda: [j for j in s32() if j["id"].startswith(("h2te-l70b", "h2te-qw3"))],
           "x2-h200-te-c": lambda: [j for j in s32() if j["id"].startswith(("h2te-olm", "h2te-mix"))],
           "x2-h200-te-d": s32d,
           # one H200 (nvidia-h200): the gpt-oss proxy's features in situ
           "x1-h200-te-s34": s34, "x1-h200-te-s34b": s34b,
           "x1-h200-te-s34c": s34c, "x1-h200-te-s34d": s34d,
           "x1-h200-te-s34e": s34e, "x1-h200-te-s34f": s34f}
# One job per feature, first: a feature whose canary fails is not tried again in the call.
CANARY_IDS = ["te-l8b-dp-00", "te-l8b-sp-06", "te-l8b-cp-03", "te-l8b-fp8-16", "te-l8b-pp-12",
              "te-mix-ep-00", "te-mix-moetp-03"]


def all_jobs() -> list[dict]:
    return [j for f in BATCHES.values() for j in f()]


def feature(job_id: str) -> str:
    return job_id.split("-")[2]


def write() -> None:
    CONFIGS.mkdir(exist_ok=True)
    jobs = {j["id"]: j for j in all_jobs()}
    assert len(jobs) == len(all_jobs()), "duplicate ids"
    batches = {"x4-te-canary": [jobs[i] for i in CANARY_IDS]}
    for name, f in BATCHES.items():
        batches[name] = [j for j in f() if j["id"] not in CANARY_IDS]
    for name, rows in batches.items():
        p = CONFIGS / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{p.relative_to(HERE.parent)}: {len(rows)} jobs")
    print(f"{len(jobs)} distinct TE jobs")


def rehearse() -> int:
    """Resolve every job as the launcher does, then have megatron-core build its TransformerConfig
    (its __post_init__ checks) in $REHEARSAL_PYTHON, without GPUs or Transformer Engine."""
    from advisor.runners import measure as M

    jobs = []
    for line in all_jobs():
        e = M.entry_from_line(line, 4)
        if e.refused:
            print(f"{e.id}: REFUSED {e.refused}")
            continue
        jobs.append(M.job_for(e, len(jobs)))
    code = r'''
import json, sys, torch, torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.activations import squared_relu
bad = 0
for job in map(json.loads, sys.stdin):
    tc = dict(job["tc"])
    for k in ("params_dtype", "pipeline_dtype"):
        tc[k] = getattr(torch, tc[k])
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    tc["activation_func"] = {"silu": F.silu, "gelu": F.gelu, "squared_relu": squared_relu,
                             "quick_gelu": quick_gelu}[tc["activation_func"]]
    if tc.get("window_size") is not None:  # the worker's JSON list -> tuple
        tc["window_size"] = tuple(tc["window_size"])
    tc = {k: v for k, v in tc.items() if v is not None}
    tc.pop("apply_rope_fusion", None)  # megatron-core checks TE's fused RoPE is importable: not on CPU
    try:
        (MLATransformerConfig if tc.get("multi_latent_attention") else TransformerConfig)(**tc)
    except Exception as ex:
        bad += 1
        print(job["id"], "FAILS", type(ex).__name__, str(ex)[:300])
print(f"{bad} of the jobs fail their TransformerConfig")
sys.exit(1 if bad else 0)
'''
    py = os.environ.get("REHEARSAL_PYTHON", "python3")
    r = subprocess.run([py, "-c", code], input="".join(json.dumps(j) + "\n" for j in jobs), text=True)
    print(f"{len(jobs)} jobs resolved")
    return r.returncode


def _statuses(ds: Path) -> dict[str, str]:
    out = {}
    if ds.exists():
        for line in ds.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if "id" in r and "status" in r:  # trial records only (micro-benchmarks share $OUT)
                    out[r["id"]] = r["status"]
    return out


def run(budget: float, out: Path, batches: list[str], canary: bool) -> int:
    """On the GPU machine: `advisor measure --batch` for the canary batch, then each main batch
    without the jobs already measured (ok) and those of a feature whose canary failed, while the
    time budget lasts. Records land in DIR/<batch>.jsonl."""
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)

    def measure(name: str, lines: list[dict]) -> None:
        left = budget - (time.time() - t0)
        if left < 25 or not lines:
            print(f"== skip {name}: {len(lines)} jobs, {left:.0f} s left", flush=True)
            return
        path = Path(tempfile.gettempdir()) / f"{name}.in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        print(f"== {name}: {len(lines)} jobs, {left:.0f} s left", flush=True)
        subprocess.run([sys.executable, "-m", "advisor", "measure", "--batch", str(path),
                        "--dataset", str(out / f"{name}.jsonl"), "--max-seconds", str(int(left - 15)),
                        "--run-dir", str(Path(tempfile.gettempdir()) / f"{name}.runs"),
                        "--timeout", "150"], check=False)

    if canary:
        measure("x4-te-canary", [json.loads(x) for x in (CONFIGS / "x4-te-canary.jsonl").read_text().splitlines() if x])
    st = _statuses(out / "x4-te-canary.jsonl")
    failed = {feature(i) for i, s in st.items() if s not in ("ok", "oom")}
    if "te-l8b-dp-00" in st and st["te-l8b-dp-00"] != "ok":
        print("== the plain data-parallel canary failed: stopping", flush=True)
        return 1
    if failed:
        print(f"== features whose canary failed, skipped: {sorted(failed)}", flush=True)
    for name in batches:
        done = {i for f in out.glob("*.jsonl") for i, s in _statuses(f).items() if s in ("ok", "oom")}
        lines = [json.loads(x) for x in (CONFIGS / f"{name}.jsonl").read_text().splitlines() if x]
        measure(name, [j for j in lines if j["id"] not in done and feature(j["id"]) not in failed])
    return 0


def table(paths: list[str]) -> None:
    for p in paths:
        for line in open(p, encoding="utf-8"):
            r = json.loads(line)
            c, th, m = r["config"], r.get("throughput") or {}, r.get("memory") or {}
            lay = f"TP{c['tp']}{'sp' if c.get('sequence_parallel') else ''} PP{c['pp']}v{c['vp']} CP{c['cp']} EP{c['ep']}/{c['etp']} DP{c['dp']}"
            print(f"{r['id']:<18} {r['status']:<7} {lay:<28} mbs{c['mbs']} {c['precision']:<4} {c['recompute']:<9} "
                  f"{th.get('tokens_per_s_per_gpu') or 0:>9,.0f} tok/s/GPU  {m.get('max_gib') or 0:5.1f} GiB  "
                  f"{(r.get('error') or '')[:120]}")
            ph = max(r.get("memory_phases") or [], key=lambda x: x["peak_gib"], default=None)
            fail = [f"rank {k} in {v.get('phase')}" for k, v in (m.get("at_failure") or {}).items()]
            if ph:  # the per-phase memory of the fullest stage (runners/mem_probe.py)
                print(f"{'':18} stage {ph['stage']}: static {ph['static_gib']:.1f}, fwd-bwd peak "
                      f"{ph['forward_backward_peak_gib']:.1f}, optimizer peak {ph['optimizer_peak_gib']:.1f}, "
                      f"reserved {ph['reserved_peak_gib']:.1f}, outside allocator "
                      f"{ph['outside_allocator_gib'] or 0:.1f} GiB, {ph['num_alloc_retries']} retries")
            elif fail:
                print(f"{'':18} out of memory: {', '.join(fail)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("write")
    sub.add_parser("rehearse")
    pr = sub.add_parser("predict")
    pr.add_argument("batches", nargs="*", default=["x4-te-edge"])
    r = sub.add_parser("run")
    r.add_argument("--budget", type=float, default=520.0)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--batches", nargs="*", default=list(BATCHES))
    r.add_argument("--no-canary", action="store_true")
    es = sub.add_parser("estimate")
    es.add_argument("batches", nargs="*", default=["x4-te-s24a", "x4-te-s24b"])
    es.add_argument("--budget", type=float, default=500.0)
    t = sub.add_parser("table")
    t.add_argument("paths", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "write":
        write()
    elif a.cmd == "rehearse":
        return rehearse()
    elif a.cmd == "predict":
        return predict(a.batches)
    elif a.cmd == "estimate":
        return estimate(a.batches, a.budget)
    elif a.cmd == "run":
        return run(a.budget, a.out, a.batches, not a.no_canary)
    else:
        table(a.paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fused attention's work as its kernels do it: whole tiles along the causal / window band.

Flash attention (Transformer Engine runs cuDNN's fused attention on Hopper; FlashAttention-3 the
same way) computes the score matrix in tiles of block_m queries x block_n keys and skips only the
tiles wholly outside the mask: a tile the band's diagonal edge crosses is computed whole. Each
thread block (one query block in the forward, one key block in the backward) also pays a fixed
cost besides its tiles: its pipeline's fill and drain, the load of its Q (forward) or K, V
(backward) block, the write of its O / LSE or dK, dV, and the per-token memory-bound passes
(the backward's dO.O preprocess, the dQ accumulator's clear and conversion, GQA's dK / dV
reduction) that scale with the block's rows, not its keys.

The forward-equivalent time of one layer's core attention is then

    ideal FLOPs / (peak x attention_efficiency) x shape_factor / head_dim_efficiency

where the ideal FLOPs count the mask exactly (models.flops.keys_per_query), and

    shape_factor = (effective keys / ideal keys) at this shape
                   / (effective keys / ideal keys) at the reference shape (causal, seq 8192, head dim 128)

so `Constants.attention_efficiency` keeps its meaning: the efficiency of full causal attention at
the reference shape, where its prior was measured (bench/kernel_rates.py, cuDNN through SDPA) and
the published runs mostly sit. Effective keys per query, forward and backward each with its tile:

    tiles computed x block_m x block_n / seq  +  Constants.attention_edge_tiles x (the block's
    other side: block_n forward, block_m backward) x kernel calls per query

weighted forward : backward = 1 : attention_backward_factor. Fitted on Transformer Engine's
measured window / full attention (bench/fit_window_attention.py, data/measurements/
h100x1-window-attention.jsonl).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from advisor.catalog.specs import ModelSpec
from advisor.models.constants import Constants
from advisor.models.flops import keys_per_query

# The reference shape of Constants.attention_efficiency: full causal, 8K tokens, head dim 128.
REFERENCE_SEQ = 8192
REFERENCE_HEAD_DIM = 128

# Tile sizes (block_m queries x block_n keys) of FlashAttention-3's Hopper kernels for 2-byte
# inputs by head dimension: forward from hopper/tile_size.h (tile_size_fwd_sm90: causal, local =
# sliding window), backward from hopper/flash_bwd_launch_template.h (run_mha_bwd_hdim*, Arch 90,
# causal or local). cuDNN's Hopper kernels, which Transformer Engine selects, are closed; they are
# built on the same WGMMA / shared-memory limits, and these are their best public stand-in.
#   head dim <=:   forward causal   forward local   backward
FA3_TILES = ((64, (192, 128), (192, 160), (128, 128)),
             (96, (192, 144), (192, 128), (64, 128)),
             (128, (128, 128), (128, 128), (64, 128)),
             (192, (128, 128), (128, 96), (64, 96)),
             (256, (128, 80), (128, 64), (64, 80)))


def tile_shapes(head_dim: int, windowed: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """((block_m, block_n) forward, (block_m, block_n) backward) for a head dimension; above 256
    (no FA3 kernel) the 256 tiles."""
    for top, causal, local, bwd in FA3_TILES:
        if head_dim <= top:
            return (local if windowed else causal), bwd
    return (FA3_TILES[-1][2] if windowed else FA3_TILES[-1][1]), FA3_TILES[-1][3]


@lru_cache(maxsize=4096)
def tiles_computed(seq: int, window: int, window_type: str, block_m: int, block_n: int) -> int:
    """Tiles of block_m x block_n the kernel computes for one head over `seq` causal tokens:
    each query block runs from the key block of its first visible key to that of its last query
    (FlashAttention's n_block_min / n_block_max). window 0 (or >= seq): full causal; "sliding":
    query i sees keys i - window + 1 .. i; "chunked": the keys of its chunk up to itself."""
    q0 = np.arange(0, seq, block_m, dtype=np.int64)
    last = np.minimum(q0 + block_m, seq) - 1  # the block's last query and so its last key
    if window <= 0 or window >= seq:
        first = np.zeros_like(q0)
    elif window_type == "chunked":
        first = (q0 // window) * window
    else:
        first = np.maximum(0, q0 - window + 1)
    return int(np.sum(last // block_n - first // block_n + 1))


def effective_keys(seq: int, window: int, window_type: str, head_dim: int, c: Constants,
                   calls: float = 1.0) -> float:
    """Keys per query the kernels' time corresponds to at the tile rate (forward + backward
    weighted 1 : attention_backward_factor): the tiles computed, plus the thread blocks' fixed
    cost (attention_edge_tiles per block, `calls` kernel calls per query: a CP ring's steps)."""
    windowed = 0 < window < seq
    (fm, fn), (bm, bn) = tile_shapes(head_dim, windowed)
    fwd = tiles_computed(seq, window, window_type, fm, fn) * fm * fn / seq + c.attention_edge_tiles * fn * calls
    bwd = tiles_computed(seq, window, window_type, bm, bn) * bm * bn / seq + c.attention_edge_tiles * bm * calls
    return (fwd + c.attention_backward_factor * bwd) / (1.0 + c.attention_backward_factor)


def head_dim_efficiency(head_dim: int, c: Constants) -> float:
    """Fused attention's efficiency at `head_dim` relative to head dim 128: 1 up to 128, then
    linear to Constants.attention_hdim256_efficiency at 256 (measured at 128 and 256 only: the
    256 kernels' smaller tiles, 128 x 80 forward / 64 x 80 backward, keep fewer tiles in flight)."""
    if head_dim <= REFERENCE_HEAD_DIM:
        return 1.0
    x = min(1.0, (head_dim - REFERENCE_HEAD_DIM) / 128.0)
    return 1.0 + x * (c.attention_hdim256_efficiency - 1.0)


def attention_head_dim(m: ModelSpec) -> int:
    """The head dimension that picks the kernel: the larger of the q / k and v dims (MLA: 192)."""
    if m.mla is not None:
        return max(m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim)
    return m.head_dim


@lru_cache(maxsize=4096)
def _reference_ratio(edge: float, backward: float) -> float:
    c = Constants(attention_edge_tiles=edge, attention_backward_factor=backward)
    return effective_keys(REFERENCE_SEQ, 0, "sliding", REFERENCE_HEAD_DIM, c) / keys_per_query(REFERENCE_SEQ)


@lru_cache(maxsize=4096)
def shape_factor(seq: int, window: int, window_type: str, head_dim: int, c: Constants, calls: float = 1.0) -> float:
    """Time of a layer's core attention relative to its ideal FLOPs at attention_efficiency:
    (effective / ideal keys at this shape) / (the same at the reference shape) / the head-dim
    efficiency. 1 at the reference shape."""
    ideal = keys_per_query(seq, window, window_type)
    here = effective_keys(seq, window, window_type, head_dim, c, calls) / ideal
    return here / _reference_ratio(c.attention_edge_tiles, c.attention_backward_factor) / head_dim_efficiency(head_dim, c)


def cp_ring_calls(cp: int) -> float:
    """Kernel calls per query of a layer's attention under Transformer Engine's load-balanced CP
    ring (cp_comm_type p2p): step 0 runs the local causal block; each of the cp - 1 later steps
    runs all local queries against half a K / V chunk (from a lower rank) or the second half of
    the queries against a whole chunk (from a higher rank): on average over the ranks 3/4 of the
    queries per step (TE's AttnFuncWithCPAndKVP2P). 1 without CP or with the all-gather."""
    return 1.0 + 0.75 * (cp - 1) if cp > 1 else 1.0


def softmax_stretch(model: ModelSpec, gpu, c: Constants) -> float:
    """Fused attention's time (forward + backward) with the softmax's exponentials on the special
    function units, over its time at the tensor rate alone, relative to the GPU and head size
    `Constants.attention_efficiency` is defined at (`attention_exp_ratio_ref`: an H100 at head
    dim 128, 1.0 there). Per attention score: 2·(d_qk + d_v) tensor FLOPs forward and
    `attention_backward_factor` times that backward; one exponential forward and one backward
    (P recomputed), at `GPUSpec.sfu_exp_tera_per_s`, not hidden behind the tensor cores (cuDNN's
    and FlashAttention-2/3's softmax waits on the scores' GEMM and the next GEMM waits on it: the
    Blackwell Ultra softmax blog's BMM1 -> softmax -> BMM2 chain). 1.0 where the GPU's SFU rate
    is not in the catalog."""
    if not gpu.sfu_exp_tera_per_s:
        return 1.0
    if model.mla is not None:
        dims = model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim + model.mla.v_head_dim
    else:
        dims = 2 * model.head_dim
    r = gpu.bf16_tflops / (gpu.sfu_exp_tera_per_s * 2.0 * dims)  # exp time / tensor time, forward
    b = c.attention_backward_factor
    return (1.0 + b + 2.0 * r) / (1.0 + b + 2.0 * c.attention_exp_ratio_ref)


def attention_seconds(model: ModelSpec, flops: float, seq: int, window: int, gpu, c: Constants) -> float:
    """Fused attention's forward seconds for `flops` of core attention over a whole `seq`: BF16 peak at
    attention_efficiency x the kernel's tiles (attention.shape_factor) x the softmax's SFU time."""
    shape = shape_factor(seq, window, model.window_type, attention_head_dim(model), c, 1.0)
    return flops / (gpu.bf16_tflops * 1e12) / c.attention_efficiency * shape * softmax_stretch(model, gpu, c)

"""torch's caching allocator: memory it holds reserved but unallocated at a stage's peak (issue #27).

What the runs measure as peak reserved less peak allocated (records: memory.peak_reserved_gib_per_rank
vs peak_allocated_gib_per_rank; the OOM messages' "X GiB is reserved by PyTorch but unallocated").
How it arises (PyTorch docs, "CUDA semantics / Memory management" and "Optimizing memory usage with
PYTORCH_CUDA_ALLOC_CONF"; c10/cuda/CUDACachingAllocator.cpp): requests over 1 MiB (kSmallSize) come
from the large pool, rounded up to 2 MiB (kRoundLarge); those under 10 MiB (kMinLargeAlloc) get a
20 MiB segment (kLargeBuffer), larger ones a cudaMalloc of their own size. A freed block stays
cached; a later request takes the smallest cached block that is large enough and splits it, so a
cached block can serve smaller requests but never a larger one: a request larger than every cached
free block makes a new segment, and the smaller free blocks stay reserved. The largest blocks a step
allocates and frees again are what leave the most behind: the cross entropy's fp32 s x b x V / TP
logits on the loss stage (llama3-8b mbs 8: 16 GiB blocks, 12 GiB reserved but unallocated), and in
a dropless MoE the token buffers of every MoE layer, whose size follows the routing and changes
every micro-batch (te-eqw3-rc-00: 41.6 GiB allocated, 66.2 reserved). With expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, TrainConfig.expandable_segments) the allocator
keeps one segment per stream and maps more pages at its end instead of making a new segment, so the
larger request tiles into the segment and freed blocks do not strand. Measured on one pair, same
machine and layout (llama3-8b[8L] DP4 mbs4 BF16, data/measurements/h100x4-te.jsonl te-l8b-alloc-32
off / te-l8b-alloc-33 on): peak allocated 47.33 GiB both, peak reserved 51.19 vs 47.77 GiB, so the
term with expandable segments is that run's residual, 0.44 GiB (Constants.alloc_reserved_expandable_gib),
whatever the blocks.

The term per stage, GiB (Constants.alloc_reserved_*):

    base + block x the stage's largest transient block + moe x sqrt(its MoE layers) x one layer's buffers

and alloc_reserved_expandable_gib instead with expandable segments. base and block fitted by
non-negative least squares on every pipeline stage of the measured runs, leave-one-architecture-out:
`python bench/memory_edge.py --allocator`; moe per stack (its profile's constant) on the stack's MoE
stages: `python bench/moe_allocator.py --pipeline`.
Why sqrt(layers): every MoE layer's buffers take a new size each micro-batch, and a freed block
serves any later request no larger than itself, so one layer's freed blocks are reused by the next
layers' requests; what stays stranded is set by how far the sizes of the stage's live set stray
from what the cached blocks hold, which grows slower than the layer count. Measured (te, Qwen3
proxy, same layout but the depth: te-qw3-ep-01 6 layers / te-qw3-top-10 12 layers, EP4 mbs2):
measured less the base and block parts 2.49 / 3.87 GiB, x1.55 for x2 the layers (sqrt: x1.41).
A toy of the caching allocator on a modelled MoE step (`python bench/allocator_toy.py`: the rules
above, buffer sizes drawn per layer and micro-batch) strands 0.03 GiB when no size changes and
1.96 / 2.84 / 4.52 / 6.94 GiB at 4 / 8 / 16 / 32 layers (Mixtral-8x7B proxy EP4 mbs1, cv 0.2: about
layers^0.6); linear in the layers (the form before) the te MoE runs' band was 6.9% LOAO, with sqrt 6.6%.
"""
from __future__ import annotations

import numpy as np

from advisor.catalog.specs import ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, GIB, Constants
from advisor.models.moe import moe_activation_elements

# physical ranges of the fitted coefficients (the fit must land inside them)
RANGES = {"alloc_reserved_base_gib": (0.0, 4.0),   # segments of small / mid requests, GiB
          "alloc_reserved_block": (0.0, 2.0),      # at most one stranded copy per size class of the block
          # one layer's buffer sets per sqrt(MoE layer): the toy allocator (bench/allocator_toy.py) strands
          # 0.6-1.5 of them at 4-32 layers; at most about 3 (a layer's kept buffers and its backward's
          # gradients of the same sizes, each stranded once per micro-batch's size change)
          "alloc_reserved_moe": (0.0, 3.0)}

def dense_block_bytes(model: ModelSpec, tp, cp, mbs, seq) -> np.ndarray:
    """A dense layer's FC1 output for one micro-batch (its largest activation), bytes: s b (2 f if
    gated) / TP in BF16. 0 for a MoE model (its MLP buffers are the MoE term)."""
    if model.is_moe:
        return np.zeros(np.shape(np.asarray(tp) * mbs))
    gated = 2 if model.activation == "swiglu" else 1
    return np.asarray(seq / np.asarray(cp) * mbs * gated * model.ffn_hidden_size / np.asarray(tp) * 2.0, float)


def logits_block_bytes(model: ModelSpec, tp, cp, mbs, seq, ce_bytes) -> np.ndarray:
    """The loss stage's largest logits tensor, bytes: s b V / TP x its bytes per logit."""
    return np.asarray(seq / np.asarray(cp) * mbs * model.vocab_size / np.asarray(tp) * ce_bytes, float)


def routing_sized_buffers(cfg: TrainConfig) -> bool:
    """Whether a dropless MoE layer allocates token buffers whose size follows the routing, so that
    their sizes change from layer to layer and micro-batch to micro-batch (megatron-core 0.19
    token_dispatcher.py; TE 2.x GroupedLinear):
    - EP > 1: each rank receives the tokens routed to its experts (the all-to-all's output_splits,
      or the allgather dispatcher's masked gather of them), so the received tokens, their sorted
      copy, the experts' FC1 / activation / FC2 outputs and the combine's inputs are all of a
      routing-dependent size;
    - experts run one at a time (moe_grouped_gemm off: megatron-core's SequentialMLP): each
      expert's FC1 / activation / FC2 outputs are tensors of its own token count;
    - quantized (FP8 / FP4): TE's GroupedLinear quantizes each expert's slice of the input into a
      tensor of its own token count.
    With EP = 1, BF16 and grouped experts every such buffer has the same size in every layer and
    micro-batch (dropless: num_out_tokens = tokens x top-k; GroupedLinear writes one output of
    sum(m_splits) rows), so a freed block serves the next layer's request exactly and none is
    stranded."""
    return cfg.ep > 1 or not cfg.moe_grouped_gemm or cfg.precision != "bf16"


def moe_buffer_bytes(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT) -> float:
    """One MoE layer's token buffers for one micro-batch on the busiest GPU, bytes (BF16: what
    models.moe.moe_activation_elements counts: permuted tokens, expert FC1 / activation / FC2 and
    the router's), where their size follows the routing (routing_sized_buffers). 0 with capacity
    padding (fixed size), with buffers of a fixed size, or for a dense model."""
    if not model.is_moe or cfg.moe_pad_to_capacity or not routing_sized_buffers(cfg):
        return 0.0
    elems, gemm_in = moe_activation_elements(model, cfg, c)
    return (elems + gemm_in) * c.bytes_activation


def reserved_free_gib(block_bytes, moe_layers, moe_bytes, c: Constants = DEFAULT) -> np.ndarray:
    """GiB reserved but unallocated at the stage's peak with torch's caching allocator as it comes
    (arrays broadcast): base + block x the largest transient block + moe x sqrt(MoE layers) x one
    layer's buffers (module doc). With expandable segments it is the measured residual
    alloc_reserved_expandable_gib (models.memory.memory_arrays)."""
    return (c.alloc_reserved_base_gib
            + (c.alloc_reserved_block * np.asarray(block_bytes, float)
               + c.alloc_reserved_moe * np.sqrt(np.asarray(moe_layers, float)) * np.asarray(moe_bytes, float)) / GIB)

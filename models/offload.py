"""Activation offloading to host memory (TrainConfig.cpu_offload_layers): the time its copies add to
a microbatch. What leaves the GPU is in models/memory.py (offloaded_activation_bytes).

megatron-core runs every transformer layer of the block inside Transformer Engine's CPU offload
context (megatron/core/transformer/transformer_block.py: get_cpu_offload_context(cpu_offloading,
cpu_offloading_num_layers, num_layers, cpu_offloading_activations, cpu_offloading_weights) and
group_prefetch_offload_commit_async after each layer). TE's DefaultOffloadSynchronizer
(transformer_engine/pytorch/cpu_offload.py), with L layers and N offloaded:
- offloads layers 0 .. N - 1: layer i's saved tensors are copied device to host on one side stream
  from layer i + 1's forward on, and the compute stream waits for that copy before layer
  L - N + i's forward (finish_offload_map);
- reloads layer i host to device on the same stream from layer L - 1 - N + i's backward on, and
  layer i's backward waits for it (start_reload_map, pop_tensor).
Every copy, D2H and H2D, is issued on that one offload stream (OffloadSynchronizer.offload_stream),
each D2H after its layer's forward (waiting on its tensors' events), each reload after
offload_stream.wait_stream(compute stream), into per-tensor pinned host buffers
(torch.empty_like(..., pin_memory=True), reused through torch's caching host allocator).
Each copy therefore has W = L - N - 1 layers of compute beside it, and the copies queue on one
stream. With a copy time t_c per layer and a forward time t_f per layer, the offload stream must
move N layers between the end of layer 0's forward and the start of layer L - 1's, L - 2 layer
forwards later, of which the copies use the fraction f = Constants.offload_overlap: exposed
forward = max(0, N t_c - f (L - 2) t_f) (f = 1: the queue's binding constraint when t_c > t_f).
With W = 0 (N = L - 1, which TE warns "prevents overlapping of computation and offload/reload") each
copy must end before the next layer starts: all N t_c exposed. The backward is the same with the
H2D reloads and the per-layer backward time (first reload at layer L - 2's backward, the last one
needed at layer 0's). A copy's time: the layer's bytes over the host link (GPUSpec.host_link_gbs)
at Constants.host_link_efficiency, the per-GPU share while every GPU of the node copies at once.
Both constants are fitted on the 4 x H100 records (bench/activation_knobs_check.py --fit: with
f = 1 and 0.85 the runs offloading 4-12 of 16 layers measured 12-36 % slower than predicted).
The compute stream's wait counts in the stage's overhead_s (like the host's issue wait); it does
not stretch with the clocks.
"""
from __future__ import annotations

import numpy as np

from advisor.catalog.specs import ClusterSpec
from advisor.models.constants import Constants
from advisor.models.memory import offloaded_activation_bytes
from advisor.models.stages import Memo, Stages
from advisor.search_spaces.columns import Layouts

__all__ = ["exposed_transfer_s", "offload_wait_arrays"]


def exposed_transfer_s(n, layers, copy_s, layer_s, overlap=1.0):
    """Seconds one pass (forward or backward) of a microbatch waits for the offload copies: `n`
    layers of `layers` offloaded, `copy_s` one layer's copy, `layer_s` one layer's compute in that
    pass, `overlap` the fraction of the other layers' compute the copies run beside
    (Constants.offload_overlap; floats or arrays). 0 where n = 0."""
    n = np.asarray(n, float)
    queued = np.maximum(0.0, n * copy_s - overlap * (np.asarray(layers, float) - 2.0) * layer_s)
    return np.where(n <= 0, 0.0, np.where(n >= np.asarray(layers) - 1, n * copy_s, queued))


def offload_wait_arrays(cluster: ClusterSpec, L: Layouts, c: Constants, memo: Memo, S: Stages,
                        fwd_layers_s: np.ndarray, bwd_layers_s: np.ndarray) -> np.ndarray:
    """[S] seconds per microbatch each stage waits for activation offloading (forward D2H plus
    backward H2D; exposed_transfer_s). `fwd_layers_s` / `bwd_layers_s`: the stage's transformer
    layers' forward / backward per microbatch with their collectives (models.step_time.stage_time_arrays,
    without the embedding and the loss; no recompute: offloading refuses it). 0 where nothing is
    offloaded."""
    if L.offload is None or not L.offload.any():
        return np.zeros(S.total)
    n = L.offload[S.row]
    layers = np.maximum(S.counts(memo).sum(axis=1), 1.0)
    bw = cluster.gpu.host_link_gbs * 1e9 * c.host_link_efficiency
    per_layer = offloaded_activation_bytes(L, memo, S) / np.maximum(n, 1)
    copy_s = per_layer / bw if bw > 0 else np.where(n > 0, np.inf, 0.0)
    f = c.offload_overlap
    return (exposed_transfer_s(n, layers, copy_s, fwd_layers_s / layers, f)
            + exposed_transfer_s(n, layers, copy_s, bwd_layers_s / layers, f))

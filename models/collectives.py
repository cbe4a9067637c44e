"""NCCL collective costs and the links a group of ranks uses (moved out of models/step_time.py,
which re-exports them): the ring cost model and group_links' NVLink / network choice."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from advisor.catalog.specs import ClusterSpec
from advisor.models.constants import Constants

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def bus_factor(kind: str, n):
    """NCCL's bus-bandwidth factor (nccl-tests' PERFORMANCE.md): bytes on the busiest link per byte of
    the buffer over a ring of n ranks; 1 for a point-to-point transfer (p2p, a CP ring's send / recv)."""
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def collective_time(kind: str, nbytes, n, bw_gbs, latency):
    """NCCL ring-style cost of a collective over n ranks moving nbytes per rank (the full buffer):
    bus_factor x bytes / bandwidth + latency (x sqrt(n-1) per ring pass for the collectives).
    Floats or arrays (one group per element; a group of one rank or no bytes costs nothing)."""
    if kind not in COLLECTIVES:
        raise ValueError(kind)
    arrays = any(isinstance(v, np.ndarray) for v in (nbytes, n, bw_gbs, latency))
    if not arrays and (n <= 1 or nbytes <= 0):
        return 0.0
    bw = bw_gbs * 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "p2p":
            lat = latency
        else:
            lat = (2 * latency if kind == "all_reduce" else latency) * (n - 1) ** 0.5
        v = bus_factor(kind, n) * nbytes / bw + lat
    return np.where((np.asarray(n) <= 1) | (np.asarray(nbytes) <= 0), 0.0, v) if arrays else v


@dataclass
class Link:
    """A group's link (group_links): floats for one group, arrays for many."""

    bw_gbs: float | np.ndarray
    latency: float | np.ndarray
    inter_node: bool | np.ndarray

    def groups(self) -> list[Link]:
        """One Link of floats per group."""
        return [Link(float(b), float(t), bool(x)) for b, t, x in
                zip(np.atleast_1d(self.bw_gbs), np.atleast_1d(self.latency), np.atleast_1d(self.inter_node))]


def group_links(cluster: ClusterSpec, stride, size, c: Constants) -> Link:
    """Link a group of `size` ranks spaced `stride` apart uses (arrays: one group per element):
    NVLink when it fits in the job's share of one NVLink domain (`ClusterSpec.domain_gpus`: an
    HGX node, or the GPUs of an NVL72 rack, over its 4-GPU trays). Across domains, the k ranks of
    the group that share a domain drive k NICs at once (NCCL runs one ring / channel per NIC; a
    node's boundary hop carries the group's traffic over all of them), so the group's per-rank
    bandwidth is k NICs' worth, at most the NVLink rate: nccl-tests on DGX H100 (8 x 400 Gb/s per
    node) show multi-node all-reduce bus bandwidths near the NVLink one with full nodes, and
    ~50 GB/s with one rank per node."""
    gpn = cluster.domain_gpus
    stride, size = np.asarray(stride), np.asarray(size)
    inter = (size > 1) & (stride * size > gpn)
    per_node = np.where(stride < gpn, np.maximum(1, np.minimum(size, gpn // np.maximum(stride, 1))), 1)
    bw = np.minimum(cluster.intra_node_bw_gbs, per_node * cluster.inter_node_bw_gbs)
    return Link(np.where(inter, bw * c.network_efficiency, cluster.intra_node_bw_gbs * c.nvlink_efficiency),
                np.where(inter, c.inter_latency_s, c.intra_latency_s), inter)


def group_link(cluster: ClusterSpec, stride: int, size: int, c: Constants) -> Link:
    """group_links of one group, as floats."""
    return group_links(cluster, stride, size, c).groups()[0]

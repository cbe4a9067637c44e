"""Megatron FSDP's step-time terms (TrainConfig.fsdp: Megatron FSDP with the optim_grads_params
sharding strategy), on the per-stage arrays of models.step_time.

What megatron-core 0.19 does (distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py, MegatronFSDP.
_register_fsdp_hooks), for an FSDP unit (fsdp_unit_modules: a TransformerLayer):
- before its forward, `_pre_forward_param_unshard` all-gathers its parameters with prefetch=True in
  PrefetchOrder.FORWARD_PASS_ORDER (the next unit's gather is issued while this one computes);
- after its forward, `_post_forward` calls `release_module_parameters(module, bwd=False,
  lazy=False)` ("Release the module parameters after the forward pass to save memory"): the
  parameters are NOT kept between the forward and the backward (only inside an activation-
  recompute forward is the release lazy);
- before its backward, `_pre_backward_param_unshard` all-gathers them again, prefetching in
  PrefetchOrder.BACKWARD_PASS_ORDER; `_post_backward_release_module` releases them after;
- its gradient is reduce-scattered after its backward: `_process_post_backward_gradients` has
  `grad_reduce_every_bprop = strategy in ["optim_grads", "optim_grads_params"]` and reduces when
  `grad_reduce_every_bprop or is_last_microbatch`, so with optim_grads_params on EVERY micro-batch.
  The gathers repeat per micro-batch too (`all_gather_params` is conditioned on
  `microbatch_count == 0` only for the hybrid (HSDP) outer-group gather).
So per micro-batch a stage of n units moves, over its DP group, 2 all-gathers and 1 reduce-scatter of
its units' parameters. The prefetch overlaps unit i+1's gather with unit i's compute (the
suggested prefetch size, `suggested_communication_unit_size // 2` with the size at least 1e9
elements, lets it run several units ahead: the stage's gathers queue on their stream while its
compute runs), so per pass the exposed part is the first unit's gather plus what the other n - 1
units' traffic exceeds their compute by (x Constants.dp_overlap_efficiency, as the DP overlap of
models.step_time). In the backward the gathers (prefetch) and the reduce-scatters (of the unit just
done) share the DP links; the last unit's reduce-scatter has no compute after it: exposed.
The parameters outside the units (the embedding, the output layer and final norm, kept gathered
by `reset(preserve_non_fsdp_units=True)`) are counted as the distributed optimizer's: one
reduce-scatter and one all-gather per step (models.step_time.dp_terms).

FP8 primary weights (TrainConfig.fp8_param_gather) gather the linear layers' weights at 1 byte
instead of 2 (half the bytes)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from advisor.models.collectives import Link, collective_time
from advisor.models.constants import Constants

__all__ = ["FSDPTerms", "fsdp_exposed_per_microbatch", "fsdp_stage_terms"]


@dataclass
class FSDPTerms:
    """Per stage: one all-gather (s) and one reduce-scatter (s) of the stage's units' parameters
    (their whole bytes over the DP / expert-DP groups) and the number of units; 0 where FSDP is off."""

    gather: np.ndarray
    reduce: np.ndarray
    units: np.ndarray

    def take(self, sm: np.ndarray) -> "FSDPTerms":
        return FSDPTerms(self.gather[sm], self.reduce[sm], self.units[sm])


def fsdp_stage_terms(on: np.ndarray, dense_units: np.ndarray, experts: np.ndarray, linear_dense: np.ndarray,
                     fpg: np.ndarray | float, units: np.ndarray, d: np.ndarray, dlink: Link, edp: np.ndarray,
                     elink: Link, c: Constants) -> FSDPTerms:
    """FSDPTerms of every stage: `dense_units` the units' dense parameters (memory.outside_layer_params
    taken out), `experts` their expert parameters (sharded over the expert-DP group `edp`), `linear_dense`
    the dense linear layers' weights (the ones FP8 primary weights gather at 1 byte where `fpg`).
    Each unit is its own collective (its latency counted once per unit): n x the cost of 1/n of the bytes."""
    gb = c.dp_grad_reduce_bytes
    n = np.maximum(units, 1.0)

    def per_unit(kind, dense_bytes, expert_bytes):
        return n * (collective_time(kind, dense_bytes / n, d, dlink.bw_gbs, dlink.latency)
                    + collective_time(kind, expert_bytes / n, edp, elink.bw_gbs, elink.latency))

    gather = per_unit("all_gather", dense_units * 2 - linear_dense * fpg, experts * (2 - fpg))
    reduce = per_unit("reduce_scatter", dense_units * gb, experts * gb)
    return FSDPTerms(np.where(on, gather, 0.0), np.where(on, reduce, 0.0), np.where(on, units, 0.0))


def fsdp_exposed_per_microbatch(t: FSDPTerms, forward_s: np.ndarray, backward_s: np.ndarray,
                                eff: float) -> np.ndarray:
    """Seconds per micro-batch per stage the FSDP traffic adds to the stage's compute (module doc):
    forward: the first unit's gather + max(0, the other units' gathers - their forward x eff);
    backward: the first unit's gather and the last unit's reduce-scatter + max(0, the other units'
    gathers and reduce-scatters - their backward x eff)."""
    n = np.maximum(t.units, 1.0)
    rest = (n - 1.0) / n  # the share of the stage's traffic and compute that can overlap
    fwd = t.gather / n + np.maximum(0.0, rest * (t.gather - forward_s * eff))
    bwd = (t.gather + t.reduce) / n + np.maximum(0.0, rest * (t.gather + t.reduce - backward_s * eff))
    return np.where(t.units > 0, fwd + bwd, 0.0)

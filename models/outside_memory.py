"""Memory outside torch's caching allocator on one GPU of each pipeline stage (issue #27): the CUDA
context and cuBLAS handle, the NCCL world communicator, one NCCL communicator per process group
megatron-core opens (whether a step uses it or not), and the connection buffers of each group of
more than one rank that a training step uses. torch's peak reserved memory (what the runs'
memory blocks measure) does not hold any of it; the device does.

Groups: megatron-core 0.19.2's parallel_state.initialize_model_parallel (gtp_remat 1) opens, on
every rank, one group of each of these kinds (`megatron_groups`: the kind and its size), 20 in all
on a rank of the first pipeline stage, one fewer on the last (no position-embedding group), two
fewer on a middle one (neither embedding group). Counted on CPU with the package's own function and
torch.distributed.new_group recorded (4 ranks; TP1 / TP2 / PP2 / EP4: 14 / 7 / 9 / 11 groups of
one rank). With init_process_group(device_id=...) (eager NCCL init, what Megatron-LM's initialize
and this project's worker do) each group's communicator is created at once: a one-rank
communicator holds more than a larger one (Constants.nccl_comm_single_gib, nccl_comm_gib).

Which groups a step uses (the connection buffers NCCL sets up at a communicator's first
collective, per channel): the data-parallel group with CP (gradient reduce-scatter / all-reduce,
parameter all-gather), TP and CP, the pipeline group (p2p), the distributed optimizer's
gradient-statistics group (the whole model replica set: grad norm), under fp8 the amax reduction
group (tensor + data + context parallel); for MoE the expert groups (EP all-to-all, tensor x expert
all-gather of the token counts, expert TP, expert DP gradients) and the router's token statistics
(tensor + data + context parallel, tensor + context parallel) (megatron-core 0.19.2:
transformer/moe/token_dispatcher.py, router.py; distributed/).

With init_process_group given no device_id (Megatron-Bridge's initialize, so NVIDIA's recipes;
TrainConfig.nccl_lazy_init, the te stack's default) torch creates a group's communicator at its
first collective: only the groups a step uses hold one (lazy=True below).

Checked against the te runner's 19 stage records with memory_phases (`python bench/memory_edge.py
--outside`): residual -0.5 to +0.6 GiB of 7.7-9.8 GiB measured.
"""
from __future__ import annotations

import numpy as np

from advisor.models.constants import DEFAULT, Constants

# kinds of megatron-core 0.19.2 groups on every rank, as functions of the layout's sizes (tp, cp,
# dp, pp, ep, etp; the expert data-parallel size is tp cp dp / (ep etp))
GROUP_KINDS = ("gtp_remat", "dp_cp", "dp", "cp", "mp", "tp", "pp", "tp_dp_cp", "tp_dp", "tp_cp",
               "expert_gtp_remat", "ep", "etp", "tp_ep", "tp_ep_pp", "tp_ep_gtp_remat_pp", "edp",
               "dist_opt_instance", "embedding", "position_embedding")


def megatron_groups(tp, pp, cp, dp, ep, etp, stage):
    """{kind: size} of the groups megatron-core opens on a rank of `stage` (ints or arrays; a kind a
    rank is not a member of has size 0)."""
    tp, pp, cp, dp, ep, etp, stage = (np.asarray(x) for x in (tp, pp, cp, dp, ep, etp, stage))
    one = np.ones_like(tp * pp)
    first, last = stage == 0, stage == pp - 1
    return {"gtp_remat": one, "dp_cp": dp * cp, "dp": dp * one, "cp": cp * one, "mp": tp * pp, "tp": tp * one,
            "pp": pp * one, "tp_dp_cp": tp * dp * cp, "tp_dp": tp * dp, "tp_cp": tp * cp, "expert_gtp_remat": one,
            "ep": ep * one, "etp": etp * one, "tp_ep": etp * ep, "tp_ep_pp": etp * ep * pp,
            "tp_ep_gtp_remat_pp": etp * ep * pp, "edp": tp * cp * dp // (ep * etp),
            "dist_opt_instance": tp * cp * dp * pp,
            # [first, last] stage (one rank without PP); [first] only
            "embedding": np.where(pp == 1, 1, np.where(first | last, 2, 0)),
            "position_embedding": np.where(first, 1, 0)}


# groups of more than one rank a training step uses, and how it connects them
DENSE_USED = (("tp", "collective"), ("cp", "collective"), ("dp_cp", "collective"), ("pp", "p2p"),
              ("dist_opt_instance", "collective"))
MOE_USED = (("ep", "all_to_all"), ("tp_ep", "collective"), ("etp", "collective"), ("edp", "collective"),
            ("tp_cp", "collective"))


def outside_allocator_arrays(tp, pp, cp, dp, ep, etp, stage, moe: bool, fp8, c: Constants = DEFAULT,
                             lazy=False):
    """GiB outside torch's allocator on one GPU of `stage` (ints or arrays, `fp8` and `lazy`: bool or
    a bool array): context + world communicator + the groups' communicators + the used groups'
    connections. Eager (init_process_group(device_id=...)): every group megatron-core opens holds a
    communicator; lazy (TrainConfig.nccl_lazy_init): only the groups of more than one rank a step
    uses (the ones whose connections are counted) create one, at their first collective."""
    g = megatron_groups(tp, pp, cp, dp, ep, etp, stage)
    lazy = np.asarray(lazy, bool)
    out = np.full(np.broadcast(*g.values(), lazy).shape, c.cuda_context_gib + c.nccl_world_gib)
    for size in g.values():
        out = out + np.where(lazy, 0.0, np.where(size == 1, c.nccl_comm_single_gib,
                                                 np.where(size > 1, c.nccl_comm_gib, 0.0)))
    connect = {"collective": c.nccl_connect_gib, "p2p": c.nccl_p2p_connect_gib,
               "all_to_all": c.nccl_a2a_connect_gib}
    for kind, how in DENSE_USED + (MOE_USED if moe else ()):
        used = g[kind] > 1
        out = out + np.where(used, connect[how] + np.where(lazy, c.nccl_comm_gib, 0.0), 0.0)
    # the tensor + data + context parallel group: fp8's amax reduction, the MoE router's token counts
    amax = (np.asarray(fp8, bool) | bool(moe)) & (g["tp_dp_cp"] > 1)
    return out + np.where(amax, c.nccl_connect_gib + np.where(lazy, c.nccl_comm_gib, 0.0), 0.0)


def outside_allocator_gib(model, cfg, stage: int | None = None, c: Constants = DEFAULT) -> float:
    """One layout's memory outside torch's allocator on one GPU of `stage` (None: the largest over
    its stages)."""
    stages = np.arange(cfg.pp) if stage is None else np.array([stage])
    v = outside_allocator_arrays(cfg.tp, cfg.pp, cfg.cp, cfg.dp, cfg.ep, cfg.etp, stages, model.is_moe,
                                    cfg.precision != "bf16", c, cfg.nccl_lazy_init)
    return float(np.max(v))

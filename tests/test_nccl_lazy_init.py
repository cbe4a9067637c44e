"""NCCL communicators created lazily (TrainConfig.nccl_lazy_init): the te stack's default (NVIDIA's
recipes through Megatron-Bridge, whose initialize gives init_process_group no device_id), off in this
project's runner (eager: device_id), and what it leaves outside torch's allocator."""
import pytest

from advisor.catalog import load_model
from advisor.catalog.specs import SpecError, TrainConfig
from advisor.models.constants import DEFAULT as c
from advisor.models.outside_memory import megatron_groups, outside_allocator_arrays, outside_allocator_gib
from advisor.models.profiles import apply_layout_defaults
from advisor.runners.megatron_args import runner_config


def test_lazy_counts_only_the_groups_a_step_uses():
    # llama3-70b's recipe layout TP4 PP8 DP2, first stage, FP8: 20 groups, 5 of one rank
    g = megatron_groups(4, 8, 1, 2, 1, 4, 0)
    single = sum(1 for v in g.values() if v == 1)
    multi = sum(1 for v in g.values() if v > 1)
    eager = float(outside_allocator_arrays(4, 8, 1, 2, 1, 4, 0, False, True, c))
    lazy = float(outside_allocator_arrays(4, 8, 1, 2, 1, 4, 0, False, True, c, lazy=True))
    # used: tp, dp_cp, pp, dist_opt_instance (and fp8's amax group tp_dp_cp), each with its communicator
    used = 5
    assert eager - lazy == pytest.approx(single * c.nccl_comm_single_gib + (multi - used) * c.nccl_comm_gib)
    assert lazy == pytest.approx(c.cuda_context_gib + c.nccl_world_gib + used * c.nccl_comm_gib
                                 + 3 * c.nccl_connect_gib + c.nccl_p2p_connect_gib + c.nccl_connect_gib)
    # arrays of both
    both = outside_allocator_arrays(4, 8, 1, 2, 1, 4, 0, False, True, c, lazy=[False, True])
    assert both.tolist() == pytest.approx([eager, lazy])


def test_te_stack_is_lazy_and_the_runner_eager():
    m = load_model("llama3-70b")
    cfg = TrainConfig(tp=4, pp=8, dp=2, vp=5, mbs=1, gbs=128, seq=8192, precision="fp8")
    te = apply_layout_defaults(cfg, "te")
    assert te.nccl_lazy_init and not cfg.nccl_lazy_init
    assert not runner_config(te).nccl_lazy_init and not runner_config(te, keep_requested=True).nccl_lazy_init
    assert outside_allocator_gib(m, te) < outside_allocator_gib(m, cfg) - 3.0
    with pytest.raises(SpecError, match="nccl_lazy_init"):
        TrainConfig(tp=1, nccl_lazy_init="yes")

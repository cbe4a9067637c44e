"""An EP group inside an NVL72 rack talks over the rack's NVLink, not the trays' NICs (issue #25):
the MoE all-to-all and DeepEP take the job's NVLink domain (ClusterSpec.domain_gpus), as the TP / CP
/ DP groups do (collectives.group_links)."""
from __future__ import annotations

import pytest

from advisor.catalog import load_cluster
from advisor.models.constants import DEFAULT
from advisor.models.moe import all_to_all_time, deepep_time, ep_group_per_node


def test_ep_inside_the_rack_rides_nvlink():
    gb = load_cluster("gb200x8")  # two 4-GPU trays of one NVL72 rack
    assert gb.gpus_per_node == 4 and gb.domain_gpus == 8
    assert ep_group_per_node(gb, 1, 8) == 8
    nbytes = 512e6
    nvl = gb.intra_node_bw_gbs * 1e9 * DEFAULT.nvlink_efficiency
    assert all_to_all_time(nbytes, 8, 1, gb, DEFAULT) == pytest.approx(
        7 / 8 * nbytes / nvl + DEFAULT.intra_latency_s * 7 ** 0.5)
    # DeepEP likewise: no RDMA leg inside the rack
    assert deepep_time(16384, 8, 2048, 8, 1, gb, DEFAULT) < deepep_time(16384, 8, 2048, 16, 1, load_cluster("h100x16"), DEFAULT)


def test_ep_across_racks_leaves_through_the_nics():
    gb = load_cluster("gb200x128")  # two racks, 64 GPUs of the job in each
    assert gb.domain_gpus == 64 and ep_group_per_node(gb, 1, 128) == 64
    inside = all_to_all_time(512e6, 64, 1, gb, DEFAULT)
    across = all_to_all_time(512e6, 128, 1, gb, DEFAULT)
    assert across > 5 * inside  # half of each rank's share over a 50 GB/s NIC instead of NVLink
    # an HGX node is its own domain: unchanged there
    h = load_cluster("h100x16")
    assert ep_group_per_node(h, 1, 16) == 8


def test_published_gb200_moe_rows_no_longer_network_bound():
    """Qwen3-30B-A3B on 8 GB200, EP8 all-to-all, MXFP8: 26,032-26,112 tok/s/GPU in the older
    containers' rows (133, 179), 39,936-40,960 in the newer (43, 59, 83). Predicted 9,314 while the
    all-to-all went over the trays' NICs (-64 to -77%, 19.8 of its 28.1 s step); over the rack's NVLink
    the all-to-all is under a third of the step and the prediction sits between the two containers'
    rows."""
    from advisor.models import published as P
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.predict import predict
    from advisor.models.profiles import apply_layout_defaults

    rows = {str(x.row_id): x for x in P.load() if str(x.row_id) in ("43", "133")}
    r = rows["133"]
    cfg = apply_layout_defaults(r.cfg, "te", r.explicit, moe=True)
    p = predict(r.model, r.cluster, cfg, resolve_calibration("default", "te", gpu=r.cluster.gpu).constants,
                check_legal=False)
    assert p.breakdown["moe_dispatch_s"] < 0.3 * p.step_time_s  # was 19.8 of 28.1 s over the NICs
    assert 0.75 * r.tokens_per_s_per_gpu < p.tokens_per_s_per_gpu < rows["43"].tokens_per_s_per_gpu

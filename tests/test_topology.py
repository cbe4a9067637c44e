"""NVLink domains: nodes (HGX boards, NVL72 compute trays) inside domains (the board, the rack)."""
import warnings

import pytest

from advisor.catalog import ClusterSpec, TrainConfig, load_cluster, load_gpu, load_model
from advisor.catalog.errors import CatalogError
from advisor.catalog.specs import SpecError, job_domain
from advisor.models.constants import DEFAULT
from advisor.models.step_time import group_link
from advisor.search_spaces.layout import violations


@pytest.mark.parametrize("name,nodes,per,domain", [
    ("gb200x128", 32, 4, 64),   # two NVL72 racks, 64 + 64
    ("gb200x256", 64, 4, 64),
    ("gb300x512", 128, 4, 64),
    ("gb300x72", 18, 4, 72),    # one full rack
    ("gb200x144", 36, 4, 72),
    ("b200x64", 8, 8, 8),       # HGX: the node is the domain
    ("h100x64", 8, 8, 8),
    ("h100x4x2", 2, 4, 4),      # 4 GPUs used of each HGX board: the domain is those 4
])
def test_cluster_strings(name, nodes, per, domain):
    c = load_cluster(name)
    assert (c.num_nodes, c.gpus_per_node, c.domain_gpus) == (nodes, per, domain)


def test_job_domain_is_whole_nodes_dividing_the_world():
    assert job_domain(128, 4, 72) == 64
    assert job_domain(100, 4, 72) == 20
    assert job_domain(48, 4, 72) == 48
    assert job_domain(64, 8, 8) == 8


def test_gb200_tray_and_rack_in_catalog():
    g = load_gpu("gb200")
    assert g.gpus_per_node == 4 and g.domain_gpus == 72 and g.generation == "blackwell"
    assert "tray" in g.sources["gpus_per_node"] and "NVL72" in g.sources["nvlink_domain_gpus"]
    assert load_gpu("h100").domain_gpus == 8


def test_tp_inside_the_rack_gets_nvlink_across_trays():
    c = load_cluster("gb200x128")
    assert not group_link(c, 1, 16, DEFAULT).inter_node  # 4 trays, one rack
    assert not group_link(c, 1, 64, DEFAULT).inter_node
    assert group_link(c, 1, 128, DEFAULT).inter_node      # both racks: the network
    h = load_cluster("h100x64")
    assert group_link(h, 1, 16, DEFAULT).inter_node
    m = load_model("gpt3-175b")  # 96 heads: TP 16 divides them
    assert not violations(m, c, TrainConfig(tp=16, pp=1, dp=8, gbs=128, seq=2048, sequence_parallel=True))
    assert any("NVLink domain" in v for v in violations(m, h, TrainConfig(tp=16, pp=1, dp=4, gbs=128)))


def _yaml(tmp_path, body):
    p = tmp_path / "c.yaml"
    p.write_text(body)
    return str(p)


def test_cluster_yaml_states_the_domain(tmp_path):
    c = load_cluster(_yaml(tmp_path, "name: nvl36\ngpu: gb200\nnodes: 18\nnvlink_domain_gpus: 36\n"
                                     "intra_node_bw_gbs: 900\ninter_node_bw_gbs: 50\n"))
    assert c.nvlink_domain_gpus == 36 and c.domain_gpus == 36 and c.world_size == 72
    assert group_link(c, 1, 72, DEFAULT).inter_node and not group_link(c, 1, 36, DEFAULT).inter_node


def test_cluster_yaml_domain_defaulted_is_a_note(tmp_path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_cluster(_yaml(tmp_path, "gpu: gb200\nnodes: 32\n"))
    notes = [str(x.message) for x in w if "nvlink_domain_gpus" in str(x.message)]
    assert len(notes) == 1 and "72" in notes[0] and "64 GPUs of this job" in notes[0]


@pytest.mark.parametrize("dom,msg", [(6, "whole number of 4-GPU nodes"), (144, "more than the 18 node"),
                                     ("x", "whole number")])
def test_cluster_yaml_bad_domain(tmp_path, dom, msg):
    with pytest.raises(CatalogError, match=msg):
        load_cluster(_yaml(tmp_path, f"gpu: gb200\nnodes: 32\nnvlink_domain_gpus: {dom}\n"))


def test_clusterspec_rejects_a_domain_not_in_nodes():
    g = load_gpu("gb200")
    with pytest.raises(SpecError, match="multiple"):
        ClusterSpec("x", g, 2, 4, 900, 50, 1200, nvlink_domain_gpus=6)

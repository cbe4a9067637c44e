"""bench/blackwell_terms.py: the GB200 / GB300 pairs, their per-term times and the candidates that
could separate them (issue #25)."""
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import blackwell_terms as T  # noqa: E402

SEVENTY = ("llama3_70b", "fp8", 64)   # the one group with the same layout on both (FSDP, TP1, MBS 2)


@pytest.fixture(scope="module")
def groups():
    return T.pair_groups(same_container=True)


@pytest.fixture(scope="module")
def consts():
    return T.blackwell_constants()


def test_same_container_pairs_share_a_release(groups):
    assert SEVENTY in groups
    for v in groups.values():
        assert v["pairs"]
        for a, b in v["pairs"]:
            assert (a.run.gpu_type, b.run.gpu_type) == T.PAIR
            assert T.container(a) == T.container(b) != ""
    every = T.pair_groups()
    assert sum(len(v["pairs"]) for v in every.values()) > sum(len(v["pairs"]) for v in groups.values())


def test_with_gpu_changes_only_what_it_is_given(groups):
    cl = groups[SEVENTY]["GB200"][0].run.cluster
    out = T.with_gpu(cl, dynamic_power_w=1050.0, power_cap_w=1100.0)
    assert out.power_cap_w == 1100.0 and out.gpu.power_span_w == 1050.0
    assert out.gpu.sm_count == cl.gpu.sm_count and out.world_size == cl.world_size
    assert cl.power_cap_w == 1200.0  # the original is untouched
    assert T.with_gpu(cl, hbm_bandwidth_gbs=9000.0).power_cap_w == cl.power_cap_w


def test_term_table_same_layout_pair(consts):
    lines = []
    out = T.term_table(consts, same_container=True, say=lines.append)
    a, b = out[SEVENTY]["GB200"], out[SEVENTY]["GB300"]
    assert a["layouts"] == b["layouts"] == ["t1p1c1v1m2"]
    ta, tb = a["us_per_token"], b["us_per_token"]
    # the same 8 TB/s HBM: memory-bound time all but equal; the doubled SFU: attention the most apart
    assert 0.98 < ta["memory_bound_s"] / tb["memory_bound_s"] < 1.05
    # (GB200 waits on its 40 offloaded layers' copies, GB300 on 20: its power-capped clock rises more)
    assert ta["attention_s"] / tb["attention_s"] > ta["gemm_s"] / tb["gemm_s"] > 1.04
    assert abs(a["clock"] - b["clock"]) < 0.02  # GB200's longer offload waits let its capped clock rise to GB300's
    assert sum(ta[t] for t in T.TERMS if t.endswith("comm_s")) == 0.0  # TP1, no exposed DP: no comm term
    assert any("llama3_70b fp8 64 GPUs" in s for s in lines)


def test_candidate_solve_meets_the_measured_ratio(groups, consts):
    v = groups[SEVENTY]
    meas, model = T.measured_ratio(v), T.group_ratio(v, consts, "GB200", {})
    # the gap the issue is about: 1.240 measured vs 1.16 before the recipes' offloaded layers were
    # priced (models/offload.py), 1.225 with them
    assert model < meas < model + 0.03
    k = T.candidate_changes()["gb200_cap_w"]
    gpu, fn, rng = k.gpu, k.changes, k.span
    assert k.shipped == 1200.0
    w = T.solve(v, consts, gpu, fn, rng[0], rng[1], meas)
    assert w is not None and 1150.0 < w < 1200.0  # what is left needs ~25 W less (was ~100 W)
    assert T.group_ratio(v, consts, gpu, fn(w)) == pytest.approx(meas, abs=2e-3)
    # a budget above the shipped one only moves the ratio further from the measured
    assert T.group_ratio(v, consts, gpu, fn(1200.0)) == pytest.approx(model, abs=1e-9)


def test_gb300_power_alone_cannot_reach_the_405b_pairs(groups, consts):
    fn = T.candidate_changes()["gb300_max_clock"].changes
    for fmt in ("fp8", "mxfp8", "nvfp4"):
        v = groups[("llama3.1_405b", fmt, 256)]
        top = T.group_ratio(v, consts, "GB300", fn(None))
        assert T.group_ratio(v, consts, "GB200", {}) <= top
        if fmt == "mxfp8":
            # since session 28's refits (the loss per cross-entropy implementation) the MXFP8 pair is
            # reached by GB300's clock alone: 1.221 predicted at its maximum clock vs 1.216 measured
            assert top == pytest.approx(T.measured_ratio(v), rel=0.01)
        else:  # FP8 1.210 vs 1.243, NVFP4 1.181 vs 1.239 measured
            assert top < T.measured_ratio(v)


def test_fit_blackwell_changes_only_the_named_gpus_rows(groups, consts):
    from fit_blackwell import change_gpus

    v = groups[SEVENTY]
    rows = [dataclasses.replace(x) for x in v["GB200"] + v["GB300"]]
    before = [T.predicted(x, consts).tokens_per_s_per_gpu for x in rows]
    change_gpus(rows, {"GB200": {"dynamic_power_w": 1050.0, "power_cap_w": 1100.0}})
    after = [T.predicted(x, consts).tokens_per_s_per_gpu for x in rows]
    for x, b, a in zip(rows, before, after):
        if x.run.gpu_type == "GB200":
            assert x.run.cluster.power_cap_w == 1100.0 and a < b * 0.99  # less budget, lower clock
        else:
            assert x.run.cluster.power_cap_w == 1400.0 and a == b
    assert v["GB200"][0].run.cluster.power_cap_w == 1200.0  # the group's own rows are untouched


def test_the_recipes_offload_explains_most_of_the_70b_gb300_gb200_gap(consts):
    """The rows carry their recipes' cpu_offload_layers (GB200 40, GB300 20: models/published_recipes.py),
    priced by models/offload.py (host link efficiency and overlap fitted on our H100 offload runs):
    the model's GB300 / GB200 ratio of the 70B FP8 pairs is within 2% of the measured (1.162 before
    offloading was modelled). The bench's extra bandwidths are a diagnostic on top of that."""
    out = T.offload_bound(consts, bandwidths=(450.0, 100.0), say=lambda s: None)
    v = T.pair_groups(same_container=True)[("llama3_70b", "fp8", 64)]
    assert abs(out[None] / T.measured_ratio(v) - 1) < 0.02
    assert out[100.0] > out[None]  # a slower link exposes GB200's doubled offload more


def test_gb200_runs_like_a_b200_where_the_model_gives_it_its_rate(consts):
    out = T.versus(("B200", "GB200"), consts, say=lambda s: None)
    meas, model = out[("llama3_8b", "mxfp8", 8)]
    # 152 vs 148 SMs at 2,062 vs 1,965 MHz: the model's GB200 runs 6.5% ahead; measured 1-2%
    assert model > 1.05 and meas < 1.03

"""The model is written once, on arrays (models/memory.py, step_time.py, power_arrays.py); the
per-layout API runs it on a Layouts of one, and tests/test_frozen_predictions.py holds both to the
frozen numbers. What this file still compares are two things: whole spaces evaluated at once
(the fixed point goes on with the rows still moving, the memos are shared, MoE knobs are keyed per
row) against each layout alone; the columnar enumeration against the per-layout one; the
calibration on arrays (models.vectorized.Calibrated) against Calibration.predict_many; the array
scores recommend ranks by against score_prediction. Every number within 1e-9 (relative), every
string and flag equal.

The spaces: dense llama3-70b, llama3.1-405b (126 layers: uneven splits, explicit pipeline layouts),
gpt3-175b (learned positions, GELU, biases), an FP8 workload, long sequences (CP > 1), MoE
deepseek-v3 (MLA, leading dense layers, 61 layers), qwen3-235b-a22b and mixtral with the MoE
knobs (dispatcher, grouped GEMM, router) varied, every recompute mode, every VP the space allows,
micro-batches up to 16; power caps per GPU, per layout and per stage; both stack profiles (te,
local) and the analytical model."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from advisor.api import default_workload, resolve
from advisor.catalog import with_power_cap
from advisor.models import DEFAULT, predict
from advisor.models import vectorized as vz
from advisor.models.calibrate import resolve_calibration
from advisor.models.memory import peak_memory_gib
from advisor.search_spaces.columns import enumerate_columns
from advisor.search_spaces.space import SpaceOptions, Workload, enumerate_layouts

RTOL = 1e-9
HF = Path(__file__).parent / "data" / "hf_configs"


def same(a, b, path="") -> list[str]:
    """Where two JSON-like values differ: floats beyond RTOL (relative), anything else at all."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return []
        if abs(a - b) <= RTOL * max(abs(a), abs(b)):
            return []
        return [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


WIDE = SpaceOptions.wide(tp_comm_overlap=True)  # recommend's space

# (model, cluster, workload overrides, space options, every how many layouts to check against the
# reference: 1 = the whole space)
SPACES = [
    ("llama3-70b", "h100x16", {}, WIDE, 1),
    ("llama3-70b", "h100x32", {"precision": "fp8"}, WIDE, 1),
    ("llama3-70b", "h100x16", {"seq": 32768, "gbs": 64}, WIDE, 1),
    ("llama3.1-405b", "h100x64", {}, SpaceOptions.wide(mbs=(1, 2), tp_comm_overlap=True), 1),
    ("gpt3-175b", "h100x32", {"seq": 2048, "gbs": 256}, SpaceOptions(mbs=(1, 4)), 1),
    ("deepseek-v3", "h100x64", {"gbs": 256}, SpaceOptions.wide(mbs=(1, 2), tp_comm_overlap=True), 3),
    ("qwen3-235b-a22b", "h100x32", {}, SpaceOptions(mbs=(1, 4), tp_comm_overlap=True), 2),
    ("mixtral-8x22b", "h200x16", {"precision": "fp8"}, SpaceOptions(mbs=(1, 2)), 1),
    # per-layer attention: sliding windows (all-gather CP for the windowed layers), sinks, MoE
    ("gpt-oss-120b", "h100x16", {"seq": 32768, "gbs": 32}, SpaceOptions(mbs=(1,)), 1),
    # Gemma 3: 5 local : 1 global, QK norm, pre+post norms; Gemma 2: logit soft-capping
    (str(HF / "gemma-3-27b.json"), "h100x32", {"seq": 32768, "gbs": 64}, SpaceOptions(mbs=(1,)), 1),
    (str(HF / "gemma-2-9b.json"), "h100x16", {"seq": 16384, "gbs": 64}, SpaceOptions(mbs=(1, 2)), 1),
    # OLMo 2 (post-norms, full-width QK norm); Llama 4 Maverick (chunked attention, MoE every 2nd layer)
    (str(HF / "olmo-2-7b.json"), "h100x8", {}, SpaceOptions(mbs=(1, 2)), 1),
    (str(HF / "llama-4-maverick.json"), "h100x64", {"seq": 16384, "gbs": 128}, SpaceOptions(mbs=(1,)), 3),
]


def _space(model, cluster, wl_over, options):
    m, c = resolve(model, cluster)
    base = default_workload(m, c)
    wl = Workload(seq=wl_over.get("seq", base.seq), gbs=wl_over.get("gbs", base.gbs),
                  precision=wl_over.get("precision", base.precision))
    return m, c, wl, list(enumerate_layouts(m, c, wl, options))


@pytest.mark.slow
@pytest.mark.parametrize("model,cluster,wl_over,options,every", SPACES,
                         ids=[f"{s[0]}-{s[1]}-{'-'.join(f'{k}{v}' for k, v in s[2].items()) or 'default'}" for s in SPACES])
def test_whole_space_agrees_with_the_reference(model, cluster, wl_over, options, every):
    m, c, wl, cfgs = _space(model, cluster, wl_over, options)
    assert len(cfgs) > 50
    # the columnar enumeration is the same space in the same order
    cols = enumerate_columns(m, c, wl, options)
    assert len(cols) == len(cfgs)
    assert all(cols.key(i) == cfg.key() for i, cfg in enumerate(cfgs))  # from the columns
    assert all(cols.config(i) == cfg for i, cfg in enumerate(cfgs))
    assert {cfg.recompute for cfg in cfgs} == {"none", "selective", "full"}
    res = vz.evaluate(m, c, cols, DEFAULT)
    peak = vz.peak_memory_gib(m, cols, DEFAULT, c)
    bad = []
    for i in range(0, len(cfgs), every):
        ref = predict(m, c, cfgs[i], DEFAULT, check_legal=False)
        got = res.prediction(i)
        bad += [f"{cfgs[i].key()}{d}" for d in same(got.to_dict(), ref.to_dict())]
        for name, value in (("tokens_per_s_per_gpu", ref.tokens_per_s_per_gpu),
                            ("energy_j_per_token", ref.energy_j_per_token), ("throttle_risk", ref.throttle_risk),
                            ("mean_power_w", ref.mean_power_w), ("peak_power_w", ref.peak_power_w),
                            ("throttle_fraction", ref.throttle_fraction), ("memory_gib_per_gpu", ref.memory_gib_per_gpu),
                            ("step_time_s", ref.step_time_s), ("clock_ratio", ref.clock_ratio), ("mfu", ref.mfu)):
            if not close(float(res.row[name][i]), value):
                bad.append(f"{cfgs[i].key()} {name}: {res.row[name][i]!r} vs {value!r}")
        if not close(float(peak[i]), peak_memory_gib(m, cfgs[i], DEFAULT)):
            bad.append(f"{cfgs[i].key()} peak memory")
    assert not bad, "\n".join(bad[:20])


def test_moe_knobs_and_layouts_built_from_configs_agree():
    """Layouts.of (any TrainConfigs): the MoE dispatcher, SequentialMLP (its per-step tensor cost
    depends on the microbatches), a forced router, on two MoE models."""
    bad = []
    for model, cluster in (("qwen3-235b-a22b", "h100x32"), ("deepseek-v3", "h100x64")):
        m, c, wl, cfgs = _space(model, cluster, {"gbs": 256}, SpaceOptions(mbs=(1, 2)))
        picked = [cfg for cfg in cfgs if cfg.ep > 1][::40][:12]
        variants = [cfg.replace(moe_dispatcher="allgather") for cfg in picked[:4]]
        variants += [cfg.replace(moe_grouped_gemm=False) for cfg in picked[4:8]]
        variants += [cfg.replace(moe_router="forced") for cfg in picked[8:]]
        res = vz.evaluate(m, c, vz.Layouts.of(m, variants), DEFAULT)
        for i, cfg in enumerate(variants):
            bad += [f"{cfg.key()}{d}" for d in same(res.prediction(i).to_dict(), predict(m, c, cfg, DEFAULT).to_dict())]
    assert not bad, "\n".join(bad[:20])


def test_new_moe_knobs_agree_per_layout_and_on_arrays():
    """Issue #24's knobs (DeepEP flex dispatcher, capacity factor with and without padding, the
    1F1B all-to-all overlap, shared-expert overlap, router fusion), mixed in one Layouts so the
    array model keys them per row, agree with the per-layout model at 1e-9."""
    bad = []
    for model, cluster in (("qwen3-235b-a22b", "h100x32"), ("deepseek-v3", "h100x64")):
        m, c, wl, cfgs = _space(model, cluster, {"gbs": 256}, SpaceOptions(mbs=(1, 2)))
        ok = [cfg for cfg in cfgs if cfg.ep > 1 and cfg.recompute != "full" and (cfg.pp == 1 or cfg.vp > 1)]
        picked = ok[::max(1, len(ok) // 14)][:14]
        knobs = [{"moe_dispatcher": "flex"}, {"moe_capacity_factor": 1.0},
                 {"moe_capacity_factor": 1.25, "moe_pad_to_capacity": True}, {"moe_a2a_overlap": True},
                 {"moe_dispatcher": "flex", "moe_a2a_overlap": True}, {"moe_shared_expert_overlap": True},
                 {"moe_router_fusion": True}, {"moe_permute_fusion": True, "moe_router_fusion": True}]
        variants = [cfg.replace(**knobs[i % len(knobs)]) for i, cfg in enumerate(picked)] + picked[:2]
        res = vz.evaluate(m, c, vz.Layouts.of(m, variants), DEFAULT)
        for i, cfg in enumerate(variants):
            bad += [f"{cfg.key()}{d}" for d in same(res.prediction(i).to_dict(), predict(m, c, cfg, DEFAULT).to_dict())]
        assert len({v.moe_key() for v in variants}) >= len(knobs)
    assert not bad, "\n".join(bad[:20])


def test_power_caps_per_layout():
    m, c, wl, cfgs = _space("llama3-70b", "h100x32", {}, WIDE)
    cfgs = [cfg for cfg in cfgs if cfg.pp > 1][::25][:16]
    caps = np.array([200.0, 325.0, 450.0, 550.0, 700.0, 400.0, 275.0, 600.0] * 2)[:len(cfgs)]
    res = vz.evaluate(m, c, vz.Layouts.of(m, cfgs), DEFAULT, caps=caps)
    bad = []
    for i, cfg in enumerate(cfgs):
        at = with_power_cap(c, float(caps[i]))
        bad += [f"cap {caps[i]} {cfg.key()}{d}" for d in same(res.prediction(i, at).to_dict(),
                                                               predict(m, at, cfg, DEFAULT).to_dict())]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("stack", ["te", "local"])
def test_calibrated_predictions_agree(stack):
    """Calibration.predict_many (the stack's shipped profile) on arrays: calibrated levels, the
    analytical level of the local profile's power (default constants), intervals."""
    cal = resolve_calibration("default", stack)
    assert vz.vectorizable(cal)
    bad = []
    for model, cluster in (("llama3-70b", "h100x32"), ("mixtral-8x22b", "h200x16")):
        m, c, wl, cfgs = _space(model, cluster, {}, SpaceOptions(mbs=(1, 2), tp_comm_overlap=stack == "te"))
        cfgs = cfgs[::7][:40]
        ref = cal.predict_many(m, c, cfgs, check_legal=False)
        got = vz.Calibrated(cal, vz.evaluate(m, c, vz.Layouts.of(m, cfgs), cal.constants))
        for i, cfg in enumerate(cfgs):
            bad += [f"{cfg.key()}{d}" for d in same(got.prediction(i).to_dict(), ref[i].to_dict())]
            for name in ("tokens_per_s_per_gpu", "step_time_s", "energy_j_per_token", "mean_power_w", "throttle_risk",
                         "memory_gib_per_gpu"):
                if not close(float(got.row[name][i]), getattr(ref[i], name)):
                    bad.append(f"{cfg.key()} {name}")
            assert bool(got.feasible[i]) == ref[i].feasible
    assert not bad, "\n".join(bad[:20])


def test_the_shipped_profiles_json_twins_load_as_their_joblib_files():
    """resolve_calibration reads a shipped profile without surrogates from its JSON twin: it must
    be the same calibration as the joblib file."""
    from advisor.models.calibrate import Calibration, _load_twin
    from advisor.models.profiles import STACKS

    for st in STACKS.values():
        a, b = Calibration.load(st.file), _load_twin(st.file)
        assert b is not None, st.file
        assert (a.constants, a.targets, a.profile, a.source) == (b.constants, b.targets, b.profile, b.source)
        assert a.surrogates == b.surrogates


def test_recommend_ranks_as_the_reference_would():
    """recommend's arrays rank every feasible layout as predict() would: the same scores, in the
    same order, for the throughput, energy and balanced objectives."""
    from advisor.api import recommend
    from advisor.models.objectives import score_prediction as _score

    for objective in ("throughput", "energy", "balanced"):
        res = recommend("llama3-70b", "h100x64", calibration=None, objective=objective, top=3,
                        power_caps="400:700:100")
        cands = list(res.candidates)
        assert len(cands) == len(res.rank_scores) > 50
        preds = [(cfg, predict(res.model, res.cluster, cfg, DEFAULT, check_legal=False)) for cfg, _ in cands[::15]]
        tps, e = res.rank_basis
        ranked = sorted(res.rank_scores, reverse=True)
        assert ranked == res.rank_scores
        for cfg, p in preds:
            s = _score(p, objective, tps, e)
            assert any(abs(s - x) <= 1e-9 * max(abs(s), 1e-12) for x in res.rank_scores), cfg.key()

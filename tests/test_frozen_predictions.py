"""The analytical model's numbers are frozen (tests/data/frozen_predictions.json.gz, written by
bench/freeze_predictions.py --write): every per-layout call (predict, estimate_power with caps per
stage, power_at_step, stage_caps, step_time at given clocks, stage_memory of another split,
stage_heat, a profile's predict_many) gives what it gave when the file was written, at 1e-9
(relative) for floats and exactly for everything else; and the array model (models.vectorized,
what recommend and predict --batch run) gives the same Predictions for the same layouts."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from support import load_bench

fz = load_bench("freeze_predictions")
FROZEN = fz.load()
CALLS = sorted({e["call"] for e in FROZEN})


def test_the_frozen_file_covers_what_it_says():
    ids = [e["id"] for e in FROZEN]
    assert len(ids) == len(set(ids)) and len(ids) > 2000
    assert {"predict", "estimate_power", "power_at_step", "stage_caps", "step_time", "stage_memory",
            "stage_heat", "calibrated"} <= set(CALLS)
    clusters = {e["cluster"] for e in FROZEN}
    assert {"h100x16", "h200x16", "gb200x72", "b200x8"} <= clusters
    cfgs = [e["cfg"] for e in FROZEN if "cfg" in e]
    assert {c.get("recompute", "none") for c in cfgs} == {"none", "selective", "full"}
    assert {c.get("precision", "bf16") for c in cfgs} >= {"bf16", "fp8", "mxfp8", "nvfp4"}
    assert any(c.get("cp", 1) > 1 for c in cfgs) and any(c.get("vp", 1) > 1 for c in cfgs)
    assert any(c.get("ep", 1) > 1 for c in cfgs) and any(c.get("pipeline_layout") for c in cfgs)
    assert {e["stack"] for e in FROZEN if e["call"] == "calibrated"} == {"local", "te"}


def test_a_changed_number_is_found():
    e = next(x for x in FROZEN if x["call"] == "predict")
    out = fz.plain(fz.run({k: v for k, v in e.items() if k != "out"}))
    assert not fz.diff(out, e["out"])
    out["prediction"]["step_time_s"] *= 1 + 1e-8
    assert fz.diff(out, e["out"])


@pytest.mark.parametrize("call", CALLS)
def test_per_layout_calls_match_the_frozen_numbers(call):
    bad = fz.check([e for e in FROZEN if e["call"] == call])
    assert not bad, "\n".join(bad[:20])


def test_arrays_match_the_frozen_predictions():
    """models.vectorized.evaluate of each space's frozen layouts at once (caps per row where the
    entry has one): each row's Prediction and peak memory as frozen."""
    from advisor.api import resolve
    from advisor.catalog import with_power_cap
    from advisor.catalog.specs import TrainConfig
    from advisor.models import DEFAULT
    from advisor.models import vectorized as vz

    groups = defaultdict(list)
    for e in FROZEN:
        if e["call"] == "predict":
            groups[(e["model"], e["cluster"])].append(e)
    bad = []
    for (model, cluster), es in groups.items():
        m, c = resolve(fz.model_path(model), cluster)
        caps = np.array([e.get("cap", c.power_cap_w) for e in es], float)
        res = vz.evaluate(m, c, vz.Layouts.of(m, [TrainConfig(**e["cfg"]) for e in es]), DEFAULT, caps=caps)
        for i, e in enumerate(es):
            at = with_power_cap(c, e["cap"]) if "cap" in e else None
            got = fz.plain({"prediction": res.prediction(i, at).to_dict()})
            bad += [f"{e['id']}{d}" for d in fz.diff(got["prediction"], e["out"]["prediction"])]
            if "cap" not in e:
                bad += [f"{e['id']} peak" for d in fz.diff(float(res.peak_gib[i]), e["out"]["peak_memory_gib"])]
    assert not bad, "\n".join(bad[:20])

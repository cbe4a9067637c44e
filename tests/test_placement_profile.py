"""Slot profiles: validation (one-line errors), the thermal fit (synthetic and the real 4 × H200 burn),
profiles from telemetry traces."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from advisor.catalog import SpecError
from advisor.placement.profile import (ProfileError, fit_thermal, leakage_per_c, load_profile,
                                       profile_from_burn_json, profile_from_dict, profile_from_trace)

DATA = Path(__file__).parent / "data" / "placement"
BURN = DATA / "h200x4_burn_trace.json"
ROOT = Path(__file__).resolve().parents[1]


def gpu(i, **kw):
    d = {"index": i, "uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000", "pci_bus_id": f"0000:{0x18 + i:02x}:00.0",
         "ambient_c": 35.0, "c_per_w": 0.045}
    d.update(kw)
    return d


def test_valid_profile_keeps_extra_fields_and_normalizes_pci():
    p = profile_from_dict({"node": "n1", "gpus": [gpu(1, speed_at_cap=0.99, row="rear"), gpu(0)], "site": "lab"})
    assert p.node == "n1" and len(p.gpus) == 2
    assert p.gpus[0].extra == {"speed_at_cap": 0.99, "row": "rear"}
    assert p.gpus[0].pci_bus_id == "00000000:19:00.0"
    assert [g.index for g in p.cuda_order()] == [0, 1]  # PCI bus order
    assert p.meta == {"site": "lab"}
    assert p.gpus[1].temp_c(700) == pytest.approx(35 + 0.045 * 700)
    again = profile_from_dict(p.to_dict())
    assert again == p and again.gpus[0].extra == p.gpus[0].extra


BAD = [
    ({"gpus": [gpu(0)]}, "'node' must be a non-empty string"),
    ({"node": "n", "gpus": []}, "'gpus' must be a non-empty list"),
    ({"node": "n", "gpus": [{k: v for k, v in gpu(0).items() if k != "c_per_w"}]}, "gpus[0]: missing field 'c_per_w'"),
    ({"node": "n", "gpus": [gpu(0, ambient_c="hot")]}, "'ambient_c' must be a number"),
    ({"node": "n", "gpus": [gpu(0, index=True)]}, "'index' must be a non-negative integer"),
    ({"node": "n", "gpus": [gpu(0, uuid=7)]}, "'uuid' must be a string"),
    ({"node": "n", "gpus": [gpu(0), gpu(1, uuid=gpu(0)["uuid"])]}, "duplicate uuid"),
    ({"node": "n", "gpus": [gpu(0), gpu(0, uuid="GPU-x", pci_bus_id="0000:30:00.0")]}, "duplicate index"),
    ({"node": "n", "gpus": [gpu(0), gpu(1, pci_bus_id="0000:18:00.0")]}, "duplicate pci_bus_id"),
    ({"node": "n", "gpus": [gpu(0, c_per_w=-0.04)]}, "c_per_w -0.04 °C/W is not physical"),
    ({"node": "n", "gpus": [gpu(0, c_per_w=3.0)]}, "is not physical"),
    ({"node": "n", "gpus": [gpu(0, ambient_c=150)]}, "ambient_c 150 °C is not physical"),
    ({"node": "n", "gpus": [gpu(0, c_per_w=float("nan"))]}, "'c_per_w' must be a number"),
    ({"node": "n", "gpus": [gpu(0, pci_bus_id="slot 3")]}, "is not a PCI bus id"),
    ({"node": "n", "gpus": [gpu(0), gpu(1, pci_bus_id="")]}, "pci_bus_id given for some GPUs only"),
    ({"node": "n", "gpus": [gpu(0, speed_at_cap=-1)]}, "'speed_at_cap' must be a non-negative number"),
    ([1, 2], "expected a JSON object"),
]


@pytest.mark.parametrize("data,msg", BAD)
def test_bad_profiles_one_line_errors(data, msg):
    with pytest.raises(ProfileError) as e:
        profile_from_dict(data, "p.json")
    text = str(e.value)
    assert msg in text and "\n" not in text and text.startswith("p.json")
    assert isinstance(e.value, SpecError)


def test_load_profile_file_errors(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


def _two_pole(t, p, amb, c_fast, tau_f, c_slow, tau_s):
    from advisor.placement.profile import _lowpass
    return amb + c_fast * _lowpass(t, p, tau_f) + c_slow * _lowpass(t, p, tau_s)


def test_fit_recovers_synthetic_two_pole_model():
    t = np.arange(0, 900, 0.5)
    p = np.where(t < 20, 80.0, np.where(t < 400, 690.0, np.where(t < 700, 400.0, 80.0)))
    rng = np.random.default_rng(0)
    p_noisy = p + rng.normal(0, 25, t.size) * (p > 100)
    temp = np.round(_two_pole(t, p, 33.0, 0.038, 0.8, 0.008, 60.0))  # NVML reports whole degrees
    fit = fit_thermal(t, temp, p_noisy)
    assert fit["c_per_w"] == pytest.approx(0.046, rel=0.06)
    assert fit["ambient_c"] == pytest.approx(33.0, abs=1.5)
    assert fit["ambient_c"] + fit["c_per_w"] * 690 == pytest.approx(33 + 0.046 * 690, abs=1.0)
    assert 20 <= fit["tau_s"] <= 200 and fit["fit_rmse_c"] < 1.0


def test_fit_needs_two_power_levels():
    t = np.arange(0, 300, 0.5)
    with pytest.raises(ProfileError, match="at least two power levels"):
        fit_thermal(t, 60 + 0 * t, 690 + 0 * t)
    with pytest.raises(ProfileError, match="at least 20 samples"):
        fit_thermal(t[:5], t[:5], t[:5])


def test_profile_from_real_h200_burn():
    p = profile_from_burn_json(BURN, node="h200x4-burn")
    assert [g.index for g in p.gpus] == [0, 1, 2, 3]
    settled = {0: 69, 1: 62, 2: 62, 3: 69}  # FACTS.md: °C at 300 s of load
    for g in p.gpus:
        assert 0.035 < g.c_per_w < 0.055 and 30 < g.ambient_c < 40
        assert g.temp_c(g.extra["load_power_w"]) == pytest.approx(settled[g.index], abs=1.0)
        assert g.extra["throttle_fraction"] > 0.9 and g.extra["thermal_throttle_fraction"] == 0.0
        assert g.pci_bus_id == ""  # the recording has no PCI ids
    at700 = {g.index: g.temp_c(700) for g in p.gpus}
    assert min(at700[0], at700[3]) - max(at700[1], at700[2]) > 5.0  # slots 0 and 3 run ~7 °C hotter
    assert {g.index: g.extra["speed_at_cap"] for g in p.gpus}[2] == 1.0
    assert 0.0005 < leakage_per_c(p) < 0.004
    assert load_profile(ROOT / "data" / "profiles" / "h200x4-burn.json") == p  # shipped profile = this fit


def test_profile_from_fake_telemetry_trace():
    telemetry = pytest.importorskip("advisor.runners.telemetry")

    class Clock:
        t = 1000.0

        def __call__(self):
            return self.t

    clock = Clock()
    backend = telemetry.FakeBackend(2, clock=clock, t_start=1000.0, ramp_w_per_s=20.0)
    s = telemetry.Sampler(backend, rate_hz=2)
    for _ in range(200):
        s.sample_once()
        clock.t += 0.5
    trace = s.stop()
    prof = profile_from_trace(trace, node="fake")
    for g, d in zip(prof.gpus, backend.devices()):
        assert g.uuid == d.uuid and g.pci_bus_id == d.pci_bus_id
        assert g.c_per_w == pytest.approx(0.05, rel=0.02)  # fake: T = 30 + 0.05 °C/W · P
        assert g.ambient_c == pytest.approx(30, abs=1.0)
        assert g.extra["throttle_fraction"] > 0.5


def test_measure_profile_pipeline_with_fake_gpus(monkeypatch):
    """thermal-profile's pipeline (sampler, one burn process per GPU, fit, throttle counters) on the
    fake telemetry backend with stand-in burn processes; the real run is tests/gpu."""
    telemetry = pytest.importorskip("advisor.runners.telemetry")
    import functools
    import time
    import types

    from advisor.placement import profile as P

    # the fake burn runs in seconds, not minutes: allow the fit a short trace
    monkeypatch.setattr(P, "fit_thermal", functools.partial(fit_thermal, min_duration_s=1.0))

    import advisor.placement.measure as M

    fake = telemetry.FakeBackend(2, ramp_w_per_s=400.0)

    class Burn:
        returncode = 0

        def __init__(self, cmd, env, **kw):
            assert cmd[-3:] == ["-m", "advisor.placement.burn", "30"] and env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")

        def communicate(self, timeout=None):
            time.sleep(1.5)
            return json.dumps({"tflops": 640.0, "iters": 10, "seconds": 30.0}), ""

        def poll(self):
            return 0

    monkeypatch.setattr(M, "_preflight", lambda: None)
    monkeypatch.setattr(M, "_open_nvml", lambda: fake)
    monkeypatch.setattr(M, "subprocess", types.SimpleNamespace(Popen=Burn, PIPE=None))
    prof = M.measure_profile(seconds=30, node="fake", idle_s=0.3, cool_s=0.3, rate_hz=20)
    assert prof.node == "fake" and [g.uuid for g in prof.gpus] == [d.uuid for d in fake.devices()]
    for g in prof.gpus:
        assert g.c_per_w == pytest.approx(0.05, rel=0.02) and g.ambient_c == pytest.approx(30, abs=1)
        assert g.extra["gemm_tflops"] == 640.0 and g.extra["speed_at_cap"] == 1.0
        assert g.extra["burn_power_violation_s"] > 0 and g.extra["burn_thermal_violation_s"] == 0
    with pytest.raises(ProfileError, match="at least 30"):
        M.measure_profile(seconds=5)

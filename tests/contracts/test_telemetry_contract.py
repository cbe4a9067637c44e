"""The telemetry backend contract, written once and run against every backend: the fake, NVML
(through a fake ``pynvml`` that speaks nvml.h units and nvidia-ml-py's error types) and AMD SMI
(through a fake ``amdsmi``), and, marked ``gpu``, the real NVML when a GPU is present.

The simulated backends all read the same synthetic GPUs (``FakeBackend``'s physics: power ramps
from idle by 100 W/s to the 700 W cap, then throttle bit 0x4 and power-violation time), on a
manual clock, so what a window reports is checked against the exact integral of that power curve.
The contract: devices keyed by UUID / PCI bus id; samples in the shared units (W, J, °C, MHz, %,
ns, bytes), None (never 0 or NaN) for what a device lacks and for counters in a fast read;
cumulative counters that never decrease; throttle reasons on the shared bit mask; windows whose
peak >= mean and whose energy is power x time; one-line errors and the degrade path when the
library is missing, fails to start, finds no GPU or loses one."""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest

from advisor.runners import telemetry as T
from advisor.runners.telemetry import (CLOCK_EVENT_REASONS, COUNTER_FIELDS, PCIE_COUNTER_WRAP, SAMPLE_FIELDS,
                                       THROTTLE_MASK, FakeBackend, Sample, Sampler, TelemetryUnavailable,
                                       normalize_pci_bus_id)
from fake_amdsmi import FakeAmdSmi
from fake_pynvml import FakeNvml

T0 = 1_000_000.0  # the synthetic GPUs' t_start on the manual clock
IDLE_W, RAMP_W_PER_S, CAP_W = 80.0, 100.0, 700.0  # FakeBackend's physics (device d idles 10 d W higher)
LIBRARIES = {"nvml": ("pynvml", FakeNvml), "amd": ("amdsmi", FakeAmdSmi)}


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Rig:
    """A backend under test, the synthetic GPUs behind it (None: a real GPU) and its clock."""

    kind: str
    backend: Any
    gpus: FakeBackend | None = None
    clock: Clock | None = None
    lib: Any = None

    def at(self, tau: float) -> None:
        """Move to tau seconds after the synthetic GPUs started (a real GPU: just wait a bit)."""
        if self.clock is None:
            time.sleep(0.02)
        else:
            self.clock.t = T0 + tau

    def status(self, uuid: str, field: str) -> str:
        return self.backend.field_status()[uuid][field]

    def supported(self, uuid: str, field: str) -> bool:
        return not self.status(uuid, field).startswith("unsupported")


def make_rig(kind: str, monkeypatch, unsupported: tuple[str, ...] = ()) -> Rig:
    clock = Clock(T0)
    gpus = FakeBackend(2, power_limit_w=CAP_W, idle_w=IDLE_W, ramp_w_per_s=RAMP_W_PER_S, clock=clock,
                       t_start=T0, unsupported=unsupported)
    if kind == "fake":
        return Rig(kind, gpus, gpus, clock)
    module, lib_cls = LIBRARIES[kind]
    lib = lib_cls(gpus)
    monkeypatch.setitem(sys.modules, module, lib.module())
    backend = T.open_backend(kind)
    backend.clock = clock
    return Rig(kind, backend, gpus, clock, lib)


def real_nvml_rig() -> Rig:
    try:
        backend = T.open_backend("nvml")
    except TelemetryUnavailable as e:
        pytest.skip(f"no NVIDIA GPU here: {e}")
    return Rig("nvml-real", backend)


@pytest.fixture(params=["fake", "nvml", "amd"])
def rig(request, monkeypatch):
    r = make_rig(request.param, monkeypatch)
    yield r
    r.backend.close()


@pytest.fixture(params=["fake", "nvml", "amd", pytest.param("nvml-real", marks=pytest.mark.gpu)])
def any_rig(request, monkeypatch):
    r = real_nvml_rig() if request.param == "nvml-real" else make_rig(request.param, monkeypatch)
    yield r
    r.backend.close()


def exact_energy_j(device: int, tau0: float, tau1: float) -> float:
    """The integral of the synthetic GPU's power min(cap, idle + ramp tau) over [tau0, tau1]."""
    idle = IDLE_W + 10.0 * device
    tc = (CAP_W - idle) / RAMP_W_PER_S

    def e(tau):
        ramp = min(tau, tc)
        return idle * ramp + 0.5 * RAMP_W_PER_S * ramp ** 2 + CAP_W * max(0.0, tau - tc)
    return e(tau1) - e(tau0)


def one_line(text: str) -> bool:
    return bool(text.strip()) and "\n" not in text


RANGES = {"power_w": (1.0, 5000.0), "energy_j": (0.0, 1e12), "gpu_temp_c": (-40.0, 150.0),
          "mem_temp_c": (-40.0, 150.0), "sm_clock_mhz": (1.0, 10_000.0), "mem_clock_mhz": (1.0, 20_000.0),
          "gpu_util_pct": (0.0, 100.0)}


# ------------------------------------------------------------------------------ identity, samples
def test_devices_are_keyed_by_uuid_and_pci_bus_id(any_rig):
    devs = any_rig.backend.devices()
    assert devs and [d.index for d in devs] == list(range(len(devs)))
    assert len({d.uuid for d in devs}) == len(devs) and all(d.uuid for d in devs)
    assert all(d.pci_bus_id == normalize_pci_bus_id(d.pci_bus_id) for d in devs)
    assert len({d.pci_bus_id for d in devs}) == len(devs)
    assert all(d.power_limit_w is None or 50.0 <= d.power_limit_w <= 5000.0 for d in devs)
    status = any_rig.backend.field_status()
    assert set(status) == {d.uuid for d in devs}
    for per_field in status.values():
        assert set(per_field) == set(SAMPLE_FIELDS)
        assert all(one_line(v) for v in per_field.values())


def test_a_sample_is_in_the_shared_units_and_none_where_unsupported(any_rig):
    any_rig.at(2.0)
    for i, d in enumerate(any_rig.backend.devices()):
        s = any_rig.backend.read(i)
        assert isinstance(s, Sample) and isinstance(s.t, float)
        assert s.t == (any_rig.clock.t if any_rig.clock else pytest.approx(time.time(), abs=1.0))
        for f in SAMPLE_FIELDS:
            v = getattr(s, f)
            if not any_rig.supported(d.uuid, f):
                assert v is None, f"{f}: unsupported but read {v!r}"
                continue
            assert v is not None, f"{f}: {any_rig.status(d.uuid, f)} but read None"
            assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (f, v)
            lo, hi = RANGES.get(f, (0.0, math.inf))
            assert lo <= v <= hi, f"{f} = {v} outside [{lo}, {hi}]"
        assert s.clock_event_reasons is None or isinstance(s.clock_event_reasons, int)


def test_a_fast_read_leaves_out_every_counter_and_nothing_else(any_rig):
    any_rig.at(2.0)
    for i in range(len(any_rig.backend.devices())):
        full, fast = any_rig.backend.read(i), any_rig.backend.read(i, counters=False)
        for f in SAMPLE_FIELDS:
            if f in COUNTER_FIELDS:
                assert getattr(fast, f) is None, f"{f} read in a counters=False sample"
            else:
                assert (getattr(fast, f) is None) == (getattr(full, f) is None), f


def test_counters_never_decrease_and_timestamps_advance(any_rig):
    reads = []
    for k in range(6):
        any_rig.at(1.0 + 0.5 * k)
        reads.append(any_rig.backend.read(0))
    assert all(b.t > a.t for a, b in zip(reads, reads[1:]))
    for f in COUNTER_FIELDS:
        vals = [getattr(s, f) for s in reads]
        if vals[0] is None:
            continue
        if f.startswith("pcie_"):  # NVML's PCIe counters are 32-bit (unwrapped in summaries)
            vals = list(T.unwrap_counter(__import__("numpy").array(vals, float), PCIE_COUNTER_WRAP))
        assert all(b >= a for a, b in zip(vals, vals[1:])), f"{f} decreased: {vals}"


# ---------------------------------------------------------------------------------- physics
def test_energy_counter_is_the_integral_of_power(rig):
    for i in range(2):
        reads = []
        for k in range(41):  # tau 1 .. 3 s every 50 ms
            rig.at(1.0 + 0.05 * k)
            reads.append(rig.backend.read(i))
        trapezoid = sum((a.power_w + b.power_w) / 2 * (b.t - a.t) for a, b in zip(reads, reads[1:]))
        counted = reads[-1].energy_j - reads[0].energy_j
        assert counted == pytest.approx(exact_energy_j(i, 1.0, 3.0), rel=1e-3)
        assert counted == pytest.approx(trapezoid, rel=1e-2)


def test_throttling_sets_the_shared_mask_and_only_when_capped(rig):
    rig.at(2.0)  # on the ramp, far from the cap
    cool = rig.backend.read(0)
    rig.at(10.0)  # capped for 3.8 s
    capped = rig.backend.read(0)
    assert cool.clock_event_reasons & THROTTLE_MASK == 0
    assert capped.clock_event_reasons & CLOCK_EVENT_REASONS["sw_power_cap"]
    assert capped.power_w == pytest.approx(CAP_W, abs=1.0) and capped.sm_clock_mhz < cool.sm_clock_mhz


def _window(rig: Rig, name: str, tau0: float, tau1: float, sampler: Sampler, n: int = 20):
    rig.at(tau0)
    sampler.begin_window(name)
    for k in range(1, n):
        rig.at(tau0 + (tau1 - tau0) * k / n)
        sampler.sample_once(counters=k % 5 == 0)  # counters at a fifth of the rate, as the thread does
    rig.at(tau1)
    return sampler.end_window(name)


def test_a_window_reports_peak_mean_energy_and_throttling_from_begin_to_end(rig):
    s = Sampler(rig.backend, rate_hz=100, counter_rate_hz=20)
    ramp = _window(rig, "ramp", 1.0, 3.0, s)
    capped = _window(rig, "capped", 8.0, 9.0, s)
    assert (ramp.t0, ramp.t1) == (T0 + 1.0, T0 + 3.0) and ramp.summary["duration_s"] == pytest.approx(2.0)
    assert [w[0] for w in s.windows] == ["ramp", "capped"]
    assert set(ramp.devices) == {d.uuid for d in rig.backend.devices()}
    for i, d in enumerate(rig.backend.devices()):
        r, c = ramp.devices[d.uuid], capped.devices[d.uuid]
        assert r["n_samples"] == 21
        assert r["peak_power_w"] >= r["p99_power_w"] >= r["mean_power_w"] > 0
        assert r["peak_power_w"] == pytest.approx(IDLE_W + 10 * i + RAMP_W_PER_S * 3.0, abs=1.0)
        assert r["energy_source"] == "counter"
        assert r["energy_j"] == pytest.approx(exact_energy_j(i, 1.0, 3.0), rel=1e-3)
        assert c["energy_j"] == pytest.approx(CAP_W * 1.0, rel=1e-3)
        assert set(r["throttle_fractions"]) == set(CLOCK_EVENT_REASONS) | {"any_throttle"}
        assert all(0.0 <= v <= 1.0 for v in r["throttle_fractions"].values())
        assert r["throttle_fractions"]["any_throttle"] == 0.0
        assert c["throttle_fractions"]["any_throttle"] == c["throttle_fractions"]["sw_power_cap"] == 1.0
        assert c["power_violation_s"] == pytest.approx(1.0, rel=0.02)
        assert r["power_violation_s"] == pytest.approx(0.0, abs=0.01)
        assert r["max_gpu_temp_c"] == pytest.approx(30.0 + 0.05 * r["peak_power_w"], abs=1.0)
        if rig.supported(d.uuid, "pcie_tx_bytes"):
            assert r["pcie_tx_bytes"] == pytest.approx(1e9 * 2.0, rel=1e-3)
        else:
            assert r["pcie_tx_bytes"] is None
    assert ramp.energy_j == pytest.approx(sum(d["energy_j"] for d in ramp.devices.values()))
    trace = s.snapshot()
    for cols in trace.columns.values():
        assert (cols["t"][1:] > cols["t"][:-1]).all()
    with pytest.raises(ValueError, match="not begun"):
        s.end_window("ramp")
    s.begin_window("x")
    with pytest.raises(ValueError, match="already open"):
        s.begin_window("x")


def test_a_window_on_any_backend_holds_the_invariants(any_rig):
    s = Sampler(any_rig.backend, rate_hz=100, counter_rate_hz=20)
    w = _window(any_rig, "w", 1.0, 2.0, s, n=10)
    for u, d in w.devices.items():
        assert d["n_samples"] >= 10
        assert d["peak_power_w"] >= d["mean_power_w"] > 0
        assert d["energy_j"] is not None and d["energy_j"] >= 0
        assert d["energy_j"] <= d["peak_power_w"] * w.summary["duration_s"] * 1.2 + 1.0
        assert all(0.0 <= v <= 1.0 for v in d["throttle_fractions"].values())


@pytest.mark.parametrize("field", ["energy_j", "mem_temp_c", "power_violation_ns", "gpu_util_pct"])
def test_a_field_the_gpu_lacks_reads_none_and_summaries_degrade(field, monkeypatch):
    for kind in ("fake", "nvml", "amd"):
        rig = make_rig(kind, monkeypatch, unsupported=(field,))
        u = rig.backend.devices()[0].uuid
        assert rig.status(u, field).startswith("unsupported"), (kind, rig.status(u, field))
        rig.at(2.0)
        assert getattr(rig.backend.read(0), field) is None, kind
        w = _window(rig, "w", 1.0, 3.0, Sampler(rig.backend, rate_hz=100, counter_rate_hz=20)).devices[u]
        if field == "energy_j":  # the documented fallback: the trapezoid of power
            assert w["energy_source"] == "power_trapezoid", kind
            assert w["energy_j"] == pytest.approx(exact_energy_j(0, 1.0, 3.0), rel=1e-3), kind
        else:
            key = {"mem_temp_c": "max_mem_temp_c", "power_violation_ns": "power_violation_s",
                   "gpu_util_pct": "mean_gpu_util_pct"}[field]
            assert w[key] is None, kind
            assert w["energy_source"] == "counter", kind
        rig.backend.close()


# ----------------------------------------------------------------------- the library's failures
@pytest.mark.parametrize("kind", sorted(LIBRARIES))
def test_a_missing_library_is_one_line_naming_what_to_install(kind, monkeypatch, caplog):
    for module, _ in LIBRARIES.values():
        monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    with pytest.raises(TelemetryUnavailable) as e:
        T.open_backend(kind)
    assert one_line(str(e.value)) and {"nvml": "nvidia-ml-py", "amd": "amd"}[kind] in str(e.value)
    with caplog.at_level(logging.WARNING, logger="advisor.runners.telemetry"):
        assert T.open_backend("auto") is None  # the degrade path: telemetry off, one warning
    assert len(caplog.records) == 1 and one_line(caplog.records[0].getMessage())


@pytest.mark.parametrize("kind", sorted(LIBRARIES))
def test_a_library_that_cannot_start_is_one_line(kind, monkeypatch):
    module, lib_cls = LIBRARIES[kind]
    lib = lib_cls(FakeBackend(1))
    lib.init_error = {"nvml": 12, "amd": 18}[kind]  # NVML_ERROR_LIBRARY_NOT_FOUND, AMDSMI_STATUS_INIT_ERROR
    monkeypatch.setitem(sys.modules, module, lib.module())
    with pytest.raises(TelemetryUnavailable) as e:
        T.open_backend(kind)
    assert one_line(str(e.value)), repr(str(e.value))
    assert {"nvml": "Library Not Found", "amd": "INIT_ERROR"}[kind] in str(e.value)


@pytest.mark.parametrize("kind", sorted(LIBRARIES))
def test_no_gpu_is_unavailable_and_the_library_is_shut_down(kind, monkeypatch):
    module, lib_cls = LIBRARIES[kind]
    lib = lib_cls(FakeBackend(0))
    monkeypatch.setitem(sys.modules, module, lib.module())
    with pytest.raises(TelemetryUnavailable, match="no (NVIDIA|AMD) GPU") as e:
        T.open_backend(kind)
    assert one_line(str(e.value)) and lib.inits == lib.shutdowns == 1


@pytest.mark.parametrize("kind", sorted(LIBRARIES))
def test_a_gpu_lost_mid_run_costs_samples_not_the_sampler(kind, monkeypatch):
    rig = make_rig(kind, monkeypatch)
    s = Sampler(rig.backend, rate_hz=100)
    rig.at(1.0)
    s.sample_once()
    rig.lib.lost = True
    with pytest.raises(Exception) as e:
        rig.backend.read(0)
    assert type(e.value).__module__ != "builtins"  # the library's own error type, not a bare crash
    rig.at(1.1)
    s.sample_once()
    assert s.errors == 2 and one_line(s.last_error), repr(s.last_error)
    rig.lib.lost = False
    rig.at(1.2)
    s.sample_once()
    assert s.snapshot().n_samples(rig.backend.devices()[0].uuid) == 2


@pytest.mark.parametrize("kind", sorted(LIBRARIES))
def test_close_shuts_the_library_down_once(kind, monkeypatch):
    rig = make_rig(kind, monkeypatch)
    rig.backend.close()
    rig.backend.close()
    assert rig.lib.inits == rig.lib.shutdowns == 1

"""GPU telemetry: backends (NVML, AMD SMI, a fake), a background sampler, traces and summaries.

Small API in the style of Zeus monitor windows::

    backend = open_backend()                  # NVML, else AMD SMI, else None (one warning line)
    with Sampler(backend, rate_hz=20) as s:   # background thread, deadline-scheduled
        s.begin_window("step")
        ...                                   # train
        w = s.end_window("step")              # WindowSummary: energy, peak power, throttling
    trace = s.trace                           # columns per device, windows, meta (overhead)
    trace.save("trace.json.gz")
    summarize_steps(trace, [(t0, t1), ...], tokens=n)

Timestamps are ``time.time()`` wall clock (to align traces across processes). GPUs are keyed by
UUID (NVIDIA "GPU-…") and PCI bus id, never by index alone. A value the device does not support
is ``None`` in a ``Sample`` and NaN in trace columns; summaries turn it back into ``None``.

Instantaneous values (power, temperatures, clocks, reasons, utilization) are read every tick.
Cumulative counters (energy, violation/slowdown ns, PCIe/NVLink bytes: COUNTER_FIELDS) are read
every ``1/counter_rate_hz`` s and at every window boundary, because on H200 / driver 580 some of
them cost milliseconds per call (energy ≈ 3 ms, NVLink ≈ 1 ms, thermal violation ≈ 0.6 ms, against
1-4 µs for power or temperature). Summaries take counter deltas, interpolated at the interval ends.
When run inside a training process the sampler competes for the GIL; for clean timing run it in
its own process and align step times by wall clock (``summarize_steps``).

NVML and AMD SMI backends live in ``telemetry_nvml`` / ``telemetry_amd`` and are imported lazily.
"""
from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from advisor.runners.telemetry_types import (COLUMNS, COUNTER_FIELDS, CLOCK_EVENT_REASONS, SAMPLE_FIELDS,
                                             THROTTLE_MASK, Backend, DeviceInfo, Sample, TelemetryUnavailable,
                                             normalize_pci_bus_id)

log = logging.getLogger(__name__)

__all__ = [
    "CLOCK_EVENT_REASONS", "THROTTLE_MASK", "SAMPLE_FIELDS", "COUNTER_FIELDS", "COLUMNS", "TelemetryUnavailable",
    "DeviceInfo", "Sample",
    "Backend", "FakeBackend", "NvmlBackend", "AmdSmiBackend", "open_backend", "Sampler", "Trace",
    "WindowSummary", "summarize", "summarize_steps", "trace_from_burn_json", "normalize_pci_bus_id",
]

# --------------------------------------------------------------------------------------------
# Backends

def __getattr__(name: str):  # lazy: importing this module must not touch NVML or amdsmi
    if name == "NvmlBackend":
        from .telemetry_nvml import NvmlBackend
        return NvmlBackend
    if name == "AmdSmiBackend":
        from .telemetry_amd import AmdSmiBackend
        return AmdSmiBackend
    raise AttributeError(name)


def open_backend(kind: str = "auto") -> Backend | None:
    """Open a telemetry backend. ``"auto"``: NVML, then AMD SMI; if neither works, log one warning
    saying telemetry is disabled and why, and return None. ``"nvml"`` / ``"amd"``: that backend,
    or raise TelemetryUnavailable."""
    from .telemetry_amd import AmdSmiBackend
    from .telemetry_nvml import NvmlBackend

    kinds = {"nvml": NvmlBackend, "amd": AmdSmiBackend}
    if kind != "auto":
        if kind not in kinds:
            raise ValueError(f"unknown telemetry backend {kind!r}; expected auto, nvml or amd")
        return kinds[kind]()
    reasons = []
    for name, cls in kinds.items():
        try:
            return cls()
        except TelemetryUnavailable as e:
            reasons.append(f"{name}: {e}")
    log.warning("GPU telemetry disabled (%s)", "; ".join(reasons))
    return None


class FakeBackend:
    """Deterministic synthetic GPUs, for tests and simulations only (never a measurement).

    Device ``d`` idles at ``idle_w + 10*d`` W at ``t_start`` and ramps by ``ramp_w_per_s`` until it
    hits ``power_limit_w``; from then on it is capped: reason bit 0x4 (SW power cap) is set, the SM
    clock drops from 1980 to 1515 MHz and ``power_violation_ns`` counts the capped time. The energy
    counter is the exact integral of that power curve. Temperatures are 30 + 0.05 °C/W × power (HBM
    5 °C more); PCIe moves 1 GB/s TX, 2 GB/s RX and NVLink 10 GB/s each way. Fields named in
    ``unsupported`` read None, like a device that lacks them. ``clock`` drives the timestamps (pass a
    manual clock for exact tests).
    """

    name = "fake"
    driver_version = None

    def __init__(self, n_devices: int = 2, *, power_limit_w: float = 700.0, idle_w: float = 80.0,
                 ramp_w_per_s: float = 100.0, clock: Callable[[], float] = time.time,
                 t_start: float | None = None, unsupported: Iterable[str] = ()):
        unknown = set(unsupported) - set(SAMPLE_FIELDS)
        if unknown:
            raise ValueError(f"unknown sample fields: {sorted(unknown)}")
        self.clock = clock
        self.t_start = clock() if t_start is None else t_start
        self.power_limit_w, self.idle_w, self.ramp = power_limit_w, idle_w, ramp_w_per_s
        self.unsupported = frozenset(unsupported)
        self._devices = [
            DeviceInfo(index=d, uuid=f"GPU-00000000-0000-4000-8000-{d:012x}",
                       pci_bus_id=f"00000000:{0x18 + d:02X}:00.0", name="Fake GPU",
                       power_limit_w=power_limit_w, slowdown_temp_c=89.0, max_operating_temp_c=87.0,
                       module_id=d + 1)
            for d in range(n_devices)]

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def field_status(self) -> dict[str, dict[str, str]]:
        return {d.uuid: {f: "unsupported" if f in self.unsupported else "synthetic"
                         for f in SAMPLE_FIELDS} for d in self._devices}

    def close(self) -> None:
        pass

    def read(self, i: int, counters: bool = True) -> Sample:
        t = self.clock()
        tau = max(0.0, t - self.t_start)
        idle = self.idle_w + 10.0 * i
        t_cap = (self.power_limit_w - idle) / self.ramp
        capped = tau >= t_cap
        if capped:
            power = self.power_limit_w
            energy = idle * t_cap + 0.5 * self.ramp * t_cap**2 + self.power_limit_w * (tau - t_cap)
        else:
            power = idle + self.ramp * tau
            energy = idle * tau + 0.5 * self.ramp * tau**2
        values = dict(
            power_w=power, energy_j=energy, gpu_temp_c=30.0 + 0.05 * power,
            mem_temp_c=35.0 + 0.05 * power, sm_clock_mhz=1515.0 if capped else 1980.0,
            mem_clock_mhz=2619.0, clock_event_reasons=0x4 if capped else 0x0,
            power_violation_ns=max(0.0, tau - t_cap) * 1e9, thermal_violation_ns=0.0,
            sw_thermal_slowdown_ns=0.0, hw_thermal_slowdown_ns=0.0, hw_power_brake_ns=0.0,
            gpu_util_pct=100.0, pcie_tx_bytes=1e9 * tau, pcie_rx_bytes=2e9 * tau,
            nvlink_tx_bytes=1e10 * tau, nvlink_rx_bytes=1e10 * tau)
        for f in self.unsupported | (set() if counters else set(COUNTER_FIELDS)):
            values[f] = None
        return Sample(t=t, **values)


# --------------------------------------------------------------------------------------------
# Trace

@dataclass
class Trace:
    """Samples as columns: ``columns[uuid][name]`` is a float64 array (NaN = unsupported/missing),
    names as in COLUMNS. ``windows`` are (name, t0, t1); ``meta`` holds backend, driver, rate,
    overhead and how each field is read."""

    devices: list[DeviceInfo]
    columns: dict[str, dict[str, np.ndarray]]
    windows: list[tuple[str, float, float]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    FORMAT = "advisor.telemetry.trace/1"

    def device(self, key: str) -> DeviceInfo:
        """Look a device up by UUID or PCI bus id."""
        return _match_devices(self.devices, [key])[0]

    def n_samples(self, uuid: str) -> int:
        return len(self.columns[uuid]["t"])

    def slice(self, t0: float, t1: float) -> Trace:
        """Samples with t0 <= t <= t1 and the windows that overlap [t0, t1]."""
        cols = {}
        for uuid, c in self.columns.items():
            lo, hi = np.searchsorted(c["t"], t0, "left"), np.searchsorted(c["t"], t1, "right")
            cols[uuid] = {k: v[lo:hi].copy() for k, v in c.items()}
        windows = [w for w in self.windows if w[2] >= t0 and w[1] <= t1]
        return Trace(list(self.devices), cols, windows, dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.FORMAT, "meta": self.meta,
                "devices": [dataclasses.asdict(d) for d in self.devices],
                "columns": {u: {k: _json_column(v) for k, v in c.items()} for u, c in self.columns.items()},
                "windows": [list(w) for w in self.windows]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        if d.get("format") != cls.FORMAT:
            raise ValueError(f"not a telemetry trace (format {d.get('format')!r}, expected {cls.FORMAT!r})")
        cols = {u: {k: np.array([math.nan if x is None else x for x in v], dtype=float)
                    for k, v in c.items()} for u, c in d["columns"].items()}
        return cls([DeviceInfo(**x) for x in d["devices"]], cols,
                   [(w[0], float(w[1]), float(w[2])) for w in d["windows"]], d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        """JSON, columnar; gzip when the name ends with .gz."""
        text = json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.write(text)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _json_column(v: np.ndarray) -> list:
    finite = v[np.isfinite(v)]
    as_int = finite.size > 0 and bool(np.all(finite == np.round(finite))) and bool(np.all(np.abs(finite) < 2**53))
    return [None if not math.isfinite(x) else (int(x) if as_int else x) for x in v.tolist()]


def _match_devices(devices: Sequence[DeviceInfo], keys: Sequence[str]) -> list[DeviceInfo]:
    """Resolve UUIDs (with or without the "GPU-" prefix) or PCI bus ids; integers are refused."""
    out = []
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"select GPUs by UUID or PCI bus id, not {key!r}")
        k = key.strip().lower()
        try:
            pci = normalize_pci_bus_id(key)
        except ValueError:
            pci = None
        hits = [d for d in devices if d.uuid.lower() in (k, "gpu-" + k) or (pci and d.pci_bus_id == pci)]
        if not hits:
            known = ", ".join(f"{d.uuid} ({d.pci_bus_id})" for d in devices)
            raise ValueError(f"no GPU {key!r}; known: {known}")
        out.append(hits[0])
    return out


# --------------------------------------------------------------------------------------------
# Sampler

@dataclass(frozen=True)
class WindowSummary:
    name: str
    t0: float
    t1: float
    summary: dict[str, Any]   # summarize(trace, t0, t1)

    @property
    def duration_s(self) -> float:
        return self.t1 - self.t0

    @property
    def energy_j(self) -> float | None:
        """Total over devices; None if any device lacks both energy counter and power."""
        return self.summary["energy_j"]

    @property
    def devices(self) -> dict[str, dict[str, Any]]:
        return self.summary["devices"]


class Sampler:
    """Samples the chosen devices of ``backend`` in a background thread at ``rate_hz``.

    Ticks are scheduled by deadline (t_start + k/rate), so the rate holds even when reads take a
    good part of the period; ticks that cannot be met are skipped and counted (``missed_ticks``).
    Cumulative counters are read on the first tick, then every ``1/counter_rate_hz`` s (at most
    every tick), and on every boundary read: ``begin_window`` / ``end_window`` / ``stop`` read all
    devices at once, so windows have exact counter deltas. Time spent inside sample calls is
    accumulated (``overhead_s``, split out for counter reads) and reported in ``Trace.meta`` with
    the thread's CPU time.
    """

    def __init__(self, backend: Backend, devices: list[str] | None = None, rate_hz: float = 20.0,
                 counter_rate_hz: float = 1.0):
        if not rate_hz > 0 or not counter_rate_hz > 0:
            raise ValueError(f"rates must be > 0, got rate_hz={rate_hz!r}, counter_rate_hz={counter_rate_hz!r}")
        self.backend = backend
        self.rate_hz = float(rate_hz)
        self.counter_rate_hz = min(float(counter_rate_hz), self.rate_hz)
        self._counter_every = max(1, round(self.rate_hz / self.counter_rate_hz))
        self.clock = getattr(backend, "clock", time.time)
        all_devices = backend.devices()
        chosen = all_devices if devices is None else _match_devices(all_devices, devices)
        self.devices = list(dict.fromkeys(chosen))  # keep order, drop duplicates
        self._pos = [all_devices.index(d) for d in self.devices]
        self._cols = {d.uuid: {k: [] for k in COLUMNS} for d in self.devices}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._open: dict[str, float] = {}
        self.windows: list[tuple[str, float, float]] = []
        self.n_ticks = self.n_boundary = self.n_counter_reads = self.missed_ticks = self.errors = 0
        self.overhead_s = self.overhead_counter_s = 0.0
        self.thread_cpu_s = 0.0
        self.last_error: str | None = None
        self.t_start = self.t_stop = None
        self.trace: Trace | None = None

    # -- sampling -----------------------------------------------------------------------------
    def sample_once(self, counters: bool = True) -> None:
        """Read every chosen device once and append the samples (thread-safe)."""
        with self._lock:
            c0 = time.perf_counter()
            for d, i in zip(self.devices, self._pos):
                try:
                    s = self.backend.read(i, counters)
                except Exception as e:  # a flaky read must not kill the thread; it is counted
                    self.errors += 1
                    self.last_error = f"{d.uuid}: {type(e).__name__}: {' '.join(str(e).split())}"  # one line
                    continue
                cols = self._cols[d.uuid]
                cols["t"].append(s.t)
                for k in SAMPLE_FIELDS:
                    v = getattr(s, k)
                    cols[k].append(math.nan if v is None else v)
            dt = time.perf_counter() - c0
            self.overhead_s += dt
            if counters:
                self.n_counter_reads += 1
                self.overhead_counter_s += dt

    def _run(self) -> None:
        cpu0 = time.thread_time()
        period = 1.0 / self.rate_hz
        deadline = time.perf_counter()
        while True:
            self.sample_once(counters=self.n_ticks % self._counter_every == 0)
            self.n_ticks += 1
            deadline += period
            now = time.perf_counter()
            if now > deadline:  # behind: skip the ticks we cannot meet, keep the grid
                skipped = int((now - deadline) / period) + 1
                self.missed_ticks += skipped
                deadline += skipped * period
            if self._stop.wait(deadline - now):
                break
        self.thread_cpu_s = time.thread_time() - cpu0

    def start(self) -> Sampler:
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self._stop.clear()
        self.t_start = self.clock()
        self._thread = threading.Thread(target=self._run, name="telemetry-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Trace:
        """Stop the thread, take a last sample and return (and keep in ``.trace``) the Trace."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample_once()
            self.n_boundary += 1
        self.t_stop = self.clock()
        self.trace = self._build_trace(None, None)
        return self.trace

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- windows ------------------------------------------------------------------------------
    def begin_window(self, name: str) -> None:
        if name in self._open:
            raise ValueError(f"window {name!r} is already open")
        # the window's start first, then its boundary sample: on a real device the sample is
        # stamped after the clock read, so it falls inside the window (found by the real-NVML contract)
        self._open[name] = self.clock()
        self.sample_once()
        self.n_boundary += 1

    def end_window(self, name: str) -> WindowSummary:
        if name not in self._open:
            raise ValueError(f"window {name!r} was not begun")
        self.sample_once()
        self.n_boundary += 1
        t1 = self.clock()
        t0 = self._open.pop(name)
        self.windows.append((name, t0, t1))
        return WindowSummary(name, t0, t1, summarize(self._build_trace(t0, t1), t0, t1))

    # -- results ------------------------------------------------------------------------------
    def snapshot(self, t0: float | None = None, t1: float | None = None) -> Trace:
        """A Trace of what has been sampled so far, safe to call while the sampler runs (a copy:
        later samples do not change it). With ``t0`` and/or ``t1``: only the samples in
        [t0, t1] plus one either side, so counters interpolate at the ends (``summarize``)."""
        if t0 is not None and t1 is not None and t1 < t0:
            raise ValueError(f"reversed interval [{t0}, {t1}]")
        return self._build_trace(t0, t1)

    def _build_trace(self, t0: float | None, t1: float | None) -> Trace:
        """Columns as arrays (copied under the lock); with t0/t1 only [t0, t1] plus one sample
        either side (cheap)."""
        cols = {}
        with self._lock:
            for uuid, c in self._cols.items():
                lo, hi = 0, len(c["t"])
                if t0 is not None:
                    lo = max(0, bisect.bisect_left(c["t"], t0) - 1)
                if t1 is not None:
                    hi = min(hi, bisect.bisect_right(c["t"], t1) + 1)
                cols[uuid] = {k: np.array(v[lo:hi], dtype=float) for k, v in c.items()}
            windows = list(self.windows)
            meta = self._meta()
        for c in cols.values():  # wall clock can step back; keep columns sorted by t
            if np.any(np.diff(c["t"]) < 0):
                order = np.argsort(c["t"], kind="stable")
                for k in c:
                    c[k] = c[k][order]
        return Trace(list(self.devices), cols, windows, meta)

    def _meta(self) -> dict[str, Any]:
        calls = self.n_ticks + self.n_boundary
        fast_calls, fast_s = calls - self.n_counter_reads, self.overhead_s - self.overhead_counter_s
        wall = (self.t_stop or self.clock()) - self.t_start if self.t_start is not None else None
        return {
            "backend": self.backend.name, "driver_version": self.backend.driver_version,
            "rate_hz": self.rate_hz, "counter_rate_hz": self.counter_rate_hz,
            "t_start": self.t_start, "t_stop": self.t_stop,
            "n_ticks": self.n_ticks, "n_boundary_samples": self.n_boundary,
            "n_counter_reads": self.n_counter_reads, "missed_ticks": self.missed_ticks,
            "overhead_s": self.overhead_s,
            "overhead_per_sample_s": self.overhead_s / calls if calls else None,
            "overhead_per_counter_sample_s": (self.overhead_counter_s / self.n_counter_reads
                                              if self.n_counter_reads else None),
            "overhead_per_fast_sample_s": fast_s / fast_calls if fast_calls else None,
            "overhead_fraction": self.overhead_s / wall if wall else None,
            "thread_cpu_s": self.thread_cpu_s,
            "errors": self.errors, "last_error": self.last_error,
            "fields": self.backend.field_status(),
        }


# --------------------------------------------------------------------------------------------
# Summaries

_DEVICE_KEYS = ("mean_power_w", "peak_power_w", "p99_power_w", "energy_j", "energy_source",
                "max_gpu_temp_c", "max_mem_temp_c", "mean_sm_clock_mhz", "min_sm_clock_mhz",
                "median_sm_clock_mhz", "mean_gpu_util_pct", "throttle_fractions",
                "power_violation_s", "thermal_violation_s", "sw_thermal_slowdown_s",
                "hw_thermal_slowdown_s", "hw_power_brake_s", "pcie_tx_bytes", "pcie_rx_bytes",
                "nvlink_tx_bytes", "nvlink_rx_bytes")


def summarize(trace: Trace, t0: float, t1: float, tokens: int | None = None) -> dict[str, Any]:
    """Summary of [t0, t1]: ``{"t0", "t1", "duration_s", "devices": {uuid: {...}}, "energy_j",
    "tokens", "energy_per_token_j"}``. Per device: n_samples, mean/peak/p99 power, energy_j (energy
    counter delta, else trapezoid of power; ``energy_source`` says which), max GPU/HBM temperature,
    mean/min/median SM clock, mean utilization, ``throttle_fractions`` (fraction of samples with each
    CLOCK_EVENT_REASONS bit, plus ``any_throttle``), violation/slowdown seconds and PCIe/NVLink
    byte deltas. Values a device does not report, and every value of a device with no sample in the
    interval, are None."""
    return _summarize([(t0, t1)], trace, tokens)


def summarize_steps(trace: Trace, step_bounds: Sequence[tuple[float, float]],
                    tokens: int | None = None) -> dict[str, Any]:
    """``summarize`` over the union of the step intervals (overlaps counted once), plus ``n_steps``
    and per device ``step_peak_power_w`` and ``step_energy_j`` (lists, one per step, None where the
    step has no sample / no energy)."""
    if not step_bounds:
        raise ValueError("summarize_steps needs at least one (t0, t1) step interval")
    out = _summarize(list(step_bounds), trace, tokens)
    out["n_steps"] = len(step_bounds)
    for d in trace.devices:
        c = trace.columns[d.uuid]
        peaks, energies = [], []
        for a, b in step_bounds:
            lo, hi = np.searchsorted(c["t"], a, "left"), np.searchsorted(c["t"], b, "right")
            p = c["power_w"][lo:hi]
            p = p[~np.isnan(p)]
            peaks.append(float(p.max()) if p.size else None)
            energies.append(_energy(c, [(a, b)])[0] if hi > lo else None)
        out["devices"][d.uuid]["step_peak_power_w"] = peaks
        out["devices"][d.uuid]["step_energy_j"] = energies
    return out


def _summarize(intervals: list[tuple[float, float]], trace: Trace, tokens: int | None) -> dict[str, Any]:
    for a, b in intervals:
        if not b > a:
            raise ValueError(f"empty or reversed interval [{a}, {b}]")
    if tokens is not None and tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    union = _merge(intervals)
    devices = {d.uuid: _device_summary(trace.columns[d.uuid], union) for d in trace.devices}
    energies = [s["energy_j"] for s in devices.values()]
    total = float(sum(energies)) if energies and all(e is not None for e in energies) else None
    return {"t0": union[0][0], "t1": union[-1][1], "duration_s": sum(b - a for a, b in union),
            "devices": devices, "energy_j": total, "tokens": tokens,
            "energy_per_token_j": total / tokens if tokens and total is not None else None}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _device_summary(c: dict[str, np.ndarray], union: list[tuple[float, float]]) -> dict[str, Any]:
    t = c["t"]
    idx = np.concatenate([np.arange(np.searchsorted(t, a, "left"), np.searchsorted(t, b, "right"))
                          for a, b in union]).astype(int)
    out: dict[str, Any] = {"n_samples": int(idx.size)}
    if idx.size == 0:
        out.update({k: None for k in _DEVICE_KEYS})
        return out

    def vals(name: str) -> np.ndarray:
        v = c[name][idx]
        return v[~np.isnan(v)]

    def stat(name: str, fn) -> float | None:
        v = vals(name)
        return float(fn(v)) if v.size else None

    out["mean_power_w"] = stat("power_w", np.mean)
    out["peak_power_w"] = stat("power_w", np.max)
    out["p99_power_w"] = stat("power_w", lambda v: np.percentile(v, 99))
    out["energy_j"], out["energy_source"] = _energy(c, union)
    out["max_gpu_temp_c"] = stat("gpu_temp_c", np.max)
    out["max_mem_temp_c"] = stat("mem_temp_c", np.max)
    out["mean_sm_clock_mhz"] = stat("sm_clock_mhz", np.mean)
    out["min_sm_clock_mhz"] = stat("sm_clock_mhz", np.min)
    out["median_sm_clock_mhz"] = stat("sm_clock_mhz", np.median)
    out["mean_gpu_util_pct"] = stat("gpu_util_pct", np.mean)
    reasons = vals("clock_event_reasons").astype(np.int64)
    if reasons.size:
        fr = {name: float(np.mean((reasons & bit) != 0)) for name, bit in CLOCK_EVENT_REASONS.items()}
        fr["any_throttle"] = float(np.mean((reasons & THROTTLE_MASK) != 0))
        out["throttle_fractions"] = fr
    else:
        out["throttle_fractions"] = None
    for name in ("power_violation", "thermal_violation", "sw_thermal_slowdown",
                 "hw_thermal_slowdown", "hw_power_brake"):
        ns = _counter_delta(t, c[name + "_ns"], union)
        out[name + "_s"] = ns / 1e9 if ns is not None else None
    for name in ("pcie_tx_bytes", "pcie_rx_bytes"):
        out[name] = _counter_delta(t, unwrap_counter(c[name], PCIE_COUNTER_WRAP), union)
    for name in ("nvlink_tx_bytes", "nvlink_rx_bytes"):
        out[name] = _counter_delta(t, c[name], union)
    return out


# NVML's PCIe byte counters (fields 197 / 198) are 32-bit: seen wrapping from just under 2^32 to a
# small value on H100 and H200 (driver 580.159.04; data/traces/h100x1-01, h200x4-a-12). At the 1 Hz
# counter rate one wrap per interval is assumed, so above ~4 GiB/s of PCIe traffic these sums are
# lower bounds.
PCIE_COUNTER_WRAP = 2 ** 32


def unwrap_counter(v: np.ndarray, wrap: float) -> np.ndarray:
    """A cumulative counter of `wrap` values made monotonic: each decrease from a value below
    `wrap` counts as one wrap-around. NaNs (unread samples) stay NaN."""
    out = v.astype(float).copy()
    ok = ~np.isnan(out)
    vv = out[ok]
    if vv.size < 2 or np.nanmax(vv) >= wrap:
        return out
    steps = np.concatenate([[0.0], np.cumsum(np.diff(vv) < 0) * float(wrap)])
    out[ok] = vv + steps
    return out


def _clipped(t: np.ndarray, union: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals of `union` clipped to the span [t[0], t[-1]] the samples cover."""
    out = []
    for a, b in union:
        a, b = max(a, t[0]), min(b, t[-1])
        if b >= a:
            out.append((a, b))
    return out


def _counter_delta(t: np.ndarray, v: np.ndarray, union: list[tuple[float, float]]) -> float | None:
    """Sum over intervals of v(b) - v(a), v linearly interpolated between samples; intervals are
    clipped to the span the counter covers. None if unsupported, uncovered or decreasing."""
    ok = ~np.isnan(v)
    tv, vv = t[ok], v[ok]
    if tv.size == 0:
        return None
    spans = _clipped(tv, union)
    total = sum(float(np.interp(b, tv, vv) - np.interp(a, tv, vv)) for a, b in spans)
    if not spans or total < 0:
        return None
    return total


def _energy(c: dict[str, np.ndarray], union: list[tuple[float, float]]) -> tuple[float | None, str | None]:
    e = _counter_delta(c["t"], c["energy_j"], union)
    if e is not None:
        return e, "counter"
    ok = ~np.isnan(c["power_w"])
    tp, pp = c["t"][ok], c["power_w"][ok]
    if tp.size < 2:
        return None, None
    spans = _clipped(tp, union)
    total = 0.0
    for a, b in spans:
        inside = (tp > a) & (tp < b)
        ts = np.concatenate([[a], tp[inside], [b]])
        ps = np.concatenate([[np.interp(a, tp, pp)], pp[inside], [np.interp(b, tp, pp)]])
        total += float(np.sum((ps[1:] + ps[:-1]) * np.diff(ts)) / 2)
    return (total, "power_trapezoid") if spans else (None, None)


# --------------------------------------------------------------------------------------------
# Recorded traces

def trace_from_burn_json(path: str | Path) -> Trace:
    """Convert a recorded burn trace (``{"what", "columns", "trace": [[t_s, [temp °C, instant W,
    SM MHz, reasons], ...per GPU]], ...}``, as in shared/gpu/data/h200x4_burn_trace.json) into a
    Trace. That file records neither UUIDs nor PCI ids, so devices are named
    ``<file stem>/nvml-index-<i>`` with ``pci_bus_id=None``; fields it lacks are NaN."""
    path = Path(path)
    raw = json.loads(path.read_text())
    rows = raw["trace"]
    n_gpu = len(rows[0]) - 1
    t = np.array([r[0] for r in rows], dtype=float)
    devices, cols = [], {}
    name = "NVIDIA H200" if "H200" in raw.get("what", "") else "unknown"
    for g in range(n_gpu):
        d = DeviceInfo(index=g, uuid=f"{path.stem}/nvml-index-{g}", pci_bus_id=None, name=name)
        devices.append(d)
        vals = np.array([r[g + 1] for r in rows], dtype=float)
        c = {k: np.full(len(rows), math.nan) for k in COLUMNS}
        c["t"] = t.copy()
        c["gpu_temp_c"], c["power_w"], c["sm_clock_mhz"], c["clock_event_reasons"] = vals.T
        cols[d.uuid] = c
    meta = {"backend": "nvml (recorded)", "source": path.name, "what": raw.get("what"),
            "date": raw.get("date"), "rate_hz": 1.0 / float(np.median(np.diff(t))),
            "gemm_tflops_per_gpu": raw.get("gemm_tflops_per_gpu")}
    return Trace(devices, cols, [], meta)

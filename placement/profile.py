"""Thermal profiles of GPU slots: how hot each physical GPU of a node runs at a given power.

A profile is one JSON file per node::

    {"node": "gpu-node-17",
     "gpus": [{"index": 0, "uuid": "GPU-…", "pci_bus_id": "00000000:18:00.0",
               "ambient_c": 36.5, "c_per_w": 0.046, ...}, ...]}

Steady state: T = ambient_c + c_per_w · P. Extra fields are kept (``tau_s``, ``fit_rmse_c``,
``speed_at_cap`` = delivered GEMM throughput under the power cap relative to the best slot,
``throttle_fraction`` = share of loaded samples with a power/thermal clock-event reason, ...).

Fit (``fit_thermal``): the die follows power within a second and the heat sink over about a
minute, so temperature is modelled as ambient plus two first-order low-pass filters of power,
T(t) = ambient + c_fast·LP_τf[P](t) + c_slow·LP_τs[P](t), each the response
T_inf − (T_inf − T0)·exp(−t/τ) to a power step. For each (τf, τs) on a grid the three
coefficients are a linear least-squares fit; the best grid point wins. The steady state is
c_per_w = c_fast + c_slow. It needs at least two power levels (idle then load is enough).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from advisor.catalog.specs import SpecError

FORMAT = "advisor.placement.profile/1"
_PCI = re.compile(r"^(?:[0-9A-Fa-f]{1,8}:)?[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7]$")
# Physical ranges; anything outside is a broken fit or a typo, not a GPU slot.
AMBIENT_RANGE_C = (-10.0, 70.0)
C_PER_W_RANGE = (0.001, 0.5)  # °C per W: liquid cold plates ~0.01-0.03, air 0.03-0.1


class ProfileError(SpecError):
    """A slot profile is missing, malformed or non-physical; one line for the user."""


@dataclass(frozen=True)
class SlotProfile:
    index: int          # NVML index when measured
    uuid: str
    pci_bus_id: str     # "" when the recording did not keep it
    ambient_c: float
    c_per_w: float
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def temp_c(self, power_w: float) -> float:
        return self.ambient_c + self.c_per_w * power_w

    def power_at_temp_w(self, temp_c: float) -> float:
        """The steady power at which this slot reaches temp_c."""
        return (temp_c - self.ambient_c) / self.c_per_w

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "pci_bus_id": self.pci_bus_id,
                "ambient_c": self.ambient_c, "c_per_w": self.c_per_w, **self.extra}


@dataclass(frozen=True)
class NodeProfile:
    node: str
    gpus: tuple[SlotProfile, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def cuda_order(self) -> list[SlotProfile]:
        """Slots in CUDA_DEVICE_ORDER=PCI_BUS_ID order (by PCI bus id; by index when not recorded)."""
        if all(g.pci_bus_id for g in self.gpus):
            return sorted(self.gpus, key=lambda g: _pci_key(g.pci_bus_id))
        return sorted(self.gpus, key=lambda g: g.index)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "node": self.node, "gpus": [g.to_dict() for g in self.gpus], **self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    def uniform(self, tol_c: float = 0.5, power_w: float = 700.0) -> bool:
        """All slots reach the same temperature (within tol_c) at power_w and at idle-ish 100 W."""
        return all(max(g.temp_c(p) for g in self.gpus) - min(g.temp_c(p) for g in self.gpus) <= tol_c
                   for p in (100.0, power_w))


def normalize_pci(bus_id: str) -> str:
    """'18:00.0', '0000:18:00.0' or NVML's '00000000:18:00.0' -> '00000000:18:00.0'."""
    s = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    if not _PCI.match(s.strip()):
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    parts = re.split(r"[:.]", s.strip())
    if len(parts) == 3:
        parts = ["0"] + parts
    d, b, dev, fn = (int(p, 16) for p in parts)
    return f"{d:08X}:{b:02X}:{dev:02X}.{fn}"


def _pci_key(bus_id: str) -> tuple[int, ...]:
    return tuple(int(p, 16) for p in re.split(r"[:.]", normalize_pci(bus_id)))


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def profile_from_dict(data: Any, source: str = "profile") -> NodeProfile:
    """Validate and build; every problem is one ProfileError line naming the file and the field."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{source}: expected a JSON object with 'node' and 'gpus'")
    node = data.get("node")
    if not isinstance(node, str) or not node.strip():
        raise ProfileError(f"{source}: 'node' must be a non-empty string, got {node!r}")
    gpus = data.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise ProfileError(f"{source}: 'gpus' must be a non-empty list")
    slots, seen = [], {"index": {}, "uuid": {}, "pci_bus_id": {}}
    for i, g in enumerate(gpus):
        where = f"{source}: gpus[{i}]"
        if not isinstance(g, Mapping):
            raise ProfileError(f"{where}: expected an object")
        for k in ("index", "uuid", "pci_bus_id", "ambient_c", "c_per_w"):
            if k not in g:
                raise ProfileError(f"{where}: missing field {k!r}")
        idx = g["index"]
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise ProfileError(f"{where}: 'index' must be a non-negative integer, got {idx!r}")
        for k in ("uuid", "pci_bus_id"):
            if not isinstance(g[k], str):
                raise ProfileError(f"{where}: {k!r} must be a string, got {g[k]!r}")
        if not g["uuid"].strip():
            raise ProfileError(f"{where}: 'uuid' is empty")
        pci = g["pci_bus_id"].strip()
        if pci and not _PCI.match(pci):
            raise ProfileError(f"{where}: 'pci_bus_id' {pci!r} is not a PCI bus id like 00000000:18:00.0")
        pci = normalize_pci(pci) if pci else ""
        for k in ("ambient_c", "c_per_w"):
            if not _num(g[k]):
                raise ProfileError(f"{where}: {k!r} must be a number, got {g[k]!r}")
        lo, hi = AMBIENT_RANGE_C
        if not lo <= g["ambient_c"] <= hi:
            raise ProfileError(f"{where}: ambient_c {g['ambient_c']:g} °C is not physical (expected {lo:g}..{hi:g})")
        lo, hi = C_PER_W_RANGE
        if not lo <= g["c_per_w"] <= hi:
            raise ProfileError(f"{where}: c_per_w {g['c_per_w']:g} °C/W is not physical (expected {lo:g}..{hi:g})")
        for k in ("speed_at_cap", "throttle_fraction", "tau_s"):
            if k in g and g[k] is not None and not (_num(g[k]) and g[k] >= 0):
                raise ProfileError(f"{where}: {k!r} must be a non-negative number, got {g[k]!r}")
        for k, v in (("index", idx), ("uuid", g["uuid"].strip().lower()), ("pci_bus_id", pci)):
            if k == "pci_bus_id" and not v:
                continue
            if v in seen[k]:
                raise ProfileError(f"{where}: duplicate {k} {g[k]!r} (also gpus[{seen[k][v]}])")
            seen[k][v] = i
        extra = {k: v for k, v in g.items() if k not in ("index", "uuid", "pci_bus_id", "ambient_c", "c_per_w")}
        slots.append(SlotProfile(idx, g["uuid"].strip(), pci, float(g["ambient_c"]), float(g["c_per_w"]), extra))
    if any(s.pci_bus_id for s in slots) and not all(s.pci_bus_id for s in slots):
        raise ProfileError(f"{source}: pci_bus_id given for some GPUs only")
    meta = {k: v for k, v in data.items() if k not in ("format", "node", "gpus")}
    return NodeProfile(node.strip(), tuple(slots), meta)


def load_profile(path: str | Path) -> NodeProfile:
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"{p}: no such profile file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{p}: not valid JSON ({e})") from None
    return profile_from_dict(data, str(p))


# ------------------------------------------------------------------------------------------ fitting
def _lowpass(t: np.ndarray, p: np.ndarray, tau: float) -> np.ndarray:
    """First-order response to power (linear between samples), starting settled at p[0];
    tau = 0 is the power itself."""
    if tau == 0:
        return p.copy()
    x = np.empty_like(p)
    x[0] = p[0]
    a = np.exp(-np.diff(t) / tau)
    for k in range(1, len(p)):
        x[k] = a[k - 1] * x[k - 1] + (1.0 - a[k - 1]) * 0.5 * (p[k - 1] + p[k])
    return x


def fit_thermal(t, temp_c, power_w, min_power_span_w: float = 100.0,
                min_duration_s: float = 20.0) -> dict[str, float]:
    """Fit T = ambient + c_fast·LP_τf[P] + c_slow·LP_τs[P]; returns ambient_c, c_per_w
    (= c_fast + c_slow, the steady state), tau_fast_s, tau_s (slow), fit_rmse_c, n_samples.
    Shorter than `min_duration_s` is refused: the fast pole alone reaches 10 s, and on the h200x4
    campaign's trial traces 8.6 and 10.5 s gave ambients of -279 and -0.4 °C."""
    t, temp, p = (np.asarray(x, dtype=float) for x in (t, temp_c, power_w))
    ok = np.isfinite(t) & np.isfinite(temp) & np.isfinite(p)
    t, temp, p = t[ok], temp[ok], p[ok]
    if t.size < 20:
        raise ProfileError(f"thermal fit needs at least 20 samples with temperature and power, got {t.size}")
    order = np.argsort(t, kind="stable")
    t, temp, p = t[order], temp[order], p[order]
    if t[-1] - t[0] < min_duration_s:
        raise ProfileError(f"thermal fit needs at least {min_duration_s:g} s of samples, got {t[-1] - t[0]:.1f} s")
    fast, slow = np.r_[0.0, np.geomspace(0.3, 10.0, 12)], np.geomspace(10.0, 1000.0, 16)
    lp = {tau: _lowpass(t, p, tau) for tau in np.r_[fast, slow]}
    if np.ptp(lp[slow[0]]) < min_power_span_w:
        raise ProfileError(f"thermal fit needs at least two power levels {min_power_span_w:g} W apart "
                           f"(e.g. idle then load); the trace spans {np.ptp(p):.0f} W")
    # two poles on the grid, and one pole alone (c_slow = 0), each with non-negative gains
    cands = [(tf, ts) for tf in fast for ts in slow] + [(tau, None) for tau in lp]
    best = None
    for tf, ts in cands:
        a = np.c_[np.ones_like(p), lp[tf]] if ts is None else np.c_[np.ones_like(p), lp[tf], lp[ts]]
        coef, *_ = np.linalg.lstsq(a, temp, rcond=None)
        if (coef[1:] < 0).any():
            continue
        sse = float(np.sum((a @ coef - temp) ** 2))
        if best is None or sse < best[0]:
            best = (sse, tf, ts, coef)
    if best is None:
        raise ProfileError("thermal fit failed: temperature does not rise with power in this trace")
    sse, tf, ts, coef = best
    return {"ambient_c": float(coef[0]), "c_per_w": float(coef[1:].sum()), "tau_fast_s": float(tf),
            "tau_s": float(tf if ts is None else ts), "fit_rmse_c": math.sqrt(sse / t.size), "n_samples": int(t.size)}


def profile_from_trace(trace, node: str | None = None) -> NodeProfile:
    """Fit every device of a telemetry Trace (advisor.runners.telemetry): a burn or past trials at
    several power levels. Adds the loaded-sample throttle fractions and the max temperature."""
    try:
        from advisor.runners.telemetry import THROTTLE_MASK
    except ImportError:  # telemetry module not there yet
        THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
    gpus = []
    for d in trace.devices:
        c = trace.columns[d.uuid]
        try:
            fit = fit_thermal(c["t"], c["gpu_temp_c"], c["power_w"])
        except ProfileError as e:
            raise ProfileError(f"GPU {d.uuid}: {e}") from None
        g = {"index": d.index, "uuid": d.uuid, "pci_bus_id": d.pci_bus_id or "",
             "ambient_c": round(fit["ambient_c"], 3), "c_per_w": round(fit["c_per_w"], 5),
             "tau_fast_s": round(fit["tau_fast_s"], 2), "tau_s": round(fit["tau_s"], 1),
             "fit_rmse_c": round(fit["fit_rmse_c"], 2), "n_samples": fit["n_samples"]}
        p, reasons, temp = c["power_w"], c["clock_event_reasons"], c["gpu_temp_c"]
        loaded = np.isfinite(p) & (p > 0.5 * np.nanmax(p))
        r = reasons[loaded & np.isfinite(reasons)].astype(np.int64)
        if r.size:
            g["throttle_fraction"] = round(float(np.mean((r & THROTTLE_MASK) != 0)), 4)
            g["thermal_throttle_fraction"] = round(float(np.mean((r & (0x20 | 0x40)) != 0)), 4)
        if np.any(loaded):
            g["load_power_w"] = round(float(np.nanmedian(p[loaded])), 1)
            g["max_temp_c"] = float(np.nanmax(temp))
        for k in ("slowdown_temp_c", "max_operating_temp_c", "power_limit_w", "module_id"):
            v = getattr(d, k, None)
            if v is not None:
                g[k] = v
        gpus.append(g)
    name = node or trace.meta.get("hostname") or trace.meta.get("source") or "node"
    meta = {"method": "fit_thermal: two first-order low-pass filters of power, least squares",
            "source": trace.meta.get("source") or trace.meta.get("backend")}
    return profile_from_dict({"node": str(name), "gpus": gpus, **meta}, f"profile of {name}")


def profile_from_burn_json(path: str | Path, node: str | None = None) -> NodeProfile:
    """Profile from a recorded all-GPU burn (shared/gpu/data/h200x4_burn_trace.json format). That
    file keeps no UUIDs or PCI ids: the UUIDs are placeholders '<stem>/nvml-index-<i>' and the
    profile cannot be matched to a live node (``advisor launch`` refuses it); it is data for
    planning and simulation. speed_at_cap = delivered GEMM TFLOP/s relative to the best GPU."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such burn trace")
    try:
        from advisor.runners.telemetry import trace_from_burn_json
        trace = trace_from_burn_json(path)
    except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ProfileError(f"{path}: not a burn trace ({type(e).__name__}: {e})") from None
    prof = profile_from_trace(trace, node or path.stem)
    tflops = trace.meta.get("gemm_tflops_per_gpu") or {}
    best = max(tflops.values()) if tflops else None
    gpus = []
    for g in prof.gpus:
        d = g.to_dict()
        tf = tflops.get(str(g.index))
        if tf is not None:
            d["gemm_tflops"] = tf
            d["speed_at_cap"] = round(tf / best, 4)
        gpus.append(d)
    meta = dict(prof.meta, source=path.name, what=trace.meta.get("what"), date=trace.meta.get("date"),
                note="UUIDs are placeholders: the recording has none; not usable by 'advisor launch'")
    return profile_from_dict({"node": prof.node, "gpus": gpus, **meta}, str(path))


def leakage_per_c(profile: NodeProfile, power_w: float | None = None) -> float | None:
    """Least-squares slope of -speed_at_cap vs slot temperature at the burn power (fraction per
    °C): how much throughput a power-capped GPU loses per degree. None without speed_at_cap."""
    pts = [(g.temp_c(power_w or g.extra.get("load_power_w", 700.0)), g.extra["speed_at_cap"])
           for g in profile.gpus if g.extra.get("speed_at_cap") is not None]
    if len(pts) < 2:
        return None
    temp, speed = np.array(pts).T
    if np.ptp(temp) < 1.0:
        return None
    slope = np.polyfit(temp, speed, 1)[0]
    return float(-slope / np.mean(speed))

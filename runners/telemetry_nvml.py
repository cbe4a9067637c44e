"""NVML telemetry backend (module ``pynvml`` from the ``nvidia-ml-py`` distribution).

Per device and sample: one batched ``nvmlDeviceGetFieldValues`` (instant power, HBM temperature;
with ``counters=True`` also power/thermal violation ns, slowdown ns, PCIe and NVLink byte
counters) plus temperature, SM and memory clocks, clock-event reasons, utilization and, with
``counters=True``, the energy counter. Measured on 2 × H200, driver 580.159.04 (median µs per
call): power 186 / HBM temp 82 / field 74 2-4, temperature / clocks / reasons / utilization 1-2,
PCIe 197/198 ~130 each, field 75 ~570, NVLink 138/139 all-links ~900-1300 each,
nvmlDeviceGetTotalEnergyConsumption ~3000. Hence the two tiers.

Every field is validated once when the backend opens (each entry's ``nvmlReturn`` must be
NVML_SUCCESS; a call must not raise); what fails reads None from then on, and ``field_status()``
says how each field is read or why not. Field IDs are written out here instead of taken from
pynvml, because their meaning depends on the driver branch, not on the wheel:

- 74 / 75 (PERF_POLICY_POWER / THERMAL, ns) are stable, and are cross-checked against
  ``nvmlDeviceGetViolationStatus``; if a field fails or disagrees, ViolationStatus is used.
- The SW-thermal / HW-thermal / HW-power-brake slowdown counters are 251-253 on R575/R580 drivers
  and 269-271 from R590 (nvidia-ml-py >= 13.590 names 269-271, which on driver 580 are
  power-smoothing fields that return success with 0). They are chosen by
  ``nvmlSystemGetDriverVersion``; drivers older than R575 have neither. On 580.159.04 (H200)
  251-253 return NOT_SUPPORTED and 269-271 return success with 0, so these counters read None
  there until a driver's meaning of 269-271 is confirmed.
- NVLink 138/139 are requested with scopeId UINT_MAX (sum over links, per nvml.h); if the driver
  refuses that, per-link scopes 0..n-1 (n from field 91) are read and summed.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .telemetry_types import COUNTER_FIELDS, DeviceInfo, Sample, TelemetryUnavailable, normalize_pci_bus_id

NVML_SUCCESS = 0
SCOPE_ALL_LINKS = 0xFFFFFFFF

FI_POWER_INSTANT = 186        # mW; scopeId = NVML_POWER_SCOPE_GPU (0)
FI_MEMORY_TEMP = 82           # °C
FI_PERF_POLICY_POWER = 74     # ns
FI_PERF_POLICY_THERMAL = 75   # ns
FI_PCIE_TX_BYTES = 197
FI_PCIE_RX_BYTES = 198
FI_NVLINK_DATA_TX = 138       # KiB
FI_NVLINK_DATA_RX = 139       # KiB
FI_NVLINK_LINK_COUNT = 91
SLOWDOWN_FIELDS = {           # driver major >= key -> (sw_thermal, hw_thermal, hw_power_brake)
    590: (269, 270, 271),
    575: (251, 252, 253),
}
NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL = 0, 1
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 1, 3
NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
VIOLATION_TOLERANCE_NS = 1e8  # field 74/75 vs ViolationStatus, read microseconds apart

_UNION = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def driver_version() -> str | None:
    """The NVIDIA driver version, or None without NVML (for records made with telemetry off)."""
    try:
        import pynvml as nvml

        nvml.nvmlInit()
        try:
            return str(nvml.nvmlSystemGetDriverVersion())
        finally:
            nvml.nvmlShutdown()
    except Exception:
        return None


def slowdown_field_ids(driver_version: str | None) -> tuple[int, int, int] | None:
    """The (sw_thermal, hw_thermal, hw_power_brake) slowdown-ns field IDs for a driver version."""
    try:
        major = int(str(driver_version).split(".")[0])
    except ValueError:
        return None
    for first_major, ids in sorted(SLOWDOWN_FIELDS.items(), reverse=True):
        if major >= first_major:
            return ids
    return None


def _value(fv) -> float | None:
    if fv.nvmlReturn != NVML_SUCCESS:
        return None
    return float(getattr(fv.value, _UNION.get(fv.valueType, "ullVal")))


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


class NvmlBackend:
    name = "nvml"

    def __init__(self):
        try:
            import pynvml
        except ImportError as e:
            raise TelemetryUnavailable(f"nvidia-ml-py is not installed ({e})") from None
        if not hasattr(pynvml, "nvmlDeviceGetFieldValues"):
            raise TelemetryUnavailable("the imported 'pynvml' is not NVIDIA's nvidia-ml-py (too old?)")
        self.nvml = nvml = pynvml
        self.clock: Callable[[], float] = time.time
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise TelemetryUnavailable(f"nvmlInit failed: {e}") from None
        try:
            self.driver_version = str(nvml.nvmlSystemGetDriverVersion())
            n = nvml.nvmlDeviceGetCount()
            if n == 0:
                raise TelemetryUnavailable("NVML found no NVIDIA GPU")
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self._devices = [self._info(i, h) for i, h in enumerate(self._handles)]
            self._plans = [self._validate(h) for h in self._handles]
        except nvml.NVMLError as e:
            nvml.nvmlShutdown()
            raise TelemetryUnavailable(f"NVML device setup failed: {e}") from None
        except BaseException:
            nvml.nvmlShutdown()
            raise

    # -- identity -----------------------------------------------------------------------------
    def _optional(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self.nvml.NVMLError:
            return None

    def _info(self, i: int, h) -> DeviceInfo:
        nvml = self.nvml
        limit_mw = self._optional(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h))
        return DeviceInfo(
            index=i, uuid=str(nvml.nvmlDeviceGetUUID(h)),
            pci_bus_id=normalize_pci_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId),
            name=str(nvml.nvmlDeviceGetName(h)),
            power_limit_w=limit_mw / 1000 if limit_mw is not None else None,
            slowdown_temp_c=self._optional(lambda: nvml.nvmlDeviceGetTemperatureThreshold(
                h, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
            max_operating_temp_c=self._optional(lambda: nvml.nvmlDeviceGetTemperatureThreshold(
                h, NVML_TEMPERATURE_THRESHOLD_GPU_MAX)),
            module_id=self._optional(lambda: nvml.nvmlDeviceGetModuleId(h)))

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    # -- validation ---------------------------------------------------------------------------
    def _validate(self, h) -> dict[str, Any]:
        """Decide once how each Sample field is read on this device. Returns the read plan:
        ``fields``: [(sample field, [(id, scope), ...], scale)] batched into one call (values of a
        multi-entry field are summed), ``calls``: {sample field: fn(h)}, ``status``: field -> text;
        ``fast_*`` are the same without the cumulative counters (COUNTER_FIELDS)."""
        nvml = self.nvml
        status: dict[str, str] = {}
        fields: list[tuple[str, list[tuple[int, int]], float]] = []
        calls: dict[str, Callable] = {}

        def probe(entries: list[tuple[int, int]]) -> tuple[list[float | None], str | None]:
            try:
                fvs = nvml.nvmlDeviceGetFieldValues(h, entries)
            except nvml.NVMLError as e:
                return [None] * len(entries), _err(e)
            vals = [_value(fv) for fv in fvs]
            bad = [f"{e[0]}: nvmlReturn {fv.nvmlReturn}" for e, fv in zip(entries, fvs)
                   if fv.nvmlReturn != NVML_SUCCESS]
            return vals, ("; ".join(bad) or None)

        def add(name: str, entries: list[tuple[int, int]], scale: float, how: str) -> None:
            _, bad = probe(entries)
            if bad:
                status[name] = f"unsupported ({bad})"
            else:
                fields.append((name, entries, scale))
                status[name] = how

        add("power_w", [(FI_POWER_INSTANT, 0)], 1e-3, "field 186 POWER_INSTANT scope GPU (mW)")
        add("mem_temp_c", [(FI_MEMORY_TEMP, 0)], 1.0, "field 82 MEMORY_TEMP")
        for name, fid in (("pcie_tx_bytes", FI_PCIE_TX_BYTES), ("pcie_rx_bytes", FI_PCIE_RX_BYTES)):
            add(name, [(fid, 0)], 1.0, f"field {fid} (cumulative bytes)")

        # NVLink: aggregate scope first, else per-link sum.
        _, agg_bad = probe([(FI_NVLINK_DATA_TX, SCOPE_ALL_LINKS), (FI_NVLINK_DATA_RX, SCOPE_ALL_LINKS)])
        if not agg_bad:
            for name, fid in (("nvlink_tx_bytes", FI_NVLINK_DATA_TX), ("nvlink_rx_bytes", FI_NVLINK_DATA_RX)):
                fields.append((name, [(fid, SCOPE_ALL_LINKS)], 1024.0))
                status[name] = f"field {fid} scope UINT_MAX (all links, KiB)"
        else:
            (n_links,), bad = probe([(FI_NVLINK_LINK_COUNT, 0)])
            n_links = int(n_links or 0)
            for name, fid in (("nvlink_tx_bytes", FI_NVLINK_DATA_TX), ("nvlink_rx_bytes", FI_NVLINK_DATA_RX)):
                if n_links == 0:
                    status[name] = f"unsupported (aggregate: {agg_bad}; link count: {bad or 0})"
                    continue
                add(name, [(fid, link) for link in range(n_links)], 1024.0,
                    f"field {fid} summed over {n_links} link scopes (KiB)")

        # Violation counters: fields 74/75 cross-checked with ViolationStatus.
        for name, fid, policy in (("power_violation_ns", FI_PERF_POLICY_POWER, NVML_PERF_POLICY_POWER),
                                  ("thermal_violation_ns", FI_PERF_POLICY_THERMAL, NVML_PERF_POLICY_THERMAL)):
            (fval,), fbad = probe([(fid, 0)])
            try:
                vs = float(nvml.nvmlDeviceGetViolationStatus(h, policy).violationTime)
                vs_err = None
            except nvml.NVMLError as e:
                vs, vs_err = None, _err(e)
            if not fbad and (vs is None or abs(fval - vs) <= VIOLATION_TOLERANCE_NS + 0.01 * vs):
                fields.append((name, [(fid, 0)], 1.0))
                status[name] = f"field {fid} (ns)" + (", matches ViolationStatus" if vs is not None else "")
            elif vs is not None:
                calls[name] = lambda h, p=policy: float(nvml.nvmlDeviceGetViolationStatus(h, p).violationTime)
                why = fbad or f"field {fid}={fval:.0f} disagrees with ViolationStatus={vs:.0f}"
                status[name] = f"nvmlDeviceGetViolationStatus policy {policy} (ns); {why}"
            else:
                status[name] = f"unsupported (field {fid}: {fbad}; ViolationStatus: {vs_err})"

        # Slowdown counters: IDs depend on the driver branch.
        ids = slowdown_field_ids(self.driver_version)
        for k, name in enumerate(("sw_thermal_slowdown_ns", "hw_thermal_slowdown_ns", "hw_power_brake_ns")):
            if ids is None:
                status[name] = f"unsupported (driver {self.driver_version} predates R575 slowdown counters)"
            else:
                add(name, [(ids[k], 0)], 1.0, f"field {ids[k]} (ns, driver {self.driver_version})")

        # Single calls.
        reasons_fn = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                      or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons"))
        candidates: dict[str, list[tuple[str, Callable]]] = {
            "gpu_temp_c": [
                ("nvmlDeviceGetTemperatureV",
                 lambda h: float(nvml.nvmlDeviceGetTemperatureV(h, NVML_TEMPERATURE_GPU))),
                ("nvmlDeviceGetTemperature",
                 lambda h: float(nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)))],
            "sm_clock_mhz": [("nvmlDeviceGetClockInfo(SM)",
                              lambda h: float(nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)))],
            "mem_clock_mhz": [("nvmlDeviceGetClockInfo(MEM)",
                               lambda h: float(nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM)))],
            "clock_event_reasons": [(reasons_fn.__name__, lambda h: int(reasons_fn(h)))],
            "gpu_util_pct": [("nvmlDeviceGetUtilizationRates",
                              lambda h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu))],
            "energy_j": [("nvmlDeviceGetTotalEnergyConsumption (mJ)",
                          lambda h: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)],
        }
        for name, options in candidates.items():
            errors = []
            for how, fn in options:
                try:
                    fn(h)
                except (nvml.NVMLError, AttributeError) as e:
                    errors.append(f"{how}: {_err(e)}")
                    continue
                calls[name] = fn
                status[name] = how
                break
            else:
                status[name] = "unsupported (" + "; ".join(errors) + ")"
        fast_fields = [f for f in fields if f[0] not in COUNTER_FIELDS]
        return {"fields": fields, "entries": [e for _, es, _ in fields for e in es],
                "calls": calls, "status": status, "fast_fields": fast_fields,
                "fast_entries": [e for _, es, _ in fast_fields for e in es],
                "fast_calls": {k: f for k, f in calls.items() if k not in COUNTER_FIELDS}}

    def field_status(self) -> dict[str, dict[str, str]]:
        return {d.uuid: dict(p["status"]) for d, p in zip(self._devices, self._plans)}

    # -- sampling -----------------------------------------------------------------------------
    def read(self, i: int, counters: bool = True) -> Sample:
        h, plan = self._handles[i], self._plans[i]
        fields, entries_all, calls = ((plan["fields"], plan["entries"], plan["calls"]) if counters else
                                      (plan["fast_fields"], plan["fast_entries"], plan["fast_calls"]))
        s = Sample(t=self.clock())
        if entries_all:
            fvs = self.nvml.nvmlDeviceGetFieldValues(h, entries_all)
            k = 0
            for name, entries, scale in fields:
                vals = [_value(fv) for fv in fvs[k:k + len(entries)]]
                k += len(entries)
                if all(v is not None for v in vals):
                    setattr(s, name, sum(vals) * scale)
        for name, fn in calls.items():
            setattr(s, name, fn(h))
        return s

    def field_latency_us(self, i: int) -> dict[str, float]:
        """latencyUsec that NVML reports for each batched field entry (for the overhead bench)."""
        h, plan = self._handles[i], self._plans[i]
        fvs = self.nvml.nvmlDeviceGetFieldValues(h, plan["entries"])
        out, k = {}, 0
        for name, entries, _ in plan["fields"]:
            out[name] = float(sum(fv.latencyUsec for fv in fvs[k:k + len(entries)]))
            k += len(entries)
        return out

    def close(self) -> None:
        if self._handles is not None:
            self._handles = None
            self.nvml.nvmlShutdown()

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""A stand-in for the ``pynvml`` module (nvidia-ml-py) in front of synthetic GPUs, for the telemetry
contract on CPU.

The GPUs are a ``FakeBackend`` (its docstring is their physics: power ramp to the cap, exact energy
integral, throttle bit 0x4 while capped); this module only speaks NVML to them, as nvidia-ml-py
documents it (nvml.h units and types):

- the error types are nvidia-ml-py's own (``NVMLError(NVML_ERROR_NOT_SUPPORTED)`` is an
  ``NVMLError_NotSupported``), and the structures its own ctypes ones (``c_nvmlFieldValue_t``
  arrays with a per-entry ``nvmlReturn``, ``c_nvmlUtilization_t``, ``c_nvmlViolationTime_t``);
- integer units as the C API returns them: power in mW, energy in mJ, temperatures in °C,
  clocks in MHz, violation / slowdown counters in ns, NVLink data in KiB, PCIe bytes as a 32-bit
  counter that wraps (seen on H100 / H200, runners/telemetry.py ``PCIE_COUNTER_WRAP``);
- driver 580 semantics: slowdown counters at field IDs 251-253; 269-271 return NOT_SUPPORTED here;
- a field the synthetic GPU lacks (``FakeBackend(unsupported=...)``) answers NOT_SUPPORTED: in
  its field-value entry, or raised by the single call, as the library does;
- ``lost=True`` makes every device call raise ``NVMLError_GpuIsLost`` (a GPU fallen off the bus).
"""
from __future__ import annotations

import types

import pynvml as _real

FI = {186: "power_w", 82: "mem_temp_c", 74: "power_violation_ns", 75: "thermal_violation_ns",
      251: "sw_thermal_slowdown_ns", 252: "hw_thermal_slowdown_ns", 253: "hw_power_brake_ns",
      197: "pcie_tx_bytes", 198: "pcie_rx_bytes", 138: "nvlink_tx_bytes", 139: "nvlink_rx_bytes"}
SCALE = {186: 1e3, 138: 1 / 1024, 139: 1 / 1024}  # W -> mW, bytes -> KiB
WRAP = {197: 2 ** 32, 198: 2 ** 32}
SCOPE_ALL_LINKS = 0xFFFFFFFF
VT_UINT, VT_ULL = 1, 3  # NVML_VALUE_TYPE_UNSIGNED_INT / UNSIGNED_LONG_LONG


class FakeNvml:
    """The library state: init count, the synthetic GPUs, and the calls made."""

    def __init__(self, gpus, driver: str = "580.159.04", name: str = "NVIDIA H200"):
        self.gpus, self.driver, self.name = gpus, driver, name
        self.inits = self.shutdowns = 0
        self.lost = False
        self.init_error: int | None = None  # an NVML_ERROR_* nvmlInit raises

    # -- helpers -------------------------------------------------------------------------------
    def _read(self, h: int, field: str):
        if self.lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        return getattr(self.gpus.read(h), field)

    def _call(self, h: int, field: str, convert=int):
        v = self._read(h, field)
        if v is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return convert(v)

    def module(self) -> types.ModuleType:
        """A module object to put in ``sys.modules["pynvml"]``."""
        m = types.ModuleType("pynvml")
        for k, v in vars(_real).items():  # constants, error classes and structures of the real one
            if k.startswith(("NVML_", "NVMLError", "c_nvml")):
                setattr(m, k, v)
        info = self.gpus.devices

        def init():
            if self.init_error is not None:
                raise _real.NVMLError(self.init_error)
            self.inits += 1

        def shutdown():
            self.shutdowns += 1

        def field_values(h, entries):
            if self.lost:
                raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
            s = self.gpus.read(h)
            out = (_real.c_nvmlFieldValue_t * len(entries))()
            for fv, e in zip(out, entries):
                fid, scope = e if isinstance(e, tuple) else (e, 0)
                fv.fieldId, fv.scopeId, fv.latencyUsec = fid, scope, 2
                v = getattr(s, FI[fid]) if fid in FI else None
                if fid in (138, 139) and scope != SCOPE_ALL_LINKS:
                    v = None  # this fake offers the aggregate scope only
                if fid == 91:
                    v = 18
                if v is None:
                    fv.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
                    continue
                v = int(v * SCALE.get(fid, 1.0)) % WRAP.get(fid, 2 ** 64)
                fv.nvmlReturn = _real.NVML_SUCCESS
                if fid in (186, 82, 91):
                    fv.valueType, fv.value.uiVal = VT_UINT, v
                else:
                    fv.valueType, fv.value.ullVal = VT_ULL, v
            return out

        def violation(h, policy):
            field = {0: "power_violation_ns", 1: "thermal_violation_ns"}[policy]
            return _real.c_nvmlViolationTime_t(referenceTime=0, violationTime=self._call(h, field))

        def threshold(h, kind):
            d = info()[h]
            v = {_real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: d.slowdown_temp_c,
                 _real.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: d.max_operating_temp_c}.get(kind)
            if v is None:
                raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
            return int(v)

        def utilization(h):
            return _real.c_nvmlUtilization_t(gpu=self._call(h, "gpu_util_pct"), memory=0)

        m.nvmlInit, m.nvmlShutdown = init, shutdown
        m.nvmlSystemGetDriverVersion = lambda: self.driver
        m.nvmlDeviceGetCount = lambda: len(info())
        m.nvmlDeviceGetHandleByIndex = lambda i: i
        m.nvmlDeviceGetUUID = lambda h: info()[h].uuid
        m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=info()[h].pci_bus_id)
        m.nvmlDeviceGetName = lambda h: self.name
        m.nvmlDeviceGetEnforcedPowerLimit = lambda h: int(info()[h].power_limit_w * 1000)
        m.nvmlDeviceGetTemperatureThreshold = threshold
        m.nvmlDeviceGetModuleId = lambda h: info()[h].module_id
        m.nvmlDeviceGetTemperatureV = lambda h, sensor: self._call(h, "gpu_temp_c")
        m.nvmlDeviceGetTemperature = lambda h, sensor: self._call(h, "gpu_temp_c")
        m.nvmlDeviceGetClockInfo = lambda h, kind: self._call(
            h, {_real.NVML_CLOCK_SM: "sm_clock_mhz", _real.NVML_CLOCK_MEM: "mem_clock_mhz"}[kind])
        m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: self._call(h, "clock_event_reasons")
        m.nvmlDeviceGetUtilizationRates = utilization
        m.nvmlDeviceGetTotalEnergyConsumption = lambda h: self._call(h, "energy_j", lambda j: int(j * 1000))
        m.nvmlDeviceGetViolationStatus = violation
        m.nvmlDeviceGetFieldValues = field_values
        return m

"""Measurement: the megatron-core trial runner (measure, jobs, records, salvage), the command runner,
the simulated runner, GPU telemetry (NVML, AMD SMI) and Ray execution."""

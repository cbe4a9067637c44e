"""The simulated runner: the analytical model plus measurement noise, in the measurement schema.

Stands in for ``advisor.runners.measure`` where there are no GPUs (tests, CI, the tuning bench,
trying a study before spending GPU hours). Every record says ``"simulated": true``. It refuses
what the command runner refuses (``search_spaces.layout.layout_refusal``: a world size that is not
the cluster's, an illegal layout) with a ``refused`` record, and simulates every other layout.

Noise: the step time is multiplied by a log-normal factor exp(N(0, sigma)) drawn once per
(seed, layout) (run-to-run spread; 3% unless measurements say otherwise), and each reported step
by another one (step-to-step spread); power by exp(N(0, sigma / 2)). A layout predicted to need
more than (1 - oom_margin) of the GPU's memory OOMs (the allocator's fragmentation and the
framework's buffers that the model does not see); ``oom_margin=None`` turns that off.

Failure injection (tests): ``inject`` maps a substring of the layout key (``TrainConfig.key()``,
e.g. ``"tp2-pp2"``) to ``"crash"`` (the trial raises), ``"die"`` (the worker process exits),
``"hang"`` (never returns) or ``"skipped"`` (a ``skipped`` record: the runner did not run it). ``delay_s`` makes each trial take that long.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
import socket
import time
import uuid
from typing import Any, Mapping

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig
from advisor.models.predict import predict
from advisor.runners.records import SCHEMA
from advisor.search_spaces.layout import layout_refusal

DEFAULTS = {"sigma": 0.03, "seed": 0, "oom_margin": 0.05, "delay_s": 0.0, "steps": 10, "inject": {}}


def new_record(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, status: str,
               error: str | None = None, runner: str = "simulate") -> dict[str, Any]:
    """A record of the measurement schema with the identity filled and no results."""
    return {
        "schema": SCHEMA, "id": uuid.uuid4().hex[:12], "timestamp": time.time(), "status": status,
        "error": error, "model_name": model.name, "model": model.to_dict(), "layers": model.num_layers,
        "config": cfg.to_dict(),
        "cluster": {"name": cluster.name, "gpu": cluster.gpu.name, "num_nodes": cluster.num_nodes,
                    "gpus_per_node": cluster.gpus_per_node},
        "env": {"hostname": socket.gethostname(), "pid": os.getpid()},
        "stack": None,  # the runner's software stack: none simulated, unknown when a job failed as a whole
        "steps": None, "throughput": None, "memory": None, "telemetry": None,
        "runner": runner, "simulated": runner == "simulate",
    }


def _rng(seed: Any, *parts: str) -> random.Random:
    h = hashlib.sha256("|".join([str(seed), *parts]).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


def run_trial(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, *, timeout_s: float | None = None,
              options: Mapping[str, Any] | None = None, node_rank: int = 0, **_: Any) -> dict[str, Any] | None:
    """Simulate one measurement of `cfg`. Returns the record (None on node ranks > 0): ``refused``
    (one line) for a layout the runners refuse."""
    o = {**DEFAULTS, **(options or {})}
    refused = layout_refusal(model, cfg, cluster.world_size)  # the command runner's rule: legality only
    if refused:
        return None if node_rank else new_record(model, cluster, cfg, "refused", refused, "simulate")
    key = cfg.key()
    for pattern, what in dict(o["inject"]).items():
        if pattern in key:
            if what == "crash":
                raise RuntimeError(f"injected crash for {key}")
            if what == "die":
                os._exit(17)
            if what == "hang":  # short sleeps, like a runner's polling loop: a polite cancel gets in
                while True:
                    time.sleep(0.1)
            if what == "skipped":
                return None if node_rank else new_record(model, cluster, cfg, "skipped",
                                                         "not run: injected", "simulate")
    if o["delay_s"]:
        time.sleep(float(o["delay_s"]))
    if node_rank:
        return None
    p = predict(model, cluster, cfg, check_legal=False)
    cap = cluster.gpu.memory_gib
    rec = new_record(model, cluster, cfg, "ok")
    rng = _rng(o["seed"], model.name, cluster.name, key)
    sigma = float(o["sigma"])
    rec["memory"] = {"max_gib": p.memory_gib_per_gpu * math.exp(rng.gauss(0, 0.01)),
                     "predicted_gib": p.memory_gib_per_gpu}
    margin = o["oom_margin"]
    # the simulated GPU runs out of memory past its real capacity (not the model's usable fraction)
    if p.memory_gib_per_gpu > cap or (margin is not None and p.memory_gib_per_gpu > (1 - float(margin)) * cap):
        rec["status"] = "oom"
        rec["error"] = (f"simulated OOM: {p.memory_gib_per_gpu:.1f} GiB predicted, over "
                        f"{(1 - float(margin or 0)) * 100:.0f}% of {cap:.0f} GiB")
        return rec
    median = p.step_time_s * math.exp(rng.gauss(0, sigma))
    steps = [median * math.exp(rng.gauss(0, sigma)) for _ in range(int(o["steps"]))]
    n = cluster.world_size
    tps = cfg.tokens_per_step / median
    mean_w = min(cluster.power_cap_w, p.mean_power_w * math.exp(rng.gauss(0, sigma / 2)))  # the GPU enforces its cap
    peak_w = max(mean_w, p.peak_power_w * math.exp(rng.gauss(0, sigma / 2)))
    rec["steps"] = {"measured": len(steps), "step_times_s": steps, "median_s": median}
    rec["throughput"] = {"tokens_per_s": tps, "tokens_per_s_per_gpu": tps / n,
                         "tflops_per_gpu": p.tflops_per_gpu * p.step_time_s / median,
                         "mfu": p.mfu * p.step_time_s / median}
    rec["telemetry"] = {"mean_power_w": mean_w, "peak_power_w": peak_w,
                        "energy_per_token_j": mean_w * n * median / cfg.tokens_per_step,
                        # the measurement schema's form: fractions of samples per reason
                        "throttle_fraction": {"any_throttle": min(1.0, p.throttle_risk * 0.1)}}
    return rec


def options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Test knobs from the environment: ADVISOR_SIM_INJECT="tp2-pp2=crash,tp4-pp1=hang",
    ADVISOR_SIM_DELAY_S=0.5, ADVISOR_SIM_SIGMA=0.03, ADVISOR_SIM_SEED=0, ADVISOR_SIM_HOLD_GPUS=1
    (on Ray, hold the GPUs a real trial would instead of one CPU: see ray_exec.cpu_only)."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    if env.get("ADVISOR_SIM_HOLD_GPUS", "").strip() not in ("", "0"):
        out["hold_gpus"] = True
    if env.get("ADVISOR_SIM_INJECT"):
        out["inject"] = dict(part.split("=", 1) for part in env["ADVISOR_SIM_INJECT"].split(",") if "=" in part)
    for var, key, cast in (("ADVISOR_SIM_DELAY_S", "delay_s", float), ("ADVISOR_SIM_SIGMA", "sigma", float),
                           ("ADVISOR_SIM_SEED", "seed", int)):
        if env.get(var):
            out[key] = cast(env[var])
    return out

"""Optuna studies that measure layouts: one study per (model, cluster, workload, objective, runner).

Two objectives: maximize tokens/s/GPU, and minimize peak power (``objective="power"``) or energy
per token (``"energy"``). Three constraints, set with ``trial.set_constraint`` (feasible <= 0):
``memory`` (GiB used / GPU memory - 1; OOM > 0), ``power`` (mean power under load / power cap - 1
- 2% for the sensors' accuracy; the GPU's power limit acts on ~1 s averages, so transient peaks
above it do not count) and ``runs``
(1 when the trial crashed, hung or was refused). The sampler is Optuna's default for
multi-objective studies (TPE in 5.0), which uses these constraints.

Every trial asks Optuna for one layout (``search_spaces.space.optuna_suggest``), then:
  * a layout the analytical model proves does not fit in memory, or one the runner cannot run,
    is told at once (values: 0 tokens/s and the predicted power/energy; constraint violated) and
    never launched;
  * a layout already measured in this study is not run again: the trial copies that trial's
    values (``duplicate_of``), or is PRUNED when that measurement is still in flight;
  * otherwise it is claimed, launched on the executor (Ray), and told when its record comes back.
With ``batch`` > 1, up to that many claimed trials go out as ONE job (the megatron runner measures
them in one torchrun, so start-up is paid once per job instead of once per trial); each trial is
still told from its own record as the job returns. TPE (constant liar) and the surrogate sampler
both see the trials in flight, so the proposals of one batch differ.
The top-K of ``advisor.api.recommend`` are enqueued when the study is created.

Predictions (the seeds' ranking, the ``predicted`` user attribute of every trial, the values of
layouts that are never launched and the surrogate sampler's prior) come from the calibration of
``TuneSettings.calibration`` (``models.calibrate.resolve_calibration``: a file, "default" or None /
"none" for the analytical model with its default constants). Which one is recorded in the study's
user attribute ``calibration`` when the study is created (a study made before this option has
none and loads as before), in each trial's ``predicted`` and in the plan. The memory screen stays
the analytical model's, and the simulated runner's ground truth is the analytical model whatever
the calibration: a calibration changes what the study expects, never what it measures.
``trials`` counts launched measurements in the whole study, so a resumed driver goes on to the
same total.

Resume rule (documented in docs/tune.md). A journal-file study has one driver at a time (an
exclusive ``flock`` on ``<journal>.<study>.lock``, released by the kernel when the driver dies).
A driver starting on it finds the trials left RUNNING by the dead driver: one whose record had
already reached its user attributes is told from that record; any other is marked FAIL and its
parameters are enqueued once (``retry_of``), unless its record is in the study's spool
(``<journal>.<study>.spool.jsonl``, where the runner appends every record the moment its trial
ends): then it is told from that record, so a trial measured in a job the dead driver never saw
return is neither lost nor run again. An RDB study may have several drivers: each in-flight
trial sends Optuna heartbeats, ``optuna.storages.fail_stale_trials`` fails trials whose driver
stopped beating, and the stale-trial callback enqueues their parameters once; layouts are claimed
in an ``advisor_layout_claims`` table (primary key study + layout) so two drivers never measure
the same layout.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.search_spaces.runnable import first_broken_rule, left_out_line
from advisor.search_spaces.space import (SpaceOptions, Workload, enumerate_layouts, layout_key,
                                         layout_params, optuna_space, optuna_suggest)
from advisor.study_storage import (GRACE_S, HEARTBEAT_S, OWN_VALUES, Claims, FileLock, dig, fail_stale,  # noqa: F401
                                   is_url, load_dataset, open_storage, rdb_url, requeue_once, study_pareto,
                                   study_records)

OBJECTIVES = {"power": "peak_power_w", "energy": "energy_j_per_token"}
CONSTRAINTS = ("memory", "power", "runs")
DEFAULT_STORAGE = "advisor-studies.journal"
POWER_TOLERANCE = 0.02  # NVML power readings are +-5 W / a few percent
FAILED_IN_A_ROW = "trials in a row failed"  # TuneResult.stopped when max_failures is reached
INTERRUPTED = "interrupted"  # TuneResult.stopped on SIGINT / SIGTERM, and the status of the trials it cut


@dataclass
class TuneSettings:
    model: str
    cluster: str
    seq: int | None = None
    gbs: int | None = None
    precision: str = "bf16"
    layers: int | None = None  # measure a proxy with this many layers
    trials: int = 24  # launched measurements in the whole study
    batch: int = 1  # trials launched together as one job (one torchrun with the megatron runner)
    timeout_s: float | None = None  # this driver stops launching after this long
    trial_timeout_s: float = 900.0
    runner: str = "simulate"
    objective: str = "power"
    storage: str | None = None  # journal file path or RDB URL
    study_name: str | None = None
    ray_address: str | None = None  # None: local Ray; "inline": no Ray
    dataset: str | None = None
    top_k: int = 4
    seed: int | None = None
    sampler: str = "tpe"  # tpe (Optuna's default) or surrogate (expected improvement on our GP)
    # predictions: None / "none" = the analytical model; "default" = the shipped calibration; a
    # calibration file; or a loaded models.calibrate.Calibration (default: the API's and the CLI's)
    calibration: Any = "default"  # advisor.api.DEFAULT_CALIBRATION (checked equal by the tests)
    power_cap_w: float | None = None
    runner_options: dict = field(default_factory=dict)
    # the megatron runner's software stack: "local" (megatron-core's local layers) or "te"
    # (Transformer Engine layer spec); also the profile the study predicts with
    stack: str = "local"
    kill_grace_s: float = 30.0
    patience: int = 200  # stop after this many asks in a row that launch nothing
    max_failures: int = 5  # stop after this many crashed / timed-out trials in a row (broken setup)


@dataclass
class Plan:
    settings: TuneSettings
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    study_name: str
    storage: str
    dataset: Path | None  # None: records stay in the study only
    layouts: list[TrainConfig]  # every legal layout, as the runner runs it
    space: dict[str, list]
    screened: dict[str, tuple[str, float, str]]  # layout key -> (constraint, violation, reason)
    enqueue: list[TrainConfig]
    calibration: Any = None  # the models.calibrate.Calibration predictions come from; None: analytical
    calibration_info: dict = field(default_factory=dict)  # what calibration_info() says of it
    left_out: str = ""  # the layouts the runner's stack cannot run, left out of the space (one line)

    @property
    def runnable(self) -> int:
        return len(self.layouts) - len(self.screened)

    def to_dict(self) -> dict[str, Any]:
        by = {}
        for c, _, _ in self.screened.values():
            by[c] = by.get(c, 0) + 1
        return {
            "study": self.study_name, "storage": self.storage, "dataset": str(self.dataset),
            "runner": self.settings.runner, "simulated": self.settings.runner == "simulate",
            "model": self.model.name, "cluster": self.cluster.name,
            "workload": {"seq": self.workload.seq, "gbs": self.workload.gbs, "precision": self.workload.precision},
            "objective": self.settings.objective, "trials": self.settings.trials,
            "batch": self.settings.batch,
            "gpus_per_trial": self.cluster.world_size,
            "space": {"layouts": len(self.layouts), "params": {k: v for k, v in self.space.items()},
                      "pruned_by_memory": by.get("memory", 0), "refused_by_runner": by.get("runs", 0),
                      "runnable": self.runnable, "left_out": self.left_out},
            "calibration": self.calibration_info,
            "enqueued": [{"key": layout_key(c), "config": c.to_dict()} for c in self.enqueue],
        }


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")


def default_study_name(model: ModelSpec, cluster: ClusterSpec, wl: Workload, objective: str, runner: str,
                       stack: str = "local") -> str:
    suffix = "-te" if stack == "te" else ""  # local studies keep the names they were stored under
    return f"{model.name}@{cluster.name}-seq{wl.seq}-gbs{wl.gbs}-{wl.precision}-{objective}-{runner}{suffix}"


def calibration_info(spec: Any, cal) -> dict[str, Any]:
    """What the study predicts with, as recorded in the plan, the study's user attributes and the
    summary: the option given (`spec`), the file loaded (None: the analytical model with its
    default constants), its sha256, the level used per target and the files it was fitted on."""
    if spec is None or isinstance(spec, str) and spec.lower() in ("none", "off", "analytical"):
        label = "none"
    elif isinstance(spec, (str, Path)):
        label = str(spec)
    else:  # a loaded Calibration
        label = getattr(spec, "source", "") or "in memory"
    if cal is None:
        return {"spec": label, "file": None, "sha256": None, "levels": None, "trained_on": None}
    digest = None
    if cal.source and Path(cal.source).is_file():
        digest = hashlib.sha256(Path(cal.source).read_bytes()).hexdigest()
    return {"spec": label, "file": cal.source or None, "sha256": digest,
            "levels": {t: v.get("mode") for t, v in cal.targets.items()},
            "trained_on": (cal.trained_on or {}).get("files")}


def calibration_label(info: dict | None) -> str:
    """One phrase for a calibration_info(): 'analytical model' or 'calibration FILE'."""
    if not info:
        return "not recorded (study made before --calibration)"
    if not info.get("file"):
        return "analytical model (default constants)"
    return f"calibration {info['file']}"


def make_plan(s: TuneSettings, options: SpaceOptions = SpaceOptions()) -> Plan:
    """Everything decided before a trial runs: the space, what is screened out, the seeds."""
    from advisor.api import default_workload, recommend, resolve
    from advisor.models.calibrate import resolve_calibration
    from advisor.models.memory import stage_memory
    from advisor.models.profiles import stack_cross_entropy
    from advisor.runners.megatron_args import RUNNER_STACKS
    from advisor.runners.ray_exec import RUNNERS, prepare

    if s.objective not in OBJECTIVES:
        raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)}, got {s.objective!r}")
    if s.runner not in RUNNERS:
        raise SpecError(f"runner must be one of {', '.join(RUNNERS)}, got {s.runner!r}")
    if s.trials < 1:
        raise SpecError("--trials must be at least 1")
    if s.batch < 1:
        raise SpecError("--batch must be at least 1")
    if s.sampler not in ("tpe", "surrogate"):
        raise SpecError(f"--sampler must be tpe or surrogate, got {s.sampler!r}")
    if s.precision not in ("bf16", "fp8"):
        raise SpecError(f"precision must be bf16 or fp8, got {s.precision!r}")
    if s.stack not in RUNNER_STACKS:
        raise SpecError(f"--stack must be one of {', '.join(RUNNER_STACKS)}, got {s.stack!r}")
    # the trials run this project's runner with the stack's layers; an unreadable file is a
    # one-line error, before anything runs
    cal = resolve_calibration(s.calibration, s.stack)
    model, cluster = resolve(s.model, s.cluster, s.power_cap_w)
    if s.layers:
        if s.layers < 1:
            raise SpecError("--layers must be at least 1")
        model = model.with_layers(s.layers)
    wl = default_workload(model, cluster, s.seq, s.gbs, s.precision)
    if options.cross_entropy_impl is None:  # what the stack's runner runs, sampled and seeded alike
        options = replace(options, cross_entropy_impl=stack_cross_entropy(s.stack))
    cap = cluster.gpu.memory_gib
    layouts, screened, seen, left_out = [], {}, set(), {}
    stack = s.stack if s.runner == "megatron" else None  # the stack the runner runs (search_spaces.runnable)
    for cfg in enumerate_layouts(model, cluster, wl, options):
        # Megatron FSDP, which the runner's settings turn off (runners.megatron_args.runner_config):
        # never sampled, counted (search_spaces.runnable.RUNNER_RULES)
        rule = stack and cfg.fsdp and first_broken_rule(model, cfg, stack, runner=True)
        if rule:
            left_out[rule] = left_out.get(rule, 0) + 1
            continue
        cfg, refusal = prepare(s.runner, model, cluster, cfg, s.stack)
        key = layout_key(cfg)
        if key in seen:
            continue
        seen.add(key)
        rule = stack and first_broken_rule(model, cfg, stack)
        if rule:  # never sampled: left out of the space, counted
            left_out[rule] = left_out.get(rule, 0) + 1
            continue
        layouts.append(cfg)
        mem = max(st.total_gib for st in stage_memory(model, cfg, gpu=cluster.gpu))
        if mem > cap:
            screened[key] = ("memory", mem / cap - 1, f"needs {mem:.1f} GiB > {cap:.0f} GiB per GPU")
        elif refusal:
            screened[key] = ("runs", 1.0, f"refused by the {s.runner} runner: {refusal}")
    if not layouts:
        raise SpecError(f"no legal layout of {model.name} on {cluster.name} with seq={wl.seq} gbs={wl.gbs}")
    if len(screened) == len(layouts):
        raise SpecError(f"none of the {len(layouts)} legal layouts of {model.name} on {cluster.name} "
                        f"fits in memory and can be run by the {s.runner} runner")
    enq, keys = [], set()
    for obj, want in (("throughput", s.top_k), ("energy" if s.objective == "energy" else "balanced", s.top_k // 2)):
        got = 0
        for top in (4 * want + 8, len(layouts)):  # the runner may refuse the first ones
            if got >= want:
                break
            try:
                res = recommend(model, cluster, seq=wl.seq, gbs=wl.gbs, precision=wl.precision,
                                top=top, objective=obj, options=options, calibration=cal, stack=s.stack)
            except SpecError:
                break
            for r in res.recommendations:
                cfg = prepare(s.runner, model, cluster, r.config, s.stack)[0]
                k = layout_key(cfg)
                if got < want and k not in screened and k not in keys:
                    keys.add(k)
                    enq.append(cfg)
                    got += 1
    name = s.study_name or default_study_name(model, cluster, wl, s.objective, s.runner, s.stack)
    storage = s.storage or DEFAULT_STORAGE
    dataset = Path(s.dataset or f"data/measurements/tune-{_safe(name)}.jsonl")
    return Plan(s, model, cluster, wl, name, storage, dataset, layouts, optuna_space(layouts), screened, enq,
                cal, calibration_info(s.calibration, cal), left_out_line(stack, left_out) if stack else "")


# --------------------------------------------------------------------------------- the study
@dataclass
class TuneResult:
    plan: Plan
    counts: dict[str, int]
    launched_here: int
    measured: int
    stopped: str
    pareto: list[dict[str, Any]]
    best: dict[str, Any] | None
    elapsed_s: float
    # the study's user attribute `calibration`: what its seeds were ranked with when it was created
    # (None for a study made before --calibration); the plan's `calibration` is this driver's
    study_calibration: dict | None = None

    @property
    def broken(self) -> bool:
        """Stopped because max_failures trials in a row crashed or timed out (a broken set-up)."""
        return FAILED_IN_A_ROW in self.stopped

    def to_dict(self) -> dict[str, Any]:
        return {**self.plan.to_dict(), "study_calibration": self.study_calibration,
                "counts": self.counts, "launched_by_this_driver": self.launched_here,
                "measured": self.measured, "stopped": self.stopped, "elapsed_s": self.elapsed_s,
                "best": self.best, "pareto": self.pareto}


class Tuner:
    """Drives one study; see the module docstring. `run()` returns a TuneResult."""

    def __init__(self, plan: Plan, executor=None, progress: Callable[[dict], None] | None = None,
                 storage=None, stop=None):
        """`stop`: a threading.Event-like object; once set (SIGINT / SIGTERM), the study launches
        nothing more, tells what has come back and marks the trials still in flight interrupted."""
        import optuna

        self.optuna = optuna
        self.plan, self.s = plan, plan.settings
        self.progress = progress
        self.stop = stop
        self.by_key = {layout_key(c): c for c in plan.layouts}
        self.cap_w = plan.cluster.power_cap_w
        self.obj = OBJECTIVES[self.s.objective]
        self.lock, url, self.spool = None, None, None
        if storage is None:
            url = plan.storage if is_url(plan.storage) else None
            if not is_url(plan.storage):
                base = str(Path(plan.storage).expanduser()) + f".{_safe(plan.study_name)}"
                self.lock = FileLock(Path(base + ".lock"))
                self.spool = Path(base + ".spool.jsonl")
            storage = open_storage(plan.storage)
        self.storage = storage
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            self._check_existing(storage)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise
        sampler = self._sampler()
        self.study = optuna.create_study(study_name=plan.study_name, storage=storage, sampler=sampler,
                                         directions=["maximize", "minimize"], load_if_exists=True)
        self._check_attrs()
        self.claims = Claims(url, plan.study_name)
        self.executor = executor
        self.inflight: dict[int, tuple[Any, Any]] = {}  # trial number -> (trial, heartbeat thread)
        self.jobs_inflight = 0  # launches (of up to `batch` trials each) not back yet
        self.launched_here = 0
        self.fail_streak, self.last_error = 0, None
        self._preds: dict[str, Any] = {}

    # -- set-up ------------------------------------------------------------------------------
    def _wanted_attrs(self, have: dict) -> dict:
        """The study attributes this plan needs; a stored, different one is a one-line error."""
        want = {"model": self.plan.model.name, "cluster": self.plan.cluster.name,
                "seq": self.plan.workload.seq, "gbs": self.plan.workload.gbs,
                "precision": self.plan.workload.precision, "objective": self.s.objective,
                "runner": self.s.runner}
        # Two drivers may create the study at the same moment: attributes the other driver has not
        # written yet are missing, not different. Only a stored, different value is a conflict.
        diff = [f"{k}={have[k]!r}" for k, v in want.items() if k in have and have[k] != v]
        if diff:
            raise SpecError(f"study {self.plan.study_name!r} in {self.plan.storage} was made with "
                            f"{', '.join(diff)}; give another --study-name")
        return want

    def _check_existing(self, storage) -> None:
        """Refuse a study made for another workload before create_study writes to its storage."""
        try:
            sid = storage.get_study_id_from_name(self.plan.study_name)
        except KeyError:
            return
        self._wanted_attrs(storage.get_study_user_attrs(sid))

    def _check_attrs(self) -> None:
        have = self.study.user_attrs
        want = self._wanted_attrs(have)
        missing = {k: v for k, v in want.items() if k not in have}
        for k, v in missing.items():
            self.study.set_user_attr(k, v)
        if missing:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
                self.study.set_metric_names(["tokens_per_s_per_gpu", self.obj])

    def _recover(self) -> None:
        """Trials a dead driver left RUNNING (journal) or that stopped beating (RDB)."""
        TS = self.optuna.trial.TrialState
        if self.lock is None:
            fail_stale(self.study)
            return
        spooled = self._spooled()
        for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            rec = t.user_attrs.get("record") or spooled.get(t.user_attrs.get("record_id"))
            trial = self.optuna.trial.Trial(self.study, t._trial_id)
            if rec is not None:
                self._tell_record(trial, rec, append=True)
            else:
                self._fail(trial, stale=True)

    def _fail(self, trial, retry_a_retry: bool = True, **attrs: Any) -> None:
        """A trial that measured nothing: FAIL, with `attrs` saying why, and its parameters
        enqueued once more (not for a trial that is itself a retry, unless `retry_a_retry`)."""
        TS = self.optuna.trial.TrialState
        frozen = self.study._storage.get_trial(trial._trial_id)
        for k, v in attrs.items():
            self.study._storage.set_trial_user_attr(trial._trial_id, k, v)
        self.study.tell(trial, state=TS.FAIL)
        if retry_a_retry or frozen.user_attrs.get("retry_of") is None:
            requeue_once(self.study, frozen)

    def _spooled(self) -> dict[str, dict]:
        """Records in this study's spool, by id (a torn last line, from a kill, is skipped)."""
        from advisor.runners.measure import read_jsonl

        if self.spool is None or not self.spool.exists():
            return {}
        return {r["id"]: r for r in read_jsonl(self.spool) if r.get("id")}

    def _sync_claims_and_dataset(self) -> None:
        TS = self.optuna.trial.TrialState
        ids = set()
        if self.plan.dataset is not None and self.plan.dataset.exists():
            with open(self.plan.dataset, encoding="utf-8") as f:
                for line in f:
                    try:
                        ids.add(json.loads(line).get("id"))
                    except (json.JSONDecodeError, AttributeError):
                        pass
        from advisor.runners.measure import append_jsonl

        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("launched") and t.state in (TS.RUNNING, TS.COMPLETE):
                self.claims.mem.setdefault(t.user_attrs["layout_key"], t.number)
            rec = t.user_attrs.get("record")
            if t.state == TS.COMPLETE and rec is not None and rec.get("id") not in ids and self.plan.dataset is not None:
                append_jsonl(self.plan.dataset, rec)

    def _enqueue_seeds(self) -> None:
        if self.study.get_trials(deepcopy=False):
            return  # a resumed study keeps its seeds, and the calibration recorded with them (or none)
        self.study.set_user_attr("calibration", self.plan.calibration_info)
        what = "analytical top-K" if self.plan.calibration is None else "calibrated top-K"
        for cfg in self.plan.enqueue:
            self.study.enqueue_trial(layout_params(cfg, self.plan.space), user_attrs={"seed": what},
                                     skip_if_exists=True)

    def _sampler(self):
        """TPE (Optuna's default for multi-objective studies), or active learning: expected
        improvement of a GP on the measurements, with the plan's prediction (calibrated, or the
        analytical model's) as its prior."""
        if self.s.sampler == "surrogate":
            from advisor.models.surrogate import SurrogateSampler
            from advisor.search_spaces.space import resolve_params

            space, layouts = self.plan.space, self.plan.layouts
            second = self.obj

            def prior(params):
                p = self.predicted(resolve_params(dict(params), layouts, space))
                return [p.tokens_per_s_per_gpu, getattr(p, second)]

            return SurrogateSampler(candidates=[layout_params(c, space) for c in layouts], prior=prior,
                                    seed=self.s.seed)
        if self.s.sampler != "tpe":
            raise SpecError(f"--sampler must be tpe or surrogate, got {self.s.sampler!r}")
        return self.optuna.samplers.TPESampler(seed=self.s.seed) if self.s.seed is not None else None

    # -- values --------------------------------------------------------------------------------
    def predicted(self, cfg: TrainConfig):
        """The plan's prediction of a layout: the calibration's (every layout of the plan at once,
        the surrogates run once), or the analytical model's."""
        k = layout_key(cfg)
        if k not in self._preds:
            cal = self.plan.calibration
            if cal is None:
                from advisor.models.predict import predict

                self._preds[k] = predict(self.plan.model, self.plan.cluster, cfg, check_legal=False)
            else:
                todo = [] if self._preds else [c for c in self.plan.layouts if layout_key(c) != k]
                for c, p in zip([cfg] + todo, cal.predict_many(self.plan.model, self.plan.cluster, [cfg] + todo,
                                                                check_legal=False)):
                    self._preds[layout_key(c)] = p
        return self._preds[k]

    def _values(self, cfg: TrainConfig, rec: dict | None) -> tuple[list[float], dict[str, float], str]:
        """(values, constraints, where the values come from) for a layout and its record."""
        p = self.predicted(cfg)
        cap = self.plan.cluster.gpu.memory_gib
        pred_obj = p.peak_power_w if self.obj == "peak_power_w" else p.energy_j_per_token
        status = (rec or {}).get("status")
        mem = dig(rec, "memory", "max_gib") or p.memory_gib_per_gpu
        cons = {"memory": mem / cap - 1, "power": p.mean_power_w / self.cap_w - 1 - POWER_TOLERANCE, "runs": 0.0}
        if status == "ok":
            tps = dig(rec, "throughput", "tokens_per_s_per_gpu")
            key = "peak_power_w" if self.obj == "peak_power_w" else "energy_per_token_j"
            obj = dig(rec, "telemetry", key)
            mean_w = dig(rec, "telemetry", "mean_power_w")
            if mean_w:
                cons["power"] = mean_w / self.cap_w - 1 - POWER_TOLERANCE
            if tps and obj:
                return [float(tps), float(obj)], cons, "measured"
            if tps:
                return [float(tps), pred_obj], cons, "measured (power predicted: no telemetry)"
            status = "crash"
        if status == "oom":
            cons["memory"] = max(0.01, p.memory_gib_per_gpu / cap - 1 + 0.01)
        elif status is not None:
            cons["runs"] = 1.0
        return [0.0, pred_obj], cons, "not measured"

    def _tell(self, trial, values, cons, state=None) -> None:
        for k in CONSTRAINTS:
            trial.set_constraint(k, cons[k])
        self.study.tell(trial, values)

    def _tell_record(self, trial, rec: dict, append: bool) -> None:
        cfg = TrainConfig.from_dict(trial.user_attrs.get("layout") or rec["config"])
        rec = {**rec, "study": self.plan.study_name, "trial": trial.number,
               "runner": self.s.runner, "simulated": self.s.runner == "simulate"}
        values, cons, source = self._values(cfg, rec)
        trial.set_user_attr("record", rec)
        trial.set_user_attr("status", rec.get("status"))
        trial.set_user_attr("error", rec.get("error"))
        trial.set_user_attr("values_from", source)
        self._tell(trial, values, cons)
        if append and self.plan.dataset is not None:
            from advisor.runners.measure import append_jsonl

            append_jsonl(self.plan.dataset, rec)

    # -- the loop ------------------------------------------------------------------------------
    def measured(self) -> int:
        TS = self.optuna.trial.TrialState
        return sum(1 for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING, TS.COMPLETE))
                   if t.user_attrs.get("launched"))

    def _owner_state(self, number: int):
        st = self.study._storage
        tid = st.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        return st.get_trial(tid)

    def _propose(self) -> tuple[Any, TrainConfig] | None:
        """Ask for a trial and dispose of it: (trial, layout) when it is to be measured (claimed,
        its heartbeat running, in `inflight`), else None (told or pruned at once)."""
        from optuna.storages._heartbeat import get_heartbeat_thread

        TS = self.optuna.trial.TrialState
        trial = self.study.ask()
        hb = get_heartbeat_thread(trial._trial_id, self.study._storage)
        hb.start()
        try:
            cfg = optuna_suggest(trial, self.plan.layouts, self.plan.space)
            key = layout_key(cfg)
            p = self.predicted(cfg)
            trial.set_user_attr("predicted", {"tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                                              "peak_power_w": p.peak_power_w, "mean_power_w": p.mean_power_w,
                                              "energy_j_per_token": p.energy_j_per_token,
                                              "memory_gib_per_gpu": p.memory_gib_per_gpu,
                                              "calibration": self.plan.calibration_info.get("file")})
            if key in self.plan.screened:
                what, violation, reason = self.plan.screened[key]
                values, cons, _ = self._values(cfg, None)
                cons[what] = max(cons[what], violation, 0.01)
                trial.set_user_attr("status", "infeasible" if what == "memory" else "refused")
                trial.set_user_attr("error", reason)
                self._tell(trial, values, cons)
                return None
            owner = self.claims.claim(key, trial.number)
            if owner != trial.number:
                o = self._owner_state(owner)
                if o.state == TS.COMPLETE:
                    trial.set_user_attr("duplicate_of", owner)
                    trial.set_user_attr("status", o.user_attrs.get("status"))
                    self._tell(trial, list(o.values), dict(o.constraints))
                    return None
                if o.state == TS.RUNNING or not self.claims.take_over(key, owner, trial.number):
                    trial.set_user_attr("duplicate_of", owner)
                    self.study.tell(trial, state=TS.PRUNED)
                    return None
            trial.set_user_attr("launched", True)
            trial.set_user_attr("runner", self.s.runner)
            trial.set_user_attr("record_id", f"t{trial.number}-{uuid.uuid4().hex[:8]}")
            self.inflight[trial.number] = (trial, hb)
            return trial, cfg
        finally:
            if trial.number not in self.inflight:
                hb.join()

    def _launch(self, picked: list[tuple[Any, TrainConfig]]) -> None:
        """One job for the proposed trials (one torchrun with the megatron runner)."""
        from advisor.runners.ray_exec import Job

        opts = dict(self.s.runner_options)
        if self.s.runner != "simulate":  # the stack the runner runs: the built-in one's, or the user's command's
            opts["stack"] = self.s.stack
        if self.spool is not None and self.s.runner != "simulate":
            opts["spool"] = str(self.spool.resolve())
        trials = [t for t, _ in picked]
        self.executor.submit(Job(trials, self.s.runner, self.plan.model, self.plan.cluster, [c for _, c in picked],
                                 self.s.trial_timeout_s, opts, ids=[t.user_attrs["record_id"] for t in trials]))
        self.jobs_inflight += 1
        self.launched_here += len(picked)

    def _start_batch(self, idle: int) -> int:
        """Propose until `batch` trials are to be measured (or the study's target, the space or the
        patience runs out), launch them as one job; the new count of idle proposals."""
        want = min(self.s.batch, self.s.trials - self.measured())
        picked: list[tuple[Any, TrainConfig]] = []
        while len(picked) < want and idle < self.s.patience:
            got = self._propose()
            if got is None:
                idle += 1
            else:
                idle = 0
                picked.append(got)
            if len(self.claims_taken()) >= self.plan.runnable:
                break
        if picked:
            self._launch(picked)
        return idle

    def _finish(self, job) -> None:
        from advisor.runners.ray_exec import failure_records

        self.jobs_inflight -= 1
        spooled = None
        results = job.results or failure_records(job, "crash", "the job returned no records")
        for tag, rec in zip(job.tags, results):
            if rec.get("status") in ("crash", "timeout", "killed"):
                # The job as a whole failed (cancelled, worker died): what the runner measured
                # before that is in the spool.
                spooled = self._spooled() if spooled is None else spooled
                rec = spooled.get(tag.user_attrs.get("record_id")) or rec
            st = rec.get("status")
            trial, hb = self.inflight.pop(tag.number)
            if st in ("crash", "killed") and self.stop is not None and self.stop.is_set():
                st = INTERRUPTED  # Ctrl-C reaches the job's processes too: not a failure of the layout
            if st in ("skipped", INTERRUPTED):
                # Never ran (the runner gave up on the rest of its batch after repeated hangs):
                # not a measurement of this layout. Failed, and its parameters enqueued once more
                # (not again for a retry, so a layout that keeps being skipped cannot loop).
                try:
                    self._fail(trial, retry_a_retry=st == INTERRUPTED, status=st, error=rec.get("error"))
                finally:
                    hb.join()
                self._report(trial)
                continue
            self.fail_streak = self.fail_streak + 1 if st in ("crash", "timeout", "killed") else 0
            self.last_error = rec.get("error")
            try:
                self._tell_record(trial, rec, append=True)
            finally:
                hb.join()
            self._report(trial)

    def _best(self) -> dict | None:
        front = self.pareto()
        return max(front, key=lambda r: r["tokens_per_s_per_gpu"]) if front else None

    def finished(self) -> int:
        """Launched trials told from their record (the records in the dataset; in-flight ones not)."""
        TS = self.optuna.trial.TrialState
        return sum(1 for t in self.study.get_trials(deepcopy=False, states=(TS.COMPLETE,))
                   if t.user_attrs.get("launched"))

    def _report(self, trial=None) -> None:
        if self.progress is not None:
            done = self.finished()
            # a resumed study may hold more than --trials asks for: the bar says done/done
            self.progress({"measured": done, "target": max(self.s.trials, done), "best": self._best(),
                           "trial": trial.number if trial is not None else None,
                           "status": trial.user_attrs.get("status") if trial is not None else None})

    def pareto(self) -> list[dict[str, Any]]:
        return study_pareto(self.study, self.obj)

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("duplicate_of") is not None:
                k = "duplicate"
            else:
                k = t.user_attrs.get("status") or t.state.name.lower()
            c[k] = c.get(k, 0) + 1
        return c

    def run(self) -> TuneResult:
        t0 = time.time()
        stopped = "trials"
        try:
            self._recover()
            self._sync_claims_and_dataset()
            self._enqueue_seeds()
            from advisor.runners.ray_exec import cpu_only

            sim_cpu = cpu_only(self.s.runner, self.s.runner_options)
            slots = self.executor.slots(self.plan.cluster, cpu_only=sim_cpu)
            if slots < 1:
                c = self.plan.cluster
                raise SpecError("the Ray cluster has no CPU for a simulated trial" if sim_cpu else
                                f"the Ray cluster has no room for one trial of {c.world_size} GPUs "
                                f"({c.num_nodes} node(s) x {c.gpus_per_node}); --runner simulate needs no GPU")
            idle, last_stale_check = 0, time.time()
            self._report()
            while True:
                measured = self.measured()
                if self.stop is not None and self.stop.is_set():
                    for job in self.executor.wait(0.0):  # what came back is told, not abandoned
                        self._finish(job)
                    stopped = INTERRUPTED
                    self._abandon(interrupted=True)
                    self._report()
                    break
                if self.s.timeout_s is not None and time.time() - t0 > self.s.timeout_s:
                    stopped = "timeout"
                elif len(self.claims_taken()) >= self.plan.runnable:
                    stopped = "space exhausted"
                elif self.fail_streak >= self.s.max_failures:
                    stopped = f"{self.fail_streak} {FAILED_IN_A_ROW} (last: {self.last_error})"
                elif idle >= self.s.patience:
                    stopped = f"{idle} proposals in a row were measured or infeasible layouts"
                elif measured >= self.s.trials:
                    stopped = "trials"
                else:
                    stopped = ""
                if not stopped and self.jobs_inflight < slots:
                    idle = self._start_batch(idle)
                    continue
                if not self.inflight:
                    break
                for job in self.executor.wait(1.0):
                    self._finish(job)
                if self.lock is None and time.time() - last_stale_check > HEARTBEAT_S:
                    fail_stale(self.study)
                    last_stale_check = time.time()
        except BaseException:
            self._abandon()
            raise
        finally:
            self.executor.shutdown()
            self.claims.close()
            if self.lock is not None:
                self.lock.release()
        return TuneResult(self.plan, self.counts(), self.launched_here, self.measured(), stopped,
                          self.pareto(), self._best(), time.time() - t0, self.study.user_attrs.get("calibration"))

    def claims_taken(self) -> set[str]:
        TS = self.optuna.trial.TrialState
        return {t.user_attrs["layout_key"] for t in self.study.get_trials(deepcopy=False, states=(TS.RUNNING, TS.COMPLETE))
                if t.user_attrs.get("launched")}

    def _abandon(self, interrupted: bool = False) -> None:
        """Interrupted: in-flight trials whose record is in the spool are told from it; the others
        are failed and enqueued once again (the resume rule). `interrupted` (a stop the user
        asked for): their status is 'interrupted', not a failure of the layout."""
        try:
            spooled = self._spooled()
        except Exception:  # noqa: BLE001 - best effort
            spooled = {}
        for trial, hb in list(self.inflight.values()):
            try:
                hb.join()
                rec = spooled.get(trial.user_attrs.get("record_id"))
                if rec is not None:
                    self._tell_record(trial, rec, append=True)
                    continue
                self._fail(trial, **({"status": INTERRUPTED} if interrupted else {"stale": True}))
            except Exception:  # noqa: BLE001 - best effort; the next driver's recovery does the same
                pass
        self.inflight.clear()
        self.jobs_inflight = 0


def run_study(settings: TuneSettings, progress: Callable[[dict], None] | None = None, executor=None,
              storage=None, plan: Plan | None = None, stop=None) -> TuneResult:
    """Plan (unless given make_plan's plan of these settings), open the study and run it (Ray at
    settings.ray_address unless given an executor)."""
    from advisor.runners.ray_exec import make_executor

    plan = plan or make_plan(settings)
    if storage is None:  # paths checked before the study opens (advisor.validate): one error line
        from advisor.validate import study_paths

        study_paths(plan.storage, plan.dataset)
    tuner = Tuner(plan, None, progress, storage, stop)
    try:
        tuner.executor = executor or make_executor(settings.ray_address, settings.kill_grace_s)
    except BaseException:
        if tuner.lock is not None:
            tuner.lock.release()
        raise
    return tuner.run()

"""Where `advisor tune` studies live: Optuna storages (journal file or RDB URL), the one-driver lock
of a journal study, the layout claims of several drivers, and the measurement records read back."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from advisor.catalog.specs import SpecError

__all__ = [
    "HEARTBEAT_S", "GRACE_S", "OWN_VALUES", "is_url", "fail_stale", "requeue_once", "rdb_url", "open_storage",
    "redact", "open_study_storage", "study_records", "load_dataset", "FileLock", "Claims", "dig", "study_pareto",
]

# RDB heartbeats of in-flight trials (Optuna's): interval and how long a silent trial lives on.
HEARTBEAT_S = int(os.environ.get("ADVISOR_TUNE_HEARTBEAT_S", "20"))
GRACE_S = int(os.environ.get("ADVISOR_TUNE_GRACE_S", "60"))


def is_url(storage: str) -> bool:
    return "://" in storage


def fail_stale(study) -> None:
    """RDB: fail trials whose driver stopped sending heartbeats (the callback re-enqueues them)."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def requeue_once(study, trial) -> None:
    """Enqueue the parameters of a trial its driver left unfinished (one retry per such trial)."""
    if trial.params:
        study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number})


def rdb_url(url: str) -> str:
    """SQLAlchemy 2.1 reads postgresql:// as psycopg 3; use psycopg2 when only it is installed."""
    if url.startswith("postgresql://"):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def open_storage(storage: str):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if is_url(storage):
        import sqlalchemy as sa

        for attempt in range(5):
            try:
                return optuna.storages.RDBStorage(
                    rdb_url(storage), heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=requeue_once, engine_kwargs={"pool_pre_ping": True})
            except sa.exc.SQLAlchemyError:  # two drivers creating the schema of a new database at once
                if attempt == 4:
                    raise
                time.sleep(0.5 + attempt)
    Path(storage).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(Path(storage).expanduser())))


# ------------------------------------------------------------------------------------------------
# records of `advisor tune` studies (Optuna journal file or RDB URL)
# ------------------------------------------------------------------------------------------------

# values_from of a trial told from its own record (Tuner._values: measured, or its failure)
OWN_VALUES = ("measured", "not measured")


def redact(url: str) -> str:
    """An RDB URL without its password."""
    return re.sub(r"://([^:/@]+):[^@/]*@", r"://\1:***@", url)


def open_study_storage(storage: str):
    import optuna

    from advisor.models.dataset import DatasetError

    if is_url(storage):
        if storage.startswith("sqlite:///") and not Path(storage[len("sqlite:///"):]).is_file():
            raise DatasetError(f"{storage}: no such file")
        try:
            return optuna.storages.RDBStorage(rdb_url(storage))
        except Exception as e:  # noqa: BLE001 - driver, network or schema: one line for the user
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise DatasetError(f"{redact(storage)}: cannot open the study storage ({type(e).__name__}"
                               f"{': ' + msg if msg else ''})") from None
    p = Path(storage).expanduser()
    if not p.is_file():
        raise DatasetError(f"{p}: no such study journal file")
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    try:
        return JournalStorage(JournalFileBackend(str(p)))
    except Exception as e:  # noqa: BLE001 - a corrupt journal is a bad file
        raise DatasetError(f"{p}: not an Optuna journal file ({type(e).__name__})") from None


def study_records(storage: str, study_name: str | None = None) -> tuple[list[tuple[str, dict]], list[dict]]:
    """The measurement records of the trials of `advisor tune` studies in `storage` (a journal
    file or an RDB URL; every study in it, or only `study_name`): ([(source, record)], one info
    dict per study for Dataset.files). The tune driver keeps each measured trial's full record
    in the trial's user attribute "record"; a trial whose values were copied from another trial
    (a duplicate layout: "duplicate_of", or values_from other than its own measurement) is left
    out, so that no measurement counts twice."""
    import optuna

    from advisor.models.dataset import DatasetError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = open_study_storage(storage)
    remote = is_url(storage)
    label = redact(storage) if remote else Path(storage).name
    shown = redact(storage) if remote else str(Path(storage).expanduser())
    try:
        summaries = st.get_all_studies()
    except Exception as e:  # noqa: BLE001
        raise DatasetError(f"{shown}: cannot read its studies ({type(e).__name__})") from None
    names = [s.study_name for s in summaries]
    if study_name is not None:
        if study_name not in names:
            raise DatasetError(f"{shown}: no study named {study_name!r} (studies: {', '.join(names) or 'none'})")
        summaries = [s for s in summaries if s.study_name == study_name]
    if not summaries:
        raise DatasetError(f"{shown}: no study in this storage")
    raw = Path(storage).expanduser().read_bytes() if not remote else b""
    out: list[tuple[str, dict]] = []
    infos = []
    for s in summaries:
        trials = st.get_all_trials(s._study_id, deepcopy=False)
        tag = label if len(names) == 1 else f"{label}[{s.study_name}]"
        recs, copied = [], 0
        for t in trials:
            rec = t.user_attrs.get("record")
            if rec is None:
                continue
            vf = t.user_attrs.get("values_from")
            own = vf is None or (isinstance(vf, str) and vf.startswith(OWN_VALUES))
            if t.user_attrs.get("duplicate_of") is not None or not own:
                copied += 1
                continue
            recs.append((f"{tag}:trial {t.number}", rec))
        copied += sum(1 for t in trials if t.user_attrs.get("record") is None
                      and t.user_attrs.get("duplicate_of") is not None)
        digest = hashlib.sha256(raw if raw else json.dumps([r for _, r in recs], sort_keys=True,
                                                            default=str).encode()).hexdigest()
        infos.append({"path": shown, "study": s.study_name, "sha256": digest, "lines": len(recs),
                      "trials": len(trials), "copied": copied})
        out.extend(recs)
    return out, infos


def load_dataset(paths=(), studies=(), study_name: str | None = None):
    """models.dataset.load on measurement JSONL files plus the records of `advisor tune` studies
    (journal files or RDB URLs; every study in each, or only `study_name`)."""
    from advisor.models import dataset

    recs, infos = [], []
    for storage in studies:
        r, i = study_records(storage, study_name)
        recs += r
        infos += i
    return dataset.load(paths, records=recs, sources=infos)


class FileLock:
    """One driver per journal study: an exclusive flock, released by the kernel if we die."""

    def __init__(self, path: Path):
        import fcntl

        self.path = path
        self.f = open(path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            who = self.f.read().strip() or "another process"
            self.f.close()
            raise SpecError(f"study is being run by another driver ({who}); wait for it, or use a "
                            f"PostgreSQL --storage for several drivers") from None
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        self.f.flush()

    def release(self) -> None:
        """Remove the lock file while still holding the lock, then let go (a driver that opened
        it meanwhile fails its non-blocking flock: it never waits for this inode)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.f.close()


class Claims:
    """Which trial measures which layout. In memory for a single driver; a table for RDB."""

    def __init__(self, url: str | None, study_name: str):
        self.mem: dict[str, int] = {}
        self.study_name = study_name
        self.engine = None
        if url:
            import sqlalchemy as sa

            self.sa = sa
            self.engine = sa.create_engine(rdb_url(url), pool_pre_ping=True)
            meta = sa.MetaData()
            self.table = sa.Table("advisor_layout_claims", meta,
                                  sa.Column("study_name", sa.String(512), primary_key=True),
                                  sa.Column("layout_key", sa.String(512), primary_key=True),
                                  sa.Column("trial_number", sa.Integer, nullable=False))
            try:
                meta.create_all(self.engine)
            except sa.exc.SQLAlchemyError:  # created by another driver at the same moment
                pass

    def claim(self, key: str, number: int) -> int:
        """Claim `key` for trial `number`; returns the owner (`number` when the claim is ours)."""
        if self.engine is None:
            return self.mem.setdefault(key, number)
        sa, t = self.sa, self.table
        try:
            with self.engine.begin() as c:
                c.execute(t.insert().values(study_name=self.study_name, layout_key=key, trial_number=number))
            return number
        except sa.exc.IntegrityError:
            with self.engine.begin() as c:
                return c.execute(sa.select(t.c.trial_number).where(
                    (t.c.study_name == self.study_name) & (t.c.layout_key == key))).scalar_one()

    def take_over(self, key: str, old: int, new: int) -> bool:
        """Move the claim from a trial that will never finish; False if someone else did first."""
        if self.engine is None:
            if self.mem.get(key) == old:
                self.mem[key] = new
                return True
            return False
        t = self.table
        with self.engine.begin() as c:
            r = c.execute(t.update().where((t.c.study_name == self.study_name) & (t.c.layout_key == key)
                                           & (t.c.trial_number == old)).values(trial_number=new))
            return r.rowcount == 1

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()


def dig(d: dict | None, *path: str) -> Any:
    """d[path[0]][path[1]]...; None where a level is missing or not a dict."""
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def study_pareto(study, obj: str) -> list[dict[str, Any]]:
    """The Pareto front of a study's launched trials (one row per layout, fastest first); `obj`:
    the second objective's key (OBJECTIVES)."""
    out, seen = [], set()
    for t in sorted(study.best_trials, key=lambda t: (-t.values[0], t.values[1], t.number)):
        k = t.user_attrs.get("layout_key")
        if k in seen or not t.user_attrs.get("launched"):
            continue
        seen.add(k)
        rec = t.user_attrs.get("record") or {}
        out.append({"trial": t.number, "key": k, "config": t.user_attrs.get("layout"),
                    "tokens_per_s_per_gpu": t.values[0], obj: t.values[1],
                    "memory_gib": dig(rec, "memory", "max_gib"),
                    "mean_power_w": dig(rec, "telemetry", "mean_power_w"),
                    "status": t.user_attrs.get("status"),
                    "predicted_tokens_per_s_per_gpu": dig(t.user_attrs, "predicted", "tokens_per_s_per_gpu")})
    return out

"""`advisor fit --study`: the measurement records an `advisor tune` study keeps in its trials'
user attributes (journal file or RDB URL), alone or with --data, each measurement counted once."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.models import calibrate as C
from advisor.models import dataset as D
from advisor import study as S
from advisor.study_storage import redact

ROOT = Path(__file__).resolve().parents[1]
JOURNAL = ROOT / "data" / "studies" / "llama3-8b-h200x4.journal"
TUNE_JSONL = ROOT / "data" / "measurements" / "tune-llama3-8b-h200x4.jsonl"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    from advisor.models.constants import DEFAULT

    cases = D.simulated_cases(("llama3-8b", "nemotron4-15b"), per_model=4)
    return D.simulate_records(cases, DEFAULT, noise=0.02)


def fill(storage, records: list[dict], name: str = "s") -> None:
    """A study as the tune driver leaves it: trials told from their own records, a duplicate
    layout told from its owner's values (with and without a copy of the record), a refused
    layout, a timed-out trial."""
    import optuna
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=storage, directions=["maximize", "minimize"])

    def add(values, **attrs):
        study.add_trial(create_trial(values=values, user_attrs=attrs))

    for i, r in enumerate(records):
        add([r["throughput"]["tokens_per_s_per_gpu"], 1.0], record={**r, "trial": i}, status="ok",
            values_from="measured", launched=True)
    add([1.0, 1.0], duplicate_of=0, status="ok")  # duplicate layout: the owner's values, no record
    add([1.0, 1.0], duplicate_of=1, status="ok", record=records[1])  # ... even carrying the record
    add([1.0, 1.0], values_from="copied from trial 2", status="ok", record=records[2])
    add([0.0, 1.0], status="refused", error="does not fit")  # screened: no record
    timeout = {**copy.deepcopy(records[0]), "id": "t-timeout", "status": "timeout", "throughput": None}
    add([0.0, 1.0], record=timeout, status="timeout", values_from="not measured", launched=True)


def journal(tmp_path, records, names=("s",)) -> str:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = tmp_path / "study.journal"
    st = JournalStorage(JournalFileBackend(str(path)))
    for n in names:
        fill(st, records, n)
    return str(path)


def test_study_records_count_each_measurement_once(tmp_path, records):
    path = journal(tmp_path, records)
    ds = S.load_dataset(studies=[path])
    assert len(ds) == len(records) and not ds.rejected
    assert ds.skipped == {"timeout": 1}
    assert ds.duplicates == 0
    assert sorted(r.id for r in ds.records) == sorted(r["id"] for r in records)
    assert ds.records[0].source == "study.journal:trial 0"
    info = ds.files[0]
    assert info["study"] == "s" and info["trials"] == len(records) + 5 and info["copied"] == 3
    assert len(info["sha256"]) == 64
    assert f"with their own record, 3 duplicates of another trial left out): {len(records)} usable" in ds.summary()
    # the same records in a JSONL file too (the tune driver appends them to its dataset): once
    jl = tmp_path / "tune.jsonl"
    jl.write_text(D.records_to_jsonl(records))
    both = S.load_dataset([str(jl)], studies=[path])
    assert len(both) == len(records) and both.duplicates == len(records)
    assert f"{len(records)} duplicate(s) of records read before" in both.summary()


def test_study_name_selects_one_study_of_several(tmp_path, records):
    path = journal(tmp_path, records[:4], names=("a", "b"))
    assert len(S.load_dataset(studies=[path])) == 4  # the same records in both studies: counted once
    ds = S.load_dataset(studies=[path], study_name="b")
    assert len(ds) == 4 and ds.records[0].source.startswith("study.journal[b]:trial ")
    with pytest.raises(D.DatasetError, match="no study named 'c' \\(studies: a, b\\)"):
        S.load_dataset(studies=[path], study_name="c")
    with pytest.raises(D.DatasetError, match="no such study journal file"):
        S.load_dataset(studies=[str(tmp_path / "none.journal")])


def test_study_in_an_rdb_url(tmp_path, records):
    import optuna

    url = f"sqlite:///{tmp_path / 'study.db'}"
    fill(optuna.storages.RDBStorage(url), records)
    ds = S.load_dataset(studies=[url])
    assert len(ds) == len(records) and ds.skipped == {"timeout": 1}
    assert ds.files[0]["path"] == url and ds.records[0].source == f"{url}:trial 0"
    with pytest.raises(D.DatasetError, match="no such file"):
        S.load_dataset(studies=[f"sqlite:///{tmp_path / 'none.db'}"])
    assert redact("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"


def test_cli_fit_on_a_study_alone_and_with_data(tmp_path, records):
    path = journal(tmp_path, records)
    out = tmp_path / "cal.joblib"
    r = run_cli("fit", "--study", path, "-o", str(out), "--folds", "2", "--no-surrogates")
    assert r.returncode == 0, r.stderr
    assert f"{len(records)} usable" in r.stderr and "timeout 1" in r.stderr
    cal = C.Calibration.load(out)
    assert cal.trained_on["n_rows"] == len(records)
    assert cal.trained_on["files"] == [f"{path} (study s)"]
    # the profile it produced is named (the file holds it; --calibration prints it back)
    assert cal.profile == "custom"
    assert r.stdout.splitlines()[-1] == f"wrote {out} (and {out.with_suffix('.json')}): profile custom"
    jl = tmp_path / "more.jsonl"
    jl.write_text(D.records_to_jsonl(records[:3]))
    r = run_cli("fit", "--data", str(jl), "--study", path, "-o", str(out), "--folds", "2", "--no-surrogates",
                "--profile-name", "h200-lab", "--json")
    assert r.returncode == 0, r.stderr
    assert "3 duplicate(s) of records read before" in r.stderr
    assert C.Calibration.load(out).trained_on["n_rows"] == len(records)
    assert json.loads(r.stdout)["profile"] == "h200-lab" == C.Calibration.load(out).profile


def test_cli_fit_study_errors_are_one_line(tmp_path):
    for args, needle in [((), "give measurements: --data FILE.jsonl and/or --study"),
                         (("--study", str(tmp_path / "x.journal")), "no such study journal file"),
                         (("--data", str(TUNE_JSONL), "--study-name", "x"), "--study-name needs --study")]:
        r = run_cli("fit", *args, "-o", str(tmp_path / "c.joblib"))
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and needle in r.stderr, r.stderr


def test_committed_study_gives_its_24_measured_trials():
    ds = S.load_dataset(studies=[str(JOURNAL)])
    assert len(ds) == 23 and ds.skipped == {"timeout": 1} and not ds.rejected  # 24 measured trials
    assert ds.files[0]["trials"] == 72 and ds.files[0]["lines"] == 24
    # its records are also in the tune JSONL: counted once
    both = S.load_dataset([str(TUNE_JSONL)], studies=[str(JOURNAL)])
    assert len(both) == 23 and both.duplicates == 24


@pytest.mark.slow
def test_cli_fit_on_the_committed_study(tmp_path):
    out = tmp_path / "x.joblib"
    r = run_cli("fit", "--study", str(JOURNAL), "-o", str(out), "--no-surrogates", "--folds", "3")
    assert r.returncode == 0, r.stderr
    assert "72 trials in 1 study (24 with their own record, 35 duplicates of another trial left out): " \
           "23 usable" in r.stderr
    assert C.Calibration.load(out).trained_on["n_rows"] == 23
    assert json.loads((tmp_path / "x.json").read_text())["trained_on"]["skipped"] == {"timeout": 1}

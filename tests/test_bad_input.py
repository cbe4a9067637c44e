"""Bad input across every command (advisor.validate): one `error:` line on stderr, exit 2, no
traceback, in under 5 s each; predict --batch answers every line; and nothing the user measured
(a study's journal and dataset, a measurement file, a trace) is touched by any of it."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "data" / "profiles" / "h200x4-burn.json"
TRACE = ROOT / "data" / "traces" / "h100x1-00.trace.json.gz"
MEASURED = ROOT / "data" / "measurements" / "h100x1-campaign.jsonl"


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 120):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, input=stdin,
                       timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})
    p.wall_s = time.perf_counter() - t0
    return p


def _read_only_dir(base: Path) -> Path | None:
    """A folder this process cannot create files in: chmod 555 for a normal user; root ignores
    permission bits, so for root a sysfs folder (creating files there fails even for root)."""
    d = base / "ro"
    d.mkdir()
    d.chmod(0o555)
    for cand in ([d] if os.geteuid() != 0 else []) + [Path("/sys/kernel")]:
        try:
            fd, tmp = tempfile.mkstemp(dir=cand)
        except OSError:
            return cand
        os.close(fd)
        os.unlink(tmp)
    return None


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs for the table: a real study (journal + dataset) the bad inputs point at, HF configs
    and cluster YAML with bad numbers, a folder, a compressed file, a read-only folder."""
    t = tmp_path_factory.mktemp("bad")
    journal, dataset = t / "study.journal", t / "study.jsonl"
    r = run_cli("tune", "-m", "llama3-8b", "-c", "h100x8", "--layers", "2", "--runner", "simulate",
                "--ray-address", "inline", "--trials", "4", "--seed", "0", "--storage", str(journal),
                "--dataset", str(dataset), "--json")
    assert r.returncode == 0, r.stderr
    hf = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
          "vocab_size": 32000, "intermediate_size": 11008}
    for name, change in (("hf_frac", {"num_hidden_layers": 32.5}), ("hf_bool", {"num_hidden_layers": True}),
                         ("hf_heads", {"num_attention_heads": "32"}), ("hf_tie", {"tie_word_embeddings": 1}),
                         ("hf_hdim", {"hidden_size": 4095})):
        (t / f"{name}.json").write_text(json.dumps({**hf, **change}))
    (t / "inf.yaml").write_text("name: c\ngpu: h100\nnodes: 2\nintra_node_bw_gbs: .inf\n")
    (t / "nan.yaml").write_text("name: c\ngpu: h100\nnodes: 2\ninter_node_bw_gbs: .nan\n")
    (t / "storage.yaml").write_text("name: c\ngpu: h100\nnodes: 2\nstorage_bw_gbs: -1\n")
    (t / "dir").mkdir()
    with gzip.open(t / "lines.jsonl.gz", "wt") as f:
        f.write('{"model": "llama3-8b", "cluster": "h100x8"}\n')
    shutil.copy(dataset, t / "cal.json")  # measurements named like a calibration's summary
    out = {k: str(t / k) for k in ("dir", "missing")}
    out.update(inf_yaml=str(t / "inf.yaml"), nan_yaml=str(t / "nan.yaml"), storage_yaml=str(t / "storage.yaml"))
    out.update({k: str(t / f"{k}.json") for k in ("hf_frac", "hf_bool", "hf_heads", "hf_tie", "hf_hdim")})
    ro = _read_only_dir(t)
    out.update(tmp=str(t), journal=str(journal), dataset=str(dataset), gz=str(t / "lines.jsonl.gz"),
               caljson=str(t / "cal.json"), ro=str(ro) if ro else None, profile=str(PROFILE), trace=str(TRACE))
    out["hashes"] = {p: _sha(Path(p)) for p in (journal, dataset, t / "cal.json", TRACE, MEASURED, PROFILE)}
    return out


def _has(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


R = ["recommend", "-m", "llama3-70b", "-c", "h100x64"]
P = ["predict", "-m", "llama3-70b", "-c", "h100x64", "--tp", "8", "--pp", "4"]
T = ["tune", "-m", "llama3-8b", "-c", "h100x8", "--layers", "2", "--runner", "simulate", "--ray-address", "inline",
     "--trials", "2"]
TS = T + ["--storage", "{journal}", "--dataset", "{dataset}"]  # pointed at the real study
F = ["fit", "--no-surrogates"]
TH = ["thermal-profile", "--from-trace", "{trace}"]
PL = ["place", "-m", "llama3-8b", "-c", "h200x4", "-p", "{profile}", "--pp", "4"]
M = ["measure", "--model", "llama3-8b", "--dry-run"]
PN = ["plan", "-m", "llama3-70b", "--tokens", "15T"]

# (args, a piece of the error line); {name} is a path of the `files` fixture
CASES = [
    # recommend
    (R + ["--top", "0"], "--top must be >= 1"),
    (R + ["--power-cap", "nan"], "--power-cap must be a finite number"),
    (R + ["--power-cap", "-5"], "--power-cap must be > 0"),
    (R + ["--seq", "0"], "--seq must be >= 1"),
    (R + ["--gbs", "-1"], "--gbs must be >= 1"),
    (R + ["--set", "seq=4096", "--seq", "8192"], "--seq 8192 and --set seq=4096 conflict"),
    (R + ["--set", "mbs=2", "--set", "mbs=4"], "--set mbs=2 and --set mbs=4 conflict"),
    (R + ["--set", "power_cap=inf"], "positive and finite"),
    (R + ["--set", "tp=2"], "recommend searches this knob"),
    # --power-caps is checked for every objective, and refused where the objective chooses no cap
    (R + ["--power-caps", "abc"], "--power-caps 'abc': expected LO:HI:STEP"),
    (R + ["--power-caps", "700:300:25"], "expected LO:HI:STEP with LO <= HI and STEP > 0"),
    (R + ["--objective", "energy", "--power-caps", "300:700:0"], "expected LO:HI:STEP with LO <= HI and STEP > 0"),
    (R + ["--power-caps", "300:700:25"], "--power-caps and --objective throughput conflict"),
    (R + ["--objective", "balanced", "--set", "gpu=a100-80g", "--power-caps", "300:700:25"],
     "--power-caps 300:700:25: power cap 700 W is above the a100-80g maximum power limit of 400 W"),
    (R + ["--html", "{missing}/r.html"], "--html {missing}/r.html: directory {missing} does not exist"),
    (R + ["--calibration", "{dir}"], "is a folder"),
    (R + ["--calibration", "{missing}"], "no such calibration file"),
    (R + ["--calibration", "{dataset}"], "not a readable calibration file"),
    (["recommend", "-m", "llama3-70b", "-c", "{inf_yaml}"], "intra_node_bw_gbs must be a positive number (finite)"),
    (["recommend", "-m", "{hf_frac}", "-c", "h100x8"], "num_hidden_layers must be an integer, got 32.5"),
    (["recommend", "-m", "{hf_bool}", "-c", "h100x8"], "num_hidden_layers must be an integer, got True"),
    # predict
    (P[:-4] + ["--pp", "1", "--pp-first-layers", "10"], "--pp-first-layers sets an uneven pipeline split"),
    (P + ["--tp", "0"], "--tp must be >= 1"),
    (P + ["--html", "{missing}/a/p.html"], "--html {missing}/a/p.html: directory {missing}/a does not exist"),
    (P + ["--mbs", "0"], "--mbs must be >= 1"),
    (P + ["--power-cap", "inf"], "--power-cap must be a finite number"),
    (P + ["--seq", "8192", "--set", "seq=4096"], "--seq 8192 and --set seq=4096 conflict"),
    (P + ["--mbs", "2", "--set", "mbs=4"], "--mbs 2 and --set mbs=4 conflict"),
    (P + ["--set", "nodes"], "expected KEY=VALUE"),
    (["predict", "--batch", "{dir}"], "--batch {dir}: is a folder"),
    (["predict", "--batch", "{missing}"], "no such file"),
    (["predict", "--batch", "{gz}"], "not a text file"),
    (["predict", "--batch", "{dataset}", "--power-caps", "300:700:25"], "--power-caps and --batch conflict"),
    (["predict", "-m", "llama3-8b", "-c", "{nan_yaml}"], "inter_node_bw_gbs must be a positive number (finite)"),
    (["predict", "-m", "{hf_heads}", "-c", "h100x8"], "num_attention_heads must be an integer"),
    (["predict", "-m", "{hf_tie}", "-c", "h100x8"], "tie_word_embeddings must be true or false"),
    (["predict", "-m", "{hf_hdim}", "-c", "h100x8"], "hidden_size 4095 is not a multiple of num_attention_heads 32"),
    (["predict", "-m", "llama3-8b"], "--model and --cluster are required"),
    # plan: quantities with units, GPU specs, rates
    (["plan", "-m", "llama3-70b", "--tokens", "15X"], "--tokens '15X': expected a number and a unit"),
    (["plan", "-m", "llama3-70b", "--tokens", "-2.5e12"], "--tokens '-2.5e12': expected a number and a unit"),
    (["plan", "-m", "llama3-70b", "--tokens", "0T"], "--tokens '0T': must be a positive finite amount"),
    (PN + ["--deadline", "60"], "--deadline '60': expected a number and a unit (s, min, h, d, w)"),
    (PN + ["--deadline", "nand"], "--deadline 'nand': expected a number and a unit"),
    (PN + ["--budget", "2.5GW"], "--budget '2.5GW': expected a number and a unit"),
    (PN + ["--gpus", "h100:<=0"], "expected GPU:N or GPU:<=N with N a positive integer"),
    (PN + ["--gpus", "h100:100"], "100 GPUs is not a whole number of 8-GPU h100 nodes"),
    (PN + ["--gpus", "h1000:<=64"], "unknown GPU 'h1000'"),
    (PN + ["--gpus", "h100:64", "--cluster", "dgx-a100-su"], "--gpus h100:64 and --cluster dgx-a100-su conflict"),
    (PN + ["--max-gbs-tokens", "1k"], "--max-gbs-tokens 1000 is less than one sequence of 8192 tokens"),
    (PN + ["--gpu-hour-price", "-1"], "--gpu-hour-price must be >= 0"),
    (PN + ["--failures-per-gpu-hour", "nan"], "--failures-per-gpu-hour must be a finite number"),
    (PN + ["--restart-min", "-5"], "--restart-min must be >= 0"),
    (PN + ["--storage-bw", "0"], "--storage-bw must be > 0"),
    (PN + ["--power-caps", "100:700:25"], "--power-caps 100:700:25: power cap 100 W is below"),
    (PN + ["--html", "{missing}/p.html"], "--html {missing}/p.html: directory {missing} does not exist"),
    (PN + ["--cluster", "{storage_yaml}"], "storage_bw_gbs must be a positive number (finite)"),
    # catalog
    (["catalog", "planets"], "is not one of"),
    # tune: paths (the real study's files are never written by any of these)
    (T + ["--storage", "{dir}"], "--storage {dir}: is a folder"),
    (T + ["--storage", "{ro}/s.journal"], "cannot write in"),
    (T + ["--storage", "postgresql://u:secret@127.0.0.1:1/db"], "--storage postgresql://u:***@127.0.0.1:1/db"),
    (T + ["--storage", "mysql://u:p@127.0.0.1:1/db"], "--storage mysql://u:***@127.0.0.1:1/db"),
    (T + ["--storage", "nosuchdb://x/y"], "unknown database kind"),
    (T + ["--storage", "{dataset}", "--dataset", "{tmp}/other.jsonl"], "is a measurement JSONL"),
    (T + ["--storage", "{tmp}/other.journal", "--dataset", "{journal}"], "is an Optuna journal"),
    (T + ["--storage", "{tmp}/other.journal", "--dataset", "{gz}"], "is not a JSONL of measurement records"),
    (T + ["--storage", "{tmp}/same", "--dataset", "{tmp}/same"], "--storage and --dataset conflict"),
    (T + ["--storage", "{tmp}/o.journal", "--dataset", "{ro}/d.jsonl"], "cannot write in"),
    (T + ["--storage", "{tmp}/o.journal", "--dataset", "{dir}"], "--dataset {dir}: is a folder"),
    (T + ["--storage", "{missing}/s.journal"], "--storage {missing}/s.journal: directory {missing} does not exist"),
    (T + ["--storage", "{tmp}/o.journal", "--dataset", "{missing}/d.jsonl"], "directory {missing} does not exist"),
    (T + ["--storage", "sqlite:///{missing}/s.db"], "--storage {missing}/s.db: directory {missing} does not exist"),
    (TS + ["--html", "{missing}/t.html"], "--html {missing}/t.html: directory {missing} does not exist"),
    (TS + ["--sim-sigma", "nan"], "--sim-sigma must be a finite number"),
    (TS + ["--sim-sigma", "-0.1"], "--sim-sigma must be >= 0"),
    (TS + ["--layers", "0"], "--layers must be >= 1"),
    (TS + ["--trial-timeout", "-1"], "--trial-timeout must be > 0"),
    (TS + ["--top-k", "-1"], "--top-k must be >= 0"),
    (TS + ["--timeout", "-5"], "--timeout must be > 0"),
    (TS + ["--timeout", "inf"], "--timeout must be a finite number"),
    (TS + ["--trials", "0"], "--trials must be >= 1"),
    (TS + ["--batch", "0"], "--batch must be >= 1"),
    (TS + ["--seed", "-1"], "--seed must be >= 0"),
    (TS + ["--power-cap", "nan"], "--power-cap must be a finite number"),
    (TS + ["--steps", "5"], "--steps and --runner simulate conflict"),
    (TS + ["--runner", "megatron", "--sim-sigma", "0.1"], "--sim-sigma and --runner megatron conflict"),
    (TS + ["--runner", "gpu"], "runner must be one of"),
    (TS + ["--objective", "speed"], "objective must be one of"),
    (TS + ["--sampler", "random"], "--sampler must be tpe or surrogate"),
    (TS + ["--calibration", "{missing}"], "no such calibration file"),
    (TS + ["--study-name", "llama3-8b[2L]@h100x8-seq8192-gbs128-bf16-power-simulate", "--seq", "4096"],
     "was made with"),  # the study of the journal, asked for another workload
    # fit
    (F + ["-d", "{dataset}", "-o", "{dir}"], "--output {dir}: is a folder"),
    (F + ["-d", "{dataset}", "-o", "{ro}/c.joblib"], "cannot write in"),
    (F + ["-d", "{dataset}", "-o", "{tmp}/c.txt"], "must end in .joblib"),
    (F + ["-d", "{dataset}", "-o", "{missing}/c.joblib"], "--output {missing}/c.joblib: directory {missing} does not exist"),
    (F + ["-d", "{dataset}", "-o", "{tmp}/c.joblib", "--html", "{missing}/f.html"], "directory {missing} does not exist"),
    (F + ["-d", "{caljson}", "-o", "{tmp}/cal.joblib"], "the calibration would overwrite the measurements"),
    (F + ["-d", "{dir}", "-o", "{tmp}/c.joblib"], "--data {dir}: is a folder"),
    (F + ["-d", "{missing}", "-o", "{tmp}/c.joblib"], "no such file"),
    (F + ["-d", "{gz}", "-o", "{tmp}/c.joblib"], "not a text file"),
    (F + ["--study", "{dataset}", "-o", "{tmp}/c.joblib"], "not an Optuna journal file"),
    (F + ["--study", "{missing}", "-o", "{tmp}/c.joblib"], "no such study journal file"),
    (F + ["--study", "postgresql://u:p@127.0.0.1:1/db", "-o", "{tmp}/c.joblib"], "127.0.0.1:1/db"),
    (F + ["-d", "{dataset}", "-o", "{tmp}/c.joblib", "--folds", "1"], "--folds must be >= 2"),
    # thermal-profile
    (["thermal-profile", "--from-trace", "{dir}"], "--from-trace {dir}: is a folder"),
    (["thermal-profile", "--from-trace", "{missing}"], "no such file"),
    (TH + ["--out", "{dir}"], "--out {dir}: is a folder"),
    (TH + ["--out", "{ro}/p.json"], "cannot write in"),
    (TH + ["--out", "{trace}"], "--out and --from-trace conflict"),
    (TH + ["--out", "{missing}/p.json"], "--out {missing}/p.json: directory {missing} does not exist"),
    (TH + ["--seconds", "10"], "--seconds and --from-trace conflict"),
    (TH + ["--rate", "nan"], "--rate must be a finite number"),
    # place
    (PL + ["--margin", "nan"], "--margin must be a finite number"),
    (PL + ["--margin", "-1"], "--margin must be >= 0"),
    (PL + ["--leak-per-c", "inf"], "--leak-per-c must be a finite number"),
    (PL[:5] + ["-p", "{missing}", "--pp", "4"], "no such profile file"),
    (PL[:5] + ["-p", "{dir}", "--pp", "4"], "is a folder"),
    (PL + ["--tp", "0"], "--tp must be >= 1"),
    (PL + ["--html", "{missing}/pl.html"], "--html {missing}/pl.html: directory {missing} does not exist"),
    # launch: a profile it cannot use only skips the placement, but a path that does not exist is a typo
    (["launch", "-p", "{missing}", "-m", "llama3-8b", "-c", "h200x4", "--pp", "4", "--", "true"],
     "--profile {missing}: no such profile file"),
    # report
    (["report", "{dir}"], "STUDY|DATASET {dir}: is a folder"),
    (["report", "{journal}", "--html", "{dir}"], "--html {dir}: is a folder"),
    (["report", "{journal}", "--html", "{ro}/r.html"], "cannot write in"),
    (["report", "{journal}", "--html", "{missing}/r.html"], "--html {missing}/r.html: directory {missing} does not exist"),
    # measure (--dry-run: no GPU needed to check the inputs)
    (M + ["--tp", "0"], "--tp must be >= 1"),
    (M + ["--telemetry-hz", "nan"], "--telemetry-hz must be a finite number"),
    (M + ["--out", "{dir}"], "--out {dir}: is a folder"),
    (["measure", "--batch", "{dir}", "--dry-run"], "--batch {dir}: is a folder"),
    (M + ["--trace-dir", "{dataset}"], "is a file; give a folder"),
    (M + ["--out", "{missing}/r.json"], "--out {missing}/r.json: directory {missing} does not exist"),
    (M + ["--dataset", "{missing}/m.jsonl"], "--dataset {missing}/m.jsonl: directory {missing} does not exist"),
    (M + ["--trace-dir", "{missing}/a/traces"], "--trace-dir {missing}/a/traces: directory {missing}/a does not exist"),
    (M + ["--run-dir", "{missing}/a/run"], "--run-dir {missing}/a/run: directory {missing}/a does not exist"),
]
if not _has("torch"):
    CASES += [
        (TS + ["--runner", "megatron", "--ray-address", "inline"], "needs torch, which is not installed"),
        (["thermal-profile", "--seconds", "60"], "thermal-profile needs torch"),
    ]


def _fmt(args, files):
    return [a.format(**{k: v for k, v in files.items() if isinstance(v, str)}) for a in args]


@pytest.mark.parametrize("args,needle", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_error_line_exit_2(files, args, needle):
    if any("{ro}" in a for a in args) and files["ro"] is None:
        pytest.skip("no read-only folder on this machine")
    p = run_cli(*_fmt(args, files))
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert _fmt([needle], files)[0] in lines[0]
    assert p.wall_s < 5.0, f"{p.wall_s:.1f} s"


def test_there_are_at_least_60_cases_over_every_command():
    assert len(CASES) >= 60
    assert {a[0] for a, _ in CASES} >= {"recommend", "predict", "catalog", "tune", "fit", "thermal-profile",
                                         "place", "measure", "report", "plan"}


BATCH = [
    {"id": "ok", "model": "llama3-70b", "cluster": "h100x64", "tp": 8, "pp": 4},
    '{"id": "inf", "model": "llama3-70b", "cluster": "h100x64", "tp": Infinity}',
    '{"id": "nan", "model": "llama3-70b", "cluster": "h100x64", "seq": NaN}',
    {"id": "long", "model": "llama3-70b", "cluster": "h100x64", "tensor_parallel": 8},
    "",
    "not json",
    "[1, 2]",
    {"id": "frac", "model": "llama3-70b", "cluster": "h100x64", "tp": 8.5},
    {"id": "bool", "model": "llama3-70b", "cluster": "h100x64", "tp": True},
    {"id": "split", "model": "llama3-70b", "cluster": "h100x64", "pp": 1, "pp_first_layers": 10},
    {"id": "cap", "model": "llama3-70b", "cluster": "h100x64", "tp": 8, "power_cap_w": -1},
    {"id": "defaults", "tp": 8},  # model and cluster from the flags
    {"id": "seq", "model": "llama3-70b", "cluster": "h100x64", "tp": 8, "pp": 4, "seq": 8192},  # vs --set seq
    {"id": "int", "model": "llama3-70b", "cluster": "h100x64", "tp": 8.0, "pp": 4},
    {"id": "type", "model": 5, "cluster": "h100x64"},
]


def test_predict_batch_answers_every_line_in_strict_json(tmp_path):
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in BATCH) + "\n"
    p = run_cli("predict", "--batch", "-", "--model", "llama3-8b", "--cluster", "h100x8", "--power-cap", "600",
                "--set", "seq=4096", stdin=text)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr

    def refuse(c):
        raise AssertionError(f"bare {c} in the output")

    out = [json.loads(x, parse_constant=refuse) for x in p.stdout.splitlines()]
    assert len(out) == len(BATCH)
    by = {o.get("id", o.get("line")): o for o in out}
    assert by["ok"]["prediction"]["tokens_per_s_per_gpu"] > 0 and by["ok"]["config"]["seq"] == 4096
    assert "Infinity" in by[2]["error"] and "line 2" in by[2]["error"]
    assert "NaN" in by[3]["error"]
    assert "unknown key 'tensor_parallel'; did you mean 'tp'?" in by["long"]["error"]
    assert "blank line" in by[5]["error"] and "not JSON" in by[6]["error"] and "JSON object" in by[7]["error"]
    assert "tp must be an integer, got 8.5" in by["frac"]["error"]
    assert "tp must be an integer, got True" in by["bool"]["error"]
    assert "pp_first_layers sets an uneven pipeline split" in by["split"]["error"]
    assert "power_cap_w must be > 0" in by["cap"]["error"]
    # the flags are every line's defaults: this line is llama3-8b on h100x8 at a 600 W cap
    d = by["defaults"]
    assert d["config"]["tp"] == 8 and d["config"]["dp"] == 1 and d["config"]["seq"] == 4096, d
    assert "seq=8192 conflicts with --set seq=4096" in by["seq"]["error"]
    assert by["int"]["config"]["tp"] == 8
    assert "needs 'model' (a string), got 5" in by["type"]["error"]
    assert [o.get("line") for o in out if "error" in o] == [i + 1 for i, o in enumerate(out) if "error" in o]


def test_predict_batch_power_cap_flag_is_a_default(tmp_path):
    line = json.dumps({"model": "llama3-8b", "cluster": "h100x8", "tp": 8})
    a = [json.loads(x) for x in run_cli("predict", "--batch", "-", stdin=line + "\n").stdout.splitlines()][0]
    b = [json.loads(x) for x in run_cli("predict", "--batch", "-", "--power-cap", "400",
                                        stdin=line + "\n").stdout.splitlines()][0]
    own = json.dumps({"model": "llama3-8b", "cluster": "h100x8", "tp": 8, "power_cap_w": 700})
    c = [json.loads(x) for x in run_cli("predict", "--batch", "-", "--power-cap", "400",
                                        stdin=own + "\n").stdout.splitlines()][0]
    assert b["prediction"]["mean_power_w"] <= 400 * 1.001 < a["prediction"]["mean_power_w"]
    assert c["prediction"]["mean_power_w"] == pytest.approx(a["prediction"]["mean_power_w"])  # the line's own wins


def test_nothing_measured_was_touched(files):
    """Every case above ran against the study's journal and dataset, a measurement file, the
    trace and the profile: all byte for byte as before."""
    for path, digest in files["hashes"].items():
        assert _sha(Path(path)) == digest, path
    assert not list(Path(files["tmp"]).glob("*.joblib")) and not (Path(files["tmp"]) / "p.json").exists()
    assert not Path(files["missing"]).exists()  # no case made the folder its output was refused for


def test_a_folder_the_user_named_is_not_made_but_a_default_ones_is(tmp_path):
    """An output path whose folder does not exist is refused (no mkdir -p of a typo), for every
    output flag (the table above); the folder of a default path, tune's
    data/measurements/tune-<study>.jsonl under the working directory, is made."""
    r = run_cli("fit", "--no-surrogates", "-d", str(MEASURED), "-o", str(tmp_path / "no" / "c.joblib"))
    assert r.returncode == 2 and r.stderr == f"error: --output {tmp_path / 'no' / 'c.joblib'}: directory " \
                                             f"{tmp_path / 'no'} does not exist\n"
    assert not (tmp_path / "no").exists()
    p = subprocess.run([sys.executable, "-m", "advisor", "tune", "-m", "llama3-8b", "-c", "h100x8", "--layers", "2",
                        "--runner", "simulate", "--ray-address", "inline", "--trials", "2", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "advisor-studies.journal").is_file()
    assert len(list((tmp_path / "data" / "measurements").glob("tune-*.jsonl"))) == 1


def test_a_study_whose_trials_all_crash_exits_1_and_keeps_every_record(tmp_path):
    """A broken set-up (here: every simulated trial crashes) stops after max_failures trials in a
    row with exit 1 and one error line, and each failure is recorded."""
    ds = tmp_path / "d.jsonl"
    r = run_cli("tune", "-m", "llama3-8b", "-c", "h100x8", "--layers", "2", "--runner", "simulate",
                "--ray-address", "inline", "--trials", "20", "--storage", str(tmp_path / "s.journal"),
                "--dataset", str(ds), "--json", env={"ADVISOR_SIM_INJECT": "tp=crash"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: the study stopped: 5 trials in a row failed"), r.stderr
    recs = [json.loads(x) for x in ds.read_text().splitlines()]
    assert len(recs) == 5 and all(x["status"] == "crash" for x in recs)
    assert json.loads(r.stdout)["counts"]["crash"] == 5


def test_fit_study_takes_the_records_of_the_simulated_runner(files, tmp_path):
    """Every trial of the simulate runner is a usable record (telemetry.throttle_fraction in the
    schema's form), and records of older simulated studies (a bare fraction) are read too."""
    from advisor.models.dataset import load
    from advisor.study import study_records

    recs, _ = study_records(files["journal"])
    ok = [r for _, r in recs if r["status"] == "ok"]
    assert ok and all(isinstance(r["telemetry"]["throttle_fraction"], dict) for r in ok)
    ds = load([], records=recs)
    assert len(ds.records) == len(ok) and not ds.rejected
    old = []
    for src, r in recs:
        r = json.loads(json.dumps(r))
        if r["status"] == "ok":
            r["telemetry"]["throttle_fraction"] = r["telemetry"]["throttle_fraction"]["any_throttle"]
        old.append((src, r))
    ds_old = load([], records=old)
    assert len(ds_old.records) == len(ok) and not ds_old.rejected
    out = tmp_path / "cal.joblib"
    r = run_cli("fit", "--study", files["journal"], "--no-surrogates", "--folds", "2", "-o", str(out))
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr
    assert "is float" not in r.stderr  # the old rejection of every simulated record


def test_api_and_cli_share_the_default_calibration():
    from advisor.api import DEFAULT_CALIBRATION, predict_layout, recommend
    from advisor.study import TuneSettings

    assert TuneSettings(model="m", cluster="c").calibration == DEFAULT_CALIBRATION
    api = recommend("llama3-70b", "h100x64", top=1).recommendations[0]
    p = run_cli("recommend", "--model", "llama3-70b", "--cluster", "h100x64", "--top", "1", "--json")
    cli = json.loads(p.stdout)
    assert cli["calibration"] == recommend("llama3-70b", "h100x64", top=1).calibration
    assert cli["recommendations"][0]["prediction"]["tokens_per_s_per_gpu"] == pytest.approx(
        api.prediction.tokens_per_s_per_gpu, rel=1e-9)
    _, one = predict_layout("llama3-70b", "h100x64", api.config.to_dict())
    assert one.tokens_per_s_per_gpu == pytest.approx(api.prediction.tokens_per_s_per_gpu, rel=1e-9)


def test_version():
    import advisor

    p = run_cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"advisor {advisor.__version__}" and p.stderr == ""


def test_sliding_window_is_modelled_without_a_warning(tmp_path):
    cfg = {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "vocab_size": 32000, "intermediate_size": 14336, "sliding_window": 4096,
           "max_position_embeddings": 32768}
    f = tmp_path / "config.json"
    times = []
    for w in (4096, None):
        f.write_text(json.dumps({**cfg, "sliding_window": w}))
        p = run_cli("predict", "-m", str(f), "-c", "h100x8", "--tp", "8", "--seq", "16384", "--json")
        assert p.returncode == 0 and p.stderr == "", p.stderr
        times.append(json.loads(p.stdout)["prediction"]["step_time_s"])
    assert times[0] < times[1]  # the window's attention is cheaper than full causal attention at 16K
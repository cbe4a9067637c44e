"""The search space's legality rules and the recommend / predict / catalog commands."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.api import recommend
from advisor.catalog import TrainConfig, load_cluster, load_model
from advisor.search_spaces.layout import stage_layer_counts, violations
from advisor.search_spaces.space import Workload, enumerate_layouts, pipeline_splits


def run_cli(*args: str, stdin: str | None = None, columns: int | None = None) -> subprocess.CompletedProcess:
    """`columns`: $COLUMNS for the command (the tables fit it); None: a pipe's 140 columns."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "advisor", *args], capture_output=True, text=True, input=stdin,
                          timeout=120, env=env)


def test_every_enumerated_layout_is_legal_and_dp_is_derived():
    m, c = load_model("mixtral-8x7b"), load_cluster("h100x32")
    n = 0
    for cfg in enumerate_layouts(m, c, Workload(seq=4096, gbs=256)):
        assert violations(m, c, cfg) == [], cfg
        assert cfg.tp * cfg.pp * cfg.cp * cfg.dp == 32
        n += 1
    assert n > 100


def test_rules_name_the_broken_rule():
    m, c = load_model("llama3-70b"), load_cluster("h100x64")
    assert any("KV groups" in v for v in violations(m, c, TrainConfig(tp=16, pp=1, dp=4, gbs=128)))
    assert any("spans more than one NVLink domain" in v for v in violations(m, c, TrainConfig(tp=16, pp=4, dp=1, gbs=128)))
    # 80 layers over pp=3 (tp·pp = 24 of 64 GPUs, so the GPU count is broken too)
    assert any("do not split evenly over pp=3" in v for v in violations(m, c, TrainConfig(tp=8, pp=3, dp=1, gbs=128)))
    assert any("gbs=100" in v for v in violations(m, c, TrainConfig(tp=8, pp=4, dp=2, mbs=4, gbs=100)))
    assert any("mixture-of-experts" in v for v in violations(m, c, TrainConfig(tp=8, pp=4, dp=2, ep=2, gbs=128)))
    mx = load_model("mixtral-8x7b")
    assert any("does not divide the 8 experts" in v for v in violations(mx, load_cluster("h100x48"),
                                                                          TrainConfig(tp=1, pp=1, dp=48, ep=3, gbs=96)))


def test_uneven_pipeline_split():
    assert stage_layer_counts(126, 16, 7, 7) == [7] + [8] * 14 + [7]
    assert pipeline_splits(126, 16, True) == [(7, 7)]
    assert pipeline_splits(80, 4, True) == [(None, None)]
    assert sum(stage_layer_counts(61, 8, *pipeline_splits(61, 8, True)[0])) == 61


def test_recommend_llama3_70b_h100x64():
    res = recommend("llama3-70b", "h100x64", top=3)
    assert res.candidates_evaluated >= res.feasible > 0
    r = res.recommendations
    assert [x.rank for x in r] == [1, 2, 3]
    assert r[0].prediction.tokens_per_s_per_gpu >= r[1].prediction.tokens_per_s_per_gpu * 0.99
    for x in r:
        assert x.prediction.feasible and x.prediction.memory_gib_per_gpu <= 80
        assert x.config.tp <= 8 and x.config.world_size == 64
        assert f"--tensor-model-parallel-size {x.config.tp}" in x.megatron_args
        assert x.reason


def test_recommend_energy_objective_orders_by_energy():
    res = recommend("llama3-8b", "h100x8", objective="energy", top=5)
    e = [r.prediction.energy_j_per_token for r in res.recommendations]
    # ranked by energy, a lower throttle risk breaking near-ties (the score weighs risk at 1%)
    assert all(a <= b * 1.01 for a, b in zip(e, e[1:]))
    assert e[0] == min(e)


def test_cli_recommend_json_shape():
    p = run_cli("recommend", "--model", "llama3-8b", "--cluster", "h100x8", "--json", "--top", "2")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert set(d) >= {"model", "cluster", "workload", "candidates_evaluated", "feasible", "recommendations"}
    rec = d["recommendations"][0]
    assert set(rec) == {"rank", "config", "prediction", "megatron_args", "megatron_notes", "reason", "power_cap_w",
                        "power_caps", "stage_caps", "memory"}
    assert set(rec["config"]) >= {"tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "gbs", "seq", "precision",
                                  "recompute", "sequence_parallel", "distributed_optimizer", "overlap_grad_reduce"}
    assert set(rec["prediction"]) >= {"tokens_per_s_per_gpu", "mfu", "memory_gib_per_gpu", "peak_power_w",
                                      "throttle_risk", "energy_j_per_token", "breakdown"}


def test_cli_table_output():
    p = run_cli("recommend", "--model", "llama3-8b", "--cluster", "h100x8", "--top", "3")
    assert p.returncode == 0, p.stderr
    assert "tok/s/GPU" in p.stdout and "Megatron args" in p.stdout


@pytest.mark.parametrize("args,needle", [
    # typer/click's own usage errors: one line too, not a boxed "Usage ... Error" block
    (["recommend", "--model", "llama3-70b", "--cluster", "h100x64", "--precision", "fp16"],
     "error: Invalid value for '--precision': 'fp16' is not one of 'bf16', 'fp8', 'mxfp8', 'nvfp4'."),
    (["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "x"], "Invalid value for '--tp'"),
    (["catalog", "foo"], "'foo' is not one of 'models', 'gpus', 'clusters'"),
    (["catalog"], "Missing argument"),
    (["recommend", "--model", "llama3-70b"], "Missing option '--cluster'"),
    (["predict"], "error: --model and --cluster are required"),
    (["recommend", "--model", "llama3-70b", "--cluster", "h100x64", "--bogus"], "No such option: --bogus"),
    (["nosuchcommand"], "No such command"),
    # the tool's own input errors
    (["recommend", "--model", "llama3-7b", "--cluster", "h100x64"], "did you mean"),
    (["recommend", "--model", "llama3-70b", "--cluster", "h100x6x"], "expected"),
    (["recommend", "--model", "llama3.1-405b", "--cluster", "h100x8"], "fits nowhere"),
    (["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "3"], "illegal layout"),
    (["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "16", "--pp", "4"], "illegal layout"),
    (["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--recompute", "sometimes"], "recompute"),
    (["recommend", "--model", "llama3-70b", "--cluster", "h100x64", "--objective", "fast"], "objective"),
    (["catalog", "planets"], "models"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    p = run_cli(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert needle in lines[0]


def test_bad_input_in_process_is_one_line_exit_2(capsys):
    from advisor.cli import main

    with pytest.raises(SystemExit) as ex:
        main(["predict", "--model", "llama3-70b", "--cluster", "h100x64", "--pp", "two"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Invalid value for '--pp'") and err.count("\n") == 1


@pytest.mark.parametrize("args", [["--help"], ["predict", "--help"], ["catalog", "--help"]])
def test_help_still_works(args):
    p = run_cli(*args)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert "Usage" in p.stdout and "--help" in p.stdout
    if args[0] == "predict":
        assert "--pp-first-layers" in p.stdout and "--pp-last-layers" in p.stdout


@pytest.mark.parametrize("calibration", ["none", "default"])
def test_predict_reproduces_recommends_uneven_pipeline_split(calibration):
    """llama3.1-405b has 126 layers: recommend's layouts on 16K GPUs split the pipeline unevenly
    (the embedding and the loss counted as layers, as NVIDIA's 405B preset does), and predict
    takes that split with --account-for-embedding / --account-for-loss, or the first / last
    stage's layers with --pp-first-layers / --pp-last-layers."""
    top = recommend("llama3.1-405b", "h100x16384", top=1, calibration=calibration).recommendations[0]
    c = top.config
    assert c.pp > 1 and c.account_for_embedding and c.account_for_loss
    flags = ["--tp", c.tp, "--pp", c.pp, "--cp", c.cp, "--vp", c.vp, "--mbs", c.mbs, "--gbs", c.gbs,
             "--recompute", c.recompute, "--account-for-embedding", "--account-for-loss"]
    p = run_cli("predict", "--model", "llama3.1-405b", "--cluster", "h100x16384", *map(str, flags),
                "--calibration", calibration, "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["config"] == json.loads(json.dumps(c.to_dict()))  # as JSON: tuples are lists
    assert d["prediction"]["tokens_per_s_per_gpu"] == pytest.approx(top.prediction.tokens_per_s_per_gpu, rel=1e-9)
    if calibration == "default":
        return
    # the layout of the example: PP=64 with one layer on the first and the last stage
    p = run_cli("predict", "--model", "llama3.1-405b", "--cluster", "h100x16384", "--tp", "8", "--pp", "64",
                "--cp", "4", "--pp-first-layers", "1", "--pp-last-layers", "1", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert (d["config"]["pp_first_layers"], d["config"]["pp_last_layers"], d["config"]["dp"]) == (1, 1, 8)
    assert d["prediction"]["feasible"]
    # without the split the same layout is illegal, and the error says which flags to give
    p = run_cli("predict", "--model", "llama3.1-405b", "--cluster", "h100x16384", "--tp", "8", "--pp", "64",
                "--cp", "4")
    assert p.returncode == 2 and "--pp-first-layers/--pp-last-layers" in p.stderr


def test_predict_single_json():
    p = run_cli("predict", "--model", "llama3-70b", "--cluster", "h100x64", "--tp", "8", "--pp", "4", "--mbs", "1",
                "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["config"]["dp"] == 2
    for k in ("tokens_per_s_per_gpu", "step_time_s", "mfu", "memory_gib_per_gpu", "feasible", "peak_power_w",
              "mean_power_w", "throttle_risk", "energy_j_per_token", "breakdown"):
        assert k in d["prediction"]


def test_predict_batch_echoes_keys_and_survives_bad_lines():
    lines = [
        {"id": "a", "model": "llama3-70b", "cluster": "h100x64", "tp": 8, "pp": 4, "mbs": 1, "gbs": 128},
        {"id": "b", "model": "llama3-70b", "cluster": "h100x64", "tp": 3},
        {"id": "c", "model": "nope", "cluster": "h100x64"},
        {"id": "d", "model": "llama3-8b", "cluster": "h100x8", "tp": 1, "mbs": 8, "gbs": 64, "seq": 8192,
         "recompute": "none"},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\nnot json\n"
    p = run_cli("predict", "--batch", "-", stdin=text)
    assert p.returncode == 0, p.stderr
    out = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(out) == 5
    assert out[0]["id"] == "a" and out[0]["tp"] == 8 and out[0]["prediction"]["feasible"]
    assert out[1]["id"] == "b" and "illegal layout" in out[1]["error"]
    assert out[2]["id"] == "c" and "unknown model" in out[2]["error"]
    assert out[3]["id"] == "d" and "prediction" in out[3]
    assert "error" in out[4]


def test_infeasible_prediction_says_why():
    from advisor.api import predict_layout

    _, p = predict_layout("llama3-70b", "h100x8", {"tp": 8, "pp": 1, "mbs": 1, "gbs": 8, "seq": 8192})
    assert not p.feasible and "GiB" in p.reason


@pytest.mark.parametrize("what", ["models", "gpus", "clusters"])
def test_catalog_commands(what):
    p = run_cli("catalog", what, "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)) >= 2


def test_catalog_tables_show_sources():
    p = run_cli("catalog", "gpus")
    assert p.returncode == 0, p.stderr
    header = next(x for x in p.stdout.splitlines() if "name" in x)
    assert "source" in header
    assert "NVIDIA H100" in p.stdout  # the start of h100's source, however narrow the column
    p = run_cli("catalog", "clusters")
    assert p.returncode == 0, p.stderr
    assert "source" in next(x for x in p.stdout.splitlines() if "name" in x)
    assert "NVIDIA DGX SuperPOD" in p.stdout


def test_catalog_clusters_json_keeps_source():
    p = run_cli("catalog", "clusters", "--json")
    assert p.returncode == 0, p.stderr
    by_name = {c["name"]: c for c in json.loads(p.stdout)}
    assert by_name["dgx-h100-su"]["source"].startswith("NVIDIA DGX SuperPOD (H100) reference architecture")
    assert all(c["source"] for c in by_name.values())


def test_a_checkout_imports_its_layer_folders_without_an_install(tmp_path):
    """`python -m advisor` in the repo root, PYTHONPATH=<repo>, or a Ray worker started there: the
    package comes from the checkout and so do its subpackages (no site, so no editable finder)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import importlib.util as u, advisor; "
            "print(advisor.__file__); print(u.find_spec('advisor.catalog').origin); "
            "print(u.find_spec('advisor.runners.measure').origin)")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines == [str(root / "advisor" / "__init__.py"), str(root / "catalog" / "__init__.py"),
                     str(root / "runners" / "measure.py")]


def test_docs_point_only_at_files_in_the_repository():
    """README.md and docs/*.md name no path outside the repository (a clone has no ../shared/),
    and every data/ file they name is there."""
    import re

    root = Path(__file__).resolve().parents[1]
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        assert "../shared/" not in text and "FACTS.md" not in text, doc.name
        for m in re.finditer(r"`(data/[^`\s*{}<>]+)`", text):
            path = m.group(1).split("::")[0].rstrip(".,;:)")
            assert (root / path).exists(), f"{doc.name}: {path}"

"""The te profile per GPU generation and the note outside a profile's domain."""
from advisor.catalog import TrainConfig, load_cluster, load_gpu, load_model
from advisor.models.calibrate import resolve_calibration
from advisor.models.domain import domain_note
from advisor.models.profiles import STACKS


def test_blackwell_gpus_get_their_profile_and_h100_keeps_its_own():
    assert resolve_calibration("default", "te", load_gpu("gb200")).profile == "te-blackwell"
    h = resolve_calibration("default", "te", load_gpu("h100"))
    assert h.source.endswith("te_calibration.json") or h.source.endswith("te_calibration.joblib")
    assert h.profile == "te" and STACKS["te"].file_for(load_gpu("h100")) == STACKS["te"].file


def test_profile_carries_domain_and_out_of_sample_errors():
    cal = resolve_calibration("default", "te", load_gpu("gb300"))
    d = cal.trained_on["domain"]
    assert {"GB200", "GB300", "B200"} <= set(d["gpus"]) and "nvfp4" in d["precisions"] and d["checked"]
    for k in ("leave_one_gpu_out", "leave_one_model_out", "leave_one_family_out"):
        assert cal.cv[k]["overall"]["mape"] < 15


def test_note_outside_the_domain_only():
    cal = resolve_calibration("default", "te", load_gpu("gb200"))
    c = load_cluster("gb200x64")
    inside = TrainConfig(tp=2, pp=4, dp=8, vp=5, gbs=256, seq=8192, precision="mxfp8", sequence_parallel=True)
    assert domain_note(cal, load_model("llama3-70b"), c, inside) is None
    n = domain_note(cal, load_model("mixtral-8x7b"), c, inside.replace(tp=1, pp=1, dp=64, vp=1))
    assert n.count("\n") == 0 and "mixture-of-experts" in n and "nearest checked" in n and "% out of sample" in n
    n = domain_note(cal, load_model("llama3-70b"), c, inside.replace(precision="bf16"))
    assert "precision bf16" in n

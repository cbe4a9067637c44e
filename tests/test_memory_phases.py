"""Issue #27: a stage's peak is the larger of the step's two phases (models.memory.memory_arrays):
the forward-backward schedule holds the activations and the loss stage's logits, the optimizer step
holds its fp32 transient (Constants.bytes_optimizer_transient per parameter of its shard) after the
last backward has freed both. Checked on the te runner's per-phase records too."""
from __future__ import annotations

from advisor.catalog import TrainConfig, load_model
from advisor.models.calibrate import resolve_calibration
from advisor.models.constants import GIB
from advisor.models.memory import stage_memory


def _static(sm) -> float:
    return sm.weights_gib + sm.grads_gib + sm.optimizer_gib


def test_the_optimizer_transient_does_not_sit_on_the_logits():
    """llama3-70b[4L] at TP4, DP1, mbs1 (the te run te-l70b-sp-00): 1.4 B parameters per GPU, little
    activation memory; the stage's peak is the larger phase, not the transient plus the logits."""
    c = resolve_calibration("default", "te").screening_constants
    m = load_model("llama3-70b").with_layers(4)
    cfg = TrainConfig(tp=4, dp=1, mbs=1, gbs=16, seq=4096, sequence_parallel=True)
    sm = stage_memory(m, cfg, c)[0]
    held = sm.activations_gib + sm.logits_gib
    transient = c.bytes_optimizer_transient * sm.params / GIB  # DP 1: the shard is every parameter
    assert transient > held  # the case where the two phases differ
    assert abs(sm.step_transient_gib - (transient - held)) < 1e-9
    peak = sm.total_gib - sm.reserved_free_gib - sm.overhead_gib - _static(sm)
    assert abs(peak - max(held, transient)) < 1e-9


def test_a_stage_whose_activations_exceed_the_transient_peaks_in_the_forward_backward():
    c = resolve_calibration("default", "te").screening_constants
    m = load_model("llama3-8b").with_layers(8)
    cfg = TrainConfig(tp=1, dp=4, mbs=4, gbs=32, seq=4096)
    sm = stage_memory(m, cfg, c)[0]
    assert sm.step_transient_gib == 0.0
    peak = sm.total_gib - sm.reserved_free_gib - sm.overhead_gib - _static(sm)
    assert abs(peak - (sm.activations_gib + sm.logits_gib)) < 1e-9


def test_the_measured_optimizer_phase_holds_four_bytes_per_shard_parameter():
    """nemotron4-15b[8L] TP1 DP4 (te-nem15-dp-00, data/measurements/h100x4-te*.jsonl): static_gib at
    the step start (weights, bf16 grads, fp32 master + Adam states, and the previous step's fp32 main
    grads) = 46.79 GiB measured; the model's static terms plus the optimizer transient within 0.3 GiB."""
    c = resolve_calibration("default", "te").screening_constants
    m = load_model("nemotron4-15b").with_layers(8)
    cfg = TrainConfig(tp=1, dp=4, mbs=1, gbs=32, seq=4096)
    sm = stage_memory(m, cfg, c)[0]
    optimizer_phase = _static(sm) + c.bytes_optimizer_transient * sm.params / cfg.dp / GIB
    assert abs(optimizer_phase - 46.79) < 0.3

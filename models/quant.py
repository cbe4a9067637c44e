"""What the linear layers' GEMMs cost in each training number format (Transformer Engine).

Under every low-precision format the linear layers of attention (QKV, output projection) and of the
MLP / experts run quantized; core attention, the embedding, the output layer and the router stay
BF16 (TE's autocast covers TE modules only). Per quantized GEMM TE writes two copies of its input
(the row-wise one for the forward / dgrad GEMM, the column-wise one for wgrad: a transpose for
per-tensor FP8, a second quantization along the other axis for the block formats), and in the
backward the same for the output gradient; each copy carries its scales. Blackwell's FP8 GEMMs take
either layout, so there TE makes no transpose of a per-tensor FP8 operand: one copy (a property of
the GPU under every profile: `GPUSpec.fp8_transposed_copy`; `copies`). The costs scale the fitted
FP8 ones (`Constants.fp8_cast_*`, `bytes_fp8_*`: 1-byte elements, no scales) by the format's bytes
per element (`constants.QUANT_FORMATS`), plus one read of the BF16 tensor where the scale needs
the tensor's own amax (current scaling). NVFP4's casts are priced from TE's measured quantize
kernels instead (`Constants.nvfp4_quantize_*`): the random Hadamard transform of the column-wise
copies wgrad reads and the gradients' stochastic rounding make them slower than their bytes.
Megatron-Bridge's performance runs keep no transformer layer in BF16 under any format
(scripts/performance get_precision_config: FP8 current scaling with first_last_layers_bf16 off,
NVFP4 as bf16_with_nvfp4_mixed, whose first / last BF16 layers are off), so neither does this.
"""
from __future__ import annotations

from dataclasses import dataclass

from advisor.catalog.specs import QUANTS, GPUSpec, ModelSpec
from advisor.models.constants import QUANT_FORMATS, Constants
from advisor.models.flops import attention_flops_all_layers, training_flops_per_token


@dataclass(frozen=True)
class Quant:
    """One format's GEMM rate and extra traffic, per element of a GEMM operand."""

    name: str
    peak_flops: float  # dense peak of its tensor cores, FLOP/s
    efficiency: float  # best sustained fraction of that peak
    half_dim: float  # GEMM efficiency saturation dimension
    in_bytes: float  # bytes per element the GEMM reads (with scales)
    cast_fwd_bytes: float  # extra HBM bytes per GEMM input element, forward
    cast_bwd_bytes: float  # ... per output-gradient element, backward
    weight_copy_bytes: float  # quantized copies of each linear weight kept in memory, bytes / param
    activation_bytes: float  # bytes per saved GEMM input element (kept for wgrad)


def element_bytes(name: str) -> float:
    """Bytes per element of a quantized operand, its scales included (MXFP8: 1 + 1/32)."""
    b, block, scale, _ = QUANT_FORMATS[name]
    return b + (scale / block if block else 0.0)


def quant(gpu: GPUSpec, code: int, c: Constants) -> Quant | None:
    """The format of QUANTS code `code` on `gpu` (None: bf16, the linear layers unquantized)."""
    name = QUANTS[int(code)]
    if name == "bf16":
        return None
    b = element_bytes(name)
    amax = c.bytes_activation if QUANT_FORMATS[name][3] else 0.0
    # the casts' writes (fp8_cast_fwd_bytes: the two 1-byte copies) per copy the format makes
    write = c.fp8_cast_fwd_bytes * b * copies(name, gpu) / 2.0
    fwd = write + amax
    bwd = (c.fp8_cast_bwd_bytes - c.fp8_cast_fwd_bytes) + write + amax
    if name == "nvfp4":  # TE's measured quantize pipelines (Hadamard transform, stochastic rounding)
        # at the peak bandwidth: the step divides cast bytes by hbm x hbm_efficiency
        fwd = c.nvfp4_quantize_input_bytes * c.hbm_efficiency
        bwd = c.nvfp4_quantize_grad_bytes * c.hbm_efficiency
    if name == "nvfp4":
        peak, eff, half = nvfp4_gemm_tflops(gpu, c), c.gemm_efficiency_max_fp4, c.gemm_half_dim_fp4
    else:
        peak, eff, half = gpu.fp8_tflops, c.gemm_efficiency_max_fp8, c.gemm_half_dim_fp8
    return Quant(name, peak * 1e12, eff, half, b, fwd, bwd, weight_copy_bytes(code, c, gpu), c.bytes_fp8_activation * b)


def fp8_transposed_copy(gpu: GPUSpec | None) -> bool:
    """GPUSpec.fp8_transposed_copy of `gpu`; None (no GPU given) is Hopper-like: True."""
    return True if gpu is None else bool(gpu.fp8_transposed_copy)


def copies(name: str, gpu: GPUSpec | None = None) -> float:
    """Quantized copies TE keeps of an operand in format `name` on `gpu`: per-tensor FP8 (no block
    scales) data + transpose where the GPU's FP8 GEMMs are TN-only (Hopper, Ada: 2), data alone
    where they take either layout (Blackwell: 1; GPUSpec.fp8_transposed_copy; None: Hopper-like);
    the block formats one per axis (2) on every GPU."""
    if QUANT_FORMATS[name][1]:
        return 2.0
    return 2.0 if fp8_transposed_copy(gpu) else 1.0


def nvfp4_gemm_tflops(gpu: GPUSpec, c: Constants) -> float:
    """The dense FP4 rate (TFLOP/s) the stack's NVFP4 GEMMs issue at: the GPU's FP4 peak, or
    `Constants.nvfp4_gemm_rate_bf16` x its BF16 peak where that is lower (Blackwell Ultra's 6x
    needs the SM103-only K=96 MMA; cuBLASLt's NVFP4 GEMMs, which TE calls, run the K=64 one at 4x).
    Scaled on the FP4 peak by the ratio of the per-clock rates (an integer: 4 Blackwell, 6 Blackwell
    Ultra), so the catalog's rounding of each peak does not move a Blackwell GPU's rate."""
    if gpu.fp4_tflops <= 0 or gpu.bf16_tflops <= 0:
        return gpu.fp4_tflops
    ratio = round(gpu.fp4_tflops / gpu.bf16_tflops)
    return gpu.fp4_tflops * min(1.0, c.nvfp4_gemm_rate_bf16 / ratio)


def weight_copy_bytes(code: int, c: Constants, gpu: GPUSpec | None = None) -> float:
    """Bytes per linear-layer weight of its quantized copies on `gpu` (0 under bf16; how many
    copies: `copies`, `gpu` None Hopper-like)."""
    name = QUANTS[int(code)]
    return 0.0 if name == "bf16" else c.bytes_fp8_weight_copy * element_bytes(name) * copies(name, gpu) / 2.0


def saved_input_bytes(code: int, c: Constants) -> float:
    """Bytes per saved GEMM-input element (the quantized copy wgrad reads; BF16 under bf16)."""
    name = QUANTS[int(code)]
    return c.bytes_activation if name == "bf16" else c.bytes_fp8_activation * element_bytes(name)


def mfu_peak_tflops(model: ModelSpec, seq: int, gpu: GPUSpec, code: int) -> float:
    """The dense peak (TFLOP/s) MFU divides by: the model FLOPs of a step over the time they
    would take at the peaks of the formats they run in. Under bf16 the BF16 peak; under FP8 /
    MXFP8 / NVFP4 the linear layers' GEMMs (6 FLOPs per weight per token, the output layer's
    excepted) at the format's peak, core attention and the output layer at the BF16 one. An
    MFU against it stays at or below 1 for any run the GPU can do (against the BF16 peak an
    NVFP4 run reads above 1)."""
    name = QUANTS[int(code)]
    bf16 = gpu.bf16_tflops
    if name == "bf16":
        return bf16
    total = training_flops_per_token(model, seq)
    high = 3.0 * attention_flops_all_layers(model, seq) + 6.0 * model.vocab_size * model.hidden_size
    low = max(0.0, total - high)
    # the GPU's peaks (not the lower rate the stack's NVFP4 GEMMs issue at: nvfp4_gemm_tflops)
    peak = gpu.fp4_tflops if name == "nvfp4" else gpu.fp8_tflops
    if peak <= 0:  # a format this GPU has no tensor cores for (refused before a prediction)
        return bf16
    return total / (low / peak + high / bf16)

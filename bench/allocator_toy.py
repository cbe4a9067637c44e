"""A toy of torch's caching allocator on a modelled dropless-MoE step (issue #27): how much memory stays
reserved but unallocated when the MoE token buffers change size with the routing, and how that grows
with the layers of a stage. A study, not a prediction: the allocation sequence is an assumption.

    python bench/allocator_toy.py            # Mixtral-8x7B / Qwen3-30B-A3B proxy shapes, L = 4 .. 32, cv 0 and > 0

The allocator (c10/cuda/CUDACachingAllocator.cpp, large pool, one stream, max_split_size unset):
requests over 1 MiB rounded up to 2 MiB; the smallest cached free block at least as large serves a
request, split when the remainder is over 1 MiB; none: a new segment (20 MiB under 10 MiB, else the
request's size); a freed block merges with free neighbours of its segment; segments are never
returned. Requests of 1 MiB or less (the small pool) are left out.
The step (PP = 1, per micro-batch; BF16 bytes; N = the busiest rank's routed tokens of the layer,
T k (1 + cv z), z standard normal, drawn per layer and micro-batch): per layer in the forward the
attention's kept tensors (4 of T h, one of 1.5 T h), the pre-MLP norm output (T h), router probs
(T E fp32), the permuted tokens (T k h, freed after the all-to-all), the all-to-all output (N h,
freed after the sort), the sorted tokens (N h, kept), FC1 output (N 2f, kept), the activation (N f,
kept), FC2 output and its unsorted copy (N h, freed), the combine's output (T k h, kept) and the
layer output (T h, kept); the loss's logits (T V x 6 B) and its fp32 gradient (T V x 4 B), freed; the
backward in reverse with the gradients of the same sizes, each freed after its use, and the layer's
kept tensors freed. Measured: peak reserved - peak allocated over `steps` steps.
"""
from __future__ import annotations

import argparse

import numpy as np

MIB, GIB = 2 ** 20, 2 ** 30
BF16 = 2


class CachingAllocator:
    """Segments as lists of [size, free] blocks; best fit over every cached free block."""

    def __init__(self):
        self.segments: list[list[list]] = []
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0

    def malloc(self, nbytes: int):
        if nbytes <= MIB:
            return None  # small pool: not modelled
        n = -(-int(nbytes) // (2 * MIB)) * (2 * MIB)
        best = None
        for seg in self.segments:
            for i, (size, free) in enumerate(seg):
                if free and size >= n and (best is None or size < best[0]):
                    best = (size, seg, i)
        if best is None:
            size = n if n >= 10 * MIB else 20 * MIB
            self.segments.append([[size, True]])
            self.reserved += size
            best = (size, self.segments[-1], 0)
        size, seg, i = best
        if size - n > MIB:
            seg[i] = [n, False]
            seg.insert(i + 1, [size - n, True])
        else:
            seg[i] = [size, False]
        block = seg[i]
        self.allocated += block[0]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return seg, block

    def free(self, handle) -> None:
        if handle is None:
            return
        seg, block = handle
        i = next(j for j, b in enumerate(seg) if b is block)
        block[1] = True
        self.allocated -= block[0]
        if i + 1 < len(seg) and seg[i + 1][1]:
            block[0] += seg[i + 1][0]
            del seg[i + 1]
        if i > 0 and seg[i - 1][1]:
            seg[i - 1][0] += block[0]
            del seg[i]


def moe_step_stranded(h: int, f: int, experts: int, top_k: int, layers: int, tokens: int, vocab: int,
                      microbatches: int, steps: int, cv: float, seed: int = 0) -> tuple[float, float]:
    """(peak allocated, peak reserved - peak allocated) GiB of the modelled steps (module doc)."""
    rng = np.random.default_rng(seed)
    a = CachingAllocator()
    T, m = tokens, a.malloc
    for _ in range(steps * microbatches):
        kept = []
        for _ in range(layers):
            N = max(1, int(T * top_k * (1.0 + cv * rng.standard_normal())))
            lay = [m(T * h * BF16) for _ in range(4)] + [m(int(T * 1.5 * h * BF16)), m(T * h * BF16),
                                                         m(T * experts * 4)]
            permuted = m(T * top_k * h * BF16)
            received = m(N * h * BF16)
            a.free(permuted)
            lay.append(m(N * h * BF16))  # sorted by expert: FC1's input
            a.free(received)
            lay += [m(N * 2 * f * BF16), m(N * f * BF16)]  # FC1 output, activation (FC2's input)
            out = m(N * h * BF16)
            unsorted = m(N * h * BF16)
            a.free(out)
            lay.append(m(T * top_k * h * BF16))  # the combine's input, kept for the probabilities' gradient
            a.free(unsorted)
            lay.append(m(T * h * BF16))
            kept.append((lay, N))
        logits = m(T * vocab * 6)
        grad = m(T * vocab * 4)
        a.free(logits)
        a.free(grad)
        for lay, N in reversed(kept):
            g_out, g_perm = m(T * h * BF16), m(T * top_k * h * BF16)
            g_recv = m(N * h * BF16)
            a.free(g_perm)
            g_sort = m(N * h * BF16)
            a.free(g_recv)
            g_act = m(N * f * BF16)
            a.free(g_sort)
            g_fc1 = m(N * 2 * f * BF16)
            a.free(g_act)
            g_in = m(N * h * BF16)
            a.free(g_fc1)
            g_unsort = m(N * h * BF16)
            a.free(g_in)
            g_back = m(T * top_k * h * BF16)
            a.free(g_unsort)
            g_x = m(T * h * BF16)
            a.free(g_back)
            a.free(g_out)
            for x in lay:
                a.free(x)
            g_attn = m(T * h * BF16)
            a.free(g_x)
            a.free(g_attn)
    return a.peak_allocated / GIB, (a.peak_reserved - a.peak_allocated) / GIB


SHAPES = {  # h, f, experts, top-k, tokens per rank and micro-batch, micro-batches per step, cv of N
    "mixtral-8x7b-proxy EP4 mbs1": (4096, 14336, 8, 2, 4096, 4, 0.2),
    "qwen3-30b-a3b-proxy EP4 mbs2": (2048, 768, 128, 8, 8192, 4, 0.32),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=4)
    a = ap.parse_args()
    print("reserved but unallocated at the peak, GiB (mean over seeds; cv 0: every buffer the same size)")
    for name, (h, f, e, k, T, mb, cv) in SHAPES.items():
        for layers in (4, 8, 16, 32):
            cells = []
            for c in (0.0, cv):
                r = [moe_step_stranded(h, f, e, k, layers, T, 32000, mb, a.steps, c, s)[1] for s in range(a.seeds)]
                cells.append(f"cv {c:4.2f}: {np.mean(r):5.2f} ({min(r):5.2f}-{max(r):5.2f})")
            print(f"  {name:30} L {layers:2d}  " + "   ".join(cells))


if __name__ == "__main__":
    main()

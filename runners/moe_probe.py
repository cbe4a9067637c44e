"""Mixture-of-experts pieces of the GPU worker (torch + megatron-core; never imports ``advisor``).

* ``TorchGroupedMLP``: the local experts as two grouped GEMMs (``torch._grouped_mm``, one kernel
  for all local experts, as Transformer Engine's GroupedLinear does), so the runner can measure
  grouped GEMM on and off without Transformer Engine; megatron-core 0.19.2's local spec only has
  ``SequentialMLP`` (one GEMM per expert).
* ``MoEPhaseTimer``: CUDA events around the sub-steps of every ``MoELayer`` (router, permute
  before / after dispatch, dispatch and combine, the experts, shared experts), forward AND
  backward: identity autograd functions on each sub-step's inputs and outputs record an event
  when the gradient reaches them, so a sub-step's backward is the time from the first gradient
  at its outputs to the last gradient at its inputs. It also keeps the tokens each expert got.

Sub-steps as megatron-core 0.19.2's ``MoELayer.forward`` runs them (``moe_layer.py``):
``shared_experts_compute`` -> ``route`` (router GEMM, score function, top-k, aux loss) ->
``preprocess`` (alltoall: permute the tokens by expert; allgather: reshape) -> ``dispatch``
(all-to-all / all-gather over EP) -> ``routed_experts_compute`` (allgather: permute local tokens;
alltoall with EP > 1: sort chunks by expert; then ``experts``; then the inverse) -> ``combine``
(all-to-all / reduce-scatter) -> ``postprocess`` (alltoall: unpermute and weight the tokens).
"""
from __future__ import annotations

import statistics

import torch

from megatron.core.transformer.module import MegatronModule

PHASES = ("shared", "router", "preprocess", "dispatch", "routed", "experts", "combine", "postprocess", "layer")
_METHODS = {"shared_experts_compute": "shared", "route": "router", "preprocess": "preprocess",
            "dispatch": "dispatch", "routed_experts_compute": "routed", "combine": "combine",
            "postprocess": "postprocess"}


# ------------------------------------------------------------------------------ grouped experts
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (torch._grouped_mm's backward
    refuses expanded ones)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class TorchGroupedMLP(MegatronModule):
    """Local experts as fc1 / activation / fc2 over all experts at once: two ``torch._grouped_mm``
    calls on the permuted tokens (one group per expert, offsets from tokens_per_expert).
    Expert TP is not supported (the runner's MoE runs have etp = 1). ``pad`` (class-wide) pads
    each expert's rows to a multiple of it when the kernel refuses unaligned groups."""

    pad = 0

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, name=None):
        super().__init__(config=config)
        assert config.expert_tensor_parallel_size == 1, "TorchGroupedMLP: expert TP is not supported"
        self.num_local_experts = num_local_experts
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        self.gated = config.gated_linear_unit
        dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, h, (2 if self.gated else 1) * f,
                                                      device=dev, dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, f, h, device=dev,
                                                      dtype=config.params_dtype))
        config.init_method(self.weight1)
        config.output_layer_init_method(self.weight2)
        expert_pgs = config.expert_model_parallel_size > 1
        for w in (self.weight1, self.weight2):
            w.allreduce = not expert_pgs  # expert-DP gradient reduction when EP > 1 (as ColumnParallelLinear)

    def _act(self, x):
        if self.gated:
            a, b = torch.chunk(x, 2, dim=-1)
            return self.config.activation_func(a) * b
        return self.config.activation_func(x)

    def _mm(self, x, w, offs):
        return torch._grouped_mm(x, w, offs=offs)

    def forward(self, hidden, tokens_per_expert, probs):
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        x = hidden
        idx = None
        if self.pad:
            padded = [-(-c // self.pad) * self.pad for c in counts]
            starts, pos = [], 0
            for p in padded:
                starts.append(pos)
                pos += p
            idx = torch.cat([torch.arange(s, s + c, device=x.device) for s, c in zip(starts, counts)]) \
                if x.shape[0] else torch.zeros(0, dtype=torch.long, device=x.device)
            xp = x.new_zeros(pos, x.shape[1])
            x = xp.index_copy(0, idx, x)
            counts = padded
        offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        y = self._mm(_ContiguousGrad.apply(x), self.weight1, offs)
        if idx is not None:
            y = y.index_select(0, idx)
        y = self._act(y)
        y = (y * probs.unsqueeze(-1)).to(hidden.dtype)
        if idx is not None:
            y = y.new_zeros(x.shape[0], y.shape[1]).index_copy(0, idx, y)
        out = self._mm(_ContiguousGrad.apply(y), self.weight2, offs)
        if idx is not None:
            out = out.index_select(0, idx)
        return out, None


def patch_grouped_experts(block_spec) -> int:
    """Replace the experts of every MoE layer spec with TorchGroupedMLP; returns how many. The
    layer spec's mlp is a ModuleSpec (dense) or, for MoE in megatron-core 0.19.2,
    functools.partial(MoELayer, submodules=MoESubmodules(experts=...))."""
    import dataclasses
    import functools

    n = 0
    for ls in block_spec.layer_specs:
        mlp = getattr(ls.submodules, "mlp", None)
        if isinstance(mlp, functools.partial) and hasattr(mlp.keywords.get("submodules"), "experts"):
            sub = dataclasses.replace(mlp.keywords["submodules"], experts=TorchGroupedMLP)
            ls.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})
            n += 1
        elif hasattr(getattr(mlp, "submodules", None), "experts"):
            mlp.submodules.experts = TorchGroupedMLP
            n += 1
    return n


def probe_grouped_mm(dtype=torch.bfloat16) -> str:
    """Which grouped-GEMM mode this torch / GPU takes: 'torch_grouped_mm' (unaligned groups work),
    'torch_grouped_mm_pad<N>' (groups padded), or 'unavailable: <why>'."""
    if not grouped_mm_available():
        return "unavailable: torch has no _grouped_mm"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(37, 64, device=dev, dtype=dtype, requires_grad=True)
    b = torch.randn(3, 64, 48, device=dev, dtype=dtype, requires_grad=True)
    try:
        o = torch._grouped_mm(a, b, offs=torch.tensor([5, 5, 37], device=dev, dtype=torch.int32))
        o.backward(torch.ones_like(o))
        if dev == "cuda":
            torch.cuda.synchronize()
        TorchGroupedMLP.pad = 0
        return "torch_grouped_mm"
    except RuntimeError as e:
        first = str(e).splitlines()[0][:200]
    try:
        a2 = torch.randn(48, 64, device=dev, dtype=dtype, requires_grad=True)
        o = torch._grouped_mm(a2, b, offs=torch.tensor([16, 16, 48], device=dev, dtype=torch.int32))
        o.backward(torch.ones_like(o))
        TorchGroupedMLP.pad = 16
        return "torch_grouped_mm_pad16"
    except RuntimeError as e:
        return f"unavailable: {first} / {str(e).splitlines()[0][:200]}"


# ------------------------------------------------------------------------------ phase timing
class _Mark(torch.autograd.Function):
    """Identity; its backward records a CUDA event into `sink` (a list)."""

    @staticmethod
    def forward(ctx, sink, x):
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.sink.append(_event())
        return None, g


def _event():
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _mark_tensors(obj, sink):
    """obj with every grad-requiring tensor (top level or in a tuple / list) passed through _Mark."""
    if torch.is_tensor(obj):
        return _Mark.apply(sink, obj) if obj.requires_grad and torch.is_grad_enabled() else obj
    if isinstance(obj, tuple):
        return tuple(_mark_tensors(o, sink) for o in obj)
    if isinstance(obj, list):
        return [_mark_tensors(o, sink) for o in obj]
    return obj


class _Call:
    __slots__ = ("phase", "f0", "f1", "bwd_out", "bwd_in")

    def __init__(self, phase):
        self.phase = phase
        self.f0 = self.f1 = None
        self.bwd_out: list = []
        self.bwd_in: list = []


class MoEPhaseTimer:
    """Times the sub-steps of every MoELayer of `chunks` while `active`; see the module doc."""

    def __init__(self, chunks):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.active = False
        self.calls: list[_Call] = []
        self.counts: list = []  # tokens_per_expert of each experts call (this step)
        self.layers = [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]
        for layer in self.layers:
            for meth, phase in _METHODS.items():
                if hasattr(layer, meth):
                    setattr(layer, meth, self._wrap(getattr(layer, meth), phase))
            layer.forward = self._wrap(layer.forward, "layer")
            layer.experts.forward = self._wrap(layer.experts.forward, "experts", counts=True)

    def _wrap(self, fn, phase, counts=False):
        def wrapped(*args, **kw):
            if not self.active:
                return fn(*args, **kw)
            call = _Call(phase)
            self.calls.append(call)
            if counts and len(args) > 1 and torch.is_tensor(args[1]):
                self.counts.append(args[1].detach().clone())
            args = _mark_tensors(args, call.bwd_in)
            call.f0 = _event()
            out = fn(*args, **kw)
            call.f1 = _event()
            return _mark_tensors(out, call.bwd_out)
        return wrapped

    def start(self):
        self.calls, self.counts = [], []
        self.active = True
        self.t0 = _event()

    def stop(self) -> dict:
        """Seconds per phase (forward, backward) summed over the step's calls, and the tokens per
        expert of every experts call."""
        self.active = False
        torch.cuda.synchronize()
        t = lambda ev: self.t0.elapsed_time(ev) / 1e3  # noqa: E731
        out = {p: {"fwd_s": 0.0, "bwd_s": 0.0, "calls": 0} for p in PHASES}
        for c in self.calls:
            d = out[c.phase]
            d["calls"] += 1
            d["fwd_s"] += t(c.f1) - t(c.f0)
            if c.bwd_out and c.bwd_in:
                d["bwd_s"] += max(0.0, max(t(e) for e in c.bwd_in) - min(t(e) for e in c.bwd_out))
        counts = [[int(x) for x in c.tolist()] for c in self.counts]
        self.calls, self.counts = [], []
        return {"phases": out, "tokens_per_expert": counts}


def summarize(steps: list[dict], step_times: list[float]) -> dict:
    """Median over profiled steps of each phase's forward / backward seconds per step, the
    derived model terms, and load statistics of the tokens per expert (first profiled step)."""
    phases = {}
    for p in PHASES:
        f = [s["phases"][p]["fwd_s"] for s in steps]
        b = [s["phases"][p]["bwd_s"] for s in steps]
        phases[p] = {"fwd_s": statistics.median(f), "bwd_s": statistics.median(b),
                     "calls": steps[0]["phases"][p]["calls"]}

    def tot(p):
        return phases[p]["fwd_s"] + phases[p]["bwd_s"]
    terms = {"router_s": tot("router"),
             # permute + unpermute: before / after dispatch and the local re-sorting around the experts
             "permute_s": tot("preprocess") + tot("postprocess") + max(0.0, tot("routed") - tot("experts")),
             "dispatch_s": tot("dispatch") + tot("combine"),
             "expert_s": tot("experts"), "shared_s": tot("shared"), "layer_s": tot("layer")}
    loads = []
    for c in steps[0]["tokens_per_expert"]:
        n = len(c)
        mean = sum(c) / n if n else 0.0
        if mean > 0:
            sd = (sum((x - mean) ** 2 for x in c) / n) ** 0.5
            loads.append((max(c) / mean, sd / mean))
    load = ({"max_over_mean": statistics.mean(x for x, _ in loads), "cv": statistics.mean(y for _, y in loads),
             "calls": len(loads)} if loads else None)
    return {"phases": phases, "terms": terms, "load": load,
            "tokens_per_expert": steps[0]["tokens_per_expert"],
            "profiled_step_s": statistics.median(step_times) if step_times else None,
            "profiled_steps": len(steps)}

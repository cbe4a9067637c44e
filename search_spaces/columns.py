"""The layout space of search_spaces.space as columns: the same layouts in the same order as
`enumerate_layouts`, built as arrays (models.vectorized.Layouts) without a TrainConfig per layout;
a row's TrainConfig is made when it is asked for (Layouts.config)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from advisor.catalog.specs import (CROSS_ENTROPY_IMPLS, FP8_PARAM_QUANTS, MOE_KNOB_DEFAULTS, MOE_KNOBS, QUANTS,
                                   RECOMPUTE_MODULES, ClusterSpec, ModelSpec, TrainConfig, knobs_key, quant_name,
                                   quant_parts)
from advisor.search_spaces.space import (SpaceOptions, Workload, expert_choices, fsdp_choices,
                                         model_parallel_choices, split_choices)

RECOMPUTE_CODES = {"none": 0, "selective": 1, "full": 2}


def recompute_modules_code(modules) -> int:
    """A bitmask of RECOMPUTE_MODULES (0: (), megatron-core's default) for Layouts.rc_modules."""
    return sum(1 << RECOMPUTE_MODULES.index(m) for m in modules)


def recompute_modules_of(code: int) -> tuple[str, ...]:
    """The modules of a recompute_modules_code, in RECOMPUTE_MODULES order."""
    return tuple(m for b, m in enumerate(RECOMPUTE_MODULES) if code >> b & 1)


_COLS = ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "dist", "rc", "split", "fsdp")


def enumerate_columns(model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                      options: SpaceOptions = SpaceOptions()):
    """models.vectorized.Layouts of every legal layout, in enumerate_layouts' order."""
    from advisor.search_spaces.layout import plan_from_parts

    blocks: list[np.ndarray] = []
    splits: list[dict] = []
    split_ids: dict = {}
    rcs = np.array([RECOMPUTE_CODES[r] for r in options.recompute], np.int64)
    moe = model.is_moe
    for tp, cp, pp, dp in model_parallel_choices(model, cluster, workload, options):
        eps, etps = expert_choices(model, tp, cp, dp)
        # the (ep, etp) pairs and distributed-optimizer settings _inner keeps, in its order
        pairs = [(ep, etp) for ep in eps for etp in etps
                 if not (dp * cp * tp) % (ep * etp) and not (moe and model.moe.ffn_hidden_size % etp)]
        # the (distributed optimizer, FSDP) settings _inner keeps, in its order
        dists = [(bool(d and dp * cp > 1), f) for d in options.distributed_optimizer
                 for f in fsdp_choices(options, bool(d and dp * cp > 1), dp, cp, pp)]
        per_dp = workload.gbs // dp
        for split, vps in split_choices(model.num_layers, pp, options):
            key = tuple(sorted(split.items()))
            sid = split_ids.get(key)
            if sid is None:
                sid = split_ids[key] = len(splits)
                splits.append(dict(split))
            mv = [(mbs, vp) for mbs in options.mbs if not per_dp % mbs
                  for vp in vps if not (vp > 1 and (per_dp // mbs) % pp)]
            if not mv or not pairs or not dists or not len(rcs):
                continue
            # the product mbs/vp x ep/etp x dist x recompute, recompute innermost
            n_mv, n_pe, n_d, n_r = len(mv), len(pairs), len(dists), len(rcs)
            mva = np.repeat(np.array(mv, np.int64), n_pe * n_d * n_r, axis=0)
            pea = np.tile(np.repeat(np.array(pairs, np.int64), n_d * n_r, axis=0), (n_mv, 1))
            da = np.tile(np.repeat(np.array(dists, np.int64), n_r, axis=0), (n_mv * n_pe, 1))
            ra = np.tile(rcs, n_mv * n_pe * n_d)
            n = len(ra)
            blocks.append(np.stack([np.full(n, tp), np.full(n, pp), np.full(n, dp), np.full(n, cp),
                                    pea[:, 0], pea[:, 1], mva[:, 1], mva[:, 0], da[:, 0], ra, np.full(n, sid),
                                    da[:, 1]], 1))
    a = np.concatenate(blocks, 0) if blocks else np.zeros((0, len(_COLS)), np.int64)
    col = {k: a[:, j] for j, k in enumerate(_COLS)}
    n = len(a)
    # pipeline plans: one per distinct (pp, vp, split)
    first, inv = unique_rows([col["pp"], col["vp"], col["split"]])
    plans = []
    for r in first:
        pp, vp, sid = col["pp"][r], col["vp"][r], col["split"][r]
        s = splits[int(sid)]
        plans.append(plan_from_parts(model.num_layers, int(pp), int(vp), s.get("pp_first_layers"), s.get("pp_last_layers"),
                           bool(s.get("account_for_embedding", False)), bool(s.get("account_for_loss", False)),
                           s.get("pipeline_layout")))
    dpcp = col["dp"] * col["cp"] > 1
    tp1 = col["tp"] > 1
    L = Layouts(model=model, tp=col["tp"], pp=col["pp"], dp=col["dp"], cp=col["cp"], ep=col["ep"], etp=col["etp"],
                vp=col["vp"], mbs=col["mbs"], gbs=np.full(n, workload.gbs, np.int64),
                seq=np.full(n, workload.seq, np.int64), recompute=col["rc"], sp=tp1 & bool(options.sequence_parallel), dist_opt=col["dist"].astype(bool),
                overlap_grad=dpcp, overlap_param=col["dist"].astype(bool) & dpcp,
                tp_overlap=tp1 & bool(options.tp_comm_overlap),
                grad_fusion=np.full(n, bool(options.gradient_accumulation_fusion)), fp8=np.full(n, QUANTS.index(quant_name(workload.precision, workload.fp8_recipe)), np.int8),
                plan=inv.reshape(-1).astype(np.int64), plans=plans, configs=[None] * n,
                extras=[_moe_defaults(model, options)] * n, same_extras=True,
                ce=np.full(n, CROSS_ENTROPY_IMPLS.index(options.cross_entropy_impl or "unfused"), np.int8))
    q = QUANTS.index(quant_name(workload.precision, workload.fp8_recipe))
    if options.fp8_param_gather and q in FP8_PARAM_QUANTS:  # with the distributed optimizer only
        L.fpg = col["dist"].astype(bool)
    if options.expandable_segments:
        L.xseg = np.ones(n, bool)
    if options.deallocate_pipeline_outputs:
        L.dpo = np.ones(n, bool)
    if options.nccl_lazy_init:
        L.lazy = np.ones(n, bool)
    if any(options.fsdp):  # Megatron FSDP where the space offers it (search_spaces.space.fsdp_applies)
        L.fsdp = col["fsdp"].astype(bool)
    L.split = col["split"]
    L.splits = splits
    L.precision = workload.precision
    return L


def _moe_defaults(model: ModelSpec, options: SpaceOptions) -> tuple:
    """The MoE knobs of every layout of the space: megatron-core's defaults, with TE's fused router
    and permutation on a MoE model where the options ask for them (the te stack's recipes)."""
    if not (options.moe_fusion and model.is_moe):
        return MOE_KNOB_DEFAULTS
    d = dict(zip(MOE_KNOBS, MOE_KNOB_DEFAULTS), moe_router_fusion=True, moe_permute_fusion=True)
    return tuple(d[k] for k in MOE_KNOBS)


# ------------------------------------------------------------------------------------------------
# layouts as columns
# ------------------------------------------------------------------------------------------------

@dataclass
class Layouts:
    """Layouts of one model as columns (one row each) plus the TrainConfig of each row, built on
    demand (`config`). `plans`: the distinct pipeline plans, `plan`: each row's index into them."""

    model: ModelSpec
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    vp: np.ndarray
    mbs: np.ndarray
    gbs: np.ndarray
    seq: np.ndarray
    recompute: np.ndarray          # RECOMPUTE_CODES
    sp: np.ndarray                 # sequence parallel
    dist_opt: np.ndarray
    overlap_grad: np.ndarray
    overlap_param: np.ndarray
    tp_overlap: np.ndarray
    grad_fusion: np.ndarray        # gradient_accumulation_fusion
    fp8: np.ndarray                # catalog.specs.QUANTS code of the linear layers' format (0 = bf16)
    plan: np.ndarray
    plans: list
    configs: list = field(default_factory=list, repr=False)   # TrainConfig or None per row
    extras: list = field(default_factory=list, repr=False)    # per row: the TrainConfig fields not in columns
    # rows made by search_spaces.columns: each row's pipeline split (an index into `splits`, the
    # TrainConfig fields of the split) and the workload's precision, to make a row's TrainConfig
    split: np.ndarray | None = None
    splits: list = field(default_factory=list, repr=False)
    precision: str = "bf16"
    same_extras: bool = False  # every row has the same extras (search_spaces.columns)
    ce: np.ndarray | None = None   # catalog.specs.CROSS_ENTROPY_IMPLS code of the loss (None: all "unfused")
    fpg: np.ndarray | None = None  # TrainConfig.fp8_param_gather (None: all off)
    xseg: np.ndarray | None = None  # TrainConfig.expandable_segments (None: all off)
    dpo: np.ndarray | None = None  # TrainConfig.deallocate_pipeline_outputs (None: all off)
    fsdp: np.ndarray | None = None  # TrainConfig.fsdp (None: all off)
    lazy: np.ndarray | None = None  # TrainConfig.nccl_lazy_init (None: all eager)
    offload: np.ndarray | None = None  # TrainConfig.cpu_offload_layers (None: all 0)
    rc_layers: np.ndarray | None = None  # TrainConfig.recompute_layers, -1 for None (None: all None)
    rc_modules: np.ndarray | None = None  # TrainConfig.recompute_modules as modules_code (None: all ())

    def __len__(self) -> int:
        return len(self.tp)

    def per_cross_entropy(self, value) -> np.ndarray:
        """Per layout, `value(impl)` of its loss's cross entropy (catalog.specs.CROSS_ENTROPY_IMPLS;
        a column of "unfused" where the layouts carry none)."""
        table = np.array([value(impl) for impl in CROSS_ENTROPY_IMPLS], float)
        return table[self.ce] if self.ce is not None else np.full(len(self), table[0])

    @property
    def num_microbatches(self) -> np.ndarray:
        return np.maximum(1, self.gbs // (self.mbs * self.dp))

    @property
    def expert_dp(self) -> np.ndarray:
        return np.maximum(1, (self.dp * self.cp * self.tp) // (self.ep * self.etp))

    @classmethod
    def of(cls, model: ModelSpec, cfgs: Sequence[TrainConfig]) -> "Layouts":
        """Columns of `cfgs` (illegal pipeline splits raise IllegalLayout, as pipeline_plan does)."""
        from advisor.search_spaces.layout import pipeline_plan

        cfgs = list(cfgs)
        ids: dict = {}
        plans: list = []
        plan = np.empty(len(cfgs), np.int64)
        for i, cfg in enumerate(cfgs):
            p = pipeline_plan(model, cfg)
            j = ids.get(p)
            if j is None:
                j = ids[p] = len(plans)
                plans.append(p)
            plan[i] = j

        def col(name, dtype=np.int64):
            return np.array([getattr(c, name) for c in cfgs], dtype)

        return cls(model=model, tp=col("tp"), pp=col("pp"), dp=col("dp"), cp=col("cp"), ep=col("ep"),
                   etp=col("etp"), vp=col("vp"), mbs=col("mbs"), gbs=col("gbs"), seq=col("seq"),
                   recompute=np.array([RECOMPUTE_CODES[c.recompute] for c in cfgs], np.int64),
                   sp=col("sequence_parallel", bool), dist_opt=col("distributed_optimizer", bool),
                   overlap_grad=col("overlap_grad_reduce", bool), overlap_param=col("overlap_param_gather", bool),
                   tp_overlap=col("tp_comm_overlap", bool), grad_fusion=col("gradient_accumulation_fusion", bool),
                   fp8=np.array([c.quant_code for c in cfgs], np.int8), plan=plan, plans=plans,
                   configs=cfgs, extras=[c.moe_knobs() for c in cfgs],
                   ce=np.array([CROSS_ENTROPY_IMPLS.index(c.cross_entropy_impl) for c in cfgs], np.int8),
                   fpg=col("fp8_param_gather", bool) if any(c.fp8_param_gather for c in cfgs) else None,
                   xseg=col("expandable_segments", bool) if any(c.expandable_segments for c in cfgs) else None,
                   dpo=col("deallocate_pipeline_outputs", bool) if any(c.deallocate_pipeline_outputs for c in cfgs)
                   else None,
                   fsdp=col("fsdp", bool) if any(c.fsdp for c in cfgs) else None,
                   lazy=col("nccl_lazy_init", bool) if any(c.nccl_lazy_init for c in cfgs) else None,
                   offload=col("cpu_offload_layers") if any(c.cpu_offload_layers for c in cfgs) else None,
                   rc_layers=np.array([-1 if c.recompute_layers is None else c.recompute_layers for c in cfgs], np.int64)
                   if any(c.recompute_layers is not None for c in cfgs) else None,
                   rc_modules=np.array([recompute_modules_code(c.recompute_modules) for c in cfgs], np.int64)
                   if any(c.recompute_modules for c in cfgs) else None)

    def config(self, i: int) -> TrainConfig:
        """Row i's TrainConfig (made from the columns the first time it is asked for)."""
        i = int(i)
        c = self.configs[i]
        if c is None:
            names = {v: k for k, v in RECOMPUTE_CODES.items()}
            c = self.configs[i] = TrainConfig(
                tp=int(self.tp[i]), pp=int(self.pp[i]), dp=int(self.dp[i]), cp=int(self.cp[i]), ep=int(self.ep[i]),
                etp=int(self.etp[i]), vp=int(self.vp[i]), mbs=int(self.mbs[i]), gbs=int(self.gbs[i]),
                seq=int(self.seq[i]), **dict(zip(("precision", "fp8_recipe"), quant_parts(self.fp8[i]))),
                recompute=names[int(self.recompute[i])], sequence_parallel=bool(self.sp[i]),
                distributed_optimizer=bool(self.dist_opt[i]), overlap_grad_reduce=bool(self.overlap_grad[i]),
                overlap_param_gather=bool(self.overlap_param[i]), tp_comm_overlap=bool(self.tp_overlap[i]),
                gradient_accumulation_fusion=bool(self.grad_fusion[i]),
                **dict(zip(MOE_KNOBS, self.extras[i])), **self.splits[int(self.split[i])],
                cross_entropy_impl=CROSS_ENTROPY_IMPLS[int(self.ce[i]) if self.ce is not None else 0],
                fp8_param_gather=bool(self.fpg[i]) if self.fpg is not None else False,
                expandable_segments=bool(self.xseg[i]) if self.xseg is not None else False,
                deallocate_pipeline_outputs=bool(self.dpo[i]) if self.dpo is not None else False,
                fsdp=bool(self.fsdp[i]) if self.fsdp is not None else False,
                nccl_lazy_init=bool(self.lazy[i]) if self.lazy is not None else False,
                cpu_offload_layers=int(self.offload[i]) if self.offload is not None else 0,
                **self.recompute_fields(i))
        return c

    @property
    def partial_recompute(self) -> bool:
        """Some row sets recompute_layers or recompute_modules (models/recompute.py prices them)."""
        return self.rc_layers is not None or self.rc_modules is not None

    def recompute_fields(self, i: int) -> dict:
        """Row i's recompute_layers and recompute_modules (TrainConfig fields)."""
        n = int(self.rc_layers[i]) if self.rc_layers is not None else -1
        code = int(self.rc_modules[i]) if self.rc_modules is not None else 0
        return {"recompute_layers": None if n < 0 else n,
                "recompute_modules": recompute_modules_of(code)}

    def key(self, i: int) -> str:
        """TrainConfig.key() of row i (from the columns when its TrainConfig is not made yet)."""
        i = int(i)
        c = self.configs[i]
        if c is not None:
            return c.key()
        sp = self.splits[int(self.split[i])]
        names = ("none", "selective", "full")
        return (f"tp{self.tp[i]}-pp{self.pp[i]}-dp{self.dp[i]}-cp{self.cp[i]}-ep{self.ep[i]}-etp{self.etp[i]}"
                f"-vp{self.vp[i]}-mbs{self.mbs[i]}-gbs{self.gbs[i]}-seq{self.seq[i]}"
                f"-{QUANTS[int(self.fp8[i])]}-{names[int(self.recompute[i])]}"
                + ("-acce" if sp.get("account_for_embedding") else "") + ("-accl" if sp.get("account_for_loss") else "")
                + (f"-layout[{sp['pipeline_layout']}]" if sp.get("pipeline_layout") else "")
                + knobs_key(self.extras[i], **self.recompute_fields(i),
                            cpu_offload_layers=int(self.offload[i]) if self.offload is not None else 0,
                            fsdp=bool(self.fsdp[i]) if self.fsdp is not None else False))

    def take(self, idx: np.ndarray) -> "Layouts":
        """The rows `idx` (in that order)."""
        idx = np.asarray(idx, np.int64)
        cols = {f.name: getattr(self, f.name)[idx] for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}
        cfgs = [self.configs[i] for i in idx]
        ex = [self.extras[i] for i in idx]
        return Layouts(model=self.model, plans=self.plans, configs=cfgs, extras=ex, splits=self.splits,
                       precision=self.precision, same_extras=self.same_extras, **cols)

    def repeat(self, n: int) -> "Layouts":
        """Every row n times in a row (rows i*n .. i*n + n - 1 are row i): for sweeps over caps."""
        return self.take(np.repeat(np.arange(len(self)), n))


def extra_codes(L: "Layouts", values: Sequence) -> np.ndarray:
    """_codes of per-row values of L.extras (all 0 when every row has the same extras)."""
    if L.same_extras:
        return np.zeros(len(values), np.int64)
    return _codes(values)


def _codes(values: Sequence) -> np.ndarray:
    """Small integer codes of hashable values (equal values, equal codes)."""
    ids: dict = {}
    return np.fromiter((ids.setdefault(v, len(ids)) for v in values), np.int64, len(values))


def unique_rows(cols: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first row of each distinct combination, inverse: each row's combination)."""
    a = [np.asarray(x, np.int64) for x in cols]
    n = len(a[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    key = np.zeros(n, np.int64)
    radix = 1
    for x in a:  # one mixed-radix integer per row, while it fits in 62 bits
        lo, span = int(x.min()), int(x.max()) - int(x.min()) + 1
        radix *= span
        if radix >= 2 ** 62:
            _, first, inv = np.unique(np.stack(a, 1), axis=0, return_index=True, return_inverse=True)
            return first, inv.reshape(-1)
        key = key * span + (x - lo)
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)

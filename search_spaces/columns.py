"""The layout space of search_spaces.space as columns: the same layouts in the same order as
`enumerate_layouts`, built as arrays (models.vectorized.Layouts) without a TrainConfig per layout;
a row's TrainConfig is made when it is asked for (Layouts.config)."""
from __future__ import annotations

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec
from advisor.search_spaces.space import SpaceOptions, Workload, divisors, powers_of_two_upto, split_choices

_COLS = ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "dist", "rc", "split")


def enumerate_columns(model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                      options: SpaceOptions = SpaceOptions()):
    """models.vectorized.Layouts of every legal layout, in enumerate_layouts' order."""
    from advisor.models.vectorized import RECOMPUTE_CODES, Layouts
    from advisor.search_spaces.layout import _plan

    world = cluster.world_size
    gpn = cluster.gpus_per_node
    heads, kv = model.num_attention_heads, model.kv_heads
    tps = [t for t in divisors(gpn) if heads % t == 0 and (model.mla is not None or kv % t == 0)]
    cps = [c for c in powers_of_two_upto(options.max_cp)
           if c == 1 or (workload.seq % (2 * c) == 0 and workload.seq // c >= options.min_tokens_per_cp_rank)]
    rows: list[tuple] = []
    splits: list[dict] = []
    split_ids: dict = {}
    rcs = [RECOMPUTE_CODES[r] for r in options.recompute]
    moe = model.is_moe
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > model.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                if workload.gbs % dp:
                    continue
                for split, vps in split_choices(model.num_layers, pp, options):
                    key = tuple(sorted(split.items()))
                    sid = split_ids.get(key)
                    if sid is None:
                        sid = split_ids[key] = len(splits)
                        splits.append(dict(split))
                    if moe:
                        eps = [e for e in divisors(model.num_experts) if (dp * cp * tp) % e == 0]
                        etps = sorted({1, tp})
                    else:
                        eps, etps = [1], [1]
                    per_dp = workload.gbs // dp
                    for mbs in options.mbs:
                        if per_dp % mbs:
                            continue
                        m = per_dp // mbs
                        for vp in vps:
                            if vp > 1 and m % pp:
                                continue
                            for ep in eps:
                                for etp in etps:
                                    if (dp * cp * tp) % (ep * etp):
                                        continue
                                    if moe and model.moe.ffn_hidden_size % etp:
                                        continue
                                    for dist in options.distributed_optimizer:
                                        d = dist and dp * cp > 1
                                        for rc in rcs:
                                            rows.append((tp, pp, dp, cp, ep, etp, vp, mbs, d, rc, sid))
    a = np.array(rows, np.int64).reshape(-1, len(_COLS))
    col = {k: a[:, j] for j, k in enumerate(_COLS)}
    n = len(a)
    # pipeline plans: one per distinct (pp, vp, split)
    pv = np.stack([col["pp"], col["vp"], col["split"]], 1)
    uniq, inv = (np.unique(pv, axis=0, return_inverse=True) if n else (np.zeros((0, 3), np.int64), np.zeros(0, np.int64)))
    plans = []
    for pp, vp, sid in uniq:
        s = splits[int(sid)]
        plans.append(_plan(model.num_layers, int(pp), int(vp), s.get("pp_first_layers"), s.get("pp_last_layers"),
                           bool(s.get("account_for_embedding", False)), bool(s.get("account_for_loss", False)),
                           s.get("pipeline_layout")))
    dpcp = col["dp"] * col["cp"] > 1
    tp1 = col["tp"] > 1
    L = Layouts(model=model, tp=col["tp"], pp=col["pp"], dp=col["dp"], cp=col["cp"], ep=col["ep"], etp=col["etp"],
                vp=col["vp"], mbs=col["mbs"], gbs=np.full(n, workload.gbs, np.int64),
                seq=np.full(n, workload.seq, np.int64), recompute=col["rc"], sp=tp1, dist_opt=col["dist"].astype(bool),
                overlap_grad=dpcp, overlap_param=col["dist"].astype(bool) & dpcp,
                tp_overlap=tp1 & bool(options.tp_comm_overlap), fp8=np.full(n, workload.precision == "fp8"),
                plan=inv.reshape(-1).astype(np.int64), plans=plans, configs=[None] * n,
                extras=[("alltoall", True, "aux_loss")] * n)
    L.split = col["split"]
    L.splits = splits
    L.precision = workload.precision
    return L

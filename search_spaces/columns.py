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
    from advisor.models.vectorized import RECOMPUTE_CODES, Layouts, _unique_rows
    from advisor.search_spaces.layout import _plan

    world = cluster.world_size
    gpn = cluster.gpus_per_node
    heads, kv = model.num_attention_heads, model.kv_heads
    tps = [t for t in divisors(gpn) if heads % t == 0 and (model.mla is not None or kv % t == 0)]
    cps = [c for c in powers_of_two_upto(options.max_cp)
           if c == 1 or (workload.seq % (2 * c) == 0 and workload.seq // c >= options.min_tokens_per_cp_rank)]
    blocks: list[np.ndarray] = []
    splits: list[dict] = []
    split_ids: dict = {}
    rcs = np.array([RECOMPUTE_CODES[r] for r in options.recompute], np.int64)
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
                if moe:
                    eps = [e for e in divisors(model.num_experts) if (dp * cp * tp) % e == 0]
                    etps = sorted({1, tp})
                else:
                    eps, etps = [1], [1]
                # the (ep, etp) pairs and distributed-optimizer settings _inner keeps, in its order
                pairs = [(ep, etp) for ep in eps for etp in etps
                         if not (dp * cp * tp) % (ep * etp) and not (moe and model.moe.ffn_hidden_size % etp)]
                dists = [bool(d and dp * cp > 1) for d in options.distributed_optimizer]
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
                    da = np.tile(np.repeat(np.array(dists, np.int64), n_r), n_mv * n_pe)
                    ra = np.tile(rcs, n_mv * n_pe * n_d)
                    n = len(ra)
                    blocks.append(np.stack([np.full(n, tp), np.full(n, pp), np.full(n, dp), np.full(n, cp),
                                            pea[:, 0], pea[:, 1], mva[:, 1], mva[:, 0], da, ra, np.full(n, sid)], 1))
    a = np.concatenate(blocks, 0) if blocks else np.zeros((0, len(_COLS)), np.int64)
    col = {k: a[:, j] for j, k in enumerate(_COLS)}
    n = len(a)
    # pipeline plans: one per distinct (pp, vp, split)
    first, inv = _unique_rows([col["pp"], col["vp"], col["split"]])
    plans = []
    for r in first:
        pp, vp, sid = col["pp"][r], col["vp"][r], col["split"][r]
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
                extras=[("alltoall", True, "aux_loss")] * n, same_extras=True)
    L.split = col["split"]
    L.splits = splits
    L.precision = workload.precision
    return L

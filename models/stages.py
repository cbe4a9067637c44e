"""How the analytical model walks layouts: flat (row, stage) indexing of a `Layouts` (one row per
layout, a single layout is a Layouts of one) and the memo of what is computed once per distinct
value (one layer's costs for a given shape, a plan's layers per rank). The terms themselves live in
models/memory.py, step_time.py and power_arrays.py; this module holds no physics.

Stage arrays are flat: the stages of row r at `start[r] : start[r] + pp[r]` (ragged; segment
reductions with numpy's reduceat).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, TrainConfig, quant_parts
from advisor.models.constants import Constants
from advisor.search_spaces.columns import Layouts, unique_rows
from advisor.search_spaces.layout import kind_representatives, rank_kinds

__all__ = ["Memo", "Stages", "gather_blocks", "layer_shape_config", "memo_for", "quant_fields"]


def quant_fields(code) -> dict:
    """TrainConfig precision fields of a QUANTS code (the `fp8` column of Layouts)."""
    precision, recipe = quant_parts(int(code))
    return {"precision": precision, "fp8_recipe": recipe}


def layer_shape_config(key) -> TrainConfig:
    """The TrainConfig of a layer-shape key (models.memory.activation_keys: tp, cp, mbs, seq, ep, etp,
    sequence parallel, QUANTS code, (grouped GEMM, router, capacity factor, padding))."""
    tp, cp, mbs, seq, ep, etp, sp, fp8, (grouped, router, cf, pad) = key
    return TrainConfig(tp=tp, cp=cp, mbs=mbs, seq=seq, ep=ep, etp=etp, sequence_parallel=sp, **quant_fields(fp8),
                       moe_grouped_gemm=grouped, moe_router=router, moe_capacity_factor=cf, moe_pad_to_capacity=pad)


class Memo:
    """Per (model, cluster, constants): values computed once per distinct key, in named tables
    (`get`), and a plan's layers of each kind per rank (`counts`). `kinds`: the representative
    layer of every layer kind of the model, the columns of per-kind arrays."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec | None, c: Constants):
        self.model, self.cluster, self.c = model, cluster, c
        self.kinds = sorted(set(kind_representatives(model)))
        self.tables: dict[str, dict] = {}

    def get(self, table: str, key, make: Callable[[], object]):
        """The table's value for `key`, made by `make()` the first time."""
        d = self.tables.setdefault(table, {})
        hit = d.get(key)
        if hit is None:
            hit = d[key] = make()
        return hit

    def per_kind(self, dicts: Sequence[dict]) -> np.ndarray:
        """[len(dicts), K]: {kind representative: value} per rank as an array."""
        pos = {i: j for j, i in enumerate(self.kinds)}
        out = np.zeros((len(dicts), len(self.kinds)))
        for r, d in enumerate(dicts):
            for i, n in d.items():
                out[r, pos[i]] = n
        return out

    def counts(self, plan) -> np.ndarray:
        """[pp, K] layers of each kind per rank of a plan."""
        return self.get("counts", plan, lambda: self.per_kind(rank_kinds(self.model, plan)))


_MEMOS: dict = {}


def memo_for(model: ModelSpec, cluster: ClusterSpec | None, c: Constants) -> Memo:
    key = (id(model), id(cluster), id(c))
    hit = _MEMOS.get(key)
    if hit is None or hit.model is not model or hit.cluster is not cluster or hit.c is not c:
        if len(_MEMOS) > 64:
            _MEMOS.clear()
        hit = _MEMOS[key] = Memo(model, cluster, c)
    return hit


class Stages:
    """Flat (row, stage) indexing of a Layouts; `cache` holds what one evaluation computed per
    stage (parameters, memory parts) for the terms that share it."""

    def __init__(self, L: Layouts):
        self.L = L
        self.n = len(L)
        self.start = np.concatenate([[0], np.cumsum(L.pp)[:-1]]).astype(np.int64)
        self.total = int(L.pp.sum())
        self.row = np.repeat(np.arange(self.n), L.pp)
        self.k = np.arange(self.total) - self.start[self.row]
        self._counts = None
        self.cache: dict = {}

    def counts(self, memo: Memo) -> np.ndarray:
        """[S, K] layers of each kind per stage."""
        if self._counts is None:
            plans = self.L.plans
            self._counts = gather_blocks([self.L.plan], lambda i: memo.counts(plans[self.L.plan[i]]), self)
        return self._counts

    def max(self, v: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(v, self.start)

    def sum(self, v: np.ndarray) -> np.ndarray:
        return np.add.reduceat(v, self.start)

    def argmax(self, v: np.ndarray) -> np.ndarray:
        """Each row's first stage with its maximum (as Python's max(key=...) picks it): stage index."""
        top = self.max(v)[self.row]
        hit = np.where(v == top, self.k, np.iinfo(np.int64).max)
        return np.minimum.reduceat(hit, self.start)

    def rows(self, v: np.ndarray, i: int) -> np.ndarray:
        """The stage values of row i."""
        s0 = int(self.start[i])
        return v[s0:s0 + int(self.L.pp[i])]


def gather_blocks(cols: Sequence[np.ndarray], block_of, S: Stages) -> np.ndarray:
    """Flat per-stage rows of per-key [pp, ...] blocks: the rows with the same values in `cols`
    share the block `block_of(r)` of their first row r; stage s of row r gets its row k."""
    first, inv = unique_rows(cols)
    blocks = [block_of(int(r)) for r in first]
    sizes = np.array([len(b) for b in blocks], np.int64)
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    flat = np.concatenate(blocks, axis=0)
    return flat[off[inv[S.row]] + S.k]

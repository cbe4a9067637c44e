"""Surrogates on top of the analytical model, and an Optuna sampler built on them.

``ResidualGP`` learns what the (calibrated) analytical model gets wrong: a Gaussian process on the
physical features of ``advisor.models.features`` predicting a residual (log of measured /
predicted, or measured - predicted), with a standard deviation. With little data a GP is the
regularised choice: far from the measured layouts it reverts to the mean residual and its
uncertainty grows, so a what-if on another GPU or cluster size falls back to the physics.

``SurrogateSampler`` (an ``optuna.samplers.BaseSampler``) proposes the untried candidate with the
largest expected improvement under a GP fitted to the finished trials, optionally on top of a prior
(e.g. the calibrated prediction of each layout). Optuna's own GPSampler needs torch; this one
needs scikit-learn only. Optuna is imported when the sampler is first used.
"""
from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

MIN_ROWS = 8  # fewer rows than this: no surrogate


def _gp(n_features: int, seed: int = 0):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    kernel = (ConstantKernel(0.1, (1e-4, 1e2)) * RBF(np.full(n_features, 3.0), (0.3, 1e3))
              + WhiteKernel(1e-3, (1e-6, 1.0)))
    gp = GaussianProcessRegressor(kernel=kernel, normalize_y=True, n_restarts_optimizer=0,
                                  random_state=seed)
    return make_pipeline(StandardScaler(), gp)


class ResidualGP:
    """Gaussian-process regression of a residual on standardised features (ARD RBF + noise)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.model = None

    def fit(self, X: np.ndarray, r: np.ndarray) -> "ResidualGP":
        from sklearn.exceptions import ConvergenceWarning

        X, r = np.asarray(X, float), np.asarray(r, float)
        self.model = _gp(X.shape[1], self.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            self.model.fit(X, r)
        return self

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, standard deviation) of the residual at each row of X."""
        mu, sd = self.model.predict(np.asarray(X, float), return_std=True)
        return np.asarray(mu, float), np.maximum(np.asarray(sd, float), 1e-9)

    @property
    def kernel(self) -> str:
        return str(self.model[-1].kernel_) if self.model is not None else ""


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float, xi: float = 0.0) -> np.ndarray:
    """EI of maximising: E[max(0, f - best - xi)] for f ~ N(mu, sd²)."""
    from scipy.stats import norm

    sd = np.maximum(sd, 1e-12)
    z = (mu - best - xi) / sd
    return (mu - best - xi) * norm.cdf(z) + sd * norm.pdf(z)


# ------------------------------------------------------------------------------------------------
# Optuna sampler
# ------------------------------------------------------------------------------------------------

def candidates_from_layouts(layouts: Sequence[Any],
                            keys: Sequence[str] = ("tp", "pp", "cp", "ep", "etp", "vp", "mbs", "recompute")
                            ) -> list[dict[str, Any]]:
    """The parameter dicts `advisor.search_spaces.space.optuna_suggest` would suggest for each
    legal layout (deduplicated), for SurrogateSampler(candidates=...)."""
    seen, out = set(), []
    for cfg in layouts:
        d = {k: getattr(cfg, k) for k in keys}
        key = tuple(d.values())
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _encode(params: Sequence[Mapping[str, Any]], space: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """Numbers: log2 when all positive; other categories: one-hot."""
    cols = []
    for name, choices in space.items():
        vals = [p[name] for p in params]
        if all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in choices):
            v = np.array(vals, float)
            cols.append(np.log2(v) if min(choices) > 0 else v)
        else:
            for c in choices:
                cols.append(np.array([x == c for x in vals], float))
    return np.column_stack(cols) if cols else np.zeros((len(params), 0))


def _make_sampler_class():
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.samplers import BaseSampler, RandomSampler
    from optuna.search_space import IntersectionSearchSpace
    from optuna.trial import TrialState

    MAXIMIZE = optuna.study.StudyDirection.MAXIMIZE

    class SurrogateSampler(BaseSampler):
        """Expected improvement over a finite candidate set (categorical parameters).

        candidates: the parameter dicts that may be proposed (e.g. every legal layout, see
            `candidates_from_layouts`); default: the product of the categorical choices.
        prior: params -> predicted objective value(s) (a float, or one per objective), or None.
            The GP then learns the residual of `a * prior + b` (a, b fitted by least squares), so
            a good prior makes the first proposals good and the GP corrects it where measurements
            disagree. With a prior the first two trials are its two best candidates; without,
            `n_startup_trials` random untried candidates.
        Several objectives: each proposal maximises EI of a random augmented-Chebyshev
        scalarisation of the normalised objectives (ParEGO). Constraints (`trial.set_constraint`):
        an infeasible trial counts as worse than every feasible one. A parameter combination is
        never proposed twice. Parameters that are not categorical are left to `RandomSampler`."""

        def __init__(self, candidates: Sequence[Mapping[str, Any]] | None = None,
                     prior: Callable[[Mapping[str, Any]], Any] | None = None,
                     n_startup_trials: int = 4, seed: int | None = None, xi: float = 0.0,
                     max_candidates: int = 5000):
            self.candidates = [dict(c) for c in candidates] if candidates is not None else None
            self.prior = prior
            self.n_startup_trials = n_startup_trials
            self.xi = xi
            self.max_candidates = max_candidates
            self._rng = np.random.RandomState(seed)
            self._random = RandomSampler(seed=seed)
            self._space = IntersectionSearchSpace()
            self._prior_cache: dict[tuple, np.ndarray] = {}
            self._picks: dict[int, dict | None] = {}

        # ---- Optuna's interface ------------------------------------------------------------
        def reseed_rng(self) -> None:
            self._rng.seed()
            self._random.reseed_rng()

        def infer_relative_search_space(self, study, trial):
            return {k: d for k, d in self._space.calculate(study).items()
                    if isinstance(d, CategoricalDistribution)}

        def sample_independent(self, study, trial, param_name, param_distribution):
            # Before any trial has finished Optuna knows no search space; with candidates, the
            # first trials still come from them (the prior's best, or random untried ones).
            pick = self._startup_pick(study, trial)
            if (pick is not None and param_name in pick and isinstance(param_distribution, CategoricalDistribution)
                    and pick[param_name] in param_distribution.choices):
                return pick[param_name]
            return self._random.sample_independent(study, trial, param_name, param_distribution)

        def sample_relative(self, study, trial, search_space):
            if not search_space:
                return {}
            names = list(search_space)
            done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.values is not None and all(math.isfinite(v) for v in t.values)
                    and all(n in t.params for n in names)]
            pool = self._untried(study, trial, names, self._pool(search_space))
            if not pool:
                return {}
            if len(done) < (2 if self.prior is not None else self.n_startup_trials):
                pick = self._startup(study, pool)
                return {n: pick[n] for n in names}
            y, transform = self._scalarize(study, done)
            space = {n: search_space[n].choices for n in names}
            Xd = _encode([t.params for t in done], space)
            Xc = _encode(pool, space)
            base_d, base_c = np.zeros(len(done)), np.zeros(len(pool))
            if self.prior is not None:
                pd_ = np.array([transform(self._prior(self._full(t.params))) for t in done])
                pc_ = np.array([transform(self._prior(p)) for p in pool])
                ok = np.isfinite(pd_)
                a, b = 0.0, float(np.mean(y))
                if ok.sum() >= 3 and np.ptp(pd_[ok]) > 0:
                    a, b = np.polyfit(pd_[ok], y[ok], 1)
                    if a <= 0:  # the prior ranks against the data: ignore it
                        a, b = 0.0, float(np.mean(y))
                elif ok.any():
                    a, b = 1.0, float(np.mean(y[ok] - pd_[ok]))
                base_d = np.where(ok, a * pd_ + b, np.mean(y))
                base_c = np.where(np.isfinite(pc_), a * pc_ + b, np.mean(y))
            gp = ResidualGP(seed=self._rng.randint(2**31 - 1)).fit(Xd, y - base_d)
            mu, sd = gp.predict(Xc)
            ei = expected_improvement(base_c + mu, sd, float(y.max()), self.xi * max(1e-12, float(np.std(y))))
            pick = pool[int(np.argmax(ei))]
            return {n: pick[n] for n in names}

        # ---- helpers -------------------------------------------------------------------------
        def _scalarize(self, study, done):
            """(one 'higher is better' number per finished trial, the same map for prior values)."""
            signs = np.array([1.0 if d == MAXIMIZE else -1.0 for d in study.directions])
            V = np.array([t.values for t in done], float) * signs
            if len(signs) == 1:
                def transform(v):
                    return float(np.atleast_1d(v)[0] * signs[0])
            else:
                lo, span = V.min(0), np.where(np.ptp(V, 0) > 0, np.ptp(V, 0), 1.0)
                w = self._rng.dirichlet(np.ones(len(signs)))

                def transform(v):
                    v = np.atleast_1d(np.asarray(v, float))
                    if v.shape != signs.shape or not np.isfinite(v).all():
                        return math.nan
                    z = (v * signs - lo) / span
                    return float(np.min(w * z) + 0.05 * np.dot(w, z))
            y = np.array([transform(t.values) for t in done])
            feasible = np.array([all(c <= 0.0 for c in t.constraints.values()) for t in done])
            if feasible.any() and not feasible.all():
                y[~feasible] = y[feasible].min() - 0.1 * max(float(np.ptp(y[feasible])), 1e-9)
            return y, transform

        def _startup_pick(self, study, trial) -> dict | None:
            if self.candidates is None:
                return None
            if trial.number not in self._picks:
                names = sorted({k for c in self.candidates for k in c})
                pool = self._untried(study, trial, names, self.candidates)
                self._picks[trial.number] = self._startup(study, pool) if pool else None
            return self._picks[trial.number]

        def _untried(self, study, trial, names, pool):
            tried = {tuple(t.params.get(n) for n in names) for t in study.get_trials(deepcopy=False)
                     if t.number != trial.number and all(n in t.params for n in names)}
            return [p for p in pool if tuple(p.get(n) for n in names) not in tried]

        def _startup(self, study, pool):
            """The prior's best untried candidate (first objective), or a random untried one."""
            if self.prior is not None:
                sign = 1.0 if study.directions[0] == MAXIMIZE else -1.0
                pri = np.array([np.atleast_1d(self._prior(p))[0] for p in pool], float)
                if np.isfinite(pri).any():
                    return pool[int(np.nanargmax(sign * pri))]
            return pool[self._rng.randint(len(pool))]

        def _prior(self, p: Mapping[str, Any]):
            key = tuple(sorted(p.items(), key=str))
            if key not in self._prior_cache:
                try:
                    v = self.prior(p)
                    v = np.atleast_1d(np.asarray(v, float)) if v is not None else np.array([math.nan])
                except (TypeError, ValueError, KeyError):
                    v = np.array([math.nan])
                self._prior_cache[key] = v
            return self._prior_cache[key]

        def _full(self, params: Mapping[str, Any]) -> Mapping[str, Any]:
            """The candidate a finished trial's parameters belong to (for the prior)."""
            if self.candidates is not None:
                for c in self.candidates:
                    if all(c.get(k) == v for k, v in params.items() if k in c):
                        return c
            return params

        def _pool(self, space: dict) -> list[dict]:
            names = list(space)
            if self.candidates is not None:
                pool = [c for c in self.candidates if all(n in c and c[n] in space[n].choices for n in names)]
            else:
                sizes = [len(space[n].choices) for n in names]
                if math.prod(sizes) <= self.max_candidates:
                    pool = [dict(zip(names, combo)) for combo in itertools.product(*(space[n].choices for n in names))]
                else:
                    pool = [{n: space[n].choices[self._rng.randint(len(space[n].choices))] for n in names}
                            for _ in range(self.max_candidates)]
            return list({tuple(p[n] for n in names): p for p in pool}.values())

    return SurrogateSampler


_SAMPLER = None


def __getattr__(name: str):
    global _SAMPLER
    if name == "SurrogateSampler":
        if _SAMPLER is None:
            _SAMPLER = _make_sampler_class()
        return _SAMPLER
    raise AttributeError(name)

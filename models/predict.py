"""One prediction for one layout: memory, time, power, throttle risk, energy. Pure: the array model
(models.vectorized.evaluate) on the layout as a Layouts of one."""
from __future__ import annotations

from advisor.catalog.specs import ClusterSpec, GPUSpec, ModelSpec, TrainConfig
from advisor.models.constants import DEFAULT, Constants
from advisor.models.memory import StageMemory, stage_memory
from advisor.models.prediction import Prediction, assemble, phase_fractions, power_fields
from advisor.models.vectorized import Layouts, evaluate
from advisor.search_spaces.layout import violations

__all__ = ["Prediction", "assemble", "memory_only", "phase_fractions", "power_fields", "predict"]


def memory_only(model: ModelSpec, cfg: TrainConfig, c: Constants = DEFAULT, gpu: GPUSpec | None = None
                ) -> list[StageMemory]:
    return stage_memory(model, cfg, c, gpu=gpu)


def predict(model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig, c: Constants = DEFAULT,
            check_legal: bool = True) -> Prediction:
    """Predict one layout on one cluster. Illegal layouts raise IllegalLayout (via check);
    layouts that do not fit in memory come back with feasible=False and the reason."""
    if check_legal:
        v = violations(model, cluster, cfg)
        if v:
            from advisor.search_spaces.layout import IllegalLayout

            raise IllegalLayout(f"illegal layout: {v[0]}")
    return evaluate(model, cluster, Layouts.of(model, [cfg]), c).prediction(0)

"""The spec types and the built-in catalog: models, GPUs and clusters by name, HF ``config.json``
files, cluster strings (``h100x64``) and cluster YAML files. See ``catalog/data`` for the numbers
and their sources."""
from advisor.catalog.errors import CatalogError
from advisor.catalog.hf import SUPPORTED_MODEL_TYPES, model_from_hf_config
from advisor.catalog.loaders import (
    CLUSTER_FORMS,
    list_clusters,
    list_gpus,
    list_models,
    load_cluster,
    load_gpu,
    load_model,
    normalize_name,
    with_power_cap,
)
from advisor.catalog.specs import (
    ClusterSpec,
    GPUSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
    SpecError,
    TrainConfig,
)

__all__ = [
    "CatalogError", "SpecError", "ModelSpec", "MoESpec", "MLASpec", "GPUSpec", "ClusterSpec",
    "TrainConfig", "load_model", "load_gpu", "load_cluster", "list_models", "list_gpus",
    "list_clusters", "model_from_hf_config", "normalize_name", "SUPPORTED_MODEL_TYPES",
    "CLUSTER_FORMS", "with_power_cap",
]

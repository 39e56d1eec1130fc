"""Inference engines as receivers: `LoadWeightsConsumer` hands buckets to an engine's
`load_weights` (vLLM, SGLang), through the weight transforms (rename, fuse, cast, drop); the
engine's own loader as the map (`record_loader_map`, `LoaderMap`); rlfleet as vLLM's
"rlfleet" weight-transfer backend (`register_vllm_backend`, the infos; the engine and trainer
classes import vLLM and are built by vLLM's factories); SGLang's flattened-bucket refit.
"""

from rlfleet.weightsync.engines._load_weights import LoadWeights, LoadWeightsConsumer
from rlfleet.weightsync.engines._loader_map import (
    Fill,
    LoaderMap,
    MapAssemble,
    Piece,
    UnmappableLoaderError,
)
from rlfleet.weightsync.engines._loader_record import record_loader_map
from rlfleet.weightsync.engines._sglang import (
    FlattenedTensorMeta,
    SglangBucketConsumer,
    flattened_bucket,
)
from rlfleet.weightsync.engines._transforms import (
    LLAMA_STACKED_PARAMS,
    Cast,
    Drop,
    Fuse,
    Rename,
    TransformChain,
    WeightTransform,
    apply_transforms,
    plan_transforms,
)
from rlfleet.weightsync.engines._vllm_plugin import (
    VLLM_BACKEND,
    VllmInitInfo,
    VllmTrainerInitInfo,
    VllmUpdateInfo,
    register_vllm_backend,
    reload_vllm_weights,
    run_together,
)

__all__ = [
    "LLAMA_STACKED_PARAMS",
    "VLLM_BACKEND",
    "Cast",
    "Drop",
    "Fill",
    "FlattenedTensorMeta",
    "Fuse",
    "LoadWeights",
    "LoadWeightsConsumer",
    "LoaderMap",
    "MapAssemble",
    "Piece",
    "Rename",
    "SglangBucketConsumer",
    "TransformChain",
    "UnmappableLoaderError",
    "VllmInitInfo",
    "VllmTrainerInitInfo",
    "VllmUpdateInfo",
    "WeightTransform",
    "apply_transforms",
    "flattened_bucket",
    "plan_transforms",
    "record_loader_map",
    "register_vllm_backend",
    "reload_vllm_weights",
    "run_together",
]

"""Inference engines as receivers: `LoadWeightsConsumer` hands buckets to an engine's
`load_weights` (vLLM, SGLang), through the weight transforms (rename, fuse, cast, drop).
"""

from rlfleet.weightsync.engines._load_weights import LoadWeights, LoadWeightsConsumer
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

__all__ = [
    "LLAMA_STACKED_PARAMS",
    "Cast",
    "Drop",
    "Fuse",
    "LoadWeights",
    "LoadWeightsConsumer",
    "Rename",
    "TransformChain",
    "WeightTransform",
    "apply_transforms",
    "plan_transforms",
]

"""Codecs: what a sync puts on the wire besides the trainer's bytes. Deltas against the version a
receiver holds (encoded per bucket, rebuilt where the full version would land, checked against
the sender's digest), and FP8 block quantization for FP8 engines. The wire dtype itself is a
property of the layout (`Layout.cast`).
"""

from rlfleet.weightsync.codec._delta import (
    DEFAULT_MAX_FRACTION,
    DELTA_KINDS,
    DeltaPayload,
    apply_delta,
    apply_delta_digest,
    bucket_digest,
    encode_delta,
)
from rlfleet.weightsync.codec._delta_scan import native_codec
from rlfleet.weightsync.codec._delta_state import (
    DELTA_MODES,
    DeltaBase,
    DeltaEncoder,
    DeltaStats,
    base_pieces_of,
    check_delta_mode,
    clear_padding,
    holds_base,
    pack_base,
    rebuild,
    tensor_pieces,
)
from rlfleet.weightsync.codec._fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    dequantize_fp8_blocks,
    fp8_error,
    fp8_layout,
    fp8_names,
    quantize_fp8_blocks,
    quantize_state_dict,
)

__all__ = [
    "DEFAULT_MAX_FRACTION",
    "DELTA_KINDS",
    "DELTA_MODES",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "SCALE_SUFFIX",
    "DeltaBase",
    "DeltaEncoder",
    "DeltaPayload",
    "DeltaStats",
    "apply_delta",
    "apply_delta_digest",
    "base_pieces_of",
    "bucket_digest",
    "check_delta_mode",
    "clear_padding",
    "dequantize_fp8_blocks",
    "encode_delta",
    "fp8_error",
    "fp8_layout",
    "fp8_names",
    "holds_base",
    "native_codec",
    "pack_base",
    "quantize_fp8_blocks",
    "quantize_state_dict",
    "rebuild",
    "tensor_pieces",
]

"""Layouts: names, shapes, dtypes, aligned offsets and buckets, computed once per model; packing a
state dict into buckets and back, bulk copies, adopting a module into one flat block, checksums.
"""

from rlfleet.weightsync.layout._block import adopt, flat_block, live_tensors
from rlfleet.weightsync.layout._copy import copy_tensors, default_copy_threads
from rlfleet.weightsync.layout._dtypes import DTYPES, dtype_from_name, dtype_name
from rlfleet.weightsync.layout._integrity import bucket_checksum, checksum, compare_fingerprints, fingerprint
from rlfleet.weightsync.layout._layout import ALIGNMENT, DEFAULT_BUCKET_BYTES, BucketSpec, Layout, TensorSpec
from rlfleet.weightsync.layout._lent import lend, lent
from rlfleet.weightsync.layout._packing import (
    bucket_starts,
    bucket_views,
    flat_views,
    pack_all,
    pack_bucket,
    typed_view,
    unpack_bucket_into,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "DTYPES",
    "BucketSpec",
    "Layout",
    "TensorSpec",
    "adopt",
    "bucket_checksum",
    "bucket_starts",
    "bucket_views",
    "checksum",
    "compare_fingerprints",
    "copy_tensors",
    "default_copy_threads",
    "dtype_from_name",
    "dtype_name",
    "fingerprint",
    "flat_block",
    "flat_views",
    "lend",
    "lent",
    "live_tensors",
    "pack_all",
    "pack_bucket",
    "typed_view",
    "unpack_bucket_into",
]

"""Data parallelism: gradient buckets, pack plans, the Reducer and its comm hooks."""

from . import hooks
from .broadcast import broadcast_coalesced
from .buckets import DEFAULT_FIRST_BUCKET_BYTES, compute_bucket_assignment_by_size
from .reducer import GradBucket, Reducer

__all__ = ["DEFAULT_FIRST_BUCKET_BYTES", "GradBucket", "Reducer", "broadcast_coalesced",
           "compute_bucket_assignment_by_size", "hooks"]

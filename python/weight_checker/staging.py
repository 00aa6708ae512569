"""Kept path: ``weight_checker.staging`` (the device staging pipeline and its
copy engines) lives in :mod:`weight_checker.hashing.staging` and
:mod:`weight_checker.hashing.copy_engines`."""

from weight_checker.errors import StagingError
from weight_checker.hashing.copy_engines import CopyEngine, CudaCopyEngine, HostCopyEngine
from weight_checker.hashing.staging import StagingStats, budget_bytes, digest_staged, plan_slots

__all__ = [
    "CopyEngine",
    "CudaCopyEngine",
    "HostCopyEngine",
    "StagingError",
    "StagingStats",
    "budget_bytes",
    "digest_staged",
    "plan_slots",
]

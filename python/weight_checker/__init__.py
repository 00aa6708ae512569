"""weight-checker: prove an RL weight update reached every rank.

Per-tensor SHA-256 digests, byte-identical to vLLM's built-in weight
checker, computed by a parallel multi-stream Rust core.
"""

from weight_checker._core import DeviceTensorError, SafetensorsError, kernel
from weight_checker._core import __version__ as __version__
from weight_checker.digests import CompareResult, checksum, compare, reset, sha256_many
from weight_checker.expected import ExpectedDigests, ExpectedDigestsError, expected_digests
from weight_checker.keys import DuplicateKeysError, rank_prefix
from weight_checker.verify import (
    ReplicaResult,
    VerifyError,
    VerifyResult,
    WeightCheckerError,
    WeightMismatchError,
    replicas,
    verify,
    verify_async,
)

__all__ = [
    "CompareResult",
    "DeviceTensorError",
    "DuplicateKeysError",
    "ExpectedDigests",
    "ExpectedDigestsError",
    "ReplicaResult",
    "SafetensorsError",
    "VerifyError",
    "VerifyResult",
    "WeightCheckerError",
    "WeightMismatchError",
    "__version__",
    "checksum",
    "compare",
    "expected_digests",
    "kernel",
    "rank_prefix",
    "replicas",
    "reset",
    "sha256_many",
    "verify",
    "verify_async",
]

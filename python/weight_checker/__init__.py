"""weight-checker: prove an RL weight update reached every rank.

Per-tensor SHA-256 digests, byte-identical to vLLM's built-in weight
checker, computed by a parallel multi-stream Rust core.

The package, by concern: :mod:`.hashing` (digests of models, tensors,
checkpoints and device memory), :mod:`.verify` (the RL check against live
engines), :mod:`.expected` (the digests each rank must hold), :mod:`.server`
(the ``POST /weight_checker`` route), :mod:`.integrations` (vLLM, Ray),
:mod:`.cli`, :mod:`.settings` (every ``WEIGHT_CHECKER_*`` variable),
:mod:`.errors`, :mod:`.keys`, and :mod:`.testing` (test support only).
"""

from weight_checker._core import DeviceTensorError, SafetensorsError, kernel
from weight_checker._core import __version__ as __version__
from weight_checker.errors import (
    CheckpointError,
    DuplicateKeysError,
    ExpectedDigestsError,
    HttpError,
    InputError,
    InputTypeError,
    SettingsError,
    StagingError,
    UnverifiedWeightsError,
    VerifyError,
    WeightCheckerError,
    WeightMismatchError,
)
from weight_checker.expected.digests import expected_digests
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.hashing.digests import CompareResult, checksum, compare, reset, sha256_many
from weight_checker.keys import rank_prefix
from weight_checker.verify.replicas import ReplicaResult, replicas
from weight_checker.verify.results import VerifyResult
from weight_checker.verify.workflow import verify, verify_async

__all__ = [
    "CheckpointError",
    "CompareResult",
    "DeviceTensorError",
    "DuplicateKeysError",
    "ExpectedDigests",
    "ExpectedDigestsError",
    "HttpError",
    "InputError",
    "InputTypeError",
    "ReplicaResult",
    "SafetensorsError",
    "SettingsError",
    "StagingError",
    "UnverifiedWeightsError",
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

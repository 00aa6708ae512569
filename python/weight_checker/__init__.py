"""weight-checker: prove an RL weight update reached every rank.

Per-tensor SHA-256 digests, byte-identical to vLLM's built-in weight
checker, computed by a parallel multi-stream Rust core.
"""

from weight_checker._core import backend
from weight_checker.digests import CompareResult, checksum, compare, reset, sha256_many
from weight_checker.keys import rank_prefix

__version__ = "0.1.0"

__all__ = [
    "CompareResult",
    "__version__",
    "backend",
    "checksum",
    "compare",
    "rank_prefix",
    "reset",
    "sha256_many",
]

"""The digests every rank of an engine must hold, computed from the weights
through vLLM's own model classes and loaders (:mod:`.digests`), fed from a
checkpoint or the trainer's tensors (:mod:`.weights`), one rank's parallel
state at a time (:mod:`.vllm.rank_groups`); the result and its manifest
(:mod:`.manifest`). Kept path: ``weight_checker.expected`` gives the names it
gave when it was one module."""

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.digests import expected_digests
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.expected.vllm.rank_model import release_buffers

__all__ = ["ExpectedDigests", "ExpectedDigestsError", "expected_digests", "release_buffers"]

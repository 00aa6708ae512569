"""Kept path: ``weight_checker.checkpoint.checksum_checkpoint`` lives in
:mod:`weight_checker.hashing.checkpoint`."""

from weight_checker.errors import CheckpointError
from weight_checker.hashing.checkpoint import checksum_checkpoint

__all__ = ["CheckpointError", "checksum_checkpoint"]

"""What :func:`weight_checker.expected_digests` returns: the digests, with
what produced them, as the manifest ``weight-checker expect`` writes; and a
manifest read back from a file (by the CLI and by the library alike)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weight_checker.errors import UsageError


class ExpectedDigests(dict[str, str]):
    """``{key: hex}`` for every key the engine reports, plus what produced them."""

    #: The fields of a manifest: ``checksum``'s, and the provenance beside it.
    FIELDS = frozenset({"checksums", "vllm_version", "layout", "unwritten", "warnings", "weight_version"})

    def __init__(
        self,
        digests: Mapping[str, str] | None = None,
        *,
        vllm_version: str = "",
        layout: dict[str, Any] | None = None,
        unwritten: list[str] | None = None,
        warnings: list[str] | None = None,
        weight_version: str | None = None,
    ):
        super().__init__(digests or {})
        #: The vLLM version whose model class and loader ran.
        self.vllm_version = vllm_version
        #: ``{"tp": T, "pp": P, "dp": D, "dtype": ..., "architecture": ...}``
        self.layout: dict[str, Any] = layout or {}
        #: Keys of parameters the weights never wrote (not in the mapping:
        #: their bytes would be uninitialized memory, so they are never hashed).
        self.unwritten: list[str] = unwritten or []
        #: What could not be established (e.g. the model's ``load_weights``
        #: does not say which parameters it wrote, so unwritten ones go unnoticed).
        self.warnings: list[str] = warnings or []
        #: The weight version the engine must report with these weights
        #: (``None``: not checked).
        self.weight_version = weight_version
        #: Seconds spent building and loading the rank models, and hashing them.
        self.seconds: dict[str, float] = {"load": 0.0, "hash": 0.0}
        #: Bytes hashed where the weights lie, never copied into a rank's
        #: parameters (see :mod:`weight_checker.expected.vllm.deferred`).
        self.bytes_in_place = 0
        #: Bytes of SHA-256 chain state this rank sent to others, in a
        #: sharded trainer's collective call (:mod:`weight_checker.expected.collective`).
        self.bytes_exchanged = 0
        #: A sharded call's plan: 1 where ranks share a host's cores (a round a run), else pipelined
        #: runs (expected/collective.py, run_plan.plan_batches).
        self.batches = 0
        #: Each key's SHA-256 chain at its block boundaries, where the one pass
        #: that hashed it recorded them (:mod:`weight_checker.hashing.block_states`):
        #: an explanation locates the blocks that differ with them, without
        #: the tensors. Not in a manifest: a manifest read back has none.
        self.block_states: dict[str, Any] = {}
        #: What :func:`weight_checker.expected.recompute.expected_tensors` needs
        #: to recompute the tensors (weak references to the weights); ``None``
        #: for digests read back from a manifest.
        self._recompute: Any = None

    def manifest(self) -> dict[str, Any]:
        """The ``checksum`` manifest format, with the provenance beside it."""
        out: dict[str, Any] = {
            "checksums": dict(sorted(self.items())),
            "vllm_version": self.vllm_version,
            "layout": self.layout,
            "unwritten": self.unwritten,
            "warnings": self.warnings,
        }
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        return out

    @classmethod
    def from_manifest(cls, data: Mapping[str, Any], digests: Mapping[str, str]) -> ExpectedDigests:
        """The expected digests of a manifest ``data`` whose ``checksums`` are
        ``digests`` (validated by the caller); absent fields are empty."""

        def strings(value: Any) -> list[str]:
            return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []

        version = data.get("weight_version")
        return cls(
            digests,
            vllm_version=data["vllm_version"] if isinstance(data.get("vllm_version"), str) else "",
            layout=data["layout"] if isinstance(data.get("layout"), dict) else {},
            unwritten=strings(data.get("unwritten")),
            warnings=strings(data.get("warnings")),
            weight_version=str(version) if isinstance(version, (str, int)) and not isinstance(version, bool) else None,
        )


def load_expected(path: str) -> ExpectedDigests:
    """An ``expect`` manifest (or any manifest) as :class:`ExpectedDigests`."""
    digests = load_manifest(path, [False])
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        raw = {}
    return ExpectedDigests.from_manifest(raw if isinstance(raw, dict) else {}, digests)


def load_manifest(path: str, stdin_used: list[bool]) -> dict[str, str]:
    """``{"checksums": {...}}`` or a bare ``{key: hex}`` mapping, from a file or ``-``."""
    if path == "-":
        if stdin_used[0]:
            raise UsageError("only one of BASELINE and CURRENT can be '-'")
        stdin_used[0] = True
        text, where = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, where = Path(path).read_text(), path
        except (OSError, ValueError) as e:  # incl. UnicodeDecodeError, an embedded NUL in the path
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise UsageError(f"{path}: cannot read: {reason}") from e
    try:
        data = json.loads(text)
    except RecursionError as e:
        raise UsageError(f"{where}: invalid JSON: nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, or a number too long to convert
        raise UsageError(f"{where}: invalid JSON: {e}") from e
    if isinstance(data, dict) and "checksums" in data and set(data) <= ExpectedDigests.FIELDS:
        data = data["checksums"]
    if not isinstance(data, dict):
        raise UsageError(f'{where}: expected {{key: sha256 hex}} or {{"checksums": {{...}}}}')
    for k, v in data.items():
        if not isinstance(v, str):
            raise UsageError(f"{where}: key {k!r:.80}: digest must be a string, got {str(v)[:40]!r}")
    return data

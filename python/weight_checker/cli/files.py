"""The CLI's files: manifests read (``{"checksums": ...}`` or a bare map,
from a file or stdin) and written (atomically, where a regular file), and
the one-line usage error every bad input becomes."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from weight_checker.errors import WeightCheckerError

if TYPE_CHECKING:
    from weight_checker.expected.manifest import ExpectedDigests


class UsageError(WeightCheckerError):
    """Bad input: one line on stderr, exit 2."""


def write_output(text: str, path: str | None) -> None:
    """To stdout, or to ``path``: a regular file is replaced atomically (no
    half-written manifest); anything else (``/dev/null``, a FIFO, a terminal)
    is written in place, never replaced."""
    if path is None or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    if target.exists() and not target.is_file():
        with open(target, "w") as f:
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_expected(path: str) -> ExpectedDigests:
    """An ``expect`` manifest (or any manifest) as :class:`ExpectedDigests`."""
    from weight_checker.expected.manifest import ExpectedDigests

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
    from weight_checker.expected.manifest import ExpectedDigests

    if isinstance(data, dict) and "checksums" in data and set(data) <= ExpectedDigests.FIELDS:
        data = data["checksums"]
    if not isinstance(data, dict):
        raise UsageError(f'{where}: expected {{key: sha256 hex}} or {{"checksums": {{...}}}}')
    for k, v in data.items():
        if not isinstance(v, str):
            raise UsageError(f"{where}: key {k!r:.80}: digest must be a string, got {str(v)[:40]!r}")
    return data

"""The CLI's files: manifests written (atomically, where a regular file) and
read (:func:`load_manifest`, :func:`load_expected`: they live with the
manifest, :mod:`weight_checker.expected.manifest`, which the library reads
too), and the one-line usage error every bad input becomes (defined with
every other exception, in :mod:`weight_checker.errors`)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from weight_checker.errors import UsageError
from weight_checker.expected.manifest import load_expected, load_manifest

__all__ = ["UsageError", "load_expected", "load_manifest", "write_output"]


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

"""Test support for the SGLang integration: tiny checkpoints SGLang can serve
on CPU (:mod:`.models`) and the test-only ``sgl_kernel`` stand-in that lets
the real SGLang server run on a CPU-only machine (:data:`STANDIN_DIR`, to put
on the server's ``PYTHONPATH``; never imported by the runtime package)."""

from pathlib import Path

#: The directory to put on ``PYTHONPATH`` (it holds the ``sgl_kernel`` stand-in).
STANDIN_DIR = Path(__file__).resolve().parent / "standin"

"""``weight-checker`` run in the test process: its ``main`` with what it prints
captured, as a ``CompletedProcess``. For commands that load vLLM's model code
(``expect``): a new process pays for importing vLLM (~10 s on two cores)
every time. tests/test_docs.py and tests/test_cli.py run the installed
command itself."""

from __future__ import annotations

import io
import logging
import os
import subprocess
from contextlib import redirect_stderr, redirect_stdout


def run_cli(*args: str) -> subprocess.CompletedProcess:
    from weight_checker.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    environ = dict(os.environ)
    vllm_level = logging.getLogger("vllm").level
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.environ.clear()
        os.environ.update(environ)
        logging.getLogger("vllm").setLevel(vllm_level)
    return subprocess.CompletedProcess(["weight-checker", *args], code, out.getvalue(), err.getvalue())

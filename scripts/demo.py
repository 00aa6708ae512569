"""The README's main job: a real vLLM with the weight_checker plugin, and
`weight-checker verify` run against it.

    make demo                                   # transfer = reload_weights: exit 0
    make demo TRANSFER="--transfer-cmd true"    # a transfer that does nothing: exit 1

Writes the default model (a tiny Llama, fixed seed) under .demo/, starts
vLLM (CPU) on a free port, runs verify, prints the report and stops the
server, also on failure or Ctrl-C. Exits with verify's exit code.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from weight_checker.testing.launch import vllm_server
from weight_checker.testing.models import write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    transfer = shlex.split(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else ["--transfer", "reload"]
    demo = ROOT / ".demo"
    demo.mkdir(exist_ok=True)
    model = write_tiny_llama(demo / "tiny-llama")
    log = demo / "vllm.log"
    print(f"demo: starting vLLM on {model} (log: {log}) ...", flush=True)
    start = time.monotonic()
    with vllm_server(model, log) as server:
        print(f"demo: vLLM ready at {server.url} in {time.monotonic() - start:.0f} s", flush=True)
        cmd = [sys.executable, "-m", "weight_checker.cli", "verify", "--url", server.url, *transfer]
        print("demo: $ weight-checker " + " ".join(shlex.quote(a) for a in cmd[3:]), flush=True)
        rc = subprocess.run(cmd).returncode
        rust_lines = [ln for ln in log.read_text(errors="replace").splitlines() if "by the Rust core" in ln]
        if rust_lines:
            print("demo: from the server log:", rust_lines[-1].split("] ", 1)[-1], flush=True)
    print(f"demo: vLLM stopped; verify exited with {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

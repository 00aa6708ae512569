"""What explaining a failed check costs (issue 43), against hashing the
mismatched tensors once, side by side in one run.

    .venv/bin/python benches/bench_explain.py [--repeat 5] [--hosts one|two|both]

A 0.94 GB bf16 "model" of eight 8B-shaped MLP matrices (4096 x 14336,
117 MB each) is the expected state; the "engine" holds it with faults:

- ``zeros``: one tensor delivered as zeros;
- ``stale-rows``: one tensor whose second half of rows is the previous step's
  (the previous step's tensors kept, as ``history``);
- ``unknown``: one tensor with one byte flipped in every block (no cause
  matches: every candidate is tried on every differing run: the worst case);
- ``4 tensors``: two zeros, one stale half, one unknown at once;
- ``8 unknown``: every tensor (the whole 0.94 GB) changed with no cause: the
  most both sides can hash.

The reference is ``digest_tensors`` of the mismatched tensors (the Rust
core: what a checksum of them costs on the same cores). An explanation is
:func:`weight_checker.verify.explain.explain` with the engine's block digests
computed by the worker's function over the engine's tensors, and the
expected tensors given (a ``TensorMap``: no recompute). Two layouts:

- ``--hosts two`` (a deployment: the engine hashes on its own host): the
  engine runs in another process pinned to core 1, this side and the
  reference in this one pinned to core 0, one hashing thread each; the
  explanation's wall time includes waiting for the engine's answer, which
  it computes at the same time;
- ``--hosts one`` (engine and trainer on one 2-core host): the engine's
  function runs on a thread of this process, both sides and the reference
  on both cores.

A check that passes runs none of it (``explain`` is never called).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

ROWS, COLS, N = 4096, 14336, 8
PREFIX = "dp0:pp0:pcp0:tp0:"
SCENARIOS = ("zeros", "stale-rows", "unknown", "4 tensors", "8 unknown")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        name = fields.get("model name\t", "").strip()
        family = fields.get("cpu family\t", "").strip()
        model = fields.get("model\t\t", "").strip()
        return f"{name} (family {family} model {model})"
    except OSError:
        return platform.processor()


def pin(core: int | None) -> None:
    """One hashing thread on ``core`` (``None``: as started). Before the core's pool starts."""
    if core is not None:
        os.sched_setaffinity(0, {core})
        os.environ["WEIGHT_CHECKER_THREADS"] = "1"


class Model:
    """The expected tensors, the previous step's, and the faults: the same
    in every process (one seed)."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.keys = [f"{PREFIX}model.layers.{i}.mlp.down_proj.weight" for i in range(N)]
        self.new = {k: (torch.randn(ROWS, COLS, generator=g) * 0.02).to(torch.bfloat16) for k in self.keys}
        self.old = {
            k: (v.float() + 0.001 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in self.new.items()
        }

    def faults(self, scenario: str) -> dict[str, str]:
        k = self.keys
        return {
            "zeros": {k[0]: "zeros"},
            "stale-rows": {k[1]: "stale-rows"},
            "unknown": {k[2]: "unknown"},
            "4 tensors": {k[0]: "zeros", k[1]: "stale-rows", k[2]: "unknown", k[3]: "zeros"},
            "8 unknown": dict.fromkeys(k, "unknown"),
        }[scenario]

    def held(self, scenario: str) -> dict:
        import torch

        def faulty(kind: str, key: str) -> torch.Tensor:
            t = self.new[key]
            if kind == "zeros":
                return torch.zeros_like(t)
            if kind == "stale-rows":
                return torch.cat([t[: ROWS // 2], self.old[key][ROWS // 2 :]])
            out = t.clone()  # "unknown": one element changed in every block of 64 rows
            out.view(-1)[:: 64 * COLS] += 1
            return out

        return {**self.new, **{k: faulty(kind, k) for k, kind in self.faults(scenario).items()}}


def answer(held: dict, keys: list[str], block_bytes: int, chain: dict | None = None) -> dict:
    """The engine's answer to a ``block_digests`` request, chained or not (the worker's function)."""
    from weight_checker.hashing.block_states import worker_answer

    got = worker_answer([(k, held[k]) for k in keys], block_bytes, "engine", chain)
    if got["errors"]:
        raise RuntimeError(got["errors"])
    return got["blocks"]


def engine_process(conn, core: int) -> None:
    """The engine on its own core: holds a scenario's tensors, answers requests."""
    pin(core)
    model = Model()
    serve(conn, model.held)


def start_engine(target) -> Any:
    """``target(conn, 1)`` in a fresh process (the engine on core 1), once it is ready: the pipe's end to it."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_end, 1), daemon=True)
    proc.start()
    if not conn.poll(600) or conn.recv() != "ready":
        raise SystemExit(f"the engine process did not start (exit code {proc.exitcode})")
    return conn


def serve(conn, held_for) -> None:
    """An engine's loop: ``("scenario", s)`` holds ``held_for(s)``, ``("fetch",
    keys, block_bytes)`` answers, ``("stop",)`` returns."""
    held: dict = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "scenario":
            held = held_for(msg[1])
            conn.send("ok")
        else:
            conn.send(answer(held, msg[1], msg[2], *msg[3:]))


def run(hosts: str, repeat: int) -> None:
    if hosts == "two" and not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit(
            "--hosts two pins the engine to core 1 and this side to core 0: this process may not run on both"
        )
    pin(0 if hosts == "two" else None)
    import torch
    from weight_checker.hashing.digests import digest_tensors
    from weight_checker.verify.explain import TensorMap, Version, explain

    if hosts == "two":
        torch.set_num_threads(1)

    def sha(t: torch.Tensor) -> str:
        return digest_tensors(["t"], [t])[0][0]

    model = Model()
    expected = {k: sha(v) for k, v in model.new.items()}
    previous = Version("step-11", {k: sha(v) for k, v in model.old.items()}, TensorMap(model.old))
    conn = None
    if hosts == "two":
        conn = start_engine(engine_process)
    threads = 1 if hosts == "two" else len(os.sched_getaffinity(0))
    where = "engine on core 1, this side on core 0" if hosts == "two" else "engine and this side on every core"
    print(f"\nhosts={hosts}: {where}; {threads} hashing thread(s) for the reference")
    print(f"{'scenario':<12} {'mismatched':>10} {'hash once':>10} {'explain':>10} {'ratio':>6}  causes")
    for name in SCENARIOS:
        faults = model.faults(name)
        held = model.held(name)
        if conn is not None:
            conn.send(("scenario", name))
            assert conn.recv() == "ok"

            def fetch(keys: list[str], block_bytes: int) -> dict:
                conn.send(("fetch", keys, block_bytes))
                return conn.recv()
        else:

            def fetch(keys: list[str], block_bytes: int, held: dict = held) -> dict:
                return answer(held, keys, block_bytes)

        current = {k: sha(v) for k, v in held.items()}
        mismatches = {k: "changed" for k in faults}
        mismatched = [held[k] for k in faults]
        once, whole = [], []
        causes: dict[str, str] = {}
        for _ in range(repeat):
            start = time.perf_counter()
            digest_tensors(list(faults), mismatched)
            once.append(time.perf_counter() - start)
            start = time.perf_counter()
            found = explain(mismatches, current, expected, fetch, TensorMap(model.new), history=[previous])
            whole.append(time.perf_counter() - start)
            causes = found.causes()
        o, w = statistics.median(once), statistics.median(whole)
        nbytes = sum(t.nbytes for t in mismatched)
        summary = ", ".join(sorted(set(causes.values())))
        print(f"{name:<12} {nbytes / 1e6:>8.0f}MB {o:>9.3f}s {w:>9.3f}s {w / o:>6.2f}  {summary}", flush=True)
    if conn is not None:
        conn.send(("stop",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--hosts", choices=("one", "two", "both"), default="both")
    args = ap.parse_args()
    import torch

    print(f"cpu: {cpu_name()}, {len(os.sched_getaffinity(0))} cores; torch {torch.__version__}")
    print(f"model: {N} tensors of {ROWS} x {COLS} bf16, {N * ROWS * COLS * 2 / 1e9:.2f} GB")
    if args.hosts == "both":  # each layout in a fresh process: the core's pool is sized once
        for hosts in ("two", "one"):
            cmd = [sys.executable, __file__, "--repeat", str(args.repeat), "--hosts", hosts]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            print("\n".join(line for line in out.splitlines()[2:] if not line.startswith("a check")), flush=True)
    else:
        run(args.hosts, args.repeat)
    print("a check that passes: explain() is not called (0 s, no block digests asked)")


if __name__ == "__main__":
    main()

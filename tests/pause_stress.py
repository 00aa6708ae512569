"""Clients generating while checks run in a loop: what a pause mode does to
the requests in flight (tests/test_sglang.py and tests/test_vllm_tp1.py).

Each client sends greedy requests, one after another, each for one of a few
prompts; meanwhile the check runs again and again (pause, reset, reload,
checksum, compare, resume: the weights are zeroed and loaded back while the
requests wait). Every completion is compared with the tokens the same
prompt gave before any check ran."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROMPTS = ("ab cd ef", "gh ij kl mn", "op qr", "st uv wx yz ab")

#: ``generate(prompt) -> (what it generated: token ids or text, whether it was aborted)``
Generate = Callable[[str], tuple[Any, bool]]


@dataclass
class Stress:
    checks: int = 0
    failed_checks: list[str] = field(default_factory=list)
    completions: int = 0
    aborted: int = 0
    #: ``(prompt, tokens, the reference's)`` of every finished completion whose tokens differ.
    different: list[tuple[str, Any, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def stress(generate: Generate, check: Callable[[], bool], *, seconds: float, clients: int = 3) -> Stress:
    """Runs ``clients`` generating threads while ``check()`` (True: it
    matched) runs in a loop for ``seconds`` (and at least twice)."""
    reference = {p: generate(p)[0] for p in PROMPTS}
    out = Stress()
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int) -> None:
        n = i
        while not stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            try:
                tokens, aborted = generate(prompt)
            except Exception as e:  # a failed request is counted, and fails the test
                with lock:
                    out.errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                out.completions += 1
                if aborted:
                    out.aborted += 1
                elif tokens != reference[prompt]:
                    out.different.append((prompt, tokens, reference[prompt]))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # requests in flight before the first check
    start = time.monotonic()
    try:
        while out.checks < 2 or time.monotonic() - start < seconds:
            ok = check()
            out.checks += 1
            if not ok:
                out.failed_checks.append(f"check {out.checks} did not match")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    return out

"""The test session's checkpoints are the same bytes however they are written:
servers are started (and their checkpoints written) on background threads
while tests draw from torch's global generator, and two copies of one
checkpoint once came out different (a fleet of two servers of "the same"
model then looked inconsistent)."""

from __future__ import annotations

import hashlib
import threading

import torch
from weight_checker.testing.models import write_tiny_llama

from .models import write_model


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_a_checkpoint_does_not_depend_on_other_threads_drawing_random_numbers(tmp_path):
    quiet = write_tiny_llama(tmp_path / "quiet")
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            torch.randn(64)
            torch.manual_seed(12345)

    noise = threading.Thread(target=draw, daemon=True)
    noise.start()
    try:
        busy = [write_tiny_llama(tmp_path / f"busy{i}") for i in range(3)]
        family = [write_model(tmp_path / f"qwen2-{i}", "qwen2") for i in range(2)]
    finally:
        stop.set()
        noise.join()
    assert {_digest(p) for p in busy} == {_digest(quiet)}
    assert _digest(family[0]) == _digest(family[1])
    assert _digest(write_tiny_llama(tmp_path / "seed1", seed=1)) != _digest(quiet)

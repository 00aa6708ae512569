"""`weight-checker expect` on checkpoints it cannot reproduce exactly: exit 2
and one line naming the tensor or the reason, never a traceback, nothing on
stdout. The library raises ExpectedDigestsError with the same message."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available
from weight_checker.testing.models import write_tiny_llama

from .cli import run_cli

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("expect-errors") / "tiny")


def variant(good: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(good, out)
    return out


def edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def edit_config(path: Path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def expect(path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("expect", str(path), *args)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("weight-checker expect:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_truncated_checkpoint(good, tmp_path):
    bad = variant(good, tmp_path, "truncated")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    line = one_line_error(expect(bad))
    assert "model.safetensors" in line


def test_a_tensor_whose_shape_disagrees_names_it(good, tmp_path):
    import torch

    bad = variant(good, tmp_path, "shape")
    name = "model.layers.1.mlp.down_proj.weight"
    edit_tensors(bad, lambda t: t.__setitem__(name, torch.zeros(3, 3, dtype=torch.bfloat16)))
    line = one_line_error(expect(bad))
    assert name in line
    with pytest.raises(weight_checker.ExpectedDigestsError, match=name.replace(".", r"\.")):
        weight_checker.expected_digests(bad)


def test_a_tensor_the_model_does_not_have_names_it(good, tmp_path):
    import torch

    bad = variant(good, tmp_path, "extra")
    edit_tensors(
        bad, lambda t: t.__setitem__("model.layers.0.mlp.surprise.weight", torch.zeros(4, dtype=torch.bfloat16))
    )
    assert "model.layers.0.mlp.surprise.weight" in one_line_error(expect(bad))


def test_a_missing_tensor_is_reported_unwritten_never_hashed(good, tmp_path):
    bad = variant(good, tmp_path, "missing")
    edit_tensors(bad, lambda t: t.pop("model.layers.0.post_attention_layernorm.weight"))
    line = one_line_error(expect(bad))
    assert "never wrote" in line and "model.layers.0.post_attention_layernorm.weight" in line
    out = weight_checker.expected_digests(bad, allow_unwritten=True)
    key = "dp0:pp0:pcp0:tp0:model.layers.0.post_attention_layernorm.weight"
    assert key not in out and out.unwritten == [key]
    assert len(out) == len(weight_checker.expected_digests(good)) - 1


def test_unknown_architecture(good, tmp_path):
    bad = variant(good, tmp_path, "arch")
    edit_config(bad, architectures=["NoSuchModelForCausalLM"])
    assert "NoSuchModelForCausalLM" in one_line_error(expect(bad))


def test_quantized_model(good, tmp_path):
    bad = variant(good, tmp_path, "quantized")
    edit_config(bad, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    line = one_line_error(expect(bad))
    assert "quantized" in line and "fp8" in line


def test_not_a_model_directory(tmp_path):
    assert "config.json" in one_line_error(expect(tmp_path))


def test_bad_layout_is_a_usage_error(good):
    r = expect(good, "--tp", "0")
    assert r.returncode == 2 and "positive integer" in r.stderr and "Traceback" not in r.stderr


def test_a_one_shot_iterator_for_several_ranks_is_refused(good):
    from safetensors.torch import load_file

    state = load_file(str(good / "model.safetensors"))
    with pytest.raises(weight_checker.ExpectedDigestsError, match="one-shot"):
        weight_checker.expected_digests(good, iter(state.items()), tp=2)
    # The same stream as a re-iterable: the checkpoint's own digests.
    assert weight_checker.expected_digests(good, state.items(), tp=2) == weight_checker.expected_digests(good, tp=2)

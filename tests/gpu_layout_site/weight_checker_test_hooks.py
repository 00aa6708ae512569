"""Test-only worker extension (``--worker-extension-cls
weight_checker_test_hooks.TestHooks``): faults that a real weight update can
have, made on purpose inside each worker through ``collective_rpc``."""

from __future__ import annotations

import glob
import os


class TestHooks:
    def weight_checker_test_gpu_layout_digests(self) -> dict[str, str]:
        """``{key: digest}`` of the parameters the CPU backend repacked after
        loading, as the loader left them (see ``sitecustomize``)."""
        from weight_checker.integrations.vllm.worker import worker_prefix

        prefix = worker_prefix(self)
        out = {}
        for name, module in self.model_runner.get_model().named_modules():
            for param, digest in getattr(module, "_weight_checker_gpu_layout", {}).items():
                out[f"{prefix}{name}.{param}"] = digest
        return out

    def weight_checker_test_load_tp0_shard(self, weights_path: str, only: list[str] | None = None) -> None:
        """Every rank loads tensor-parallel rank 0's shard of the checkpoint
        at ``weights_path`` (the bug of vllm-gguf-plugin#103): each layer's and
        parameter's ``tp_rank`` is set to 0 while ``load_weights`` runs.
        ``only``: the whole checkpoint is loaded right first, then tp0's shard
        of just these checkpoint tensors (e.g. ``gate_proj`` alone: half of
        the fused ``gate_up_proj`` another rank's, the other half right)."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        model = self.model_runner.get_model()
        files = sorted(glob.glob(os.path.join(weights_path, "*.safetensors")))
        if only is not None:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                model.load_weights(safetensors_weights_iterator(files, False))
        saved = []
        for module in model.modules():
            for obj in (module, *module.parameters(recurse=False)):
                if isinstance(getattr(obj, "tp_rank", None), int):
                    saved.append((obj, obj.tp_rank))
                    obj.tp_rank = 0
        try:
            weights = safetensors_weights_iterator(files, False)
            if only is not None:
                weights = ((name, t) for name, t in weights if name in only)
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                model.load_weights(weights)
        finally:
            for obj, rank in saved:
                obj.tp_rank = rank

    def weight_checker_test_load_with_fault(
        self, weights_path: str, fault: str | None = None, name: str | None = None, ranks: list[int] | None = None
    ) -> None:
        """Loads the checkpoint at ``weights_path`` (every tensor through the
        model's ``load_weights``, as a transfer does), then makes ``fault`` in
        parameter ``name`` (issue 43's sync bugs, each in place): ``zeros``
        (zero bytes delivered), ``fp16`` (the values went through float32 ->
        float16 -> the parameter's dtype), ``stale-rows`` (the second half of
        the rows kept from before the load: a dropped bucket), ``transposed``
        (a square matrix sent transposed). ``ranks``: only these TP ranks
        load at all (the others missed the update)."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        if ranks is not None and ps.get_tp_group().rank_in_group not in ranks:
            return
        model = self.model_runner.get_model()
        before = model.get_parameter(name).detach().clone() if name else None
        files = sorted(glob.glob(os.path.join(weights_path, "*.safetensors")))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            model.load_weights(safetensors_weights_iterator(files, False))
            if fault is None or name is None:
                return
            p = model.get_parameter(name)
            if fault == "zeros":
                p.zero_()
            elif fault == "fp16":
                p.copy_(p.float().half().to(p.dtype))
            elif fault == "stale-rows":
                half = p.shape[0] // 2
                p[half:] = before[half:]
            elif fault == "transposed":
                p.copy_(p.t().contiguous())
            else:
                raise ValueError(f"unknown fault {fault!r}")

"""TEST-ONLY stand-in for SGLang's kernel package ``sgl_kernel``, CPU path.

Why it exists: SGLang (0.5.23) run on CPU (``SGLANG_USE_CPU_ENGINE=1``)
imports a few CPU ops from ``sgl_kernel`` unconditionally, at module import
time, and PyPI has no CPU build of that package (``sglang-kernel`` /
``sgl-kernel`` are CUDA-only and fail to import here; building the CPU kernel
from source is too slow for CI). Putting the directory that holds this package
on the server's ``PYTHONPATH`` lets the real SGLang server, scheduler, loader
and weight-update paths run on a CPU-only test machine, with tiny models.
Never ship it, never install it beside a real ``sgl_kernel``.

What it provides:

- :func:`assign_req_to_token_pool_cpu`, implemented in torch with the exact
  semantics of SGLang's Triton kernel ``assign_req_to_token_pool``
  (``sglang/srt/mem_cache/allocation.py``), which SGLang replaces by this op
  on CPU (``assign_req_to_token_pool_func``). In 0.5.23 it is reached only
  from speculative decoding (``alloc_for_spec_decode``); plain prefill/decode
  writes ``req_to_token`` through ``write_cache_indices``' torch fallback.
- Every other name SGLang imports from ``sgl_kernel`` on the CPU path, as a
  function that raises :class:`NotImplementedError` when called: importable,
  so the modules load, but never silently wrong.

What it deliberately does not provide:

- No ``torch.ops.sgl_kernel`` ops are registered, so
  ``sglang.srt.utils.common.cpu_has_amx_support()`` is false and RMSNorm,
  SiluAndMul, rotary and sampling take their pure-torch paths; linear weights
  are not repacked after loading (the GPU layout, unlike a real CPU/AMX
  kernel's ``convert_weight_packed``).
- No submodules (``scalar_type``, ``allreduce``, ``kvcacheio``, ...) and no
  module-level ``__getattr__``: SGLang probes several names with
  ``try: from sgl_kernel... import X / except ImportError`` and falls back to
  a torch path (``sglang/srt/layers/quantization/utils.py``
  ``get_scalar_types``, ``custom_all_reduce_ops.py``, rotary, renorm); a
  catch-all stub would defeat those fallbacks (``scalar_types.uint4b8`` then
  fails at import). ``kvcacheio`` is imported only on CUDA/HIP.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

#: Marks this package as the stand-in (a real ``sgl_kernel`` has no such name).
IS_TEST_STANDIN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    """For each request ``i`` (in order), write the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (a
    running cursor from 0) into row ``req_pool_indices[i]`` of
    ``req_to_token``, columns ``start_offset[i]:end_offset[i]``; in place.

    As the Triton kernel does: ``req_to_token`` is addressed flat, row ``r``
    starting at ``r * pool_len`` (SGLang passes ``req_to_token.shape[1]``);
    values are cast to ``req_to_token``'s dtype (int32) on store; the cursor
    of request ``i`` is the sum of ``end - start`` over the requests before
    it, and a request with ``end <= start`` writes nothing.
    """
    flat = req_to_token.view(-1)  # contiguous, as the kernel's pointer arithmetic assumes
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            base = row * pool_len
            flat[base + start : base + end] = out_cache_loc[cursor : cursor + n]
        cursor += n


def _not_implemented(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the test-only stand-in "
            "(weight_checker.testing.sglang.standin); install a real CPU build of sgl-kernel"
        )

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Stand-in for ``sgl_kernel.{name}``: raises NotImplementedError when called."
    return op


# Imported at start-up on the CPU path (found by starting SGLang 0.5.23 with
# SGLANG_USE_CPU_ENGINE=1 and importing its server, scheduler, model runner,
# Llama/Qwen2 and speculative modules); called only by KV-cache moves
# (sglang/kernels/ops/kvcache/cache_move.py) and speculative decoding
# (sglang/kernels/ops/speculative/{eagle,spec_tree}.py, ...).
copy_all_layer_kv_cache_cpu = _not_implemented("copy_all_layer_kv_cache_cpu")
build_tree_kernel_efficient_cpu = _not_implemented("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_implemented("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_implemented("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_implemented("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _not_implemented("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_implemented("fill_bonus_tokens_cpu")

"""The digests every rank of an SGLang engine must hold, computed through
SGLang's own model classes and ``load_weights``, rank by rank, on the CPU.

    expected = weight_checker.expected_digests(None, trainer_state, like="http://sglang:30000")
    expected = weight_checker.expected_digests("ckpt/", tp=2, engine="sglang")

For rank ``tp_rank`` of ``tp``, SGLang's runtime context is built for that
rank (``create_context``, used only while the model is built and loaded: the
process's own context, an in-process engine's included, is restored) and its
tensor-parallel groups are plain ``(rank, size)`` stand-ins (nothing is
communicated while a model is built and loaded). SGLang itself then pads the
vocabulary (to 64 rows, or ``64 * tp``), fuses ``qkv_proj`` and
``gate_up_proj``, splits rows and columns and replicates KV heads. The
tensors hashed are the ones the plugin hashes in the engine
(:func:`weight_checker.integrations.sglang.worker.walk`: SGLang's own
checker's walk), keyed ``dp{d}:pp0:pcp0:tp{t}:{name}``. The model's
post-load processing is never run: on a GPU it changes no unquantized
weight, and what it would change is refused (:mod:`.server`).

SGLang is imported here, in the caller's process, on its CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, set before the first import); its kernel
module must import (a GPU host's ``sgl_kernel``; on a CPU-only host a build
for the CPU, or the test suite's stand-in). A kernel that would repack the
weights for the CPU (Intel AMX) is refused by name for an engine on the CPU.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.expected.recipe import pairs_for, read_again, remember
from weight_checker.expected.sglang.server import SGLANG
from weight_checker.expected.transforms import transformed
from weight_checker.expected.vllm.rank_model import LOCK, Arena
from weight_checker.expected.weights import Pass, Tracked, weights_source
from weight_checker.hashing.digests import checksum_sized
from weight_checker.integrations.sglang.plugin import KNOWN_VERSIONS
from weight_checker.integrations.sglang.worker import walk
from weight_checker.keys import rank_prefix, split_rank

CPU_ENGINE = "SGLANG_USE_CPU_ENGINE"


def import_sglang() -> Any:
    """SGLang's modules, on its CPU engine; refused in one line where they cannot be."""
    if "sglang" not in sys.modules:
        os.environ.setdefault(CPU_ENGINE, "1")
    if os.environ.get(CPU_ENGINE) != "1":
        raise ExpectedDigestsError(
            f"SGLang was imported in this process without {CPU_ENGINE}=1: the expected digests build SGLang's model "
            "on the CPU; set it before SGLang is first imported"
        )
    try:
        import sglang
        from sglang.srt import runtime_context
    except ImportError as e:
        raise ExpectedDigestsError(
            f"expected digests for an SGLang engine need SGLang {KNOWN_VERSIONS[0]} here ({e}): pip install "
            f"sglang=={KNOWN_VERSIONS[0]}"
        ) from e
    if sglang.__version__ not in KNOWN_VERSIONS:
        raise ExpectedDigestsError(
            f"SGLang {sglang.__version__} is installed here; expected digests know SGLang {', '.join(KNOWN_VERSIONS)}"
        )
    return runtime_context


class _Group:
    """A tensor-parallel group as SGLang's layers read it while they are
    built and loaded: a rank and a size (any other use would communicate)."""

    def __init__(self, rank: int, size: int):
        self.rank_in_group = self.rank = rank
        self.world_size = size
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == size - 1
        self.device_group = self.cpu_group = None

    def __getattr__(self, name: str) -> Any:
        raise ExpectedDigestsError(f"SGLang's model asked its process group for {name!r} while it was built")


def server_args(model: str, tp: int, dtype: str | None, revision: str | None) -> Any:
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=model, device="cpu", tp_size=tp, attention_backend="torch_native", dtype=dtype or "auto",
        revision=revision, disable_cuda_graph=True,
    )  # fmt: skip
    args.resolve_once()
    return args


def refuse_repacking(device: str | None) -> None:
    """An engine on the CPU whose kernel module packs weights for AMX holds
    them repacked: refused where this host's SGLang would do it too."""
    from sglang.srt.utils.common import cpu_has_amx_support

    if device == "cpu" and cpu_has_amx_support():
        raise ExpectedDigestsError(
            "an SGLang engine on the CPU with sgl_kernel's AMX kernels repacks its weights after loading "
            "(convert_weight_packed): not reproduced"
        )


#: One rank's parameter memory, kept from call to call (as vLLM's ranks'):
#: freed by :func:`weight_checker.expected.release_buffers`.
SGLANG_ARENA = Arena()


def build_rank(
    args: Any, tp_rank: int, tp: int, pairs: Any, cpu_engine: bool = False, deferred_in: Arena | None = None
) -> tuple[Any, list[str], Any]:
    """``(model, names of parameters the weights never wrote, deferred)``
    of one rank. ``cpu_engine``: the engine runs on the CPU, where SGLang's
    model runner pads heads and MLP sizes to what its kernels need
    (``adjust_config_with_unaligned_cpu_tp``, as the engine does).
    ``deferred_in``: the parameters are bound to this arena and the loader's
    plain copies of ``pairs`` (a :class:`~weight_checker.expected.weights.Pass`)
    recorded, not made (:class:`~weight_checker.expected.vllm.deferred.DeferredWrites`,
    returned: hash with its ``checksum``); else ``pairs`` are plain pairs,
    loaded for real, and ``deferred`` is ``None``."""
    runtime_context = sys.modules["sglang.srt.runtime_context"]
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from weight_checker.expected.vllm.deferred import DeferredWrites, capturing

    ranks = runtime_context.SpawnRanks(
        world_rank=runtime_context.spawn_world_rank(args, tp_rank=tp_rank, pp_rank=0), dp_rank=None, gpu_id=0
    )
    context = runtime_context.create_context(args, role="scheduler", ranks=ranks)
    group = _Group(tp_rank, tp)
    deferred = None
    with runtime_context.use_context(context):
        with runtime_context.get_parallel().override(
            pp_group=_Group(0, 1), tp_group=group, moe_tp_group=group, attn_tp_group=group
        ):
            model_config = ModelConfig.from_server_args(args)
            if cpu_engine:
                from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp

                model_config = adjust_config_with_unaligned_cpu_tp(model_config, LoadConfig(load_format="auto"), tp)
            if model_config.quantization is not None:
                from weight_checker.expected.sglang.server import SGLANG_QUANTIZED

                raise ExpectedDigestsError(f"quantized model ({model_config.quantization}): {SGLANG_QUANTIZED}")
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                model = _initialize_model(model_config, LoadConfig(load_format="auto"), None)
            if deferred_in is not None:
                # Bound to the arena (what an earlier rank left there): what the
                # build gave a parameter that is not NaN-filled below is kept.
                built = {id(p): p.detach().clone() for p in model.parameters() if not p.is_floating_point()}
                bound = deferred_in.bind(model, zero=False)
                for p in bound:
                    if id(p) in built:
                        p.data.copy_(built[id(p)])
                deferred = DeferredWrites(deferred_in.buffer, bound)
            params = dict(model.named_parameters())
            # A layout's weights are address space, never bytes: no NaN fill
            # there (its unwritten parameters are those no write reached, and
            # a key its pieces do not tile is named by the layout anyway).
            if deferred is None or not capturing():
                for p in params.values():
                    if p.is_floating_point():
                        p.data.fill_(float("nan"))
            if deferred is None:
                model.load_weights(iter(pairs))
            else:
                tracked = Tracked(pairs.pairs, deferred.note_source if pairs.stable else None)
                with deferred:
                    model.load_weights(iter(tracked))
    if deferred is not None:
        # A parameter its recorded copies tile exactly is written in full; any
        # other one is written into the arena now, to be looked at.
        params = {n: p for n, p in params.items() if not deferred.tiles(p)}
        if capturing():
            return model, [n for n, p in params.items() if deferred.left_unwritten(p)], deferred
        for p in params.values():
            deferred.replay_param(p)
    # SGLang's loaders write through ``param.data``, which no version counter
    # sees: a row still NaN everywhere was never written.
    unwritten = [name for name, p in params.items() if _has_unwritten_row(p)]
    return model, unwritten, deferred


def _has_unwritten_row(p: Any) -> bool:
    """Whether some row of ``p`` (an element, for a vector) is NaN
    throughout, as every parameter was filled before the weights were
    loaded: no weight's row is, while a weight the loader skipped, or one
    part of a fused weight (``k_proj`` of ``qkv_proj``), is. (NaN, not a byte
    pattern: any pattern is some float16 weight's ordinary value.)"""
    import torch

    if p.numel() == 0 or not p.is_floating_point():
        return False
    rows = torch.isnan(p.detach()).reshape(p.shape[0] if p.dim() > 1 else p.numel(), -1)
    return bool(rows.all(dim=1).any())


def _built(
    args: Any, tp_rank: int, tp: int, pairs: Any, name: str, cpu_engine: bool, deferred_in: Arena | None = None
) -> tuple[Any, list[str], Any]:
    """:func:`build_rank`, SGLang's own errors (a shape that does not
    split, a weight of the wrong shape) named by rank."""
    try:
        return build_rank(args, tp_rank, tp, pairs, cpu_engine, deferred_in)
    except ExpectedDigestsError:
        raise
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        raise ExpectedDigestsError(f"SGLang's model for {name} could not be built and loaded: {why}") from e


class _Checker:
    """What :func:`~weight_checker.integrations.sglang.worker.walk` reads of SGLang's checker."""

    def __init__(self, model: Any):
        self.model = model

    def _model_state(self) -> Any:
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()


class SGLangExpectedDigests(ExpectedDigests):
    """Expected digests of an SGLang engine; :meth:`tensors` gives the
    tensors behind them again (the explanation's source), rebuilt from the
    same weights, which must still be what they were."""

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> dict[str, dict[str | None, Any]]:
        recipe = self._recompute
        if recipe is None or recipe.refusal:
            raise ExpectedDigestsError(
                f"{', '.join(keys)}: cannot recompute the expected tensors: "
                f"{getattr(recipe, 'refusal', None) or 'digests read from a manifest'}"
            )
        wanted: dict[int, list[str]] = {}
        for key in keys:
            if key not in self:
                raise ExpectedDigestsError(f"{key}: not a key of these expected digests")
            rank, _ = split_rank(key)
            wanted.setdefault(int(rank.split(":")[3].removeprefix("tp")), []).append(key)
        with LOCK:  # SGLang's context and torch's default dtype are process-wide while a rank is built
            return self._rebuilt(recipe, wanted, keys, transforms)

    def _rebuilt(
        self, recipe: Any, wanted: dict[int, list[str]], keys: Sequence[str], transforms: Sequence[str]
    ) -> dict[str, dict[str | None, Any]]:
        settings = recipe.settings
        weights = read_again(recipe, list(keys))
        out: dict[str, dict[str | None, Any]] = {}
        try:
            args = server_args(settings["path"], settings["tp"], settings["dtype"], settings["revision"])
            for tp_rank, rank_keys in sorted(wanted.items()):
                pairs = pairs_for(weights, None, rank_keys)
                cpu_engine = settings.get("device") == "cpu"
                model, _, _ = _built(args, tp_rank, settings["tp"], pairs, f"pp0:tp{tp_rank}", cpu_engine)
                held = dict(walk(_Checker(model)))
                for key in rank_keys:
                    t = held[split_rank(key)[1]].detach()
                    digests, _ = checksum_sized([("t", t)], "")
                    if digests["t"] != self[key]:
                        raise ExpectedDigestsError(
                            f"{key}: the expected tensors changed since the digests were computed"
                        )
                    out[key] = {None: t}
                    for name in transforms:
                        candidate = transformed(name, t)
                        if candidate is not None:
                            out[key][name] = candidate
        finally:
            weights.close()
        return out


def sglang_expected_digests(
    model: Any,
    weights: Any,
    *,
    tp: int,
    pp: int,
    dp: int,
    dtype: str | None,
    allow_unwritten: bool,
    progress: Callable[[str], None] | None,
    weight_version: str | None,
    arguments: Mapping[str, Any],
) -> SGLangExpectedDigests:
    """:func:`weight_checker.expected_digests` for an SGLang engine
    (``engine="sglang"``, or ``like=`` an SGLang server)."""
    unsupported = sorted(k for k, v in arguments.items() if k not in ("device", "revision") and v not in (None, False))
    if unsupported:
        raise ExpectedDigestsError(f"not covered for an SGLang engine: {', '.join(unsupported)}")
    if pp != 1:
        raise ExpectedDigestsError("SGLang pipeline parallelism (pp > 1) is not covered yet")
    if not isinstance(model, (str, Path)):
        raise ExpectedDigestsError("an SGLang engine's model is its checkpoint directory (or like=URL)")
    checkpoint = Path(model)
    if not (checkpoint / "config.json").is_file():
        raise ExpectedDigestsError(f"{checkpoint}: no config.json (an SGLang engine's model is a local checkpoint)")
    config = _config(checkpoint)
    experts = _experts(config)
    if experts:
        # SGLang's MoE layers reorder their expert weights after loading on some GPU backends (aiter, flashinfer).
        raise ExpectedDigestsError(f"{checkpoint}: a mixture-of-experts model ({experts}): not covered on SGLang")
    source = weights_source(weights, checkpoint if weights is None else None, tp)
    import_sglang()
    refuse_repacking(arguments.get("device"))
    cpu_engine = arguments.get("device") == "cpu"
    shapes = _checkpoint_shapes(checkpoint) if weights is not None else {}

    def checked(pairs: Any) -> Any:
        """The trainer's pairs, each of the checkpoint's shape where the
        checkpoint names it: SGLang's CPU loader zero-pads a short tensor
        where a GPU engine's refuses it."""
        for name, tensor in pairs:
            want = shapes.get(name)
            if want is not None and list(tensor.shape) != want:
                raise ExpectedDigestsError(
                    f"weight '{name}' has shape {list(tensor.shape)}; the checkpoint's is {want}"
                )
            yield name, tensor

    import sglang

    args = server_args(str(checkpoint), tp, dtype, arguments.get("revision"))
    out = SGLangExpectedDigests(weight_version=weight_version)
    from weight_checker.expected.vllm.deferred import PendingDigests  # torch's: imported when a rank is built
    from weight_checker.hashing.block_states import recording

    # The loader's plain copies are hashed where the weights lie, every
    # rank's in one run at the end (as vLLM's ranks: .vllm.deferred).
    later = PendingDigests()
    with recording() as states:  # each key's chain at its block boundaries, for explanations
        try:
            start = time.perf_counter()
            for tp_rank in range(tp):
                name = f"pp0:tp{tp_rank}"
                if progress is not None:
                    progress(name)
                read = source.read()
                pairs = Pass(checked(read.pairs), read.stable)
                model_obj, unwritten, deferred = _built(args, tp_rank, tp, pairs, name, cpu_engine, SGLANG_ARENA)
                try:
                    loaded = time.perf_counter()
                    out.seconds["load"] += loaded - start
                    if unwritten and not allow_unwritten:
                        shown = ", ".join(unwritten[:5]) + (" ..." if len(unwritten) > 5 else "")
                        raise ExpectedDigestsError(
                            f"the weights never wrote {len(unwritten)} parameter(s) of {name} (rows still NaN after "
                            f"loading: no weight fed them, or the weights hold NaN there): {shown}"
                        )
                    skip = set(unwritten)
                    held_dtype = str(next(model_obj.parameters()).dtype).removeprefix("torch.")
                    prefix = rank_prefix(0, 0, 0, tp_rank)
                    hashed = [(n, t) for n, t in walk(_Checker(model_obj)) if n not in skip]
                    out.update(deferred.checksum(hashed, prefix, later))
                    if source.fresh_per_rank:
                        # Weights a callable makes anew for each rank (a reused
                        # staging buffer) are hashed before it is called again.
                        out.update(later.finish())
                    out.unwritten += [prefix + n for n in unwritten]
                finally:
                    deferred.release()  # its pieces are in ``later`` now, or dropped with it
                del model_obj
                start = time.perf_counter()
                out.seconds["hash"] += start - loaded
            out.update(later.finish())
        finally:
            later.drop()
    out.seconds["hash"] += later.seconds
    out.block_states.update(states)
    for d in range(1, dp):  # every data-parallel replica holds the same
        for key in [k for k in out if k.startswith("dp0:")]:
            out[f"dp{d}:" + key.removeprefix("dp0:")] = out[key]
            if key in states:
                out.block_states[f"dp{d}:" + key.removeprefix("dp0:")] = states[key]
        out.unwritten += [f"dp{d}:" + k.removeprefix("dp0:") for k in out.unwritten if k.startswith("dp0:")]
    out.layout = {
        "tp": tp, "pp": 1, "dp": dp, "dtype": held_dtype, "engine": SGLANG, "sglang_version": sglang.__version__,
        "architecture": (config.get("architectures") or [None])[0],
    }  # fmt: skip
    out._recompute = remember(
        checkpoint, weights, checkpoint if weights is None else None, None, source,
        path=str(checkpoint), tp=tp, dtype=dtype, revision=arguments.get("revision"), device=arguments.get("device"),
    )  # fmt: skip
    source.forget_others()
    return out


def _checkpoint_shapes(checkpoint: Path) -> dict[str, list[int]]:
    """``{name: shape}`` of the checkpoint's safetensors files (their headers
    only), ``{}`` where it has none (a config alone)."""
    from weight_checker import _core

    shapes: dict[str, list[int]] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        try:
            shapes.update({name: list(shape) for name, _, shape, _ in _core.safetensors_tensors(str(path))})
        except ValueError as e:
            raise ExpectedDigestsError(f"{path}: {e}") from e
    return shapes


#: config.json fields that give a model experts.
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _config(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's config.json (``{}`` where it cannot be read: SGLang's own reading then says why)."""
    import json

    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _experts(config: dict[str, Any]) -> str | None:
    """``"num_experts = 8"`` where the config gives the model experts, else ``None``."""
    for part in (config, config.get("text_config") or {}):
        for field in EXPERT_FIELDS:
            if part.get(field):
                return f"{field} = {part[field]}"
    return None

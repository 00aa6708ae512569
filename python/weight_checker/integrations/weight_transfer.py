"""Every update through vLLM's weight-transfer API, verified: :func:`verified`, around vLLM's sync clients.

vLLM ≥ 0.32's trainer engines (``TrainerWeightTransferEngine``: NCCL, IPC, and
the ones TRL's server mode, SkyRL or open-instruct build on it) drive an
inference server through a ``VLLMWeightSyncClient``: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` and ``finish_weight_update``.
:func:`verified` wraps one (or a fleet of them) and checks every update as it
finishes::

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.integrations.weight_transfer import verified

    client = verified(HTTPVLLMWeightSyncClient(url), expected=lambda version: expected_for(version))
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
    engine.send_weights()            # raises WeightMismatchError if the engine does not hold the update
    client.results[-1]               # the verdict, its weight version, where the digests came from, timings

At ``finish_weight_update(weight_version)`` it takes the engines' digests of
the weights the update committed: from the finish answer itself where the
server serves this package's route (``"checksum": true`` is sent with the
update: the workers hash as they commit), else from one checksum, and says
which (``result.digests_from``). It compares them with the expected digests
(a manifest, a mapping, or a callable that returns this update's), classes
each mismatch (``stale``, ``wrong-shard``, ``changed``, ``missing``,
``unexpected``) against what the engines held before, ties the verdict to
the weight version each engine claims, and raises
:class:`~weight_checker.WeightMismatchError` or warns (``on_mismatch``).

What it wraps:

- vLLM's ``HTTPVLLMWeightSyncClient`` (or anything with a ``base_url``): the
  update and the finish are posted here, with the checksum flag;
- an in-process ``vllm.LLM``: the finish is the plugin's worker method, which
  finishes and hashes in one call (:func:`finish_weight_update`);
- any other client (vLLM's Ray client, your own): its own calls, then one
  checksum of ``checksum_from`` (URLs, engines or Ray actor handles: what
  :func:`weight_checker.verify` takes);
- a list of any of these: a fleet, each update sent to all at once.

Its rooms: :mod:`.weight_transfer_client` (the wrapper, :class:`VerifiedClient`,
and its verdict, :class:`UpdateCheck`), :mod:`.weight_transfer_engines` (how
each kind of client is reached) and :mod:`.weight_transfer_finish` (the
in-process finish that hashes as it commits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weight_checker.errors import InputError
from weight_checker.integrations.weight_transfer_client import UpdateCheck, VerifiedClient
from weight_checker.integrations.weight_transfer_finish import finish_weight_update, finish_weight_update_async

__all__ = ["UpdateCheck", "VerifiedClient", "finish_weight_update", "finish_weight_update_async", "verified"]


def verified(
    client: Any,
    expected: Any,
    *,
    on_mismatch: str = "raise",
    include: Any = None,
    checksum_from: Any = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    weight_version: Callable[[], str | None] | None = None,
    explain: bool | int = True,
    keep_versions: int = 2,
) -> VerifiedClient:
    """``client`` (a ``VLLMWeightSyncClient``, an in-process ``vllm.LLM``, or
    a list of them: a fleet) wrapped so that every update is verified at its
    finish against ``expected`` (a manifest path, a ``{key: hex}`` mapping, or
    a callable returning this update's, given the weight version if it takes
    an argument). Usable wherever the client is: ``client=`` of
    ``TrainerWeightTransferEngine.trainer_init``. ``on_mismatch``: ``"raise"``
    (:class:`~weight_checker.WeightMismatchError` from
    ``finish_weight_update``) or ``"warn"``; ``include``: the checksum's scope
    (default: every scope a manifest or mapping ``expected`` holds keys of,
    else what vLLM's own checksum covers; a callable's digests that hold more
    are checked by one checksum after the finish); ``checksum_from``: where to
    take the digests of a client that is neither vLLM's HTTP client nor an
    engine (URLs, engines, Ray actor handles); ``weight_version``: a callable
    giving the version to finish each update with where the caller finishes
    without one (vLLM's trainer engines call ``finish_weight_update()`` with
    no argument): the engines are finished with it, ``expected`` is given it
    and the verdict is tied to it. ``explain``: on a mismatch, explain the
    first 64 mismatched keys (an int: that many; ``False``: none): where in
    each tensor and the likely cause, in ``.results[-1].explanation`` and on
    the raised error; ``keep_versions``: how many previous updates' expected
    digests are kept for causes like ``version:step-11`` (default 2)."""
    clients = list(client) if isinstance(client, (list, tuple)) else [client]
    if not clients:
        raise InputError("no client given")
    return VerifiedClient(
        clients, expected, on_mismatch=on_mismatch, include=include, checksum_from=checksum_from,
        api_key=api_key, timeout=timeout, weight_version=weight_version, explain=explain,
        keep_versions=keep_versions,
    )  # fmt: skip

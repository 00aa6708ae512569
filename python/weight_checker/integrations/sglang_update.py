"""An update through SGLang's weight-update flow, verified: :func:`verified`.

SGLang ≥ 0.5.23 updates a server's weights inside a session:
``/begin_weight_update``, then any number of ``/update_weights_from_tensor``
or ``/update_weights_from_distributed`` calls, then ``/end_weight_update``
(its post-load processing). :func:`verified` runs that session inside
:func:`weight_checker.verify`: the server is paused (in the mode asked for),
its digests taken, the session opened, your ``send(session)`` run, the
session closed (also when ``send`` fails: the server is never left in one),
the digests taken again and compared with the expected ones, then the
server resumed::

    from weight_checker.integrations.sglang_update import verified

    expected = weight_checker.expected_digests(None, trainer_state, like=url)
    result = verified(url, lambda s: s.from_tensor(trainer_state.items()), expected=expected, pause="keep")
    result.raise_for_mismatch()      # stale, wrong-shard, zeros... named per key

    def send(s):                     # one broadcast per tensor, over the group the server joined
        s.from_distributed(names, dtypes, shapes, group_name="g", broadcast=lambda: [dist.broadcast(t, 0, group=g)
                                                                                 for t in tensors])
    verified(url, send, expected=expected)

``from_tensor`` serializes with SGLang's own ``MultiprocessingSerializer``
(SGLang installed in the trainer, as its weight updates need anyway), one
payload per tensor-parallel rank (``per_rank`` gives each its own pairs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from weight_checker.errors import InputError, WeightCheckerError
from weight_checker.httpclient import api_key_from_env, request, validate_url
from weight_checker.verify.workflow import verify

__all__ = ["UpdateSession", "verified"]


class UpdateSession:
    """An open weight-update session on one SGLang server: the updates it takes."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self._tp: int | None = None

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One of SGLang's update calls; raises :class:`WeightCheckerError` naming it unless it succeeded."""
        status, answer = request("POST", self.url, path, body, timeout=self.timeout, api_key=self.api_key)
        if status != 200 or not isinstance(answer, dict) or answer.get("success") is False:
            message = answer.get("message") if isinstance(answer, dict) else answer
            raise WeightCheckerError(f"{self.url}{path}: HTTP {status}: {message}")
        return answer

    @property
    def tp(self) -> int:
        """The server's tensor-parallel size (one ``from_tensor`` payload per rank)."""
        if self._tp is None:
            status, info = request("GET", self.url, "/server_info", timeout=self.timeout, api_key=self.api_key)
            if status != 200 or not isinstance(info, dict) or not isinstance(info.get("tp_size"), int):
                raise WeightCheckerError(f"{self.url}/server_info: no tp_size (HTTP {status})")
            self._tp = info["tp_size"]
        return self._tp

    def from_tensor(
        self,
        named_tensors: Iterable[tuple[str, Any]] | None = None,
        *,
        per_rank: Sequence[Iterable[tuple[str, Any]]] | None = None,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor``: ``named_tensors`` (the checkpoint's
        names, whole tensors) to every rank, or ``per_rank[r]`` to rank ``r``."""
        if (named_tensors is None) == (per_rank is None):
            raise InputError("from_tensor: give named_tensors or per_rank, one of them")
        # sglang: the trainer's, installed where it sends SGLang updates.
        import torch.multiprocessing
        from sglang.srt.utils import MultiprocessingSerializer

        if per_rank is None:
            assert named_tensors is not None
            pairs = list(named_tensors)
            per_rank = [pairs] * self.tp
        elif len(per_rank) != self.tp:
            raise InputError(f"from_tensor: {len(per_rank)} payloads for {self.tp} tensor-parallel ranks")
        # One serialization a rank, as SGLang's Engine does: a rank that opens a
        # shared tensor's handle releases it, so two ranks cannot share one.
        # SGLang's schedulers open the tensors by file name (a descriptor cannot
        # be sent over HTTP); the trainer's own strategy is back once they are out.
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            payloads = [MultiprocessingSerializer.serialize(list(pairs), output_str=True) for pairs in per_rank]
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
        body: dict[str, Any] = {"serialized_named_tensors": payloads, "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.post("/update_weights_from_tensor", body)

    def from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        broadcast: Callable[[], Any],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_distributed``: the server receives one
        broadcast per name, in order, over ``group_name`` (which it joined by
        ``/init_weights_update_group``); ``broadcast()`` sends them, here,
        while the call is pending. Where ``broadcast()`` fails part way, the
        server is still in the collective: the call returns when SGLang gives
        up on it (its group's timeout) or at this session's ``timeout``."""
        body: dict[str, Any] = {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name,
        }  # fmt: skip
        if weight_version is not None:
            body["weight_version"] = weight_version
        answer: list[Any] = []

        def call() -> None:
            try:
                answer.append(self.post("/update_weights_from_distributed", body))
            except BaseException as e:  # handed to the caller's thread below
                answer.append(e)

        pending = threading.Thread(target=call, name="sglang-update-from-distributed", daemon=True)
        pending.start()
        try:
            broadcast()
        finally:
            pending.join()
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]  # type: ignore[no-any-return]


def session_transfer(
    url: str, send: Callable[[UpdateSession], Any], api_key: str | None, timeout: float
) -> Callable[[], None]:
    """The transfer :func:`weight_checker.verify` runs: begin, ``send``, end."""

    def transfer() -> None:
        session = UpdateSession(url, api_key, timeout)
        session.post("/begin_weight_update", {})
        try:
            send(session)
        except BaseException as failed:
            # The session is ended whatever happened; the error raised is send's.
            try:
                session.post("/end_weight_update", {})
            except Exception as e:
                failed.add_note(f"and the session could not be ended: {e}")
            raise
        session.post("/end_weight_update", {})

    return transfer


def verified(
    url: str,
    send: Callable[[UpdateSession], Any],
    *,
    expected: Any,
    api_key: str | None = None,
    pause: str = "abort",
    timeout: float = 600.0,
    **options: Any,
) -> Any:
    """Runs SGLang's update session (``send(session)`` between
    ``begin_weight_update`` and ``end_weight_update``) inside
    :func:`weight_checker.verify` against ``expected``, and returns its
    :class:`~weight_checker.VerifyResult`. ``options``: verify's others
    (``explain``, ``history``...)."""
    url = validate_url(url)
    key = api_key_from_env(api_key)
    transfer = session_transfer(url, send, key, timeout)
    return verify(
        url, transfer, expected=expected, api_key=key, pause=pause, engine="sglang", timeout=timeout, **options
    )

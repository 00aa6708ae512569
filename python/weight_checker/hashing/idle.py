"""Digests made in a core's idle time, for a later checksum to reuse.

An expected-digests call for a quantized TP engine spends much of its time
on one Python thread (vLLM's loaders, the builds of the rank models) while
the other cores idle, and its last step hashes every rank's tensors on all
of them. A layer's tensors are final once vLLM has processed it, well
before that step. :class:`IdleHashing` hashes them in between, on a thread
of the core's own under Linux's ``SCHED_IDLE`` policy, on that thread alone
(``_core.BackgroundHasher``: no pool thread at the normal priority takes its
work up), and it waits between two steps while an FP8 kernel runs (the
core's ``foreground``): on this project's 2-vCPU Intel Xeon an idle-policy
hasher beside the kernels slowed them from 2.9 to 2.0 GB/s, and the loads
lost what the hashing saved. The last step then takes the digest of each
tensor that is still the very object hashed, its version unchanged
(:meth:`IdleHashing.digest_of`), and hashes the rest as before. Measured
there (``benches/bench_quantized.py``, online FP8 of a 1 GB model at TP=2):
0.57-0.66 s a call against 0.68-0.69 s; at TP=1 a rank's load left too
little idle time to gain, and no session is opened.

A digest taken assumes what every digest of memory in use assumes: nothing
writes a submitted tensor without torch seeing it (through ``.data``, a
raw pointer or a numpy view: its version does not change), and nothing
frees or resizes its storage, nor writes it through another tensor set on
it (``set_``: no version shared). What is hashed is an alias that owns the
storage, kept until the session ends: a tensor rebound elsewhere, ``.data
= ...``, frees nothing under the run, and its new memory cannot lie where
the old one did (the allocator cannot hand out an address still held), so
checking where it lies catches the rebinding. The callers
submit a layer only once vLLM's processing of it has returned, and leave
out a tensor whose memory still has copies pending (``pending_pieces`` of
:mod:`weight_checker.expected.vllm.deferred_rows`); a copy deferred into
a memory later, or written there for real, is told here (:func:`invalidate`),
and no digest of a tensor in that memory is taken.

Where ``SCHED_IDLE`` is missing (not Linux) or refused, :func:`session`
hashes nothing in the background: the last step hashes everything, as
before. The idle thread never runs Python: on a host whose cores other
processes keep busy it may wait seconds to run again, and one preempted
while it held the GIL would stall every Python thread of the process that
long. Nor does a caller ever wait for it: the core only tries the queues
they share (a few tries, yielding between them; one still busy is tried
again at the next call), and closing returns at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

#: Smaller tensors are not worth a queue entry: the last step hashes them in batches.
MIN_BYTES = 1 << 16
#: The bytes one background run takes (at least one tensor): enough
#: messages for the core to choose its lanes; one under way when the call
#: asks for its digests is stopped, and its tensors hashed then.
RUN_BYTES = 64 << 20

#: How long a session's end waits for its thread to let go of a stopped run:
#: a step, where a core is free. Where other processes keep the cores busy
#: the idle-policy thread may not run for a while, and the call does not
#: wait for it (under two busy loops on the 2-vCPU AMD EPYC, a wait of 1 s
#: took 0.4-1.0 s of some calls); it lets go when it runs again.
JOIN_SECONDS = 0.05

_LOCAL = threading.local()


class IdleHashing:
    """One call's background hasher (see the module docstring)."""

    def __init__(self) -> None:
        from weight_checker import _core

        self._core = _core.BackgroundHasher(RUN_BYTES)
        self._closed = False
        self._queued: set[int] = set()
        self._next_job = 0
        #: job id -> (a weak reference to the tensor, its version when
        #: submitted, the alias hashed). The alias is kept until the session
        #: ends: while it holds the old memory, a rebinding cannot land there.
        self._jobs: dict[int, tuple[weakref.ref[Any], int, Any]] = {}
        #: id(tensor) -> (a weak reference to it, its version when submitted, its digest).
        self._done: dict[int, tuple[weakref.ref[Any], int, str]] = {}
        self._aliases: list[Any] = []
        #: id(tensor) -> (where it lies, :func:`_layout`; the clock when
        #: submitted); each storage address -> the clock when last written
        #: (:meth:`invalidate`).
        self._submitted: dict[int, tuple[tuple[Any, ...], int]] = {}
        self._written: dict[int, int] = {}
        self._clock = 0

    @property
    def hashed_bytes(self) -> int:
        """Bytes the background has hashed so far."""
        return self._core.hashed_bytes

    @property
    def thread_id(self) -> int | None:
        """The hashing thread's Linux id, once it runs."""
        return self._core.thread_id

    def submit(self, tensors: Iterable[Any]) -> None:
        """Queues each tensor worth it, once a session: a plain contiguous
        CPU tensor of at least :data:`MIN_BYTES` (an inference tensor, which
        keeps no version, or one torch cannot describe, is left to the last
        step). The caller's: its memory holds its bytes now, and nothing
        writes them without torch seeing it."""
        import torch

        self._collect()
        if self._closed or self._core.refused:
            return
        chosen = []
        # Looked at past any torch function mode of the caller's (the deferred
        # copies': asking for a storage would hand that memory out).
        with torch._C.DisableTorchFunction():
            for t in tensors:
                if id(t) in self._queued or type(t) not in (torch.Tensor, torch.nn.Parameter):
                    continue
                try:
                    if (
                        t.is_inference()
                        or t.device.type != "cpu"
                        or not t.is_contiguous()
                        or t.numel() * t.element_size() < MIN_BYTES
                    ):
                        continue
                    # The alias hashed owns the storage: rebinding the tensor's
                    # (``.data =``) while it is read frees nothing under it.
                    chosen.append((t, t.detach(), _layout(t), t._version))
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                self._queued.add(id(t))
        if not chosen:
            return
        ids = []
        for t, alias, layout, version in chosen:
            self._clock += 1
            self._next_job += 1
            self._submitted[id(t)] = (layout, self._clock)
            self._jobs[self._next_job] = (weakref.ref(t), version, alias)
            ids.append(self._next_job)
        try:
            with torch._C.DisableTorchFunction():
                self._core.submit(ids, [alias for _, alias, _, _ in chosen])
        except (ValueError, TypeError, BufferError):
            # One the core cannot read in the background: none of these is
            # queued, and the last step hashes them (the call goes on).
            for job in ids:
                del self._jobs[job]

    def idle(self) -> bool:
        """Whether nothing is queued or being hashed."""
        return self._core.idle()

    def close(self) -> None:
        """Nothing more hashed: the run under way is stopped at its next
        step, and what is queued is given back (its tensors are the caller's
        to hash). Returns at once: on a busy host the thread, at the idle
        policy, may not run again for seconds; it ends when it does. The
        digests finished before are still taken (:meth:`digest_of`)."""
        if not self._closed:
            self._closed = True
            self._core.close()
            self._collect()

    def wait(self, timeout_s: float) -> bool:
        """After :meth:`close`: waits up to ``timeout_s`` for the thread to
        end and let go of every tensor it held; whether it did."""
        return self._core.wait(timeout_s)

    def invalidate(self, address: int) -> None:
        """The memory of the storage at ``address`` is written (a deferred
        copy into it, recorded or written for real): no digest of a tensor
        in it submitted before is taken."""
        self._clock += 1
        self._written[address] = self._clock

    def digest_of(self, tensor: Any) -> str | None:
        """The digest hashed of this very tensor, if its version is still the
        one it had when submitted, it still lies where it lay (same storage,
        offset, shape, strides and dtype: not rebound by ``.data =``), and its
        memory was not written since (:meth:`invalidate`); else ``None``."""
        import torch

        self._collect()
        entry = self._done.get(id(tensor))
        if entry is None:
            return None
        ref, version, digest = entry
        hashed = ref()
        if hashed is None or hashed is not tensor:
            return None  # another object that took the id of one hashed and freed
        layout, submitted = self._submitted[id(hashed)]
        with torch._C.DisableTorchFunction():
            if hashed._version != version or _layout(hashed) != layout:
                return None
        return digest if self._written.get(layout[0], 0) < submitted else None

    def _collect(self) -> None:
        """Takes the digests the thread finished (and lets go of their tensors)."""
        for job, digest in self._core.take_digests():
            entry = self._jobs.pop(job, None)
            if entry is None:
                continue  # after release(): nothing more is taken
            ref, version, alias = entry
            tensor = ref()
            if digest is not None and tensor is not None:
                self._done[id(tensor)] = (ref, version, digest)
                self._aliases.append(alias)

    def release(self) -> None:
        """After :meth:`close`: nothing more is taken, and the memory the
        aliases kept is let go of (the session's end)."""
        self._collect()
        self._done.clear()
        self._jobs.clear()
        self._aliases.clear()


def _layout(t: Any) -> tuple[Any, ...]:
    """Where a tensor's bytes lie: its storage's address first, then its own
    address, shape, strides and dtype."""
    return (t.untyped_storage().data_ptr(), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def available() -> bool:
    """Whether this host has the idle scheduling policy."""
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


@contextlib.contextmanager
def session() -> Iterator[IdleHashing | None]:
    """On this thread, inside: :func:`submit` queues tensors for one
    :class:`IdleHashing`, and :func:`current` gives it; closed on the way
    out. Nested, the outer session goes on."""
    if getattr(_LOCAL, "hashing", None) is not None or not available():
        yield getattr(_LOCAL, "hashing", None)
        return
    hashing = IdleHashing()
    _LOCAL.hashing = hashing
    try:
        yield hashing
    finally:
        _LOCAL.hashing = None
        hashing.close()
        # Its run, stopped, lets go of the tensors it holds as soon as it runs
        # again: at once on a host with a core to spare. On a busy one the
        # call does not wait long for it; they are let go of when it does.
        hashing.wait(JOIN_SECONDS)
        hashing.release()  # what its runs gave back, and the aliases kept, let go of here


def current() -> IdleHashing | None:
    """This thread's open session's hasher, if any."""
    return getattr(_LOCAL, "hashing", None)


def submit(tensors: Iterable[Any]) -> None:
    """:meth:`IdleHashing.submit` to this thread's session; nothing outside one."""
    hashing = current()
    if hashing is not None:
        hashing.submit(tensors)


def invalidate(address: int) -> None:
    """:meth:`IdleHashing.invalidate` on this thread's session; nothing outside one."""
    hashing = current()
    if hashing is not None:
        hashing.invalidate(address)


def digests(names: list[str], tensors: list[Any]) -> list[str]:
    """The digest of each tensor: the session's, where it hashed that very
    tensor unchanged, the rest hashed now (all of them outside a session).
    The session stops first (its run under way cut short)."""
    from weight_checker.hashing.digests import digest_tensors

    hashing = current()
    if hashing is not None:
        hashing.close()
    found = [hashing.digest_of(t) if hashing is not None else None for t in tensors]
    rest = [i for i, d in enumerate(found) if d is None]
    hashed, _ = digest_tensors([names[i] for i in rest], [tensors[i] for i in rest])
    for i, digest in zip(rest, hashed, strict=True):
        found[i] = digest
    return [d for d in found if d is not None]  # every one found or hashed

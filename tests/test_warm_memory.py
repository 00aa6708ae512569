"""The memory a quantized rank's build reuses between calls
(expected/vllm/warm_memory.py): a buffer is handed out again only once torch
freed every tensor over it, reads as zeros when reused, and anything not a
plain contiguous CPU allocation goes to torch; the FP8 expected digests made
from reused memory are the ones a pure-torch quantization gives (hashlib),
call after call, at TP=1 and TP=2."""

from __future__ import annotations

import gc
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from weight_checker.expected.vllm import deferred_rows, warm_memory
from weight_checker.hashing import idle
from weight_checker.testing.launch import vllm_available

MB = 1 << 20


@pytest.fixture
def pool():
    return warm_memory.WarmPool()


def address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_an_allocation_is_served_zeroed_and_reused_only_once_every_view_is_freed(pool):
    with warm_memory.serving(pool):
        a = torch.empty((512, 1024), dtype=torch.bfloat16, device="cpu")
        assert a.shape == (512, 1024) and a.dtype == torch.bfloat16 and a.is_contiguous()
        assert a.data_ptr() % warm_memory.ALIGN == 0 and pool.fresh_bytes == MB
        first = address(a)
        a.fill_(3)
        view = a.t()[5:]  # a view alone keeps the buffer
        del a
        b = torch.empty((512, 1024), dtype=torch.bfloat16, device="cpu")
        assert address(b) != first and pool.reused_bytes == 0
        del view, b
        c = torch.empty(MB, dtype=torch.uint8, device="cpu")
        assert address(c) == first and pool.reused_bytes == MB
        assert int(c.count_nonzero()) == 0  # what it held is not seen


def test_the_fp8_output_is_not_zeroed_and_is_torch_s_outside_serving(pool):
    with warm_memory.serving(pool):
        a = warm_memory.empty((1024, 1024), torch.float8_e4m3fn)
        a.view(torch.uint8).fill_(7)
        del a
        b = warm_memory.empty((1024, 1024), torch.float8_e4m3fn)
        assert pool.reused_bytes == MB and b.dtype == torch.float8_e4m3fn
        assert int((b.view(torch.uint8) == 7).sum()) == MB  # written in full by its caller: left as it was
    outside = warm_memory.empty((1024, 1024), torch.float8_e4m3fn)
    assert pool.reused_bytes == MB and pool.fresh_bytes == MB and outside.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(MB),  # no dtype given: the thread's default is not guessed
        lambda: torch.empty(MB, dtype=torch.float32),  # no device given
        lambda: torch.empty(MB, dtype=torch.float32, device="meta"),
        lambda: torch.empty(MB, dtype=torch.float32, device="cpu", pin_memory=False, requires_grad=True),
        lambda: torch.empty_strided((1024, 1024), (1, 1024), dtype=torch.float32, device="cpu"),
        lambda: torch.empty_like(torch.zeros(1024, 1024).t(), dtype=torch.float32),
        lambda: torch.empty(16, dtype=torch.float32, device="cpu"),  # small: torch's
        lambda: torch.zeros(MB, dtype=torch.float32, device="cpu"),
    ],
)
def test_what_is_not_a_plain_contiguous_cpu_allocation_is_torch_s(pool, make):
    with warm_memory.serving(pool):
        t = make()
    assert pool.fresh_bytes == pool.reused_bytes == 0
    assert isinstance(t, torch.Tensor)


def test_empty_strided_and_empty_like_are_served_when_contiguous(pool):
    with warm_memory.serving(pool):
        a = torch.empty_strided(size=(1024, 512), stride=(512, 1), dtype=torch.float32, device="cpu")
        b = torch.empty_like(a)
        c = torch.empty_like(a, dtype=torch.bfloat16)
    assert (a.shape, b.shape, c.shape) == ((1024, 512),) * 3 and c.dtype == torch.bfloat16
    assert pool.fresh_bytes == 2 * MB + 2 * MB + MB


def test_trim_frees_what_the_call_did_not_use(pool):
    with warm_memory.serving(pool):
        a = torch.empty(MB, dtype=torch.uint8, device="cpu")
        b = torch.empty(4 * MB, dtype=torch.uint8, device="cpu")
    del a, b
    pool.trim()  # both used by this "call": kept
    both = pool.kept_bytes
    assert both >= 5 * MB
    with warm_memory.serving(pool):
        c = torch.empty(4 * MB, dtype=torch.uint8, device="cpu")
    del c
    pool.trim()  # the 1 MiB buffer was not used by the second call
    assert 4 * MB < pool.kept_bytes <= both - MB
    pool.clear()
    assert pool.kept_bytes == 0


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """``(resident, all)`` pages under ``t``'s bytes, as the kernel reports them (mincore)."""
    with torch._C.DisableTorchFunction():  # asked past the deferring mode: a pointer handed out writes its copies
        pointer = t.data_ptr()
    return resident_pages_at(pointer, t.numel() * t.element_size())


def resident_pages_at(pointer: int, nbytes: int) -> tuple[int, int]:
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = pointer // page * page
    length = pointer + nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec), pages


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_buffer_written_in_full_is_resident_before_it_is_written_and_one_never_written_takes_no_memory(pool):
    n = 16 * MB
    with warm_memory.serving(pool, mode=False), deferred_rows.DeferredCopies(pool, serves=True) as mode:
        source = torch.ones(n // 2, dtype=torch.bfloat16)
        mode.note_source("w", source)
        # The first call: a weight whose copy stays deferred (never written
        # here), and the FP8 cast's output, written in full.
        weight = torch.empty(n // 2, dtype=torch.bfloat16, device="cpu")
        weight.copy_(source)
        out = warm_memory.empty((n,), torch.float8_e4m3fn)
        assert resident_pages(out)[0] == resident_pages(out)[1]  # faulted in at once, before any write
        before = minor_faults()
        out.view(torch.uint8).fill_(1)
        assert minor_faults() - before < n // os.sysconf("SC_PAGE_SIZE") // 10
        assert resident_pages(weight)[0] == 0  # its copy deferred: nothing of it touched
        pieces = deferred_rows.pieces_of(weight.view(1, -1))
        assert pieces is not None and pieces[0].source.ctypes.data == source.data_ptr()  # read where it lies
        mode.pending.clear()  # dropped unread, as a quantized layer's bf16 weight is
        del weight, out, pieces
    with warm_memory.serving(pool, mode=False), deferred_rows.DeferredCopies(pool, serves=True):
        # The next call, both buffers free and either fitting either request
        # (same sizes): the writer is served the resident one, the weight the other.
        weight = torch.empty(n // 2, dtype=torch.bfloat16, device="cpu")
        out = warm_memory.empty((n,), torch.float8_e4m3fn)
        assert pool.reused_bytes == 2 * n
        assert resident_pages(out)[0] == resident_pages(out)[1]
        assert resident_pages(weight)[0] == 0
        before = minor_faults()
        out.view(torch.uint8).fill_(2)
        assert minor_faults() - before < n // os.sysconf("SC_PAGE_SIZE") // 10
        # A copy written for real (read before the end) is faulted in at once too.
        assert float(weight[-1]) == 0.0 and resident_pages(weight)[0] == resident_pages(weight)[1]


def test_only_the_bytes_served_are_made_resident_and_a_pass_that_never_writes_makes_none(pool):
    with warm_memory.serving(pool, mode=False):
        big = warm_memory.empty((32 * MB,), torch.uint8, written=False)  # as the amax-only pass's outputs
        assert resident_pages(big)[0] == 0
        first = address(big)
        del big
        # A writer of a little over half of it is served the same buffer (it
        # fits): the pages under its bytes are faulted in, none of the rest.
        half = warm_memory.empty((17 * MB,), torch.uint8)
        assert address(half) == first and resident_pages(half)[0] == resident_pages(half)[1]
        assert resident_pages_at(first + 18 * MB, 14 * MB)[0] == 0  # the buffer's slack past them


# --- copies deferred into served memory (deferred_rows) ----------------------------------------------------


def deferring_modes(pool, one_mode: bool):
    """The deferring mode over served memory: as quantized.py enters it (one
    mode that serves the allocations too), or over warm_memory's own mode."""
    if one_mode:
        return warm_memory.serving(pool, mode=False), deferred_rows.DeferredCopies(pool, serves=True)
    return warm_memory.serving(pool), deferred_rows.DeferredCopies(pool)


@pytest.fixture(params=["one mode", "two modes"])
def deferring(request, pool):
    """Served memory and a deferring mode over it, a stable source noted."""
    source = torch.arange(512 * 1024, dtype=torch.float32).to(torch.bfloat16).view(512, 1024)
    serving, deferred = deferring_modes(pool, request.param == "one mode")
    with serving, deferred as mode:
        mode.note_source("w", source)
        yield mode, source


def served(shape=(512, 1024)) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16, device="cpu")


def test_a_deferred_copy_is_written_before_anything_reads_it(deferring):
    mode, source = deferring
    w = served()
    w[:256].copy_(source[:256])
    w[256:].copy_(source[256:])
    assert mode.pending and mode.replayed_bytes == 0
    assert torch.equal(w.float().sum(0), source.float().sum(0))  # read: written first
    assert mode.replayed_bytes == w.nbytes and not mode.pending


def test_a_source_written_in_place_after_the_copy_leaves_the_copy_as_it_was(deferring):
    _, source = deferring
    before = source.clone()
    w = served()
    w.copy_(source)
    source.add_(1)  # the copy was made first: every pending piece is written before this write
    assert torch.equal(w, before)


def test_rows_the_pieces_do_not_cover_read_as_zeros_and_a_freed_allocation_is_never_written(pool, deferring):
    _, source = deferring
    w = served()
    w.copy_(source)  # fresh memory: nothing to zero
    del w
    w = served()  # the same buffer again: zeros under the pieces, written only where they are not
    assert pool.reused_bytes == w.nbytes
    w[:100].copy_(source[:100])
    assert deferred_rows.pieces_of(w) is None  # rows 100.. are no piece's
    assert int(w[100:].float().abs().sum()) == 0 and torch.equal(w[:100], source[:100])
    x = served()
    x.copy_(source)
    del x  # freed with its copy pending: dropped, never written into the next allocation there
    y = served()
    assert int(y.float().abs().sum()) == 0


def test_pieces_of_gives_rows_where_they_lie_and_the_mode_writes_what_is_left_on_exit(pool):
    source = torch.randn(512, 2048).to(torch.bfloat16)
    with warm_memory.serving(pool):
        with deferred_rows.DeferredCopies(pool) as mode:
            mode.note_source("w", source)
            w = served()
            w.copy_(source[:, 1024:])  # a row-parallel shard: rows 2048 items apart
            pieces = deferred_rows.pieces_of(w)
            assert pieces is not None and [(p.first, p.rows, p.stride) for p in pieces] == [(0, 512, 2048)]
            assert pieces[0].source.ctypes.data == source[:, 1024:].data_ptr()  # no copy
        assert torch.equal(w, source[:, 1024:])  # written when the mode ended


def test_pieces_handed_on_stay_unwritten_until_a_later_mode_adopts_them_and_reads_them_where_they_lie(pool):
    """A held layer's weight (quantized.py's one pass at TP > 1): its copies
    are handed on when the load's mode ends, the rest written; a later mode
    adopts them and reads them in place; a source written in between is an
    error naming it, never a wrong byte."""
    from weight_checker.errors import ExpectedDigestsError

    source = torch.randn(512, 2048).to(torch.bfloat16)
    handed: list = []
    with warm_memory.serving(pool):
        with deferred_rows.DeferredCopies(pool) as mode:
            mode.note_source("w", source)
            held, other = served(), served()
            held.copy_(source[:, 1024:])
            other.copy_(source[:, :1024])
            deferred_rows.hand_on(held, handed)
        assert torch.equal(other, source[:, :1024])  # written when the mode ended
        assert len(handed) == 1 and int(held.float().abs().sum()) == 0  # not written
        with deferred_rows.DeferredCopies(pool, adopt=handed):
            pieces = deferred_rows.pieces_of(held)
            assert pieces is not None and pieces[0].source.ctypes.data == source[:, 1024:].data_ptr()
        assert torch.equal(held, source[:, 1024:])  # written when the adopting mode ended

        handed.clear()
        with deferred_rows.DeferredCopies(pool) as mode:
            mode.note_source("w", source)
            again = served()
            again.copy_(source[:, 1024:])
            deferred_rows.hand_on(again, handed)
        source.add_(1)  # written between the two modes
        with pytest.raises(ExpectedDigestsError, match=r"'w'.*written"):
            with deferred_rows.DeferredCopies(pool, adopt=handed):
                deferred_rows.pieces_of(again)


@pytest.mark.parametrize("one_mode", [True, False], ids=["one mode", "two modes"])
def test_reused_memory_reads_as_zeros_under_deferral_and_a_freed_copy_never_lands_in_the_next(pool, one_mode):
    """Buffers that held bytes, served again: where no piece covers them they
    read as zeros (the zero piece under the copies), also through a numpy
    view; an unzeroed one whose copy was pending when it was freed holds only
    what its next owner copies."""
    source = torch.randn(512, 1024).to(torch.bfloat16)
    other = torch.randn(512, 1024).to(torch.bfloat16)
    serving, deferred = deferring_modes(pool, one_mode)
    with serving, deferred as mode:
        mode.note_source("w", source)
        mode.note_source("o", other)
        a = served()
        a.fill_(7)
        del a
        w = served()
        w[:100].copy_(source[:100])
        assert pool.reused_bytes == w.nbytes and int(w[100:].count_nonzero()) == 0
        assert torch.equal(w[:100], source[:100])
        del w
        v = served()  # reused again, handed out to numpy before anything wrote it
        assert pool.reused_bytes == 2 * v.nbytes
        assert not np.any(v.view(torch.int16).numpy())
        x = warm_memory.empty((512, 1024), torch.bfloat16)  # not zeroed: written in full by its owner
        x.copy_(other)
        address = x.data_ptr()
        del x  # freed with its copy pending
        y = warm_memory.empty((512, 1024), torch.bfloat16)
        assert y.data_ptr() == address  # the same buffer
        y[:256].copy_(source[:256])
        y[256:].copy_(source[256:])
        assert torch.equal(y, source)


def test_memory_handed_out_is_written_for_real_from_then_on(deferring):
    """A numpy view or a raw pointer of served memory sees every later copy."""
    mode, source = deferring
    w = served()
    seen = w.view(torch.int16).numpy()
    w.copy_(source)
    assert not mode.pending and np.array_equal(seen, source.view(torch.int16).numpy())
    x = served()
    x.data_ptr()
    x.copy_(source)
    assert not mode.pending


def test_a_write_to_a_source_through_an_operator_overload_writes_the_copies_first(deferring):
    mode, source = deferring
    before = source.clone()
    w = served()
    w.copy_(source)
    torch.ops.aten.fill_.Scalar(source, 0.0)  # named "fill_.Scalar"
    assert not mode.pending and torch.equal(w, before)


def test_a_copy_into_a_source_is_never_deferred(pool):
    with warm_memory.serving(pool), deferred_rows.DeferredCopies(pool) as mode:
        source = served()  # a source in served memory (a callable's weights read inside the call)
        source.fill_(1)
        other = torch.full((512, 1024), 2.0, dtype=torch.bfloat16)
        mode.note_source("w", source)
        mode.note_source("o", other)
        w = served()
        w.copy_(source)
        source.copy_(other)  # written after the copy was recorded: the copy keeps the old bytes
        assert torch.equal(w, torch.ones_like(w)) and torch.equal(source, other)


def test_a_finalizer_run_by_a_collection_inside_the_pool_does_not_deadlock(pool):
    """A served tensor in a reference cycle, freed by a garbage collection
    that an allocation inside the pool's lock sets off."""

    class Node:
        pass

    thresholds = gc.get_threshold()
    with warm_memory.serving(pool):
        for threshold in range(1, 60):
            gc.collect()
            n = Node()
            n.me, n.t = n, served((1024, 1024))
            del n
            gc.set_threshold(threshold)
            try:
                x = served((1024, 1024))
            finally:
                gc.set_threshold(*thresholds)
            del x
    assert pool.kept_bytes > 0


# --- the FP8 expected digests made from reused memory ------------------------------------------------------


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def pure_torch(state: dict, tp: int) -> dict[str, str]:
    """Each rank's FP8 weight (stored [K, N]) and scale of every fused layer,
    quantized in pure torch (weight_checker.testing.quantized), hashed by
    hashlib: column-parallel layers split by output rows (q, k and v each, as
    vLLM fuses them), row-parallel ones by input columns with the whole
    weight's scales (vLLM all-reduces their amax)."""
    from weight_checker.testing.quantized import fp8_channel_quantize

    out = {}
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})
    for layer in layers:
        for name, parts in FUSED.items():
            whole = [state[f"model.layers.{layer}.{p}.weight"] for p in parts]
            for t in range(tp):
                key = f"dp0:pp0:pcp0:tp{t}:model.layers.{layer}.{name}"
                if name in ROW_PARALLEL:
                    q, scale = fp8_channel_quantize(whole[0])
                    q = q.chunk(tp, dim=1)[t]
                else:
                    q, scale = fp8_channel_quantize(torch.cat([w.chunk(tp, dim=0)[t] for w in whole]))
                out[key + ".weight"], out[key + ".weight_scale"] = sha(q.t()), sha(scale)
    return out


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_expected_digests_from_reused_memory_equal_a_pure_torch_quantization_call_after_call(
    models, tmp_path, monkeypatch, tp
):
    """Every allocation served from the pool (the tiny model's are all under
    the size it serves at otherwise); steps 1, 2, then 1 again, each call
    reusing what the last one freed (the second rank reusing the first's at
    TP=2): every quantized key equals hashlib's digest of the pure-torch
    quantization of that step's weights, and the repeat equals the first."""
    import weight_checker
    from safetensors.torch import load_file

    from .test_expected_verify import push, train_step

    monkeypatch.setattr(warm_memory, "MIN_BYTES", 0)
    monkeypatch.setattr(warm_memory, "POOL", warm_memory.WarmPool())
    source = Path(models.path("tiny-llama"))
    state = load_file(str(source / "model.safetensors"))
    steps = {1: train_step(state, 1), 2: train_step(state, 2)}
    paths = {s: push(w, source, tmp_path / f"step{s}") for s, w in steps.items()}
    from weight_checker.expected.vllm import quantized
    from weight_checker.expected.vllm.deferred import storage_address

    # Every FP8 weight hashed is pool memory (a held layer's too: its
    # processing serves from the pool as the load's does).
    served: list[bool] = []
    original = quantized.ranks_digests if tp > 1 else quantized.rank_digests

    def hashing(models, *args):
        for model, _ in models if tp > 1 else [(models, None)]:
            for _, p in model.named_parameters():
                if p.dtype == torch.float8_e4m3fn:
                    served.append(warm_memory.POOL.serial(storage_address(p)) is not None)
        return original(models, *args)

    monkeypatch.setattr(quantized, "ranks_digests" if tp > 1 else "rank_digests", hashing)
    results = []
    for step in (1, 2, 1):
        reused_before = warm_memory.POOL.reused_bytes
        totals_before = dict(deferred_rows.TOTALS)
        expected = weight_checker.expected_digests(paths[step], tp=tp, quantization="fp8_per_channel")
        oracle = pure_torch(steps[step], tp)
        assert {k: expected[k] for k in oracle} == oracle, step
        moved = {k: deferred_rows.TOTALS[k] - totals_before[k] for k in totals_before}
        results.append((dict(expected), warm_memory.POOL.reused_bytes - reused_before, moved))
        gc.collect()
    assert served and all(served), served
    assert results[0][0] == results[2][0] and results[0][0] != results[1][0]
    assert results[1][1] > 0 and results[2][1] > 0  # the later calls did reuse memory
    # Every key (embeddings, norms, scales included) as a run with nothing
    # served computes it: real copies into torch's own memory.
    monkeypatch.setattr(warm_memory, "MIN_BYTES", 1 << 62)
    plain = weight_checker.expected_digests(paths[1], tp=tp, quantization="fp8_per_channel")
    assert dict(plain) == results[2][0]

    # Every quantized weight was read where the checkpoint holds it, and no
    # more often than vLLM's processing needs: a weight whose amax is not
    # reduced once (its cast made in the read of its amax); at TP=2 a
    # row-parallel one (its amax all-reduced) twice: its amax, read before
    # it is held back, then its cast once the amaxes are reduced (its copies
    # left deferred meanwhile, its amax not read again).
    def nbytes(parts: Iterable[str]) -> int:
        return sum(steps[1][f"model.layers.{i}.{p}.weight"].nbytes for i in (0, 1) for p in parts)

    linear = nbytes([p for ps in FUSED.values() for p in ps])
    held = nbytes([p for name, ps in FUSED.items() if name in ROW_PARALLEL for p in ps]) if tp > 1 else 0
    assert 0 < held < linear or tp == 1
    # What is written for real: only the checkpoint's other matrices (the
    # embeddings, served by the pool here; a norm's vector is not deferred).
    others = sum(t.nbytes for t in steps[1].values() if t.dim() == 2) - linear
    moved = [(r[2]["in_place"], r[2]["replayed"]) for r in results]
    assert all(m == (linear + held, others) for m in moved), (linear, held, others, moved)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_fp8_at_tp2_from_a_callable_that_refills_one_buffer_per_rank_equals_a_run_with_nothing_served(
    models, monkeypatch
):
    """A callable's tensors may be refilled for the next rank (docs/expected.md):
    a held layer's copies are then written as its rank's load ends, not left
    pending on buffers the next rank's call refills (which would be refused
    as written meanwhile), and the digests equal a run with nothing served."""
    import weight_checker
    from safetensors.torch import load_file

    source = Path(models.path("tiny-llama"))
    state = load_file(str(source / "model.safetensors"))
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    calls: list[int] = []

    def weights():
        # Refilled for each rank's load, in place (the version of each buffer moves on).
        with torch.no_grad():
            for k, b in buffers.items():
                b.copy_(state[k])
        calls.append(1)
        return list(buffers.items())

    monkeypatch.setattr(warm_memory, "POOL", warm_memory.WarmPool())
    monkeypatch.setattr(idle, "JOIN_SECONDS", 30.0)  # the idle hasher lets go before the call returns
    results = []
    for min_bytes in (0, 1 << 62):
        monkeypatch.setattr(warm_memory, "MIN_BYTES", min_bytes)
        results.append(
            dict(weight_checker.expected_digests(str(source), weights, tp=2, quantization="fp8_per_channel"))
        )
    assert results[0] == results[1] and len(results[0]) > 10 and len(calls) >= 4
    assert warm_memory.POOL.live_bytes() == 0


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
@pytest.mark.parametrize("writer", ["write_gptq_int4", "write_fp8_channel"])
def test_a_quantized_checkpoints_digests_from_reused_memory_equal_a_run_with_nothing_served(
    models, tmp_path, monkeypatch, writer
):
    """A checkpoint format (its processing repacks or transposes what it
    loads, no copy deferred) with every allocation served, twice in a row,
    against a run with nothing served; at TP=2."""
    import weight_checker
    from weight_checker.testing import quantized

    checkpoint = getattr(quantized, writer)(Path(models.path("tiny-llama")), tmp_path / writer)
    monkeypatch.setattr(warm_memory, "POOL", warm_memory.WarmPool())
    monkeypatch.setattr(warm_memory, "MIN_BYTES", 0)
    first = dict(weight_checker.expected_digests(checkpoint, tp=2))
    gc.collect()
    second = dict(weight_checker.expected_digests(checkpoint, tp=2))
    assert warm_memory.POOL.reused_bytes > 0
    monkeypatch.setattr(warm_memory, "MIN_BYTES", 1 << 62)
    plain = dict(weight_checker.expected_digests(checkpoint, tp=2))
    assert first == second == plain and len(plain) > 10


def test_young_garbage_pauses_the_collector_frees_the_calls_cycles_and_restores_its_state():
    import weakref

    class Node:
        pass

    assert gc.isenabled()
    with warm_memory.young_garbage():
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle, as a model's modules make
        alive = weakref.ref(a)
        del a, b
        assert alive() is not None  # nothing collected inside
    assert gc.isenabled() and alive() is None  # the young collection on the way out freed it
    gc.disable()
    try:
        with warm_memory.young_garbage():
            pass
        assert not gc.isenabled()  # a caller that paused it keeps it paused
    finally:
        gc.enable()


def test_a_mapping_that_fails_is_a_memory_error_in_one_line(monkeypatch):
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    pool = warm_memory.WarmPool()
    with pytest.raises(MemoryError, match=r"could not map [\d,]+ bytes \(Cannot allocate memory\)"):
        pool.take(1 << 20, zeroed=False)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_online_fp8_at_tp2_falls_back_to_two_passes_where_one_would_not_fit_and_a_failed_call_keeps_nothing(
    models, monkeypatch
):
    """Where the first rank's memory times the ranks is over the budget, the
    ranks are loaded twice, one at a time (the amax pass, then the real
    one): the same digests. A call that fails after every rank was loaded
    leaves no buffer of the pool in use."""
    import weight_checker
    from weight_checker.errors import ExpectedDigestsError
    from weight_checker.expected.vllm import quantized

    monkeypatch.setattr(warm_memory, "MIN_BYTES", 0)
    monkeypatch.setattr(warm_memory, "POOL", warm_memory.WarmPool())
    path = models.path("tiny-llama")
    loads = []
    original = quantized.load_and_process
    monkeypatch.setattr(
        quantized, "load_and_process", lambda *a, **k: loads.append(k.get("amax_only", False)) or original(*a, **k)
    )
    for pp in (1, 2):  # pipeline stages: each reduces over its own TP ranks
        loads.clear()
        monkeypatch.setattr(warm_memory, "spare_bytes", lambda: 1 << 62)
        one_pass = weight_checker.expected_digests(path, tp=2, pp=pp, quantization="fp8_per_channel")
        assert loads == [False] * 2 * pp  # one pass: each rank loaded once
        loads.clear()
        monkeypatch.setattr(warm_memory, "spare_bytes", lambda: 0)
        monkeypatch.setattr(warm_memory.POOL, "_free", [])  # nothing kept to count either
        two_passes = weight_checker.expected_digests(path, tp=2, pp=pp, quantization="fp8_per_channel")
        # The first rank tried, then the amax pass and the real one.
        assert loads == [False] + [True] * 2 * pp + [False] * 2 * pp
        assert dict(two_passes) == dict(one_pass) and len(one_pass) > 0
    monkeypatch.setattr(warm_memory, "spare_bytes", lambda: 1 << 62)
    loads.clear()

    def fail(*args, **kwargs):
        raise ExpectedDigestsError("refused on purpose")

    monkeypatch.setattr(quantized, "ranks_digests", fail)
    # The session's end waits this long for an idle hasher to give back its
    # stopped run (on a busy host it may not run for a while).
    monkeypatch.setattr(idle, "JOIN_SECONDS", 30.0)
    with pytest.raises(ExpectedDigestsError, match="on purpose"):
        weight_checker.expected_digests(path, tp=2, quantization="fp8_per_channel")
    assert loads == [False, False]  # one pass: each rank loaded once
    assert warm_memory.POOL.live_bytes() == 0  # emptied by the call itself (no collection asked for)


def test_spare_bytes_is_half_of_what_the_process_may_still_take():
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    spare = warm_memory.spare_bytes()
    assert 0 < spare <= total // 2

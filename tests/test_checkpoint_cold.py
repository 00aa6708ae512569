"""The read path for checkpoints not in the page cache: large sequential reads
into a few reusable buffers on a reader thread, hashed while the next ones are
read, several spans of the files read side by side. Checked against hashlib
(and against the mapping path) for tensors that span buffers, buffers that
hold many tensors, files larger than every buffer and empty tensors; the same
errors as the mapping for truncated files and headers that lie; the choice of
path by what the page cache holds; progress and cancel."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from weight_checker import _core
from weight_checker.checkpoint import checksum_checkpoint
from weight_checker.errors import CheckpointError

from .cli import run_cli

KiB, MiB = 1 << 10, 1 << 20


def write(root: Path, shards: list[list[int]], seed: int) -> dict[str, str]:
    """Random uint8 tensors of the given sizes, one file a shard; hashlib's
    digest of each."""
    rng = np.random.default_rng(seed)
    want = {}
    for s, sizes in enumerate(shards):
        tensors = {}
        for t, n in enumerate(sizes):
            a = rng.integers(0, 256, n, dtype=np.uint8)
            tensors[f"s{s}.t{t:03d}"] = a
            want[f"s{s}.t{t:03d}"] = hashlib.sha256(a.tobytes()).hexdigest()
        save_file(tensors, str(root / f"shard{s}.safetensors"))
    return want


def digests(paths: list[Path], **kw) -> dict[str, str]:
    return {n: h for n, h, _ in _core.checksum_safetensors([str(p) for p in paths], **kw)}


def evict(paths: list[Path]) -> None:
    """Drops the files' clean pages from the page cache (no privilege needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# Buffers of 4 KiB + 3 (never a multiple of a tensor's size), 64 KiB and the
# default: tensors that span many buffers, buffers that hold many tensors.
buffer_sizes = st.sampled_from([4 * KiB + 3, 64 * KiB, 0])
edges = st.sampled_from([64 * KiB, 64 * KiB + 1, 9 * MiB + 7])
sizes = st.one_of(st.integers(0, 300), st.integers(1, 300 * KiB), edges)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(sizes, min_size=1, max_size=12), min_size=1, max_size=3),
    buffer_sizes,
    st.integers(0, 2**32 - 1),
)
def test_read_path_digests_equal_hashlib_for_any_mix(tmp_path_factory, shards, buffer_bytes, seed):
    root = tmp_path_factory.mktemp("cold")
    want = write(root, shards, seed)
    files = sorted(root.glob("*.safetensors"))
    assert digests(files, mode="read", buffer_bytes=buffer_bytes) == want


def test_files_larger_than_every_buffer_and_many_small_tensors(tmp_path):
    """Two 70B-shaped files in miniature: one large tensor per file far larger
    than the buffers (and than all of them together), beside a run of small
    tensors that share buffers; and more spans than the reader has cursors."""
    shards = [[3 * MiB + 5] + [17] * 40 + [0, 0] + [257 * KiB] * 6, [2 * MiB] * 5 + [1] * 9]
    want = write(tmp_path, shards, seed=7)
    files = sorted(tmp_path.glob("*.safetensors"))
    for buffer_bytes in (4 * KiB, 64 * KiB + 1, 1 * MiB):
        assert digests(files, mode="read", buffer_bytes=buffer_bytes) == want, buffer_bytes
    assert digests(files, mode="map") == want
    assert checksum_checkpoint(files, io="read") == checksum_checkpoint(files, io="map") == want


def test_a_cold_file_is_read_and_a_cached_one_mapped(tmp_path):
    want = write(tmp_path, [[4 * MiB] * 4], seed=3)
    [f] = list(tmp_path.glob("*.safetensors"))
    f.read_bytes()  # into the page cache
    assert _core.safetensors_cached_fraction(str(f)) >= 0.75
    evict([f])
    cold = _core.safetensors_cached_fraction(str(f))
    if cold >= 0.75:
        pytest.skip(f"this filesystem keeps the file cached after POSIX_FADV_DONTNEED ({cold:.0%})")
    # Asking reads nothing: still cold when asked again.
    assert _core.safetensors_cached_fraction(str(f)) < 0.75
    # The default (auto) takes the read path here and gives hashlib's digests.
    assert checksum_checkpoint([f]) == want
    assert digests([f], mode="auto") == want


def test_truncated_files_and_lying_headers_get_the_same_error_on_both_paths(tmp_path):
    """Refused at open, before either path reads a byte: the same message,
    naming the file and the tensor. (A file cut short while the read path
    reads it is an error naming the tensor: the Rust tests.)"""
    write(tmp_path, [[1 * MiB, 2 * MiB]], seed=5)
    [f] = list(tmp_path.glob("*.safetensors"))
    blob = f.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    cases = {
        "truncated": blob[:-1000],
        # The header claims more bytes for the last tensor than its shape has.
        "lying-header": blob[:8] + blob[8 : 8 + n].replace(b"3145728", b"3145729") + blob[8 + n :],
        "header-past-end": struct.pack("<Q", len(blob)) + blob[8:],
    }
    for name, data in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        errors = {}
        for mode in ("map", "read", "auto"):
            with pytest.raises(_core.SafetensorsError) as e:
                _core.checksum_safetensors([str(bad)], mode=mode)
            errors[mode] = str(e.value)
        assert len(set(errors.values())) == 1, errors
        assert bad.name in errors["read"]
        with pytest.raises(CheckpointError, match=name):
            checksum_checkpoint([bad], io="read")


def test_progress_counts_the_bytes_read_and_an_exception_cancels(tmp_path):
    want = write(tmp_path, [[3 * MiB] * 6], seed=11)
    files = sorted(tmp_path.glob("*.safetensors"))
    seen: list[tuple[int, int]] = []
    assert checksum_checkpoint(files, io="read", progress=lambda d, t: seen.append((d, t))) == want
    total = sum(3 * MiB for _ in range(6))
    assert seen and seen[-1] == (total, total)
    assert all(d <= t == total for d, t in seen)

    class Stop(Exception):
        pass

    def stop(done: int, total: int) -> None:
        raise Stop

    with pytest.raises(Stop):
        _core.checksum_safetensors([str(f) for f in files], stop, mode="read")


FD_LIMIT = r"""
import resource, sys
from weight_checker import _core
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
files = sys.argv[1:]
print(len(_core.checksum_safetensors(files, mode="map")), len(_core.checksum_safetensors(files, mode="read")))
"""


def test_more_shards_than_open_files_allowed(tmp_path):
    """A mapping needs no open descriptor: 100 shards under a limit of 64."""
    import subprocess
    import sys

    write(tmp_path, [[5, 0, 300]] * 100, seed=17)
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-c", FD_LIMIT, *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["300", "300"]


def test_unknown_mode_is_refused_before_any_read(tmp_path):
    with pytest.raises(ValueError, match="io='mmap'"):
        checksum_checkpoint([tmp_path / "missing.safetensors"], io="mmap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected"):
        _core.checksum_safetensors([], mode="fast")
    with pytest.raises(ValueError, match="buffer_bytes"):
        _core.checksum_safetensors([], mode="read", buffer_bytes=1 << 36)


def test_the_cli_reads_with_io_read_and_refuses_an_unknown_mode(tmp_path):
    want = write(tmp_path, [[2 * MiB, 5, 0]], seed=13)
    out = run_cli("checksum", "--no-prefix", "--io", "read", tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["checksums"] == want
    bad = run_cli("checksum", "--io", "fast", tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--io" in bad.stderr

"""Our checkpoint reader against Python's `safetensors.safe_open` on a corpus
of crafted files: the same accept/reject verdict on every file, and on every
accepted file digests equal to hashlib over the tensors safe_open loads.

The corpus covers every dtype the safetensors crate knows, zero-size and 0-d
tensors, metadata, and the defects: gaps, overlaps, sub-byte sizes that are
not whole bytes, unknown dtypes, data not covering the file, truncation,
reversed and out-of-range offsets, a header past the end, bad JSON. Each file
goes through both read paths (the mapping and the cold path's reads).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open
from weight_checker import _core

# dtype -> bits per element, as the safetensors crate (0.8) defines them.
DTYPES = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


def raw(header: dict | bytes, data: bytes, header_len: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 131 + seed * 17) % 251 for i in range(n))


def corpus() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    # Every dtype, alone and all together back to back.
    together, at, data = {}, 0, b""
    for i, (dt, bits) in enumerate(DTYPES.items()):
        shape = [2, 4] if bits % 8 == 0 else [4, 2]  # 8 elements: whole bytes for 4- and 6-bit too
        n = 8 * bits // 8
        files[f"dtype-{dt}"] = raw({"t": entry(dt, shape, 0, n)}, pattern(n, i))
        together[f"t.{dt}"] = entry(dt, shape, at, at + n)
        data += pattern(n, i)
        at += n
    files["all-dtypes"] = raw(together | {"__metadata__": {"format": "pt"}}, data)
    files["zero-size-and-0d"] = raw({"e": entry("F32", [0, 3], 0, 0), "s": entry("F64", [], 0, 8)}, pattern(8))
    files["empty-header"] = raw({}, b"")
    files["unsorted-entries"] = raw({"b": entry("U8", [4], 4, 8), "a": entry("U8", [4], 0, 4)}, pattern(8))
    # Defects.
    files["gap"] = raw({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 6, 10)}, pattern(10))
    files["gap-at-start"] = raw({"a": entry("U8", [4], 2, 6)}, pattern(6))
    files["overlap"] = raw({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, pattern(6))
    files["sub-byte-f4-odd"] = raw({"a": entry("F4", [3], 0, 2)}, pattern(2))
    files["sub-byte-f6"] = raw({"a": entry("F6_E2M3", [5], 0, 4)}, pattern(4))
    files["unknown-dtype"] = raw({"a": entry("Q9", [1], 0, 1)}, pattern(1))
    files["lowercase-dtype"] = raw({"a": entry("f32", [1], 0, 4)}, pattern(4))
    files["trailing-bytes"] = raw({"a": entry("U8", [4], 0, 4)}, pattern(6))
    files["size-mismatch"] = raw({"a": entry("F32", [3], 0, 8)}, pattern(8))
    files["reversed"] = raw({"a": entry("U8", [1], 4, 0)}, pattern(4))
    files["out-of-range"] = raw({"a": entry("F32", [4], 0, 16)}, pattern(8))
    files["truncated"] = raw({"a": entry("F32", [4], 0, 16)}, pattern(16))[:-3]
    files["header-past-end"] = raw({}, b"", header_len=10_000)
    files["bad-json"] = raw(b"{nope", b"")
    files["not-an-object"] = raw(b"[1, 2]", b"")
    files["negative-shape"] = raw({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, pattern(1))
    files["metadata-not-strings"] = raw({"__metadata__": {"k": 1}, "a": entry("U8", [1], 0, 1)}, pattern(1))
    files["short"] = b"\x01\x02"
    return files


def safe_open_verdict(path: Path) -> dict[str, bytes] | None:
    """Each tensor's bytes as safe_open reads them, or None if it refuses the file."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
    except Exception:
        return None
    # safe_open accepted the header; read each tensor's bytes by its offsets
    # (numpy has no bf16/f8/f4 dtypes, so get_tensor cannot load all of them).
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    start = 8 + n
    return {k: blob[start + header[k]["data_offsets"][0] : start + header[k]["data_offsets"][1]] for k in names}


CORPUS = corpus()


@pytest.mark.parametrize("mode", ["map", "read"])
@pytest.mark.parametrize("name", list(CORPUS))
def test_same_verdict_as_safe_open_and_digests_equal_hashlib(tmp_path, name, mode):
    """On both read paths: through the mapping (files in the page cache) and
    with large sequential reads (cold files)."""
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(CORPUS[name])
    expected = safe_open_verdict(path)
    try:
        got = _core.checksum_safetensors([str(path)], mode=mode)
    except _core.SafetensorsError as e:
        assert expected is None, f"we refuse what safe_open accepts: {e}"
        assert path.name in str(e)
        return
    assert expected is not None, f"we accept what safe_open refuses: {got}"
    assert {n: h for n, h, _ in got} == {n: hashlib.sha256(b).hexdigest() for n, b in expected.items()}


def test_torch_loaded_tensors_match_for_the_dtypes_torch_has(tmp_path):
    """Where torch can load a dtype, safe_open(framework="pt") + hashlib of the
    loaded tensor is the oracle (the digest vLLM would compute)."""
    import torch

    path = tmp_path / "all.safetensors"
    path.write_bytes(CORPUS["all-dtypes"])
    ours = {n: h for n, h, _ in _core.checksum_safetensors([str(path)])}
    checked = 0
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            try:
                t = f.get_tensor(k)
            except Exception:
                continue  # a dtype this torch cannot hold (e.g. F4)
            if t.dtype == torch.bool:
                continue  # safetensors may normalise bool bytes on load
            want = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            assert ours[k] == want, k
            checked += 1
    assert checked >= 15

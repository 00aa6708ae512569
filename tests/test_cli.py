"""`weight-checker checksum` and `compare`, run as subprocesses."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import weight_checker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from weight_checker import _core

from .test_digests import random_tensor

CLI = [sys.executable, "-m", "weight_checker.cli"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, input=stdin)


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    dtypes = [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.int8,
        torch.bool,
        torch.int64,
        torch.uint8,
    ]
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    out = {f"layer.{i}.w": random_tensor((17, 33), dt, seed + i) for i, dt in enumerate(dtypes)}
    out["big"] = random_tensor((3 << 20,), torch.bfloat16, seed + 99)
    out["empty"] = torch.empty(0, 4)
    out["scalar"] = torch.tensor(2.5)
    return out


@pytest.fixture
def sharded(tmp_path) -> Path:
    """Two shards and an index, as transformers writes them."""
    tensors = sample_tensors()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / shard)
        weight_map |= dict.fromkeys(keys, shard)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def loaded_digests(path: Path, prefix: str = "dp0:pp0:pcp0:tp0:") -> dict[str, str]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors |= load_file(f)
    return dict(sorted(weight_checker.checksum(tensors, prefix=prefix).items()))


def test_checksum_equals_torch_loaded_digests(sharded):
    want = loaded_digests(sharded)
    for args in (
        [str(sharded)],
        [str(sharded / "model.safetensors.index.json")],
        [str(p) for p in sorted(sharded.glob("*.safetensors"))],
    ):
        r = run("checksum", *args)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out == {"checksums": want}
        assert list(out["checksums"]) == sorted(want)


def test_checksum_prefix_options_and_output_file(sharded, tmp_path):
    bare = loaded_digests(sharded, prefix="")
    r = run("checksum", str(sharded), "--no-prefix")
    assert json.loads(r.stdout)["checksums"] == bare
    r = run("checksum", str(sharded), "--prefix", "dp1:pp0:pcp0:tp3:")
    assert json.loads(r.stdout)["checksums"] == {"dp1:pp0:pcp0:tp3:" + k: v for k, v in bare.items()}
    out = tmp_path / "manifest.json"
    r = run("checksum", str(sharded), "-o", str(out))
    assert r.returncode == 0 and r.stdout == ""
    assert json.loads(out.read_text())["checksums"] == loaded_digests(sharded)


def good_file(tmp_path: Path) -> Path:
    p = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 3)}, p)
    return p


def raw_file(path: Path, header: dict | bytes, data: bytes, header_len: int | None = None) -> Path:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if header_len is None else header_len) + h + data)
    return path


def bad_cases(tmp_path: Path) -> list[tuple[str, list[str], str, str | None]]:
    """(label, paths, file named in the message, tensor named in the message)."""
    cases = []
    good = good_file(tmp_path)
    trunc = tmp_path / "truncated.safetensors"
    trunc.write_bytes(good.read_bytes()[:-7])
    cases.append(("truncated", [str(trunc)], trunc.name, "b"))
    cases.append(
        (
            "header past end",
            [str(raw_file(tmp_path / "hlen.safetensors", {}, b"", header_len=10_000))],
            "hlen.safetensors",
            None,
        )
    )
    cases.append(
        (
            "invalid JSON",
            [str(raw_file(tmp_path / "json.safetensors", b"{nope", b""))],
            "json.safetensors",
            None,
        )
    )
    f32 = lambda n, b, e: {"dtype": "F32", "shape": [n], "data_offsets": [b, e]}  # noqa: E731
    cases.append(
        (
            "out of range",
            [str(raw_file(tmp_path / "range.safetensors", {"w": f32(4, 0, 16)}, b"\0" * 8))],
            "range.safetensors",
            "w",
        )
    )
    cases.append(
        (
            "overlap",
            [
                str(
                    raw_file(
                        tmp_path / "overlap.safetensors",
                        {"x": f32(2, 0, 8), "y": f32(2, 4, 12)},
                        b"\0" * 12,
                    )
                )
            ],
            "overlap.safetensors",
            "y",
        )
    )
    cases.append(
        (
            "dtype/shape vs bytes",
            [str(raw_file(tmp_path / "shape.safetensors", {"z": f32(3, 0, 8)}, b"\0" * 8))],
            "shape.safetensors",
            "z",
        )
    )
    dup_dir = tmp_path / "dup"
    dup_dir.mkdir()
    save_file({"same": torch.ones(2)}, dup_dir / "s1.safetensors")
    save_file({"same": torch.zeros(2)}, dup_dir / "s2.safetensors")
    cases.append(("repeated name", [str(dup_dir)], "s2.safetensors", "same"))
    idx_dir = tmp_path / "idx"
    idx_dir.mkdir()
    save_file({"p": torch.ones(2)}, idx_dir / "a.safetensors")
    (idx_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"p": "a.safetensors", "q": "gone.safetensors"}})
    )
    cases.append(("missing shard", [str(idx_dir)], "model.safetensors.index.json", "q"))
    return cases


def test_bad_files_exit_2_with_one_line_naming_file_and_tensor(tmp_path):
    for label, paths, fname, tensor in bad_cases(tmp_path):
        r = run("checksum", *paths)
        assert r.returncode == 2, (label, r.stdout, r.stderr)
        assert r.stdout == "", label
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, (label, r.stderr)
        assert fname in lines[0], (label, lines[0])
        if tensor is not None:
            assert f"'{tensor}'" in lines[0], (label, lines[0])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**65) | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.dictionaries(
        st.text(max_size=5),
        st.one_of(
            json_values,
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["F32", "BF16", "U8", "F4", "XX", 3]),
                    "shape": st.lists(st.integers(-1, 2**40), max_size=3) | json_values,
                    "data_offsets": st.lists(st.integers(-1, 2**64 - 1), max_size=3) | json_values,
                }
            ),
        ),
        max_size=4,
    ),
    st.integers(0, 64),
)
def test_structured_headers_get_safe_opens_verdict(tmp_path_factory, header, data_len):
    """Random headers (raw bytes are fuzzed by the Rust proptests): we accept
    exactly the files Python's safe_open accepts, never panic, and every
    accepted tensor lies inside the file."""
    from safetensors import safe_open

    p = tmp_path_factory.mktemp("fuzz") / "s.safetensors"
    raw_file(p, json.dumps(header).encode(), b"\x01" * data_len)
    try:
        with safe_open(str(p), framework="numpy") as f:
            f.keys()
        accepted = True
    except Exception:
        accepted = False
    try:
        entries = _core.safetensors_tensors(str(p))
    except (_core.SafetensorsError, OSError):
        assert not accepted, header
        return
    assert accepted, header
    for _, _, _, nbytes in entries:
        assert nbytes <= data_len


def test_compare_classes_and_exit_codes(tmp_path):
    base = {"k1": "a" * 64, "k2": "b" * 64, "k3": "c" * 64}
    cur = {"k1": "a" * 64, "k2": "f" * 64, "k4": "d" * 64}
    (tmp_path / "base.json").write_text(json.dumps({"checksums": base}))
    (tmp_path / "cur.json").write_text(json.dumps(cur))  # a bare mapping
    r = run("compare", str(tmp_path / "base.json"), str(tmp_path / "cur.json"))
    assert r.returncode == 1
    assert "MISMATCH: 3 keys differ" in r.stdout
    assert "changed" in r.stdout and "missing" in r.stdout and "unexpected" in r.stdout
    r = run("compare", str(tmp_path / "base.json"), str(tmp_path / "cur.json"), "--json")
    report = json.loads(r.stdout)
    assert report == {
        "match": False,
        "mismatches": ["k2", "k3", "k4"],
        "classes": {"changed": ["k2"], "missing": ["k3"], "unexpected": ["k4"]},
        "map": report["map"],  # which ranks and layers (tests/test_rank_map.py)
        "patterns": [],
    }
    r = run("compare", str(tmp_path / "base.json"), "-", stdin=json.dumps({"checksums": base}))
    assert r.returncode == 0 and r.stdout.startswith("match")


@pytest.mark.parametrize(
    "content,msg",
    [
        ("{nope", "invalid JSON"),
        ('{"k": 5}', "must be a string"),
        ("[1]", "expected"),
        (None, "No such file"),
    ],
)
def test_compare_bad_input_exit_2(tmp_path, content, msg):
    good = tmp_path / "good.json"
    good.write_text("{}")
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    r = run("compare", str(good), str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_compare_both_stdin_is_refused():
    r = run("compare", "-", "-", stdin="{}")
    assert r.returncode == 2 and "only one" in r.stderr


def test_progress_bar_only_after_a_delay(capsys):
    from weight_checker.cli.report import Progress

    quiet = Progress("x", enabled=True, delay=60)
    quiet(5, 10)
    shown = Progress("x", enabled=True, delay=0)
    shown(5, 10)
    shown.close()
    err = capsys.readouterr().err
    assert err.count("[") == 1 and "50.0%" in err


def test_output_to_a_special_file_writes_in_place(sharded, tmp_path):
    # `-o /dev/null` must never replace /dev/null with a regular file: a
    # FIFO stands in for it here.
    import os
    import stat
    import threading

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    r = run("checksum", str(sharded), "-o", str(fifo))
    reader.join(timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(got[0])["checksums"] == loaded_digests(sharded)

"""The release wheel (`make wheel`, dist/) installs and works where there is
no Rust toolchain: a fresh venv, no cargo on PATH, no other package."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

DIST = Path(__file__).resolve().parent.parent / "dist"


def the_wheel() -> Path:
    wheels = sorted(DIST.glob("weight_checker-*-cp311-abi3-manylinux*_x86_64.whl"))
    if not wheels:
        pytest.skip("no wheel in dist/: run `make wheel` (make test does)")
    return wheels[-1]


def sdist_missing(sdist: Path, root: Path) -> list[str]:
    """The files a build from ``sdist`` needs that it lacks: every tracked
    file of the Rust crate and the Python package, and the build manifests."""
    import tarfile

    tracked = subprocess.run(
        ["git", "ls-files", "rust", "python/weight_checker", "Cargo.toml", "Cargo.lock", "pyproject.toml"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    present = {n.split("/", 1)[1] for n in names if "/" in n}
    assert f"{top}/PKG-INFO" in names, names[:5]
    return sorted(set(tracked) - present)


def test_sdist_holds_every_file_the_build_needs():
    the_wheel()
    root = DIST.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    sdists = sorted(DIST.glob("weight_checker-*.tar.gz"))
    assert sdists, "make wheel builds the sdist beside the wheel"
    assert sdist_missing(sdists[-1], root) == []
    import tarfile

    with tarfile.open(sdists[-1]) as tar:
        top = tar.getnames()[0].split("/")[0]
        info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    import weight_checker

    assert f"\nVersion: {weight_checker.__version__}\n" in info, info[:300]


def hello_checkpoint(tmp_path: Path) -> Path:
    """A one-tensor safetensors file whose digest is sha256(b"hello")."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [5], "data_offsets": [0, 5]}}).encode()
    st = tmp_path / "small.safetensors"
    st.write_bytes(struct.pack("<Q", len(header)) + header + b"hello")
    return st


#: What the wheel installs with (``dependencies = []``): none of these.
OPTIONAL = ("torch", "numpy", "vllm", "fastapi", "starlette", "httpx", "ray", "trl", "safetensors", "transformers")

#: The modules a user without the extras imports: the top level, the CLI's
#: offline commands and HTTP verification (the standard library's client).
DEPENDENCY_FREE = (
    "weight_checker",
    "weight_checker.cli.main",
    "weight_checker.checkpoint",
    "weight_checker.expected",
    "weight_checker.verify",
    "weight_checker.staging",
    "weight_checker.scope",
    "weight_checker.settings",
)


def test_package_imports_without_optional_dependencies(tmp_path):
    """The wheel test below catches a module-level ``import torch`` only where
    a wheel was built; this catches it in every run, from the installed
    package, with every optional dependency made unimportable."""
    st = hello_checkpoint(tmp_path)
    code = f"""
import importlib, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (made absent by the test)")
sys.meta_path.insert(0, Absent())
for name in {DEPENDENCY_FREE!r}:
    importlib.import_module(name)
from weight_checker.cli.main import main
sys.exit(main(["checksum", {str(st)!r}, "--no-prefix"]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == {"checksums": {"w": hashlib.sha256(b"hello").hexdigest()}}


def test_wheel_installs_and_runs_without_rust(tmp_path):
    wheel = the_wheel()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
        check=True,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    assert shutil.which("cargo", path=env["PATH"]) is None and shutil.which("rustc", path=env["PATH"]) is None

    messages = [b"", b"abc", bytes(range(256)) * 1000]
    code = (
        "import json, importlib.metadata as m, weight_checker as w;"
        "msgs = [b'', b'abc', bytes(range(256)) * 1000];"
        "print(json.dumps([w.__version__, m.version('weight-checker'), w.sha256_many(msgs)]))"
    )
    out = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    version, dist_version, digests = json.loads(out.stdout)
    assert version == dist_version and version in wheel.name
    assert digests == [hashlib.sha256(m).hexdigest() for m in messages]

    cli = venv / "bin" / "weight-checker"
    r = subprocess.run([str(cli), "--version"], env=env, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"weight-checker {version}"

    st = hello_checkpoint(tmp_path)
    r = subprocess.run([str(cli), "checksum", str(st), "--no-prefix"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"checksums": {"w": hashlib.sha256(b"hello").hexdigest()}}

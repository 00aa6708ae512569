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
from weight_checker.testing.launch import ci, vllm_available

DIST = Path(__file__).resolve().parent.parent / "dist"


def the_wheel() -> Path:
    wheels = sorted(DIST.glob("weight_checker-*-cp311-abi3-manylinux*_x86_64.whl"))
    if not wheels:
        if ci():
            pytest.fail("CI=true but there is no wheel in dist/: make test builds it before the Python suite")
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


def readme_install_lines() -> list[str]:
    """The ``pip install`` lines of the README's Install section, as shown."""
    readme = (DIST.parent / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash no-run\n", 1)[1].split("```", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("pip install")]


def test_the_readmes_install_gives_a_working_cli_and_vllm_plugin(tmp_path):
    """The README's install command, run as shown (from the clone's root) in a
    fresh venv that has vLLM (this environment's packages, weight_checker's
    development install not among them): the command works, and vLLM's own
    plugin loader finds the installed plugin and patches its worker."""
    the_wheel()
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    lines = readme_install_lines()
    assert lines and all("dist/weight_checker-" in ln for ln in lines), lines
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # vLLM, torch and the rest from this environment's site-packages: a folder of
    # links to every entry but this package's (its development install), on the
    # venv's path through a .pth file (whose own .pth files are not read).
    import sysconfig

    here = Path(sysconfig.get_paths()["purelib"])
    others = tmp_path / "site-without-weight-checker"
    others.mkdir()
    for entry in here.iterdir():
        if not entry.name.lower().startswith(("weight_checker", "weight-checker")):
            (others / entry.name).symlink_to(entry)
    there = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(there, "with-vllm.pth").write_text(f"{others}\n")
    env = dict(
        os.environ, PATH=f"{venv / 'bin'}:/usr/bin:/bin", VIRTUAL_ENV=str(venv), PIP_DISABLE_PIP_VERSION_CHECK="1"
    )
    env.pop("PYTHONPATH", None)
    for line in lines:
        r = subprocess.run(line, shell=True, cwd=DIST.parent, env=env, capture_output=True, text=True)
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-3000:])
    import weight_checker

    cli = shutil.which("weight-checker", path=env["PATH"])
    assert cli is not None and Path(cli).parent == venv / "bin", cli
    r = subprocess.run([cli, "--version"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"weight-checker {weight_checker.__version__}", r.stderr
    code = """
import json, weight_checker
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.worker.gpu_worker import Worker
print(json.dumps([weight_checker.__file__, Worker.compute_weight_checksums.__module__]))
"""
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    where, patched_by = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(where).is_relative_to(there), where  # the installed wheel, not this checkout
    assert patched_by == "weight_checker.integrations.vllm.worker"

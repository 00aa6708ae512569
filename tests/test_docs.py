"""Every command shown in the README and docs/ runs as shown.

Conventions (docs/development.md says the same):

- A fenced ```` ```bash ```` block is run, line by line (``\\`` continues a
  line), in one working directory per document, in order, so a later command
  may read what an earlier one wrote. The directory holds ``ckpt/`` (a tiny
  Llama: ``config.json`` + ``model.safetensors``) and ``model.safetensors``.
  A line ending in ``# exits N`` must exit with N; every other line with 0.
- A ```` ```bash no-run ```` block needs something a test cannot give it (a
  live vLLM server, a GPU, the test suite itself): it is not run, but every
  ``weight-checker`` command in it is parsed by the CLI's own parser, so an
  option that does not exist fails here.
- A ```` ```python ```` block must compile.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```\s*$", re.S | re.M)
EXITS = re.compile(r"\s+#\s*exits\s+(\d+)\s*$")


def blocks(path: Path) -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(path.read_text())]


def commands(body: str) -> list[str]:
    """Shell lines of a block: continuations joined, comments and blanks dropped."""
    out, pending = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def strip_comment(line: str) -> str:
    """The command without a trailing ``# ...`` comment (outside quotes)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return shlex.join(list(lexer))


def test_every_document_has_commands_and_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 10 * 1024, f"README is {len(readme.encode())} bytes"
    first_screen = "\n".join(readme.splitlines()[:60])
    for needed in ("pip install", "weight-checker verify", "weight-checker expect", "Exit codes"):
        assert needed in first_screen, needed
    assert any(info.startswith("bash") for doc in DOCS for info, _ in blocks(doc))


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a document's headings: lower case, punctuation
    dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no headings in code blocks
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_point_at_files_and_headings_that_exist(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{doc.name}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_blocks_compile(doc):
    for info, body in blocks(doc):
        if info.split()[:1] == ["python"]:
            compile(body, f"{doc.name} python block", "exec")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_run_weight_checker_commands_parse(doc):
    from weight_checker.cli.main import build_parser

    parser = build_parser()
    for info, body in blocks(doc):
        if info.split()[:2] != ["bash", "no-run"]:
            continue
        for line in commands(body):
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", strip_comment(line)):
                words = shlex.split(part)
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # VAR=value prefixes
                if words[:1] == ["weight-checker"]:
                    try:
                        parser.parse_args(words[1:])
                    except SystemExit as e:
                        pytest.fail(f"{doc.name}: `{part}` does not parse (exit {e.code})")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, models):
    from weight_checker.testing.models import write_tiny_llama

    base = tmp_path_factory.mktemp("docs")
    with models.exclusive():  # transformers' lazy imports race the shared servers' checkpoint writers
        write_tiny_llama(base / "ckpt")
    return base


def runnable(doc: Path) -> list[str]:
    return [c for info, body in blocks(doc) if info.split() == ["bash"] for c in commands(body)]


@pytest.mark.parametrize("doc", [d for d in DOCS if runnable(d)], ids=lambda p: p.name)
def test_runnable_commands_run_as_shown(doc, workdir, tmp_path):
    cwd = tmp_path / "cwd"
    shutil.copytree(workdir, cwd)
    shutil.copy(cwd / "ckpt" / "model.safetensors", cwd / "model.safetensors")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for line in runnable(doc):
        want = int(m[1]) if (m := EXITS.search(line)) else 0
        r = subprocess.run(line, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == want, (
            f"{doc.name}: `{line}` exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        )

"""The package's rooms, read from its source with :mod:`ast` (nothing is
imported): each module's length, the private names it takes from another
module, and the import circles among the modules under ``python/``.

Every import counts, at module level or inside a function, ``TYPE_CHECKING``
or not: a function-local import that dodges a circle still makes one. Run it
as a script for the report: ``python3 tests/house.py``."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "python"
PACKAGE = "weight_checker"
#: The compiled module: a module of the package whose name starts with ``_``
#: by maturin's convention (``module-name = "weight_checker._core"``), not a private name.
COMPILED = f"{PACKAGE}._core"
MAX_LINES = 500


@dataclass
class Module:
    name: str
    path: Path | None  # None: the compiled module
    is_package: bool
    lines: int = 0
    imports: set[str] = field(default_factory=set)


@dataclass
class PrivateImport:
    importer: str
    line: int
    source: str
    name: str

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.source}.{self.name}"


def modules(root: Path = PACKAGE_ROOT) -> dict[str, Module]:
    out: dict[str, Module] = {COMPILED: Module(COMPILED, None, False)}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        if parts and parts[0] == PACKAGE:
            name = ".".join(parts)
            out[name] = Module(name, path, is_package, len(path.read_text().splitlines()))
    return out


def _absolute(module: Module, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def read_imports(mods: dict[str, Module]) -> list[PrivateImport]:
    """Fills each module's ``imports`` (the package's modules it imports) and
    returns every private name taken from another module."""
    private: list[PrivateImport] = []
    for module in mods.values():
        if module.path is None:
            continue
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.Import):
                module.imports.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node.level, node.module)
                if not source.startswith(PACKAGE):
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in mods:
                        module.imports.add(submodule)
                        continue
                    if source in mods:
                        module.imports.add(source)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(PrivateImport(module.name, node.lineno, source, alias.name))
    return private


def circles(mods: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in mods[v].imports - {v}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(mods)))
    for v in mods:
        if v not in index:
            visit(v)
    return found


def too_long(mods: dict[str, Module], limit: int = MAX_LINES) -> list[tuple[str, int]]:
    return [(m.name, m.lines) for m in mods.values() if m.lines > limit]


def report() -> str:
    mods = modules()
    lines = [f"private import: {p}" for p in read_imports(mods)]
    for component in circles(mods):
        members = set(component)
        lines.append("circle: " + ", ".join(component))
        lines += [f"  {m} -> {', '.join(sorted(mods[m].imports & members - {m}))}" for m in component]
    lines += [f"over {MAX_LINES} lines: {name} ({n})" for name, n in too_long(mods)]
    return "\n".join(lines) or "the house is in order"


if __name__ == "__main__":
    print(report())


#: The package's top-level modules that every room may use: the ground floor.
GROUND = frozenset({"errors", "tally", "keys", "settings", "scope", "httpclient", "_core"})
#: The subpackages of ``integrations/`` that run inside an engine's processes: rooms of their own.
ENGINE_GLUE = frozenset({"vllm", "sglang"})
#: Top-level modules kept only as import paths of earlier releases (re-exports).
KEPT_PATHS = frozenset({"checkpoint", "staging", "vllm", "ray"})


def room_of(module: str) -> str:
    """The room a module is in, as docs/design.md names rooms: ``ground``,
    ``kept paths``, ``weight_checker`` (the package root), or a subpackage
    (``hashing/``, ``integrations/vllm/``, ``integrations/sglang/``, ``integrations/`` for the rest)."""
    parts = module.split(".")[1:]
    if not parts:
        return PACKAGE
    if len(parts) == 1 and parts[0] in GROUND:
        return "ground"
    if len(parts) == 1 and parts[0] in KEPT_PATHS:
        return "kept paths"
    if parts[0] == "integrations" and len(parts) > 1 and parts[1] in ENGINE_GLUE:
        return f"integrations/{parts[1]}/"
    return f"{parts[0]}/"


def room_imports(mods: dict[str, Module]) -> dict[str, set[str]]:
    """``{room: the other rooms its modules import}`` (call :func:`read_imports` first)."""
    out: dict[str, set[str]] = {}
    for module in mods.values():
        here = room_of(module.name)
        out.setdefault(here, set()).update(room_of(i) for i in module.imports if room_of(i) != here)
    return out

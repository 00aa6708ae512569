"""The rooms stay readable (issue 48): no module of the package over 500 lines,
no private name taken from another module, no import circle among the
package's modules (function-local imports included), and no Rust file over
600 lines unless its first lines say why it must stay whole."""

from __future__ import annotations

from pathlib import Path

from . import house

RUST_ROOT = Path(__file__).resolve().parent.parent / "rust"
RUST_MAX_LINES = 600


def test_the_checker_sees_the_package():
    mods = house.modules()
    assert "weight_checker.verify.workflow" in mods and "weight_checker.keys" in mods
    house.read_imports(mods)
    # An import it must see, or every finding below would be empty for nothing.
    assert "weight_checker.errors" in mods["weight_checker.keys"].imports


def test_a_circle_and_a_private_import_are_found(tmp_path):
    pkg = tmp_path / "weight_checker"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from weight_checker.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import _hidden\n")
    mods = house.modules(tmp_path)
    private = house.read_imports(mods)
    assert [(p.importer, p.source, p.name) for p in private] == [
        ("weight_checker.sub.b", "weight_checker.a", "_hidden")
    ]
    assert house.circles(mods) == [["weight_checker.a", "weight_checker.sub.b"]]


def test_no_module_is_over_500_lines():
    assert house.too_long(house.modules()) == []


def test_no_module_takes_another_modules_private_name():
    assert [str(p) for p in house.read_imports(house.modules())] == []


def test_no_import_circle_among_the_packages_modules():
    mods = house.modules()
    house.read_imports(mods)
    assert house.circles(mods) == []


def test_a_long_rust_file_says_why_it_stays_whole():
    for path in sorted(RUST_ROOT.rglob("*.rs")):
        lines = path.read_text().splitlines()
        if len(lines) > RUST_MAX_LINES:
            head = " ".join(lines[:12]).lower()
            assert "whole" in head, (
                f"{path.relative_to(RUST_ROOT)}: {len(lines)} lines and no word on why it stays whole"
            )


DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"


def documented_floors() -> dict[str, set[str]]:
    """docs/design.md's table of floors: ``{room: the rooms it may import}``."""
    text = DESIGN.read_text()
    table = text[text.index("### The floors") : text.index("### The rooms")]
    floors: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        floors[cells[0].strip("`")] = {w.strip("`") for w in cells[1].split()}
    return floors


def test_each_room_imports_only_the_floors_design_md_gives_it():
    mods = house.modules()
    house.read_imports(mods)
    floors = documented_floors()
    actual = house.room_imports(mods)
    assert set(actual) == set(floors), "a room missing from docs/design.md's floors, or one that is gone"
    beyond = {room: sorted(used - floors[room]) for room, used in actual.items() if used - floors[room]}
    assert beyond == {}, f"imports above what docs/design.md allows: {beyond}"

"""What the workflow's checksums say, once they are all in: every key
classed against the reference (the baseline or the expected digests),
engine by engine in a fleet, and each engine's weight version against the
one the expected digests carry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_checker.hashing.unseen import is_unseen_key, unseen_warning
from weight_checker.verify.classes import (
    EMPTY_DIGEST,
    already_zeroed_warning,
    class_counts,
    classify,
    classify_expected,
)
from weight_checker.verify.engine_digests import EngineDigests, display_key
from weight_checker.verify.results import VerifyResult


def _of(values: dict[str, Any], name: str, engine: str | None) -> dict[str, str] | None:
    """The digests a step kept as ``name``: one engine's, or all of them
    merged, less its ``unseen:`` keys (weights no digest covers: see
    :func:`_unseen_of`), which are never compared."""
    checked = values.get(name)
    if checked is None:
        return None
    digests = checked.digests
    held = dict(digests.per_engine[engine]) if engine is not None else digests.merged()
    return {k: v for k, v in held.items() if not is_unseen_key(k)}


def _unseen_of(values: dict[str, Any], engine: str | None) -> list[str]:
    """The ``unseen:`` keys any step's checksum answered (weights an engine
    holds outside its parameters: :mod:`weight_checker.hashing.unseen`)."""
    found: set[str] = set()
    for name in ("baseline", "post_reset", "before", "current"):
        checked = values.get(name)
        if checked is None:
            continue
        digests = checked.digests
        held = digests.per_engine[engine] if engine is not None else digests.merged()
        found |= {k for k in held if is_unseen_key(k)}
    return sorted(found)


def compare(result: VerifyResult, values: dict[str, Any]) -> None:
    """Classifies every key, engine by engine in a fleet, and records the
    result. ``values``: the steps' findings (:class:`Checked` under
    ``baseline``, ``post_reset``, ``before``, ``current``) and the
    references (``expected``, ``baseline_manifest``)."""
    current: EngineDigests = values["current"].digests
    result.layout = current.layout
    engines: list[str | None] = list(current.per_engine) if current.layout == "fleet" else [None]
    expected = values.get("expected")
    compared: list[tuple[str | None, Mapping[str, str], Mapping[str, str]]] = []
    for engine in engines:
        after = _of(values, "current", engine) or {}
        if expected is not None:
            classes, details, warnings, count = _against_expected(expected, _of(values, "before", engine), after)
            compared.append((engine, expected, after))
        else:
            manifest = values.get("baseline_manifest")
            if manifest is not None:  # a baseline saved from an engine's checksum: its unseen: keys prove nothing
                manifest = {k: v for k, v in manifest.items() if not is_unseen_key(k)}
            reference = manifest or _of(values, "baseline", engine) or {}
            compared.append((engine, reference, after))
            post_reset = _of(values, "post_reset", engine)
            classes, details, count = classify(reference, after, post_reset), {}, len(reference)
            warnings = [w] if post_reset is not None and (w := already_zeroed_warning(reference, post_reset)) else []
        unseen = _unseen_of(values, engine)
        if engine is not None:
            unseen = [display_key(engine, k) for k in unseen]
            result.by_engine[engine] = classes
            classes = {display_key(engine, k): c for k, c in classes.items()}
            details = {display_key(engine, k): d for k, d in details.items()}
            warnings = [f"{engine}: {w}" for w in warnings]
        result.unseen += unseen
        result.mismatches.update(classes)
        result.details.update(details)
        result.warnings += warnings
        result.key_count += count
    if result.mismatches:  # what the rank × layer map places; nothing is kept on a match
        unwritten = set(getattr(expected, "unwritten", ())) if expected is not None else set()
        for engine, ref, held in compared:
            keys = sorted((ref.keys() | held.keys()) - unwritten)
            result.compared_keys += keys if engine is None else [display_key(engine, k) for k in keys]
    result.reference = "the expected digests" if expected is not None else "the baseline"
    _weight_versions(result, values, current)
    if result.unseen:
        result.warnings.append(unseen_warning(result.unseen))
    # Never a match over weights no digest covers.
    result.match = not result.mismatches and not result.version_mismatches and not result.unseen


def _weight_versions(result: VerifyResult, values: dict[str, Any], current: EngineDigests) -> None:
    """Each engine's weight version before and after, and whether the one it
    claims after the transfer is the expected one, held with its weights."""
    first = values.get("before") or values.get("baseline")
    before = first.weight_versions if first is not None else {}
    after = values["current"].weight_versions
    want = getattr(values.get("expected"), "weight_version", None)
    for engine in current.per_engine:
        result.weight_versions[engine] = {"before": before.get(engine), "after": after.get(engine)}
        if want is None:
            continue
        got = after.get(engine)
        if got is None:
            result.warnings.append(
                f"{engine} reports no weight version (vLLM < 0.32, or no dev mode): the version is not checked"
            )
            continue
        if current.layout == "fleet":
            wrong = result.by_engine.get(engine, {})
        else:
            wrong = {k: c for k, c in result.mismatches.items() if k in current.per_engine[engine]}
        if got != want:
            result.version_mismatches[engine] = f"reports weight version {got!r}, expected {want!r}"
        elif wrong:
            held = f"{len(wrong)} key(s) do not hold its weights ({class_counts(wrong)})"
            result.version_mismatches[engine] = f"claims weight version {want!r} but {held}"


def _against_expected(
    expected: Mapping[str, str], before: dict[str, str] | None, after: dict[str, str]
) -> tuple[dict[str, str], dict[str, str], list[str], int]:
    """``(classes, details, warnings, keys compared)`` of one model against
    the digests it must hold; keys the weights never wrote are not compared."""
    unwritten = set(getattr(expected, "unwritten", ()))
    after = {k: v for k, v in after.items() if k not in unwritten}
    classes, details = classify_expected(expected, before, after)
    warnings = []
    if unwritten:
        warnings.append(f"{len(unwritten)} key(s) not checked: the expected weights never wrote them")
    emptied = [k for k in classes if after.get(k) == EMPTY_DIGEST != expected.get(k)]
    if emptied:
        warnings.append(
            f"{len(emptied)} key(s) hold no bytes on the engine but are expected to (a CPU backend repacks "
            f"linear weights into empty parameters): they cannot match, e.g. {emptied[0]}"
        )
    return classes, details, warnings, len(expected)

"""What the CLI prints: the progress bar, and the compare, verify and
mismatch reports."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from weight_checker.tally import class_counts
from weight_checker.verify.rank_map import RankLayerMap


class Progress:
    """A progress bar on stderr, shown only on a TTY and only once the work
    has taken more than a second."""

    def __init__(self, label: str, enabled: bool | None = None, delay: float = 1.0):
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.monotonic()
        self.delay = delay
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        if elapsed < self.delay and done < total:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / elapsed / 1e9 if elapsed > 0 else 0.0
        sys.stderr.write(
            f"\r{self.label} [{bar:<30}] {frac:6.1%} {done / 1e9:.2f}/{total / 1e9:.2f} GB {rate:.2f} GB/s"
        )
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def compare_report(baseline: dict[str, str], current: dict[str, str]) -> dict:
    """``compare``'s JSON report: vLLM's compare with every mismatching key
    classed by :func:`weight_checker.classes.classify`, grouped by class."""
    from weight_checker.hashing.unseen import is_unseen_key
    from weight_checker.verify.classes import classify

    # unseen: keys name weights no digest covers (their digests are random):
    # never compared, never a match.
    unseen = sorted({k for k in baseline.keys() | current.keys() if is_unseen_key(k)})
    seen_base = {k: v for k, v in baseline.items() if not is_unseen_key(k)}
    seen_current = {k: v for k, v in current.items() if not is_unseen_key(k)}
    classes = classify(seen_base, seen_current)
    by_class: dict[str, list[str]] = {}
    for k in sorted(classes):
        by_class.setdefault(classes[k], []).append(k)
    report = {"match": not classes and not unseen, "mismatches": sorted(classes), "classes": by_class}
    if unseen:
        report |= {"unseen": unseen, "verdict": "mismatch" if classes else "unverified"}
    return report


def print_mismatches(result: dict, out=sys.stdout) -> None:
    names = {k: c for c, ks in result["classes"].items() for k in ks}
    details = result.get("details", {})
    for k in result["mismatches"]:
        detail = f"  ({details[k]})" if k in details else ""
        print(f"  {names[k]:<22} {k}{detail}", file=out)


def summary_line(result: dict, nbase: int, ncur: int) -> str:
    if result["match"]:
        return f"match: {nbase} keys, all digests equal"
    if result.get("verdict") == "unverified":
        return (
            f"UNVERIFIED: every other digest equal, but {len(result['unseen'])} key(s) name weights held outside the "
            "model's parameters (unseen:), which no digest covers"
        )
    counts = class_counts({k: c for c, ks in result["classes"].items() for k in ks})
    n = len(result["mismatches"])
    return f"MISMATCH: {n} keys differ ({counts}); baseline {nbase} keys, current {ncur}"


def _fleet(report: dict) -> str:
    layout = report.get("layout")
    if layout == "fleet":
        return f" (a fleet of {len(report['servers'])} replicas, each compared on its own)"
    if layout == "merge":
        return f" ({len(report['servers'])} servers' ranks merged into one model)"
    return ""


def verify_verdict(report: dict) -> str:
    """``MATCH: ...`` or ``MISMATCH: ...``: the verdict of a verify report."""
    if report.get("error") and not report.get("key_count"):
        return f"ERROR: {report['error']}"
    reference = "the expected digest" if report.get("reference") == "the expected digests" else "the baseline"
    if report["match"]:
        return f"MATCH: {report['key_count']} keys, every digest equals {reference}{_fleet(report)}"
    if report.get("verdict") == "unverified":
        names = sorted({k.split("unseen:", 1)[-1] for k in report.get("unseen", [])})
        return (
            f"UNVERIFIED: {report['key_count']} keys equal {reference}, but {len(names)} weight tensor(s) are held "
            f"outside the model's parameters, so no digest covers them (not a match)"
        )
    counts = class_counts({k: c for c, ks in report["classes"].items() for k in ks})
    versions = len(report.get("version_mismatches", {}))
    also = f"; {versions} engine(s) claim a weight version their weights are not" if versions else ""
    return f"MISMATCH: {len(report['mismatches'])} keys ({counts or 'none differ'}){also}"


def print_verify_report(report: dict) -> None:
    print(f"weight-checker verify: {len(report['servers'])} server(s): {' '.join(report['servers'])}")
    for i, s in enumerate(report["steps"], 1):
        status = "ok" if s["ok"] else "FAILED"
        slowest = s.get("slowest")
        slow = f"   slowest {slowest['engine']} {slowest['seconds']:.3f} s" if slowest else ""
        print(f"  {i}. {s['step']:<24} {status:<6} {s['seconds']:8.3f} s{slow}")
    for w in report.get("warnings", []):
        print(f"warning: {w}")
    if report.get("error") and not report.get("key_count"):
        print(f"result: ERROR: {report['error']}")
        return
    for engine, seen in report.get("weight_versions", {}).items():
        print(f"weight version: {engine}: {seen['before']} -> {seen['after']}")
    print(f"result: {verify_verdict(report)}")
    for key in report.get("unseen", []):
        print(f"  unseen                  {key}")
    if report["mismatches"]:
        print_mismatches(report)
    print_explanation(report.get("explanation"))
    for engine, why in report.get("version_mismatches", {}).items():
        print(f"  weight-version          {engine} {why}")
    if report.get("error"):
        print(f"error: {report['error']}")


def print_explanation(explanation: Mapping[str, Any] | None) -> None:
    """Why the check failed, a line a key: its class, the cause, where in the
    tensor (``verify``'s explanation, as ``to_json`` gives it)."""
    if not explanation:
        return
    print("why (the first mismatched keys: class, cause, where in the tensor):")
    for e in explanation.get("keys", []):
        where = "the whole tensor" if e.get("whole") else e.get("where") or ""
        spans = ", ".join(f"{a}-{b}" for a, b in e.get("ranges", [])[:4])
        if spans and not e.get("whole"):
            where = f"{where} (bytes {spans}{' ...' if len(e.get('ranges', [])) > 4 else ''})"
        causes = e.get("block_causes") or {}
        mixed = "; ".join(f"{c}: {len(r)} range(s)" for c, r in causes.items()) if e.get("cause") == "mixed" else ""
        note = f" [{e['note']}]" if e.get("note") else ""
        print(f"  {e['cause']:<24} {e['class']:<12} {e['key']}  {where}{'  ' + mixed if mixed else ''}{note}")
    if explanation.get("left_out"):
        print(f"  ({explanation['left_out']} more mismatched keys not explained: --explain N to see more)")
    for note in explanation.get("notes", []):
        print(f"  note: {note}")


def use_color(out: TextIO) -> bool:
    """Colour on a terminal, unless ``NO_COLOR`` is set."""
    return out.isatty() and not os.environ.get("NO_COLOR")


def print_rank_map(rank_map: RankLayerMap | None, out: TextIO | None = None) -> None:
    """The rank × layer map and its patterns, under a failed check's verdict
    (nothing on a match); coloured on a terminal."""
    from weight_checker.verify.rank_map import render_text

    if rank_map is None or not rank_map.labels:
        return
    out = out or sys.stdout
    print(file=out)
    print(render_text(rank_map, color=use_color(out)), file=out)


def write_report(
    path: str,
    rank_map: RankLayerMap | None,
    verdict: str,
    details: Mapping[str, Mapping[str, Any]] | None = None,
    notes: Sequence[str] = (),
    title: str = "weight-checker",
) -> None:
    """``--report FILE``: the self-contained HTML page (the verdict, the
    patterns, the map, the per-key table and the block ranges), written
    atomically; ASCII only (every other character as an HTML reference)."""
    from weight_checker.cli.files import UsageError, write_output
    from weight_checker.verify.rank_map import render_html

    page = render_html(rank_map, details, title=title, verdict=verdict, notes=notes)
    try:
        write_output(page.encode("ascii", "xmlcharrefreplace").decode("ascii"), path)
    except OSError as e:
        raise UsageError(f"--report {path}: {e.strerror or e}") from e

"""``weight-checker``: checksum checkpoints, compare manifests, verify a live
RL weight update.

    weight-checker checksum PATH... [--prefix P | --no-prefix] [-o FILE]
    weight-checker compare BASELINE CURRENT [--json]
    weight-checker verify --url URL [--url URL ...]
                          (--transfer reload | --transfer-cmd CMD | --wait | --baseline FILE)

Exit codes: 0 match / success, 1 mismatch, 2 bad input or a failed step,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weight_checker.keys import rank_prefix

EXIT_OK, EXIT_MISMATCH, EXIT_BAD, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_PREFIX = rank_prefix(0, 0, 0, 0)


class UsageError(Exception):
    """Bad input: one line on stderr, exit 2."""


# --- output helpers ------------------------------------------------------------


def write_output(text: str, path: str | None) -> None:
    """To stdout, or to ``path``: a regular file is replaced atomically (no
    half-written manifest); anything else (``/dev/null``, a FIFO, a terminal)
    is written in place, never replaced."""
    if path is None or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    if target.exists() and not target.is_file():
        with open(target, "w") as f:
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


# --- checksum ------------------------------------------------------------------


def cmd_checksum(args: argparse.Namespace) -> int:
    from weight_checker.checkpoint import CheckpointError, checksum_checkpoint

    prefix = "" if args.no_prefix else (args.prefix if args.prefix is not None else DEFAULT_PREFIX)
    progress = Progress("checksum", enabled=False if args.no_progress else None)
    try:
        digests = checksum_checkpoint(args.paths, prefix=prefix, progress=progress)
    except CheckpointError as e:
        progress.close()
        raise UsageError(str(e)) from None
    progress.close()
    write_output(json.dumps({"checksums": digests}, indent=2, sort_keys=True) + "\n", args.output)
    return EXIT_OK


# --- compare -------------------------------------------------------------------


def load_manifest(path: str, stdin_used: list[bool]) -> dict[str, str]:
    """``{"checksums": {...}}`` or a bare ``{key: hex}`` mapping, from a file or ``-``."""
    if path == "-":
        if stdin_used[0]:
            raise UsageError("only one of BASELINE and CURRENT can be '-'")
        stdin_used[0] = True
        text, where = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, where = Path(path).read_text(), path
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: {e.strerror if isinstance(e, OSError) else e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: invalid JSON: {e}") from None
    if isinstance(data, dict) and set(data) == {"checksums"}:
        data = data["checksums"]
    if not isinstance(data, dict):
        raise UsageError(f'{where}: expected {{key: sha256 hex}} or {{"checksums": {{...}}}}')
    for k, v in data.items():
        if not isinstance(v, str):
            raise UsageError(f"{where}: key {k!r}: digest must be a string, got {v!r:.40}")
    return data


def classify(baseline: dict[str, str], current: dict[str, str], post_reset: dict[str, str] | None = None) -> dict:
    """Every mismatching key (vLLM's union semantics) with its class: missing
    (baseline only), unexpected (current only), untouched-since-reset (still
    its post-reset digest) or changed."""
    from weight_checker.digests import compare

    result = compare(baseline, current)
    classes: dict[str, str] = {}
    for k in result["mismatches"]:
        if k not in current:
            classes[k] = "missing"
        elif k not in baseline:
            classes[k] = "unexpected"
        elif post_reset is not None and post_reset.get(k) == current[k]:
            classes[k] = "untouched-since-reset"
        else:
            classes[k] = "changed"
    by_class: dict[str, list[str]] = {}
    for k, c in classes.items():
        by_class.setdefault(c, []).append(k)
    return {"match": result["match"], "mismatches": result["mismatches"], "classes": by_class}


def print_mismatches(result: dict, out=sys.stdout) -> None:
    names = {k: c for c, ks in result["classes"].items() for k in ks}
    for k in result["mismatches"]:
        print(f"  {names[k]:<22} {k}", file=out)


def summary_line(result: dict, nbase: int, ncur: int) -> str:
    if result["match"]:
        return f"match: {nbase} keys, all digests equal"
    counts = ", ".join(f"{len(v)} {c}" for c, v in sorted(result["classes"].items()))
    n = len(result["mismatches"])
    return f"MISMATCH: {n} keys differ ({counts}); baseline {nbase} keys, current {ncur}"


def cmd_compare(args: argparse.Namespace) -> int:
    used = [False]
    baseline = load_manifest(args.baseline, used)
    current = load_manifest(args.current, used)
    result = classify(baseline, current)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(summary_line(result, len(baseline), len(current)))
        print_mismatches(result)
    return EXIT_OK if result["match"] else EXIT_MISMATCH


# --- verify --------------------------------------------------------------------


class StepError(Exception):
    def __init__(self, step: str, server: str | None, message: str):
        where = f" on {server}" if server else ""
        super().__init__(f"step '{step}'{where}: {message}")


def http_post(url: str, path: str, body: Any, timeout: float, step: str) -> Any:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method="POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip()
        raise StepError(step, url, f"HTTP {e.code}: {detail[:300]}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StepError(step, url, f"cannot connect: {reason}") from None
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError:
        raise StepError(step, url, f"answer is not JSON: {raw[:200]!r}") from None


class Verifier:
    def __init__(self, urls: list[str], timeout: float):
        self.urls = urls
        self.timeout = timeout
        self.steps: list[dict] = []

    def step(self, name: str, fn, detail: str = ""):
        start = time.perf_counter()
        try:
            value = fn()
        except BaseException:
            self.steps.append(
                {
                    "step": name,
                    "ok": False,
                    "seconds": time.perf_counter() - start,
                    "detail": detail,
                }
            )
            raise
        self.steps.append({"step": name, "ok": True, "seconds": time.perf_counter() - start, "detail": detail})
        return value

    def each(self, path: str, body: Any, step: str) -> list[Any]:
        return [http_post(u, path, body, self.timeout, step) for u in self.urls]

    def checksum(self, step: str) -> dict[str, str]:
        merged: dict[str, str] = {}
        for url in self.urls:
            answer = http_post(url, "/weight_checker", {"action": "checksum"}, self.timeout, step)
            sums = answer.get("checksums") if isinstance(answer, dict) else None
            if not isinstance(sums, dict):
                raise StepError(step, url, f"unexpected answer {str(answer)[:200]}")
            if dup := merged.keys() & sums.keys():
                raise StepError(step, url, f"keys also served by another server: {sorted(dup)[:5]}")
            merged.update(sums)
        return merged


def run_transfer(args: argparse.Namespace, v: Verifier) -> str:
    if args.transfer == "reload":
        v.each("/collective_rpc", {"method": "reload_weights"}, "transfer")
        return "collective_rpc reload_weights"
    if args.transfer_cmd is not None:
        import subprocess

        env = dict(os.environ, WEIGHT_CHECKER_URLS=" ".join(v.urls))
        rc = subprocess.run(args.transfer_cmd, shell=True, env=env).returncode
        if rc != 0:
            raise StepError("transfer", None, f"--transfer-cmd exited with {rc}")
        return f"ran {args.transfer_cmd!r}"
    sys.stderr.write("weight-checker: transfer the weights now, then press Enter... ")
    sys.stderr.flush()
    if not sys.stdin.readline():
        raise StepError("transfer", None, "--wait: standard input closed before Enter")
    return "waited for Enter"


def cmd_verify(args: argparse.Namespace) -> int:
    v = Verifier(args.url, args.timeout)
    report: dict[str, Any] = {"servers": args.url, "steps": v.steps}
    post_reset: dict[str, str] | None = None
    paused = False
    error: str | None = None
    interrupted = False
    try:
        if args.baseline is not None:
            baseline = load_manifest(args.baseline, [False])
        else:
            v.step("pause", lambda: v.each("/pause?mode=abort", None, "pause"))
            paused = True
            baseline = v.step("checksum (baseline)", lambda: v.checksum("checksum (baseline)"))
            v.step("reset", lambda: v.each("/weight_checker", {"action": "reset"}, "reset"))
            post_reset = v.step("checksum (post-reset)", lambda: v.checksum("checksum (post-reset)"))
            v.step("transfer", lambda: run_transfer(args, v))
        current = v.step("checksum (current)", lambda: v.checksum("checksum (current)"))
        result = v.step("compare", lambda: classify(baseline, current, post_reset))
        report |= result | {"keys": len(baseline)}
    except StepError as e:
        error = str(e)
    except KeyboardInterrupt:
        error, interrupted = "interrupted", True
    finally:
        if paused:
            try:
                v.step("resume", lambda: v.each("/resume", None, "resume"))
            except StepError as e:
                error = error or str(e)
    if error is not None:
        report["error"] = error
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_verify_report(report)
    if interrupted:
        return EXIT_INTERRUPTED
    if error is not None:
        print(f"weight-checker verify: {error}", file=sys.stderr)
        return EXIT_BAD
    return EXIT_OK if report["match"] else EXIT_MISMATCH


def print_verify_report(report: dict) -> None:
    print(f"weight-checker verify: {len(report['servers'])} server(s): {' '.join(report['servers'])}")
    for i, s in enumerate(report["steps"], 1):
        status = "ok" if s["ok"] else "FAILED"
        print(f"  {i}. {s['step']:<24} {status:<6} {s['seconds']:8.3f} s")
    if "match" not in report:
        print(f"result: ERROR: {report.get('error')}")
        return
    if report["match"]:
        print(f"result: MATCH: {report['keys']} keys, every digest equals the baseline")
    else:
        counts = ", ".join(f"{len(v)} {c}" for c, v in sorted(report["classes"].items()))
        print(f"result: MISMATCH: {len(report['mismatches'])} keys ({counts})")
        print_mismatches(report)
    if "error" in report:
        print(f"error: {report['error']}")


# --- entry point -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weight-checker", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("checksum", help="per-tensor SHA-256 of safetensors checkpoints")
    c.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help=".safetensors file(s), a directory, or an index.json",
    )
    g = c.add_mutually_exclusive_group()
    g.add_argument("--prefix", help=f"key prefix (default {DEFAULT_PREFIX!r})")
    g.add_argument("--no-prefix", action="store_true", help="bare tensor names as keys")
    c.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c.set_defaults(func=cmd_checksum)

    m = sub.add_parser("compare", help="compare two manifests ({checksums} or {key: hex})")
    m.add_argument("baseline", metavar="BASELINE", help="file or -")
    m.add_argument("current", metavar="CURRENT", help="file or -")
    m.add_argument("--json", action="store_true", help='{"match", "mismatches", "classes"}')
    m.set_defaults(func=cmd_compare)

    v = sub.add_parser("verify", help="run the RL weight-update check against vLLM API servers")
    v.add_argument("--url", action="append", required=True, help="API server (repeat for several)")
    t = v.add_mutually_exclusive_group()
    t.add_argument("--transfer", choices=["reload"], help="reload: POST /collective_rpc reload_weights")
    t.add_argument("--transfer-cmd", metavar="CMD", help="shell command that transfers the weights")
    t.add_argument("--wait", action="store_true", help="wait for Enter while the trainer transfers")
    v.add_argument("--baseline", metavar="FILE", help="skip pause/checksum/reset: compare to this manifest")
    v.add_argument("--json", action="store_true", help="machine-readable report")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "verify" and args.baseline is None and not (args.transfer or args.transfer_cmd or args.wait):
        parser.error("verify needs one of --transfer reload, --transfer-cmd CMD, --wait (or --baseline FILE)")
    try:
        return args.func(args)
    except UsageError as e:
        print(f"weight-checker {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD
    except KeyboardInterrupt:
        print(f"weight-checker {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""``weight-checker``: checksum checkpoints, compare manifests, verify a live
RL weight update.

    weight-checker checksum PATH... [--prefix P | --no-prefix] [-o FILE]
    weight-checker compare BASELINE CURRENT [--json]
    weight-checker expect CKPT [--tp T] [--pp P] [--dp D] [--dtype DTYPE] [-o FILE]
    weight-checker verify --url URL [--url URL ...] [--api-key KEY]
                          (--transfer reload | --transfer-cmd CMD | --wait | --baseline FILE)
                          [--expected FILE]
    weight-checker replicas --url URL [--url URL ...] [--api-key KEY]

Exit codes: 0 match / success, 1 mismatch, 2 bad input or a failed step,
130 interrupted. Never a traceback (``WEIGHT_CHECKER_DEBUG=1`` shows one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from weight_checker.cli_files import UsageError, load_expected, load_manifest, write_output
from weight_checker.cli_report import Progress, compare_report, print_mismatches, print_verify_report, summary_line
from weight_checker.keys import rank_prefix

EXIT_OK, EXIT_MISMATCH, EXIT_BAD, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_PREFIX = rank_prefix(0, 0, 0, 0)
DEBUG_ENV = "WEIGHT_CHECKER_DEBUG"

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


# --- expect --------------------------------------------------------------------


def cmd_expect(args: argparse.Namespace) -> int:
    # vLLM's INFO and WARNING lines are not this command's output (its errors become ours).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from weight_checker.expected import ExpectedDigestsError, expected_digests

    ranks = args.tp * args.pp
    show = sys.stderr.isatty() and not args.no_progress
    done = [0]

    def progress(rank: str) -> None:
        done[0] += 1
        if show:
            sys.stderr.write(f"\rexpect: loading and hashing {rank} ({done[0]}/{ranks})   ")
            sys.stderr.flush()

    try:
        expected = expected_digests(
            args.checkpoint,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            dtype=args.dtype,
            allow_unwritten=args.allow_unwritten,
            progress=progress,
        )
    except ExpectedDigestsError as e:
        raise UsageError(str(e)) from None
    finally:
        if show and done[0]:
            sys.stderr.write("\n")
    write_output(json.dumps(expected.manifest(), indent=2, sort_keys=True) + "\n", args.output)
    return EXIT_OK


# --- compare -------------------------------------------------------------------


def cmd_compare(args: argparse.Namespace) -> int:
    used = [False]
    baseline = load_manifest(args.baseline, used)
    current = load_manifest(args.current, used)
    result = compare_report(baseline, current)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(summary_line(result, len(baseline), len(current)))
        print_mismatches(result)
    return EXIT_OK if result["match"] else EXIT_MISMATCH


# --- verify and replicas ----------------------------------------------------------


def http_target(args: argparse.Namespace):
    """The HTTP target of ``--url``s, validated before anything is sent."""
    from weight_checker.verify import HttpTarget

    try:
        return HttpTarget(args.url, api_key=args.api_key, timeout=args.timeout, concurrency=args.concurrency)
    except ValueError as e:
        raise UsageError(str(e)) from None


def transfer_for(args: argparse.Namespace, target) -> Callable[[], None]:
    """The transfer callable and how to describe it."""
    from weight_checker.httpclient import HttpError, post_json
    from weight_checker.verify import VerifyError

    if args.transfer == "reload":

        def reload() -> None:
            for url in target.urls:
                try:
                    post_json(
                        url,
                        "/collective_rpc",
                        {"method": "reload_weights"},
                        timeout=target.timeout,
                        api_key=target.api_key,
                    )
                except HttpError as e:
                    raise VerifyError("transfer", url, e.message) from None

        return reload
    if args.transfer_cmd is not None:

        def run_cmd() -> None:
            import subprocess

            env = dict(os.environ, WEIGHT_CHECKER_URLS=" ".join(target.urls))
            rc = subprocess.run(args.transfer_cmd, shell=True, env=env).returncode
            if rc != 0:
                raise VerifyError("transfer", None, f"--transfer-cmd exited with {rc}")

        return run_cmd

    def wait() -> None:
        sys.stderr.write("weight-checker: transfer the weights now, then press Enter... ")
        sys.stderr.flush()
        if not sys.stdin.readline():
            raise VerifyError("transfer", None, "--wait: standard input closed before Enter")

    return wait


def cmd_verify(args: argparse.Namespace) -> int:
    from weight_checker.verify import VerifyError, VerifyResult, verify

    target = http_target(args)
    baseline = load_manifest(args.baseline, [False]) if args.baseline is not None else None
    expected = load_expected(args.expected) if args.expected is not None else None
    if baseline is not None and expected is not None:
        raise UsageError("--baseline and --expected exclude each other")
    interrupted = False
    try:
        transfer = transfer_for(args, target) if baseline is None else None
        result = verify(target, transfer, baseline=baseline, expected=expected)
    except VerifyError as e:
        result = e.result or VerifyResult(servers=target.urls, error=str(e))
    except KeyboardInterrupt as e:
        interrupted = True
        result = getattr(e, "weight_checker_result", None) or VerifyResult(servers=target.urls)
        result.error = "interrupted"
    report = result.to_json()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_verify_report(report)
    if interrupted:
        return EXIT_INTERRUPTED
    if result.error is not None:
        print(f"weight-checker verify: {result.error}", file=sys.stderr)
        return EXIT_BAD
    return EXIT_OK if result.match else EXIT_MISMATCH


def cmd_replicas(args: argparse.Namespace) -> int:
    from weight_checker.verify import VerifyError, replicas

    target = http_target(args)
    try:
        result = replicas(target)
    except VerifyError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    elif result.consistent:
        print(f"consistent: {len(result.replicas)} replicas ({', '.join(result.replicas)}), {result.groups} keys each")
    else:
        print(f"INCONSISTENT: {len(result.inconsistent)} of {result.groups} keys differ between replicas")
        for key, held in result.inconsistent.items():
            print(f"  {key}")
            for replica, digest in held.items():
                print(f"    {replica:<40} {digest}")
    return EXIT_OK if result.consistent else EXIT_MISMATCH


# --- entry point -------------------------------------------------------------------


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from weight_checker import __version__

    p = argparse.ArgumentParser(prog="weight-checker", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"weight-checker {__version__}")
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

    e = sub.add_parser(
        "expect", help="the digests every rank must hold after loading a checkpoint (vLLM's own loader, on the CPU)"
    )
    e.add_argument("checkpoint", metavar="CKPT", help="model directory: config.json and *.safetensors")
    e.add_argument("--tp", type=positive, default=1, help="tensor-parallel size (default 1)")
    e.add_argument("--pp", type=positive, default=1, help="pipeline-parallel size (default 1)")
    e.add_argument("--dp", type=positive, default=1, help="data-parallel size (default 1)")
    e.add_argument("--dtype", help="the engine's --dtype (default: vLLM's choice for the config)")
    e.add_argument("--allow-unwritten", action="store_true", help="leave out parameters the checkpoint never writes")
    e.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    e.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    e.set_defaults(func=cmd_expect)

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
    v.add_argument(
        "--expected", metavar="FILE", help="no reset: checksum before and after the transfer, compare with `expect`'s"
    )
    v.add_argument("--json", action="store_true", help="machine-readable report")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds per request to each server (default 600)")
    v.add_argument("--concurrency", type=positive, default=32, help="servers asked at once (default 32)")
    v.add_argument("--api-key", metavar="KEY", help="the servers' API key (default: $VLLM_API_KEY)")
    v.set_defaults(func=cmd_verify)

    r = sub.add_parser("replicas", help="check that the replicas of a model hold the same weights (no pause, no reset)")
    r.add_argument("--url", action="append", required=True, help="API server (repeat for several)")
    r.add_argument("--json", action="store_true", help="machine-readable report")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request to each server (default 600)")
    r.add_argument("--concurrency", type=positive, default=32, help="servers asked at once (default 32)")
    r.add_argument("--api-key", metavar="KEY", help="the servers' API key (default: $VLLM_API_KEY)")
    r.set_defaults(func=cmd_replicas)
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
    except Exception as e:  # never a traceback, unless asked for
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        message = " ".join(str(e).split())[:300] or type(e).__name__
        print(f"weight-checker {args.command}: error: {type(e).__name__}: {message}", file=sys.stderr)
        return EXIT_BAD


if __name__ == "__main__":
    sys.exit(main())

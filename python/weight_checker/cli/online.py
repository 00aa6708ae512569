"""The commands against live API servers: ``verify`` (the RL weight-update
check) and ``replicas`` (do the replicas hold the same weights)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from weight_checker.cli.files import UsageError, load_expected, load_manifest
from weight_checker.cli.report import print_rank_map, print_verify_report, verify_verdict, write_report
from weight_checker.engines import DEFAULT_PAUSE
from weight_checker.errors import InputError, VerifyError
from weight_checker.scope import DEFAULT
from weight_checker.verify.engine_digests import Layout
from weight_checker.verify.results import VerifyResult
from weight_checker.verify.targets.http import HttpTarget

EXIT_OK, EXIT_MISMATCH, EXIT_BAD, EXIT_INTERRUPTED = 0, 1, 2, 130
#: Nothing differs, but some weights are held where no digest reaches (never a match).
EXIT_UNVERIFIED = 3


def http_target(
    args: argparse.Namespace, layout: Layout | None = None, include: tuple[str, ...] = DEFAULT
) -> HttpTarget:
    """The HTTP target of ``--url``s, validated before anything is sent."""
    try:
        return HttpTarget(
            args.url,
            api_key=args.api_key,
            timeout=args.timeout,
            concurrency=args.concurrency,
            layout=layout,
            include=include,
            engine=args.engine,
            pause=getattr(args, "pause", DEFAULT_PAUSE),
        )
    except InputError as e:
        raise UsageError(str(e)) from e


def transfer_for(args: argparse.Namespace, target: HttpTarget) -> Callable[[], None]:
    """The transfer step ``--transfer``, ``--transfer-cmd`` or ``--wait`` asks for."""
    if args.transfer == "reload":

        def reload() -> None:  # every server loads its checkpoint again, all at once (its family says how)
            target.each("reload", "transfer")

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
    from weight_checker.verify.workflow import requested_layout, scope_for, verify

    baseline = load_manifest(args.baseline, [False]) if args.baseline is not None else None
    expected = load_expected(args.expected) if args.expected is not None else None
    if args.expected_from is not None:
        expected = expected_from(args.expected_from, args.url, args.api_key)
    target = http_target(args, requested_layout(args.fleet, args.merge), scope_for(args.include, expected))
    interrupted = False
    try:
        transfer = transfer_for(args, target) if baseline is None else None
        result = verify(target, transfer, baseline=baseline, expected=expected, explain=args.explain)
    except VerifyError as e:
        result = e.result or VerifyResult(servers=target.urls, error=str(e))
    except KeyboardInterrupt as e:
        interrupted = True
        result = getattr(e, "weight_checker_result", None) or VerifyResult(servers=target.urls)
        result.error = "interrupted"
    report = result.to_json()
    # The explanation's per-key details (verify/explain/__init__.py), where one was made: causes label the map.
    explanation = getattr(result, "explanation", None)
    details = explanation.details() if explanation is not None else None
    rank_map = result.rank_map(details)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_verify_report(report)
        print_rank_map(rank_map)
    if args.report is not None:
        title = f"weight-checker verify: {' '.join(result.servers)}"
        write_report(args.report, rank_map, verify_verdict(report), details, notes=result.warnings, title=title)
    if interrupted:
        return EXIT_INTERRUPTED
    if result.error is not None:
        print(f"weight-checker verify: {result.error}", file=sys.stderr)
        return EXIT_BAD
    if result.match:
        return EXIT_OK
    return EXIT_UNVERIFIED if result.verdict == "unverified" else EXIT_MISMATCH


def expected_from(checkpoint: str, urls: list[str], api_key: str | None) -> Any:
    """``verify --expected-from CKPT``: the digests computed from ``CKPT`` for
    the engine the servers run (read from the first one's ``/server_info``;
    every other one must run the same engine)."""
    import logging

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's lines are not this command's output
    logging.getLogger("vllm").setLevel(logging.ERROR)
    if api_key:
        os.environ["VLLM_API_KEY"] = api_key
    from weight_checker.errors import ExpectedDigestsError
    from weight_checker.expected.digests import expected_digests
    from weight_checker.expected.server_config import reconcile, server_engine

    try:
        first = server_engine(urls[0])
        for url in urls[1:]:
            other = server_engine(url)
            stated = {"tp": other.tp, "pp": other.pp, "dp": other.dp, **other.arguments}
            reconcile(first, stated)
            if other.model != first.model:
                raise ExpectedDigestsError(f"{url} serves {other.model}, {first.url} {first.model}: give --expected")
        return expected_digests(None, checkpoint, like=urls[0])
    except ExpectedDigestsError as e:
        raise UsageError(f"--expected-from: {e}") from e


def cmd_replicas(args: argparse.Namespace) -> int:
    from weight_checker.verify.replicas import replicas

    target = http_target(args, include=args.include or DEFAULT)
    try:
        result = replicas(target)
    except VerifyError as e:
        raise UsageError(str(e)) from e
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

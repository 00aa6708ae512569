"""The commands that read files only: ``checksum`` (a checkpoint), ``expect``
(the digests each rank must hold) and ``compare`` (two manifests)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from weight_checker.cli.files import UsageError, load_manifest, write_output
from weight_checker.cli.report import (
    Progress,
    compare_report,
    print_mismatches,
    print_rank_map,
    summary_line,
    write_report,
)
from weight_checker.errors import CheckpointError, ExpectedDigestsError
from weight_checker.keys import rank_prefix

EXIT_OK, EXIT_MISMATCH = 0, 1
#: Nothing differs, but some keys name weights no digest covers (unseen:).
EXIT_UNVERIFIED = 3
DEFAULT_PREFIX = rank_prefix(0, 0, 0, 0)


def cmd_checksum(args: argparse.Namespace) -> int:
    from weight_checker.hashing.checkpoint import checksum_checkpoint

    prefix = "" if args.no_prefix else (args.prefix if args.prefix is not None else DEFAULT_PREFIX)
    progress = Progress("checksum", enabled=False if args.no_progress else None)
    try:
        digests = checksum_checkpoint(args.paths, prefix=prefix, progress=progress, io=args.io)
    except CheckpointError as e:
        raise UsageError(str(e)) from e
    finally:
        progress.close()
    write_output(json.dumps({"checksums": digests}, indent=2, sort_keys=True) + "\n", args.output)
    return EXIT_OK


def cmd_expect(args: argparse.Namespace) -> int:
    # vLLM's INFO and WARNING lines are not this command's output (its errors become ours).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from weight_checker.expected.digests import expected_digests

    ranks = (args.tp or 1) * (args.pp or 1)
    show = sys.stderr.isatty() and not args.no_progress
    done = [0]

    def progress(rank: str) -> None:
        done[0] += 1
        if show:
            sys.stderr.write(f"\rexpect: loading and hashing {rank} ({done[0]}/{ranks})   ")
            sys.stderr.flush()

    # The engine's LoRA settings given (vLLM's engine arguments), and the flags that gave them.
    lora_flags = {
        "max_lora_rank": (args.max_lora_rank, "--max-lora-rank"),
        "max_loras": (args.max_loras, "--max-loras"),
        "lora_dtype": (args.lora_dtype, "--lora-dtype"),
        "lora_target_modules": (args.lora_target_modules, "--lora-target-modules"),
        "fully_sharded_loras": (args.fully_sharded_loras or None, "--fully-sharded-loras"),
    }
    lora_settings = {k: v for k, (v, _) in lora_flags.items() if v}
    names = [name for name, _ in args.lora]
    if len(set(names)) != len(names):
        raise UsageError(f"--lora: adapter {next(n for n in names if names.count(n) > 1)!r} given twice")
    if lora_settings and not (args.enable_lora or args.lora or args.server):
        flags = " / ".join(flag for k, (_, flag) in lora_flags.items() if k in lora_settings)
        raise UsageError(f"{flags}: LoRA settings of the engine, they need --enable-lora (or --lora)")
    if args.api_key and not args.server:
        raise UsageError("--api-key is the --server's")
    if args.api_key:
        os.environ["VLLM_API_KEY"] = args.api_key  # read by the server's /server_info request
    model = args.checkpoint if args.server is None else None
    weights = args.checkpoint if args.server is not None else None
    try:
        expected = expected_digests(
            model,
            weights,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            dtype=args.dtype,
            allow_unwritten=args.allow_unwritten,
            progress=progress,
            enable_lora=args.enable_lora,
            loras=dict(args.lora),
            draft=args.draft,
            num_speculative_tokens=args.num_speculative_tokens,
            weight_version=args.weight_version,
            like=args.server,
            buffers=args.buffers,
            engine=args.engine,
            **lora_settings,
            **({"enable_expert_parallel": True} if args.enable_expert_parallel else {}),
            **({"hf_overrides": args.hf_overrides} if args.hf_overrides is not None else {}),
        )
    except ExpectedDigestsError as e:
        raise UsageError(str(e)) from e
    finally:
        if show and done[0]:
            sys.stderr.write("\n")
    write_output(json.dumps(expected.manifest(), indent=2, sort_keys=True) + "\n", args.output)
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    used = [False]
    baseline = load_manifest(args.baseline, used)
    current = load_manifest(args.current, used)
    result = compare_report(baseline, current)
    rank_map = None
    if not result["match"]:  # which ranks and layers (nothing on a match)
        from weight_checker.verify.rank_map import rank_layer_map

        labels = {k: c for c, keys in result["classes"].items() for k in keys}
        rank_map = rank_layer_map(labels, baseline.keys() | current.keys())
        result |= {"map": rank_map.to_json(), "patterns": rank_map.patterns}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(summary_line(result, len(baseline), len(current)))
        print_mismatches(result)
        print_rank_map(rank_map)
    if args.report is not None:
        title = f"weight-checker compare {args.baseline} {args.current}"
        write_report(args.report, rank_map, summary_line(result, len(baseline), len(current)), title=title)
    if result["match"]:
        return EXIT_OK
    return EXIT_UNVERIFIED if result.get("verdict") == "unverified" else EXIT_MISMATCH

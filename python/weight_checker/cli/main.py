"""``weight-checker``: checksum checkpoints, compare manifests, verify a live
RL weight update.

    weight-checker checksum PATH... [--prefix P | --no-prefix] [-o FILE]
    weight-checker compare BASELINE CURRENT [--json] [--report FILE]
    weight-checker expect CKPT [--tp T] [--pp P] [--dp D] [--dtype DTYPE] [-o FILE]
    weight-checker expect [CKPT] --server URL [-o FILE]
    weight-checker verify --url URL [--url URL ...] [--api-key KEY] [--fleet | --merge]
                          (--transfer reload | --transfer-cmd CMD | --wait) [--expected FILE]
    weight-checker verify --url URL [--url URL ...] --baseline FILE
    weight-checker replicas --url URL [--url URL ...] [--api-key KEY]

Exit codes: 0 match / success, 1 mismatch, 2 bad input or a failed step,
130 interrupted. Never a traceback (``WEIGHT_CHECKER_DEBUG=1`` shows one,
with every chained cause).
"""

from __future__ import annotations

import argparse
import sys

from weight_checker import settings
from weight_checker.cli.files import UsageError
from weight_checker.cli.offline import DEFAULT_PREFIX, cmd_checksum, cmd_compare, cmd_expect
from weight_checker.cli.online import EXIT_BAD, EXIT_INTERRUPTED, cmd_replicas, cmd_verify
from weight_checker.engines import DEFAULT_PAUSE, FAMILIES, PAUSE_MODES
from weight_checker.errors import SettingsError

DEBUG_ENV = "WEIGHT_CHECKER_DEBUG"


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from e
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def scope(text: str) -> tuple[str, ...]:
    from weight_checker.errors import InputError
    from weight_checker.scope import parse_include

    try:
        return parse_include(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def named_dir(text: str) -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, path


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", required=True, help="API server (repeat for several)")
    p.add_argument(
        "--include",
        type=scope,
        metavar="SCOPE",
        help="what a checksum covers: target,draft,lora (default: the expected digests' scopes, else target)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request to each server (default 600)")
    p.add_argument("--concurrency", type=positive, default=32, help="servers asked at once (default 32)")
    p.add_argument("--api-key", metavar="KEY", help="the servers' API key (default: $VLLM_API_KEY)")
    p.add_argument("--engine", choices=FAMILIES, help="the servers' inference engine (default: read from each server)")


def build_parser() -> argparse.ArgumentParser:
    from weight_checker import __version__

    description = (__doc__ or "").split("\n\n")[0].replace("``", "")
    p = argparse.ArgumentParser(prog="weight-checker", description=description)
    p.add_argument("--version", action="version", version=f"weight-checker {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("checksum", help="per-tensor SHA-256 of safetensors checkpoints")
    c.add_argument("paths", nargs="+", metavar="PATH", help=".safetensors file(s), a directory, or an index.json")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--prefix", help=f"key prefix (default {DEFAULT_PREFIX!r})")
    g.add_argument("--no-prefix", action="store_true", help="bare tensor names as keys")
    c.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c.add_argument(
        "--io", choices=("auto", "map", "read"), default="auto", help="how files are read: auto (default) maps "
        "files in the page cache and reads the others with large sequential reads; map or read forces one"
    )  # fmt: skip
    c.set_defaults(func=cmd_checksum)

    e = sub.add_parser(
        "expect", help="the digests every rank must hold after loading a checkpoint (vLLM's or SGLang's own loader, "
        "on the CPU)"
    )  # fmt: skip
    e.add_argument(
        "checkpoint", metavar="CKPT", nargs="?", help="model directory: config.json and *.safetensors "
        "(with --server: the weights; default: the server's model)"
    )  # fmt: skip
    e.add_argument(
        "--server", metavar="URL", help="the engine of this running vLLM (dev-mode) or SGLang server: its "
        "model, dtype, layout, config overrides, LoRA settings and draft read from its /server_info (a flag that "
        "contradicts it is an error)"
    )  # fmt: skip
    e.add_argument(
        "--engine", choices=FAMILIES, help="the engine whose model classes make the tensors (default: vllm, or the "
        "--server's)"
    )  # fmt: skip
    e.add_argument("--api-key", metavar="KEY", help="the server's API key, with --server (default: $VLLM_API_KEY)")
    e.add_argument("--tp", type=positive, help="tensor-parallel size (default 1)")
    e.add_argument("--pp", type=positive, help="pipeline-parallel size (default 1)")
    e.add_argument("--dp", type=positive, help="data-parallel size (default 1)")
    e.add_argument("--enable-expert-parallel", action="store_true", help="the engine's --enable-expert-parallel")
    e.add_argument(
        "--dtype", help="the engine's --dtype (default: the --server's, else the engine's choice for the config)"
    )
    e.add_argument(
        "--hf-overrides", type=json_object, metavar="JSON", help="the engine's --hf-overrides (a JSON object: "
        "the model's config fields it overrides)"
    )  # fmt: skip
    e.add_argument("--allow-unwritten", action="store_true", help="leave out parameters the checkpoint never writes")
    e.add_argument("--enable-lora", action="store_true", help="the engine runs with --enable-lora (.base_layer. names)")
    e.add_argument("--max-lora-rank", type=positive, help="the engine's --max-lora-rank (default: vLLM's)")
    e.add_argument("--max-loras", type=positive, help="the engine's --max-loras (default: vLLM's)")
    e.add_argument(
        "--lora-dtype", choices=("auto", "float16", "bfloat16"), help="the engine's --lora-dtype (default auto: the "
        "model's dtype)"
    )  # fmt: skip
    e.add_argument(
        "--lora-target-modules", nargs="+", action="extend", metavar="MODULE", help="the engine's "
        "--lora-target-modules: only these layers carry LoRA (default: every supported one)"
    )  # fmt: skip
    e.add_argument("--fully-sharded-loras", action="store_true", help="the engine's --fully-sharded-loras")
    e.add_argument(
        "--lora",
        action="append",
        type=named_dir,
        metavar="NAME=DIR",
        default=[],
        help="a PEFT adapter the engine holds under NAME (repeat; implies --enable-lora)",
    )
    e.add_argument("--draft", metavar="DIR", help="the draft model of draft-model speculative decoding")
    e.add_argument("--num-speculative-tokens", type=positive, help="the engine's (default 2)")
    e.add_argument("--weight-version", metavar="V", help="the weight version the engine must claim with these weights")
    e.add_argument("--buffers", action="store_true", help="the target's persistent buffers too (keys ...:buffer:NAME)")
    e.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    e.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    e.set_defaults(func=cmd_expect)

    m = sub.add_parser("compare", help="compare two manifests ({checksums} or {key: hex})")
    m.add_argument("baseline", metavar="BASELINE", help="file or -")
    m.add_argument("current", metavar="CURRENT", help="file or -")
    m.add_argument("--json", action="store_true", help='{"match", "mismatches", "classes"} (and "map", "patterns")')
    m.add_argument("--report", metavar="FILE", help="write an HTML page: the verdict, the rank x layer map, every key")
    m.set_defaults(func=cmd_compare)

    v = sub.add_parser("verify", help="run the RL weight-update check against vLLM or SGLang API servers")
    _server_options(v)
    t = v.add_mutually_exclusive_group()
    t.add_argument(
        "--transfer", choices=["reload"], help="reload: every server loads its checkpoint again (vLLM: /collective_rpc "
        "reload_weights; SGLang: /update_weights_from_disk)",
    )  # fmt: skip
    t.add_argument("--transfer-cmd", metavar="CMD", help="shell command that transfers the weights")
    t.add_argument("--wait", action="store_true", help="wait for Enter while the trainer transfers")
    t.add_argument("--baseline", metavar="FILE", help="no pause, reset or transfer: compare the current digests")
    x = v.add_mutually_exclusive_group()
    x.add_argument(
        "--expected", metavar="FILE", help="no reset: checksum before and after the transfer, compare with `expect`'s"
    )
    x.add_argument(
        "--expected-from", metavar="CKPT", help="as --expected, the digests computed from CKPT for the engine each "
        "server runs (read from its /server_info, as `expect CKPT --server URL`)"
    )  # fmt: skip
    v.add_argument(
        "--report", metavar="FILE", help="write an HTML page: the verdict, the rank x layer map, every key that differs"
    )
    v.add_argument(
        "--explain", metavar="N", type=_keys_to_explain, default=64,
        help="on a mismatch against expected digests, explain the first N keys: where in each tensor and the likely "
        "cause (default 64; 0: none)",
    )  # fmt: skip
    v.add_argument(
        "--pause", choices=PAUSE_MODES, default=DEFAULT_PAUSE,
        help="how generation is paused for the check: abort the requests in flight (default), wait for them, or keep "
        "them to go on after (SGLang: abort or keep)",
    )  # fmt: skip
    f = v.add_mutually_exclusive_group()
    f.add_argument("--fleet", action="store_true", help="the servers are replicas: each compared on its own")
    f.add_argument("--merge", action="store_true", help="the servers serve disjoint ranks of one model (external LB)")
    v.set_defaults(func=cmd_verify)

    r = sub.add_parser("replicas", help="check that the replicas of a model hold the same weights (no pause, no reset)")
    _server_options(r)
    r.set_defaults(func=cmd_replicas)
    return p


def _keys_to_explain(raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of keys >= 0, got {raw!r}")
    return n


def _debug() -> bool:
    try:
        return settings.enabled(DEBUG_ENV, default=False)
    except SettingsError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "verify":
        if not (args.transfer or args.transfer_cmd or args.wait or args.baseline):
            parser.error("verify needs one of --transfer reload, --transfer-cmd CMD, --wait, --baseline FILE")
        if args.baseline is not None and (args.expected is not None or args.expected_from is not None):
            parser.error("--baseline and --expected exclude each other")
    if args.command == "expect" and args.checkpoint is None and args.server is None:
        parser.error("expect needs CKPT, or --server URL")
    try:
        settings.check()
        return args.func(args)
    except (UsageError, SettingsError) as e:
        if _debug():
            raise
        print(f"weight-checker {args.command}: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD
    except KeyboardInterrupt:
        print(f"weight-checker {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # never a traceback, unless asked for
        if _debug():
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"weight-checker {args.command}: error: {type(e).__name__}: {message}", file=sys.stderr)
        return EXIT_BAD


if __name__ == "__main__":
    sys.exit(main())

"""expected_tensors (the expected side of a failed check's explanation) for
one key of a ~1 GB model, against hashing that key's tensor once.

    .venv/bin/python benches/bench_explain_expected.py [--tp 1] [--repeat 7] [--form dict|checkpoint] [--float32]
        [--explain [--hosts one|two]]

The checkpoint (Llama-shaped: hidden 2048, intermediate 5632, 8 layers, 16
heads, 4 KV heads, vocab 32000: 0.49 B parameters, 0.98 GB bf16, one shard)
is written once under .bench/. In one process: ``expected_digests`` of the
trainer's tensors (``--form dict``, the default) or of the checkpoint, as a
trainer's step makes it; then, for each key, ``--repeat`` runs (in turn,
best and median) of

- ``hash``: the key's tensor (the one ``expected_tensors`` returns, in
  memory) hashed once: ``digest_tensors``, as every digest is made;
- ``expected_tensors(expected, [key])``: the tensor recomputed (the rank model
  of the call reused, only the weights that feed the key loaded, the tensor
  hashed against its digest, and copied out), with ``copy=False`` (a view of
  the weights where the tensor is one piece of one), and with each candidate
  cause (each call also recomputes and checks the untransformed tensor);
- every key of dp0 at once (the whole model mismatched), against hashing all
  of them once;
- with ``--explain``, the whole explanation through the recompute, against
  the expected tensors given. ``--hosts one`` (the default): the engine's
  block digests computed on a thread of this process, on the same cores;
  ``--hosts two`` (a deployment: the engine hashes on its own host): the
  engine in another process pinned to core 1, this side and the reference
  pinned to core 0, one hashing thread each.

The ratio is each time over ``hash``. The cost of keeping what a recompute
needs is measured too: ``remember`` (weak references to the weights) against
the ``expected_digests`` call that makes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ceiling import machine

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}


def make_checkpoint(path: Path) -> Path:
    """The checkpoint of :data:`SHAPE`, written once (bench_expected.py's writer)."""
    from bench_expected import make_checkpoint as write

    return write(path, SHAPE)


def measure(runs: dict[str, Any], repeat: int) -> dict[str, tuple[float, float]]:
    """``{label: (best, median)}`` seconds, the runs taken in turn ``repeat``
    times (so that a neighbour's burst on this shared machine falls on all of them)."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, fn in runs.items():
            started = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - started)
    return {label: (min(t), statistics.median(t)) for label, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--form", choices=["dict", "checkpoint"], default="dict")
    parser.add_argument("--float32", action="store_true", help="the trainer's tensors in float32 (cast by the loader)")
    parser.add_argument(
        "--explain", action="store_true", help="also the whole explanation through the recompute (verify's path)"
    )
    parser.add_argument("--hosts", choices=("one", "two"), default="one", help="where the engine hashes (--explain)")
    args = parser.parse_args()
    if args.hosts == "two":
        if not {0, 1} <= os.sched_getaffinity(0):
            raise SystemExit("--hosts two pins the engine to core 1 and this side to core 0: this process may not")
        from bench_explain import pin

        pin(0)  # before the core's pool starts

    import torch
    import weight_checker
    from safetensors.torch import load_file
    from weight_checker.expected.recompute import TRANSFORMS, expected_tensors, remember
    from weight_checker.hashing.digests import digest_tensors

    ckpt = make_checkpoint(ROOT / ".bench" / "explain-1g")
    print(machine())
    print(f"checkpoint: {(ckpt / 'model.safetensors').stat().st_size / 1e9:.2f} GB, tp={args.tp}, form={args.form}"
          f"{', float32 weights' if args.float32 else ''}")  # fmt: skip
    weights = load_file(str(ckpt / "model.safetensors")) if args.form == "dict" else None
    if weights is not None and args.float32:
        weights = {k: v.float() for k, v in weights.items()}
    weight_checker.expected_digests(ckpt, weights, tp=args.tp)  # vLLM's model code imported, the rank models built
    started = time.perf_counter()
    expected = weight_checker.expected_digests(ckpt, weights, tp=args.tp)
    step = time.perf_counter() - started
    if weights is not None:
        kept = measure({"remember": lambda: remember(ckpt, weights, ckpt, None, tp=1)}, args.repeat)["remember"][0]
        print(f"expected_digests (a step): {step:.3f} s; keeping weak references to its {len(weights)} weights: "
              f"{kept * 1e3:.2f} ms ({kept / step:.2%})")  # fmt: skip
    last = args.tp - 1
    keys = [
        "dp0:pp0:pcp0:tp0:model.embed_tokens.weight",
        f"dp0:pp0:pcp0:tp{last}:model.layers.3.mlp.gate_up_proj.weight",
        f"dp0:pp0:pcp0:tp{last}:model.layers.3.mlp.down_proj.weight",
        f"dp0:pp0:pcp0:tp{last}:model.layers.3.self_attn.qkv_proj.weight",
    ]
    print("seconds as best / median of the runs; ratios over hashing the tensor once (best, median)")
    for key in keys:
        tensor = expected_tensors(expected, [key])[key][None]
        runs: dict[str, Any] = {"hash": lambda tensor=tensor, key=key: digest_tensors([key], [tensor])}
        runs["alone"] = lambda key=key: expected_tensors(expected, [key])
        runs["alone, copy=False"] = lambda key=key: expected_tensors(expected, [key], copy=False)
        for transform in TRANSFORMS:
            runs[transform] = lambda key=key, t=transform: expected_tensors(expected, [key], [t])
        runs["all four in one call"] = lambda key=key: expected_tensors(expected, [key], TRANSFORMS)
        got = measure(runs, args.repeat)
        hb, hm = got.pop("hash")
        print(f"{key} ({tensor.nbytes / 1e6:.1f} MB): hash {hb:.3f} / {hm:.3f} s")
        for label, (b, m) in got.items():
            print(f"    {label:<26} {b:.3f} / {m:.3f} s   {b / hb:5.2f}x / {m / hm:5.2f}x")
    # Every key of the model at once (everything mismatched), against hashing every tensor once.
    every = [k for k in expected if k.startswith("dp0:")]
    tensors = expected_tensors(expected, every)
    flat = [tensors[k][None] for k in every]
    got = measure(
        {
            "hash": lambda: digest_tensors(every, flat),
            "expected_tensors": lambda: expected_tensors(expected, every),
            "copy=False": lambda: expected_tensors(expected, every, copy=False),
        },
        args.repeat,
    )
    hb, hm = got.pop("hash")
    print(f"every key of dp0 ({len(every)}, {sum(t.nbytes for t in flat) / 1e9:.2f} GB): hash {hb:.3f} / {hm:.3f} s")
    for label, (b, m) in got.items():
        print(f"    {label:<26} {b:.3f} / {m:.3f} s   {b / hb:5.2f}x / {m / hm:5.2f}x")
    if args.explain:
        if args.hosts == "two":
            torch.set_num_threads(1)
        explain_through_recompute(expected, every, tensors, args.repeat, args.hosts)
    del torch
    sys.stdout.flush()


def engine_process(conn: Any, core: int) -> None:
    """The engine on its own core: loads a scenario's tensors from a file, answers block-digest requests."""
    from bench_explain import pin, serve

    pin(core)
    from safetensors.torch import load_file

    serve(conn, load_file)


def explain_through_recompute(expected: Any, every: list[str], tensors: dict, repeat: int, hosts: str) -> None:
    """The whole explanation (``explain``) of an engine whose tensors each
    have one element changed every 1/64 of them (no cause: every candidate
    tried), the engine's block digests computed on a thread of this process
    (``hosts`` one) or in a process on core 1 (two): the expected tensors
    recomputed from the recipe (``ExpectedSource``, what ``verify`` does)
    against given (``TensorMap``), over hashing the mismatched tensors once."""
    from bench_explain import answer, start_engine
    from safetensors.torch import save_file
    from weight_checker.hashing.digests import digest_tensors
    from weight_checker.verify.explain import ExpectedSource, TensorMap, explain

    given = {k: v[None] for k, v in tensors.items()}
    conn = None
    if hosts == "two":
        conn = start_engine(engine_process)
    where = "an engine process on core 1, this side on core 0" if hosts == "two" else "the engine on a thread here"
    print(f"the whole explanation ({where}), over hashing the mismatched tensors once")
    for label, keys in [("embed_tokens", [every[0]]), (f"every key ({len(every)})", every)]:
        held = dict(given)
        for k in keys:
            t = held[k].clone()
            t.view(-1)[:: max(1, t.numel() // 64)] += 1
            held[k] = t
        current = {k: digest_tensors([k], [v])[0][0] for k, v in held.items()}
        mismatches = dict.fromkeys(keys, "changed")
        if conn is not None:
            path = ROOT / ".bench" / "explain-1g" / "held.safetensors"
            save_file({k: held[k].contiguous() for k in keys}, str(path))
            conn.send(("scenario", str(path)))
            assert conn.recv() == "ok"

            def fetch(ks: list[str], block_bytes: int, chain: Any = None, conn: Any = conn) -> dict:
                conn.send(("fetch", ks, block_bytes, chain))
                return conn.recv()
        else:

            def fetch(ks: list[str], block_bytes: int, chain: Any = None, held: dict = held) -> dict:
                return answer(held, ks, block_bytes, chain)

        def chained(ks: list[str], block_bytes: int, chain: Any = None, fetch: Any = fetch) -> dict:
            return fetch(ks, block_bytes, chain)

        chained.chains = True  # type: ignore[attr-defined]

        got = measure(
            {
                "hash": lambda keys=keys, held=held: digest_tensors(keys, [held[k] for k in keys]),
                "given (TensorMap)": lambda m=mismatches, c=current, f=fetch: explain(
                    m, c, expected, f, TensorMap(given)
                ),
                "recomputed (verify)": lambda m=mismatches, c=current, f=fetch: explain(
                    m, c, expected, f, ExpectedSource(expected)
                ),
                "chain states (verify)": lambda m=mismatches, c=current, f=chained: explain(
                    m, c, expected, f, ExpectedSource(expected)
                ),
            },
            repeat,
        )
        hb, hm = got.pop("hash")
        print(f"{label}: hash {hb:.3f} / {hm:.3f} s")
        for name, (b, m) in got.items():
            print(f"    {name:<26} {b:.3f} / {m:.3f} s   {b / hb:5.2f}x / {m / hm:5.2f}x")
    if conn is not None:
        conn.send(("stop",))
        (ROOT / ".bench" / "explain-1g" / "held.safetensors").unlink(missing_ok=True)


if __name__ == "__main__":
    main()

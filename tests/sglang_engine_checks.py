"""Checks of an in-process ``sglang.Engine``, in SGLang's own environment:
run by tests/test_sglang.py as ``python tests/sglang_engine_checks.py CKPT0 CKPT1``.

One engine (TP=1) on ``CKPT0``: ``weight_checker.verify(engine, ...)`` with a
reload from disk (paused in place), with seed 1 loaded against expected
digests computed through SGLang's model classes, and with seed 1's
embedding rows 96-223 zeroed (sent from tensor, in SGLang's update session)
and explained through the engine's own fan-out; and expected digests
refusing a trainer tensor shorter than the checkpoint's (SGLang's CPU loader
would zero-pad it). Prints one JSON object:
scenario -> the check's ``to_json()``, plus the engine's digests and the
expected digests of ``CKPT0``."""

from __future__ import annotations

import json
import sys

import sglang
import weight_checker
from safetensors.torch import load_file
from weight_checker.verify.targets import target_for


def main() -> None:
    ckpt0, ckpt1 = sys.argv[1], sys.argv[2]
    engine = sglang.Engine(
        model_path=ckpt0, device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
        max_total_tokens=4096, context_length=512, log_level="error",
    )  # fmt: skip
    out: dict = {}
    try:
        out["digests"] = target_for(engine).checksums("checksum").merged()
        out["expected0"] = dict(weight_checker.expected_digests(ckpt0, engine="sglang"))
        reload = weight_checker.verify(engine, lambda: engine.update_weights_from_disk(ckpt0), pause="keep")
        out["reload"] = reload.to_json()
        expected1 = weight_checker.expected_digests(ckpt1, engine="sglang")
        out["seed1"] = weight_checker.verify(
            engine, lambda: engine.update_weights_from_disk(ckpt1), expected=expected1
        ).to_json()
        zeroed = load_file(f"{ckpt1}/model.safetensors")
        zeroed["model.embed_tokens.weight"][96:224] = 0

        def send_zeroed() -> None:
            engine.begin_weight_update()
            try:
                engine.update_weights_from_tensor(list(zeroed.items()))
            finally:
                engine.end_weight_update()

        out["zeros"] = weight_checker.verify(engine, send_zeroed, expected=expected1).to_json()
        short = dict(zeroed)
        short["model.layers.0.self_attn.q_proj.weight"] = short["model.layers.0.self_attn.q_proj.weight"][:32]
        try:
            weight_checker.expected_digests(ckpt1, short, engine="sglang")
            out["short"] = None
        except weight_checker.ExpectedDigestsError as e:
            out["short"] = str(e)
        out["generated"] = engine.generate("ab cd ef", {"max_new_tokens": 4, "temperature": 0})["output_ids"]
    finally:
        engine.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

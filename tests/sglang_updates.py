"""Weight updates sent to a live SGLang server and checked, in SGLang's own
environment (``.venv-sglang``, where the trainer side's SGLang imports):
run by tests/test_sglang.py as ``python tests/sglang_updates.py URL KEY CKPT0 CKPT1``.

Each scenario sends seed 1's weights (``CKPT1``), or a faulty copy of them,
through SGLang's update session (:func:`weight_checker.integrations.sglang_update.verified`),
checks the engine against the expected digests of ``CKPT1`` (computed through
SGLang's model classes, ``like=URL``), and loads seed 0 back from disk. It
prints one JSON object: scenario -> the check's ``to_json()``, plus the
expected digests of both checkpoints, for the test to compare with the
engine's own."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

import torch
from safetensors.torch import load_file
from weight_checker import expected_digests
from weight_checker.httpclient import request
from weight_checker.integrations.sglang_update import verified

#: Faults, each in one HF tensor of seed 1's weights.
STALE = "model.layers.0.mlp.down_proj.weight"  # left out of the update
ZEROED = "model.embed_tokens.weight"  # rows 96-223 zeroed (whole blocks at TP=1 and TP=2)
ZERO_ROWS = (96, 224)
SWAPPED = "model.layers.1.self_attn.o_proj.weight"  # tp1 given tp0's columns


def post(url: str, key: str | None, path: str, body: dict) -> dict:
    status, answer = request("POST", url, path, body, api_key=key)
    assert status == 200 and answer.get("success", True), (path, status, answer)
    return answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    url, key, ckpt0, ckpt1 = sys.argv[1], sys.argv[2] or None, sys.argv[3], sys.argv[4]
    tp = request("GET", url, "/server_info", api_key=key)[1]["tp_size"]
    seed1 = load_file(f"{ckpt1}/model.safetensors")
    if key:
        os.environ["VLLM_API_KEY"] = key  # what like=URL's /server_info request sends
    out: dict = {}
    expected1 = expected_digests(ckpt1, like=url)
    out["expected0"] = dict(expected_digests(ckpt0, like=url))
    out["expected1"] = dict(expected1)

    def check(name: str, send) -> None:
        try:
            result = verified(url, send, expected=expected1, api_key=key, pause="keep")
            out[name] = result.to_json()
        finally:
            post(url, key, "/update_weights_from_disk", {"model_path": ckpt0})

    check("tensor", lambda s: s.from_tensor(seed1.items()))
    check("stale", lambda s: s.from_tensor([(n, t) for n, t in seed1.items() if n != STALE]))
    zeroed = dict(seed1)
    zeroed[ZEROED] = seed1[ZEROED].clone()
    zeroed[ZEROED][ZERO_ROWS[0] : ZERO_ROWS[1]] = 0
    check("zeros", lambda s: s.from_tensor(zeroed.items()))
    if tp == 2:
        full = seed1[SWAPPED]
        half = full.shape[1] // 2
        swapped = dict(seed1, **{SWAPPED: torch.cat([full[:, :half], full[:, :half]], dim=1)})
        check("wrong-shard", lambda s: s.from_tensor(per_rank=[seed1.items(), swapped.items()]))
    check("distributed", lambda s: distributed(url, key, s, seed1, tp))
    print(json.dumps(out), flush=True)
    # torch's file_system sharing started a torch_shm_manager, which would
    # outlive this process (and hold its stdout): every update is loaded now.
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.name().startswith("torch_shm"):  # the kernel cuts a name at 15 characters
            child.kill()


def distributed(url: str, key: str | None, session, weights: dict, tp: int) -> None:
    """The server joins a gloo group with this process (rank 0), then receives every tensor by broadcast."""
    from sglang.srt.utils.common import init_custom_process_group

    port = free_port()
    joined: list = []
    body = {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": tp + 1,
        "group_name": "wc_test", "backend": "gloo",
    }  # fmt: skip
    joining = threading.Thread(target=lambda: joined.append(post(url, key, "/init_weights_update_group", body)))
    joining.start()
    group = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=tp + 1, rank=0, group_name="wc_test"
    )
    joining.join()
    assert joined, "the server did not join the group"
    try:
        names = list(weights)
        session.from_distributed(
            names, [weights[n].dtype for n in names], [weights[n].shape for n in names], group_name="wc_test",
            broadcast=lambda: [torch.distributed.broadcast(weights[n], src=0, group=group) for n in names],
        )  # fmt: skip
    finally:
        post(url, key, "/destroy_weights_update_group", {"group_name": "wc_test"})
        torch.distributed.destroy_process_group(group)


if __name__ == "__main__":
    main()

"""A trainer-like process with a local Ray cluster: two actors each host an
in-process ``vllm.LLM`` (TP=1), verified as one fleet through their handles.
Run by tests/test_ray_fleet.py:

    python tests/ray_fleet.py MODEL_DIR

Prints one ``RESULT {json}`` line with what each case found.
"""

from __future__ import annotations

import json
import sys

import ray
import weight_checker
from weight_checker.integrations.ray import EngineActorMixin


@ray.remote(num_cpus=0)
class Engine(EngineActorMixin):
    def __init__(self, model: str):
        import os

        # The engine core in the actor's own process, as verl and OpenRLHF run theirs (and no process
        # of its own to start).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        self.llm = vllm.LLM(
            model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256
        )


def main(model: str) -> dict:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engines = [Engine.remote(model) for _ in range(2)]
    ray.get([e.vllm_version.remote() for e in engines])  # both engines up

    def reload(which):
        return lambda: ray.get([e.collective_rpc.remote("reload_weights") for e in which])

    out: dict = {}
    good = weight_checker.verify(engines, transfer=reload(engines))
    out["good"] = {"match": good.match, "key_count": good.key_count, "servers": good.servers}
    skipped = weight_checker.verify(engines, transfer=reload(engines[:1]))
    out["skipped"] = skipped.classes()
    ray.get(engines[1].collective_rpc.remote("reload_weights"))
    out["consistent"] = weight_checker.replicas(engines).consistent
    ray.get(engines[0].collective_rpc.remote("weight_checker_reset"))
    after_reset = weight_checker.replicas(engines)
    out["after_reset"] = {"consistent": after_reset.consistent, "inconsistent": after_reset.inconsistent}
    ray.shutdown()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)

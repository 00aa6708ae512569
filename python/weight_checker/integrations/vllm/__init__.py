"""vLLM glue: a stock vLLM serves weight_checker's digests once this package
is installed.

- :mod:`.plugin`: the ``vllm.general_plugins`` entry point (loaded in the API
  server, the engine cores and every worker): patches vLLM's worker class
  and its API-key middleware as they are imported (:mod:`.hooks`).
- :mod:`.worker`: what a worker gains: the Rust core's checksum and reset,
  its thread budget, vLLM's own routine for comparison.
- :mod:`.endpoint`: the ``vllm.endpoint_plugins`` entry point: this
  package's route (:mod:`weight_checker.server`) over every engine behind
  the API server (vLLM 0.31 has no built-in route).
- :mod:`.guard`: vLLM's ``--api-key`` extended to the dev-mode routes.
"""

import logging

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = logging.getLogger("vllm.plugins.weight_checker")

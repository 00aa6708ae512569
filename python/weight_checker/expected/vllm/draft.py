"""The draft model of draft-model speculative decoding, built and loaded as
the engine builds it: vLLM's own draft configuration
(``DraftModelProposer._create_draft_vllm_config``: the speculative config's
draft model and parallel configs) and loader, sharded with the target's
tensor-parallel rank. Its keys are ``draft:{name}``. ``reload_weights``
reloads the target only, so a trainer must push the draft itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError


def speculative_config(draft: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
    """The engine argument of a draft-model engine (``--speculative-config``)."""
    if not (Path(draft) / "config.json").is_file():
        raise ExpectedDigestsError(f"draft {draft}: not a model directory (no config.json)")
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": num_speculative_tokens}


def draft_configs(vllm_config: Any) -> tuple[Any, Any]:
    """``(draft vLLM config, draft model config)`` as the engine derives them."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "draft_model":
        method = getattr(spec, "method", None)
        raise ExpectedDigestsError(f"the engine's speculative method is {method!r}: only 'draft_model' is checked")
    # The proposer's own recipe, without its __init__ (which needs a device and a runner).
    proposer = object.__new__(DraftModelProposer)
    proposer.vllm_config = vllm_config
    proposer.speculative_config = spec
    return proposer._create_draft_vllm_config(), spec.draft_model_config

"""Kept path: the vLLM glue (``weight_checker.vllm``) lives in
:mod:`weight_checker.integrations.vllm`; the entry points in
``pyproject.toml`` name its modules."""

from weight_checker.integrations.vllm.endpoint import WeightCheckerEndpoint
from weight_checker.integrations.vllm.plugin import register
from weight_checker.integrations.vllm.worker import patch_worker_class, thread_share, worker_prefix

__all__ = ["WeightCheckerEndpoint", "patch_worker_class", "register", "thread_share", "worker_prefix"]

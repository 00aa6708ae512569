"""Patching a vLLM module right after it is imported (the worker class in
workers, the auth middleware in the API server), so that processes that
never import it do not pay for it, and a plugin loaded before vLLM's modules
still reaches them."""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from typing import Any

from weight_checker.integrations.vllm import logger

#: module name -> what to do with the module once it is imported.
Patches = dict[str, Callable[[Any], None]]


def patch_on_import(patches: Patches) -> None:
    """Applies each patch now where its module is imported already, else
    when it is."""
    pending: Patches = {}
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending:
        sys.meta_path.insert(0, _PatchAfterImport(pending))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module named in ``patches``.

    To find the module it asks the other finders on ``sys.meta_path``. Another
    finder built the same way (another vLLM plugin's, a test's) asks every
    finder too, this one included: without a guard the two would call each
    other until the import fails with ``RecursionError``, in every vLLM
    process. While this finder is asking, a nested call for the same module
    (from the same thread) answers ``None``: "not mine", so the outer search
    goes on to the next finder."""

    def __init__(self, patches: Patches):
        self.patches = patches
        self._asking = threading.local()

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        asking: set[str] = self._asking.__dict__.setdefault("names", set())
        if fullname in asking:
            return None
        asking.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                    return spec
            return None
        finally:
            asking.discard(fullname)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Any):
        self.inner = inner
        self.patch = patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.patch(module)
        except Exception:  # a plugin must never take vLLM down
            logger.exception("weight_checker: patching %s failed; left as is", module.__name__)

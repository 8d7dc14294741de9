"""statecore's connector inside vLLM 0.33's real engine Scheduler, against vLLM's own
OffloadingConnector on the same seeded workload (run with scripts/vllm-integration.sh)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# "vllm.config", not "vllm": without vLLM, this very folder (tests/vllm, on sys.path through
# pytest's rootdir insertion) would import as an empty namespace package named vllm.
pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

from statecore.bench.scheduler import RunResult, Scenario, run_vllm

SCENARIOS = {
    # GPU cache smaller than the working set: CPU hits, async loads, flushes
    "steady": Scenario(
        concurrency=16, steps=200, num_prefixes=32, gpu_cache_factor=0.8, max_prompt_len=1536
    ),
    # the same with reset_connector_cache() in the middle (reset fence, stale reports)
    "reset": Scenario(
        concurrency=16,
        steps=200,
        num_prefixes=32,
        gpu_cache_factor=0.8,
        max_prompt_len=1536,
        reset_at=100,
    ),
    # two simulated tensor-parallel ranks
    "tp2": Scenario(
        concurrency=12,
        steps=150,
        num_prefixes=24,
        gpu_cache_factor=0.8,
        max_prompt_len=1024,
        num_workers=2,
    ),
}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def pair(request: pytest.FixtureRequest) -> tuple[RunResult, RunResult]:
    sc = SCENARIOS[request.param]
    return run_vllm(sc, "vllm"), run_vllm(sc, "statecore")


def test_every_request_finishes_with_the_same_outputs(pair: tuple[RunResult, RunResult]) -> None:
    upstream, ours = pair
    assert ours.counters["requests"] == upstream.counters["requests"]
    assert len(ours.outputs) == ours.counters["requests"]
    assert ours.outputs == upstream.outputs


def test_loads_hit_the_same_chunks(pair: tuple[RunResult, RunResult]) -> None:
    upstream, ours = pair
    assert upstream.counters.get("load_jobs", 0) > 0, "scenario produced no CPU hits"
    # per request: the hit tokens of every lookup that found something, in order
    assert ours.hits == upstream.hits
    # per request: the number of CPU chunks of every load job, in order
    assert ours.loads == upstream.loads
    for key in ("load_jobs", "store_jobs", "flushed", "lookups_deferred"):
        assert ours.counters.get(key, 0) == upstream.counters.get(key, 0), key


def test_nothing_is_left_behind(pair: tuple[RunResult, RunResult]) -> None:
    upstream, ours = pair
    assert all(v == 0 for v in upstream.leftovers.values()), upstream.leftovers
    assert all(v == 0 for v in ours.leftovers.values()), ours.leftovers
    for key in ("requests", "jobs", "stalled", "fences", "pinned", "write_pending"):
        assert key in ours.leftovers


def test_loaded_through_kv_connector_module_path() -> None:
    code = (
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "ktc = KVTransferConfig(kv_connector='StatecoreOffloadingConnector',"
        " kv_connector_module_path='statecore.adapters.vllm', kv_role='kv_both')\n"
        "print(KVConnectorFactory.get_connector_class(ktc).__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "statecore.adapters.vllm"

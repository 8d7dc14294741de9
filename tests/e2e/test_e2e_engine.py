"""statecore's connector in vLLM's real engine (CPU build) against the same engine without a
connector: the same tokens and logprobs, with statecore loading what the device cache evicted.

Scenarios whose batches are the same with and without the connector (one request at a time)
compare logprobs bit for bit. Where a load instead of a recompute changes which requests run
together in a step (concurrent requests), the tokens must still be identical and the logprobs
agree within ``LOGPROB_TOL`` (the CPU kernels' float32 sums depend on the batch's shape).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from statecore.bench.e2e_harness import BLOCK_SIZE, EngineSpec, RunResult, run_engine

LOGPROB_TOL = 1e-4
"""Largest logprob difference accepted where the batch composition differs."""

CPU_TIER = {"num_cpu_chunks": 256}


def prompts(n: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (after ``prefix``), seeded."""
    rng = random.Random(seed)
    head = list(prefix or [])
    return [head + [rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def compare(
    base: RunResult, ours: RunResult, *, bit_identical: bool, tol: float = LOGPROB_TOL
) -> int:
    """Assert identical tokens and logprobs (bit for bit, or within ``tol``) for every
    request both runs completed; returns the number of requests compared."""
    compared = 0
    worst_seen = 0.0
    for r, (rb, ro) in enumerate(zip(base.outputs, ours.outputs, strict=True)):
        for i, (b, o) in enumerate(zip(rb, ro, strict=True)):
            if b is None or o is None:
                continue
            assert o[0] == b[0], f"round {r} request {i}: tokens differ"
            worst = max(abs(x - y) for x, y in zip(o[1], b[1], strict=True))
            worst_seen = max(worst_seen, worst)
            if bit_identical:
                assert o[1] == b[1], f"round {r} request {i}: logprobs differ"
            else:
                assert worst <= tol, f"round {r} request {i}: logprob off by {worst}"
            compared += 1
    print(f"compared {compared} requests, largest logprob difference {worst_seen:.3g}")
    return compared


def both(spec: EngineSpec, extra: dict[str, Any] | None = None) -> tuple[RunResult, RunResult]:
    """Run ``spec`` without a connector, then with statecore's (``extra`` config)."""
    base = run_engine(EngineSpec(**{**spec.__dict__, "connector": None, "inject": None}))
    ours = run_engine(EngineSpec(**{**spec.__dict__, "connector": extra or dict(CPU_TIER)}))
    return base, ours


@pytest.mark.smoke
def test_full_attention_alternating(llama_dir: Path) -> None:
    """Two 600-token prompts visited alternately, one at a time, on a device cache too small
    for both: every revisit loads the prefix plain vLLM recomputes; bit-identical."""
    a, b = prompts(2, 600, seed=1)
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=[[a], [b], [a], [b], [a]],
        gpu_blocks=24,
        max_model_len=23 * BLOCK_SIZE,
    )
    base, ours = both(spec)
    assert compare(base, ours, bit_identical=True) == 5
    # three revisits, each loading (at least) most of its 18 full blocks
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.loaded_tokens >= 3 * 12 * BLOCK_SIZE, ours.counters
    assert ours.counters["jobs_failed"] == 0


@pytest.mark.smoke
def test_sliding_window_next_to_full_attention(sliding_dir: Path) -> None:
    """Sliding-window layers next to full-attention ones (two KV-cache groups): revisits load
    both groups' chunks (the window's last chunks only) and stay bit-identical."""
    a, b = prompts(2, 600, seed=2)
    spec = EngineSpec(
        model=str(sliding_dir),
        rounds=[[a], [b], [a], [b]],
        gpu_blocks=44,
        max_model_len=20 * BLOCK_SIZE,
    )
    base, ours = both(spec)
    assert ours.num_groups == 2
    assert compare(base, ours, bit_identical=True) == 4
    assert ours.loaded_tokens > 0, ours.counters
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.counters["jobs_failed"] == 0


def test_blocks_per_chunk_two(llama_dir: Path) -> None:
    """Chunks of two device blocks (``blocks_per_chunk`` 2): the same alternating visits,
    bit-identical, loads in whole chunks."""
    a, b = prompts(2, 600, seed=3)
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=[[a], [b], [a], [b]],
        gpu_blocks=24,
        max_model_len=23 * BLOCK_SIZE,
    )
    base, ours = both(spec, {"num_cpu_chunks": 128, "blocks_per_chunk": 2})
    assert compare(base, ours, bit_identical=True) == 4
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.loaded_tokens >= 2 * 12 * BLOCK_SIZE, ours.counters
    assert ours.loaded_tokens % (2 * BLOCK_SIZE) == 0
    assert ours.counters["jobs_failed"] == 0


def shared_prefix_rounds(
    rounds: int, per_round: int, prefixes: int, seed: int
) -> list[list[list[int]]]:
    """Rounds of concurrent requests: each a 256-token prefix out of ``prefixes`` shared
    ones, then 48 tokens of its own."""
    heads = prompts(prefixes, 256, seed=seed)
    rng = random.Random(seed + 1)
    return [
        [
            prompts(1, 48, seed=rng.randrange(1 << 30), prefix=heads[i % prefixes])[0]
            for i in range(per_round)
        ]
        for _ in range(rounds)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_concurrency_preemption_chunked_prefill(llama_dir: Path, async_scheduling: bool) -> None:
    """Twelve concurrent requests per round over eight shared 256-token prefixes, a device
    cache far too small for the batch (preemption), a 128-token step budget (chunked
    prefill), with and without vLLM's asynchronous scheduling (the next step scheduled while
    the current one runs): identical tokens, logprobs within the tolerance (loads change
    which requests run together in a step)."""
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=shared_prefix_rounds(3, 12, 8, seed=4),
        max_tokens=16,
        gpu_blocks=40,
        max_model_len=39 * BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        async_scheduling=async_scheduling,
    )
    base, ours = both(spec)
    assert compare(base, ours, bit_identical=False) == 36
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.loaded_tokens >= 4 * 8 * BLOCK_SIZE, ours.counters
    assert ours.counters["jobs_failed"] == 0
    assert ours.final == {"live_jobs": 0, "tracked_requests": 0, "stalled_ledger": 0}


def test_aborts_while_loads_and_stores_are_in_flight(llama_dir: Path) -> None:
    """The odd-numbered requests of each round are aborted two engine steps in, while their
    loads and stores run: the others finish identical, nothing fails, nothing leaks."""
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=shared_prefix_rounds(3, 8, 8, seed=5),
        max_tokens=16,
        gpu_blocks=40,
        max_model_len=39 * BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        abort=[2, 2, 2],
    )
    base, ours = both(spec)
    assert compare(base, ours, bit_identical=False) == 12
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.loaded_tokens > 0, ours.counters
    assert ours.counters["jobs_failed"] == 0
    assert ours.final == {"live_jobs": 0, "tracked_requests": 0, "stalled_ledger": 0}


def test_reset_prefix_cache_mid_run(llama_dir: Path) -> None:
    """``reset_prefix_cache`` (vLLM's and the connector's, running requests preempted) in the
    middle of a round, with the connector's stores in flight: the requests recompute, the
    output is identical, and what is stored after the reset loads again. vLLM itself refuses
    a reset while a request waits for its load (``RuntimeError`` after preempting
    everything), so the reset lands on the first step from step 1 without one."""
    a, b = prompts(2, 600, seed=6)
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=[[a], [b], [a], [b], [a]],
        gpu_blocks=24,
        max_model_len=23 * BLOCK_SIZE,
        reset_at=[[2, 1]],
    )
    base, ours = both(spec)
    assert compare(base, ours, bit_identical=False) == 5
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.counters["resets"] >= 1
    # round 4 loads a, stored again after the reset
    assert ours.loaded_by_round[4] > ours.loaded_by_round[3], ours.loaded_by_round


def test_injected_load_failure_recomputes(llama_dir: Path) -> None:
    """The worker's first load job fails (the transfer backend raises): vLLM gets its blocks
    back as load errors and recomputes them; the output is bit-identical and later loads
    succeed."""
    a, b = prompts(2, 600, seed=7)
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=[[a], [b], [a], [b], [a]],
        gpu_blocks=24,
        max_model_len=23 * BLOCK_SIZE,
        inject="load_failure",
        kv_load_failure_policy="recompute",
    )
    base, ours = both(spec)
    assert ours.injected == 1
    assert compare(base, ours, bit_identical=True) == 5
    print(f"loaded {ours.loaded_tokens} tokens, by round {ours.loaded_by_round}")
    assert ours.counters["jobs_failed"] == 1, ours.counters
    assert ours.loaded_by_round[2] == 0  # the failed one
    assert ours.loaded_tokens > 0


def test_kv_events_and_metrics_in_the_engine(llama_dir: Path) -> None:
    """vLLM's KV-cache events on (``kv_events_config``): the connector hands vLLM's
    publisher a ``BlockStored`` event per offloaded chunk batch, and ``BlockRemoved`` ones
    when the CPU tier (40 chunks here, two prompts' worth) evicts for a third prompt; the
    output is bit-identical. vLLM's stats on (``disable_log_stats=False``): its Prometheus
    logger records statecore's metrics in the process's registry, and what they count
    (bytes and jobs loaded and stored, hit tokens) is what the scheduler counted."""
    a, b, c = prompts(3, 600, seed=9)
    spec = EngineSpec(
        model=str(llama_dir),
        rounds=[[a], [b], [a], [c]],
        gpu_blocks=24,
        max_model_len=23 * BLOCK_SIZE,
        kv_events=True,
        log_stats=True,
    )
    base, ours = both(spec, {"num_cpu_chunks": 40})
    assert compare(base, ours, bit_identical=True) == 4
    kinds = set(ours.events)
    print(f"loaded {ours.loaded_tokens} tokens; events {sorted(kinds)} ({len(ours.events)})")
    assert "BlockStored" in kinds and "BlockRemoved" in kinds, ours.events
    assert ours.loaded_tokens > 0, ours.counters
    metrics, counted = ours.metrics, ours.counters
    print(f"metrics {metrics}")
    for name, counter in (
        ("vllm:kv_offload_load_bytes_total", "load_bytes"),
        ("vllm:kv_offload_store_bytes_total", "store_bytes"),
        ("statecore:kv_offload_lookup_hit_tokens_total", "lookup_hit_tokens"),
        ("statecore:kv_offload_load_jobs_created_total", "load_jobs_created"),
        ("statecore:kv_offload_store_jobs_created_total", "store_jobs_created"),
        ("statecore:kv_offload_jobs_completed_total", "jobs_completed"),
    ):
        assert metrics.get(name, 0) == counted[counter], (name, metrics, counted)
    assert metrics["vllm:kv_offload_load_bytes_total"] > 0

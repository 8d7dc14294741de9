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
from e2e_harness import BLOCK_SIZE, EngineSpec, RunResult, run_engine

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
    for r, (rb, ro) in enumerate(zip(base.outputs, ours.outputs, strict=True)):
        for i, (b, o) in enumerate(zip(rb, ro, strict=True)):
            if b is None or o is None:
                continue
            assert o[0] == b[0], f"round {r} request {i}: tokens differ"
            if bit_identical:
                assert o[1] == b[1], f"round {r} request {i}: logprobs differ"
            else:
                worst = max(abs(x - y) for x, y in zip(o[1], b[1], strict=True))
                assert worst <= tol, f"round {r} request {i}: logprob off by {worst}"
            compared += 1
    return compared


def both(spec: EngineSpec, extra: dict[str, Any] | None = None) -> tuple[RunResult, RunResult]:
    """Run ``spec`` without a connector, then with statecore's (``extra`` config)."""
    base = run_engine(EngineSpec(**{**spec.__dict__, "connector": None}))
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

"""statecore's engine models against vLLM 0.33's real ``Scheduler``: the same seeded workload
(shared prefixes, a device cache small enough to preempt, aborts; failing loads, slow loads
and the operator's resets as variants) through both, each over
statecore's scheduler, must make the same connector calls step by step (hook, request ids,
block ids, token counts), for a full-attention and a hybrid (sliding window + full)
configuration. Both engine models are compared: the simulator's (which the fuzzer drives too)
and the model checker's (run as the checker runs it, but along one seeded trace: every copy
delivered when due; vLLM then runs without its GPU prefix cache, which the checker's engine
does not model). So is the scheduler benchmark's own engine loop (``statecore bench scheduler
--engine standalone``): vLLM replays the requests it generated, when it generated them, with
the tokens it sampled, and must make the same calls.

Run with ``scripts/vllm-integration.sh`` (vLLM 0.33 on CPU torch); the traces are built by
:mod:`engine_trace` beside this file.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

import dataclasses

from engine_trace import (
    Arrival,
    Shape,
    Trace,
    bench_shape,
    first_divergence,
    run_bench_model,
    run_checker_model,
    run_engine_model,
    run_vllm_engine,
    summary,
    workload,
)

from statecore.bench.scheduler import Scenario

SHAPES = {
    "full": Shape(groups="full", num_gpu_blocks=24),
    "hybrid": Shape(groups="hybrid", num_gpu_blocks=40),
}
REQUESTS = {"full": (24, 40), "hybrid": (24, 40)}
"""Per configuration: requests, and the steps they arrive over."""
SEEDS = (1, 2, 3)
FAILURES: dict[str, dict[str, object]] = {
    "no-failures": {},
    "every-2nd-load-fails": {"load_fail_every": 2},
    "resets-slow-loads-failures": {
        "load_fail_every": 2,
        "load_delay": 2,
        "reset_steps": tuple(range(3, 200, 4)),
    },
}
"""The environment beside the workload: nothing; the worker fails every second load job it
runs (vLLM's side with ``kv_load_failure_policy="recompute"``, the engine models' policy: the
request recomputes what the load lost, after the engine learns of it a step later than the
connector); or, beside those failures, loads that take two steps and an operator's
``reset_prefix_cache(reset_connector=True)`` every fourth step (stores flushed and
discarded, loads the workers run carried over the reset)."""
OUTPUT_LEN = (16, 64)
"""Long enough outputs that decoding outgrows the device cache: preemption."""


def load(groups: str, seed: int) -> list[Arrival]:
    n, steps = REQUESTS[groups]
    return workload(seed, n=n, steps=steps, output_len=OUTPUT_LEN)


def shape(shapes: dict[str, Shape], groups: str, failures: str) -> Shape:
    return dataclasses.replace(shapes[groups], **FAILURES[failures])  # type: ignore[arg-type]


@functools.cache
def vllm_trace(groups: str, seed: int, failures: str = "no-failures") -> Trace:
    return run_vllm_engine(shape(SHAPES, groups, failures), load(groups, seed))


CHECKER_SHAPES = {
    groups: dataclasses.replace(
        shape,
        max_running=64,  # the checker's engine has no cap on running requests
        prefix_caching=False,
        counted_tokens=True,
        stall_timeout_s=10.0,  # the checker's scheduler configuration
        stall_check_interval_s=1.0,
    )
    for groups, shape in SHAPES.items()
}
CHECKER_OUTPUT_LEN = 24
"""The checker's engine generates one length for every request."""


def checker_load(groups: str, seed: int) -> list[Arrival]:
    n, steps = REQUESTS[groups]
    out = CHECKER_OUTPUT_LEN
    return [
        dataclasses.replace(a, req_id=f"r{i}")  # the checker's request ids
        for i, a in enumerate(workload(seed, n=n, steps=steps, output_len=(out, out)))
    ]


@functools.cache
def vllm_trace_without_prefix_cache(groups: str, seed: int, failures: str = "no-failures") -> Trace:
    trace = run_vllm_engine(shape(CHECKER_SHAPES, groups, failures), checker_load(groups, seed))
    trace.merge_outputs()
    return trace


MODELS: dict[str, tuple[dict[str, Shape], Any, Any, Any]] = {
    "simulator": (SHAPES, load, run_engine_model, vllm_trace),
    "checker": (CHECKER_SHAPES, checker_load, run_checker_model, vllm_trace_without_prefix_cache),
}
"""Per engine model compared: its shapes, its workloads, how it runs one, and vLLM's traces of
the same."""
TRACES = {name: (m[3], m[1]) for name, m in MODELS.items()}
"""Per engine model: vLLM's traces and the workloads they ran."""


@pytest.mark.parametrize("failures", sorted(FAILURES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("groups", sorted(SHAPES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_engine_model_makes_vllms_connector_calls(
    model: str, groups: str, seed: int, failures: str
) -> None:
    shapes, workload_of, run_model, vllm = MODELS[model]
    upstream = vllm(groups, seed, failures)
    ours = run_model(shape(shapes, groups, failures), workload_of(groups, seed))
    assert first_divergence(upstream, ours) is None
    assert upstream.calls == ours.calls


@pytest.mark.parametrize("model", sorted(TRACES))
@pytest.mark.parametrize("groups", sorted(SHAPES))
def test_the_workload_preempts_loads_stores_and_aborts(groups: str, model: str) -> None:
    trace, workload_of = TRACES[model]
    counts: dict[str, int] = {}
    for seed in SEEDS:
        for k, v in summary(trace(groups, seed)).items():
            counts[k] = counts.get(k, 0) + v
    assert counts.get("preempted", 0) > 0, counts
    assert counts.get("load_jobs", 0) > 0, counts
    assert counts.get("store_jobs", 0) > 0, counts
    # with failures: loads that ended with invalid blocks, whose requests recompute them
    failed = sum(
        summary(trace(groups, seed, "every-2nd-load-fails")).get("invalid", 0) for seed in SEEDS
    )
    assert failed > 0
    # with resets: stores flushed and discarded, and (the checker's) loads carried over
    resets = [
        c
        for seed in SEEDS
        for calls in trace(groups, seed, "resets-slow-loads-failures").calls.values()
        for c in calls
        if c[0] == "reset"
    ]
    assert resets and sum(len(c[3]) for c in resets) > 0
    if model == "checker":
        assert sum(len(c[5]) for c in resets) > 0
    aborted = sum(1 for seed in SEEDS for a in workload_of(groups, seed) if a.abort_at is not None)
    assert aborted > 0


BENCH_SCENARIOS = {
    # the benchmark's default shape (N=64), shortened
    "default": Scenario(steps=150, warmup_steps=0),
    # small and tight: preemption, loads of evicted prefixes, prefills in flight
    **{
        f"tight-{seed}": Scenario(
            concurrency=16,
            steps=60,
            num_prefixes=4,
            prefix_len=64,
            suffix_len=(16, 96),
            output_len=(16, 96),
            max_prompt_len=512,
            gpu_cache_factor=0.35,
            max_num_batched_tokens=256,
            warmup_steps=0,
            seed=seed,
        )
        for seed in SEEDS
    },
}
"""Scenarios of ``statecore bench scheduler --engine standalone`` compared with vLLM."""


@functools.cache
def bench_traces(name: str) -> tuple[Trace, Trace]:
    """The benchmark loop's trace of a scenario and vLLM's replay of it."""
    sc = BENCH_SCENARIOS[name]
    ours, arrivals, tokens = run_bench_model(sc)
    upstream = run_vllm_engine(bench_shape(sc), arrivals, max_steps=10 * sc.steps, sampled=tokens)
    return upstream, ours


@pytest.mark.parametrize("name", sorted(BENCH_SCENARIOS))
def test_the_benchmarks_engine_loop_makes_vllms_connector_calls(name: str) -> None:
    upstream, ours = bench_traces(name)
    assert first_divergence(upstream, ours) is None
    assert upstream.calls == ours.calls


def test_the_benchmark_scenarios_preempt_load_and_store() -> None:
    counts: dict[str, int] = {}
    for name in BENCH_SCENARIOS:
        for k, v in summary(bench_traces(name)[0]).items():
            counts[k] = counts.get(k, 0) + v
    assert counts.get("preempted", 0) > 0, counts
    assert counts.get("load_jobs", 0) > 0, counts
    assert counts.get("store_jobs", 0) > 0, counts

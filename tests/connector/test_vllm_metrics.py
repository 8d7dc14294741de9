"""statecore's stats as Prometheus metrics, read back from a prometheus_client registry (no
vLLM needed): vLLM's names and labels where both have them, statecore's own counters."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from statecore.adapters.vllm_metrics import COUNTERS, OffloadPrometheus, stats_payload

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed (pip install 'statecore[test]')"
)


def metrics(registry: Any) -> OffloadPrometheus:
    def bind(cls: Any) -> Any:
        return functools.partial(cls, registry=registry)

    pc = prometheus_client
    return OffloadPrometheus(
        bind(pc.Counter),
        bind(pc.Gauge),
        bind(pc.Histogram),
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )


def test_payload_reaches_vllm_names_and_statecore_counters() -> None:
    reg = prometheus_client.CollectorRegistry()
    prom = metrics(reg)
    stats = {
        "kv_offload_load_bytes": 3_000_000,
        "kv_offload_load_time": 0.5,
        "kv_offload_store_bytes": 8_000_000,
        "kv_offload_store_time": 1.5,
        "kv_offload_allocation_failure": 2,
        "lookups": 7,
        "lookup_hit_tokens": 96,
        "jobs_stalled": 1,
        "late_reports": 3,
        "stale_reports": 4,
        "jobs_failed": 5,
        "jobs_discarded": 6,
        "loads_carried": 1,
        "flushes_requested": 9,
        "lookups_deferred": 2,
        "live_jobs": 11,
    }
    prom.observe(stats_payload(stats, [1_000_000, 2_000_000], [8_000_000]), engine_idx=1)
    prom.observe(stats_payload({"kv_offload_load_bytes": 5}, [], []), engine_idx=1)

    def value(name: str, **labels: str) -> float | None:
        got: float | None = reg.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})
        return got

    assert value("vllm:kv_offload_load_bytes_total") == 3_000_005
    assert value("vllm:kv_offload_load_time_total") == 0.5
    assert value("vllm:kv_offload_store_bytes_total") == 8_000_000
    assert value("vllm:kv_offload_store_time_total") == 1.5
    assert value("vllm:kv_offload_allocation_failure_total") == 2
    assert value("vllm:kv_offload_load_size_count") == 2
    assert value("vllm:kv_offload_load_size_sum") == 3_000_000
    le = prometheus_client.utils.floatToGoString(1e6)
    assert value("vllm:kv_offload_load_size_bucket", le=le) == 1  # vLLM's first bucket
    assert value("vllm:kv_offload_store_size_count") == 1
    # vLLM's per-direction series
    assert value("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 3_000_005
    assert value("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 8_000_000
    assert value("vllm:kv_offload_total_time_total", transfer_type="GPU_to_CPU") == 1.5
    assert value("vllm:kv_offload_size_count", transfer_type="CPU_to_GPU") == 2
    # statecore's own
    for key in ("jobs_stalled", "late_reports", "stale_reports", "jobs_failed", "loads_carried"):
        assert value(f"statecore:kv_offload_{key}_total") == stats[key], key
    assert value("statecore:kv_offload_lookups_total") == 7
    assert value("statecore:kv_offload_lookup_hit_tokens_total") == 96
    assert value("statecore:kv_offload_flushes_requested_total") == 9
    assert value("statecore:kv_offload_live_jobs") == 11
    # the other engine saw nothing
    assert reg.get_sample_value(
        "vllm:kv_offload_load_bytes_total", {"model_name": "m", "engine": "0"}
    ) in (None, 0.0)


def test_every_statecore_counter_is_a_scheduler_counter() -> None:
    from statecore.scheduler import SchedulerCounters

    names = set(SchedulerCounters().as_dict())
    assert set(COUNTERS) <= names, set(COUNTERS) - names


def test_tier_failed_jobs_are_counted_by_tier_and_kind() -> None:
    reg = prometheus_client.CollectorRegistry()
    prom = metrics(reg)
    payload = {
        "redis0.failed_jobs_unreachable": 3,
        "redis0.failed_jobs_out_of_memory": 1,
        "redis0.failed_jobs_corrupt": 0,
        "file1.failed_jobs_missing": 2,
        "redis0.failed_jobs": 4,  # the total: not a kind
    }
    prom.observe(stats_payload(payload, [], []), engine_idx=0)
    prom.observe(stats_payload({"redis0.failed_jobs_unreachable": 2}, [], []), engine_idx=0)

    def value(tier: str, kind: str) -> float | None:
        got: float | None = reg.get_sample_value(
            "statecore:kv_offload_tier_failed_jobs_total",
            {"model_name": "m", "engine": "0", "tier": tier, "kind": kind},
        )
        return got

    assert value("redis0", "unreachable") == 5
    assert value("redis0", "out-of-memory") == 1
    assert value("file1", "missing") == 2
    assert value("redis0", "corrupt") is None  # never incremented: no series


def test_a_second_instance_on_the_registry_replaces_the_first() -> None:
    """A second engine in one process builds statecore's metrics again on vLLM's registry:
    the earlier ones are unregistered first (as vLLM does for its ``vllm:`` metrics), the new
    ones count from zero, and collectors that are not statecore's stay."""
    from statecore.adapters.vllm_metrics import metric_names, unregister_statecore_metrics

    reg = prometheus_client.CollectorRegistry()
    other = prometheus_client.Counter("not_statecore", "someone else's", registry=reg)
    metrics(reg)
    with pytest.raises(ValueError, match="Duplicated"):  # without the registry: refused
        metrics(reg)

    def bind(cls: Any) -> Any:
        return functools.partial(cls, registry=reg)

    pc = prometheus_client
    for lookups in (7, 2):
        prom = OffloadPrometheus(
            bind(pc.Counter), bind(pc.Gauge), bind(pc.Histogram), ["m"], {0: ["x"]}, registry=reg
        )
        prom.observe(stats_payload({"lookups": lookups}, [], []))
        assert reg.get_sample_value("statecore:kv_offload_lookups_total", {"m": "x"}) == lookups
    other.inc()
    assert reg.get_sample_value("not_statecore_total") == 1
    assert unregister_statecore_metrics(reg) == len(metric_names())
    assert reg.get_sample_value("statecore:kv_offload_lookups_total", {"m": "x"}) is None
    assert reg.get_sample_value("not_statecore_total") == 1
    assert unregister_statecore_metrics(object()) == 0  # no registry internals: nothing

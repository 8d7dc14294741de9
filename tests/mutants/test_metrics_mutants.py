"""Seeded mutants of the vLLM adapter's Prometheus metrics (:data:`catalogue.METRICS_MUTANTS`):
each must fail the metrics check below, which builds statecore's metrics twice on one
``prometheus_client`` registry, as a second engine in one process does."""

from __future__ import annotations

import functools

import pytest
from catalogue import METRICS_MUTANTS

from statecore.adapters.vllm_metrics import OffloadPrometheus, stats_payload

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed (pip install 'statecore[test]')"
)


def metrics_finding() -> str | None:
    """What the check reports (None: it passed): two engines, one after the other, each
    building its metrics on the same registry and counting its own lookups."""
    reg = prometheus_client.CollectorRegistry()
    pc = prometheus_client
    for engine, lookups in enumerate((3, 5)):
        try:
            prom = OffloadPrometheus(
                functools.partial(pc.Counter, registry=reg),
                functools.partial(pc.Gauge, registry=reg),
                functools.partial(pc.Histogram, registry=reg),
                ["model_name"],
                {0: ["m"]},
                registry=reg,
            )
        except ValueError as exc:
            return f"engine {engine}: {exc}"
        prom.observe(stats_payload({"lookups": lookups}, [], []))
        got = reg.get_sample_value("statecore:kv_offload_lookups_total", {"model_name": "m"})
        if got != lookups:
            return f"engine {engine}: lookups_total {got}, not {lookups}"
    return None


def test_metrics_check_passes_without_mutants() -> None:
    """The control: the unmodified metrics pass the check."""
    assert metrics_finding() is None


@pytest.mark.parametrize("name", sorted(METRICS_MUTANTS))
def test_metrics_mutant_is_caught(name: str) -> None:
    """The check fails with the mutant applied."""
    with METRICS_MUTANTS[name].apply():
        finding = metrics_finding()
    assert finding is not None, f"mutant {name!r} survived the metrics check"

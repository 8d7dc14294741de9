"""statecore's connector stats as Prometheus metrics, with vLLM 0.33's names where both have them.

vLLM's engine collects ``get_kv_connector_stats()`` from the scheduler role, aggregates them
and calls the connector's Prometheus object (``build_prom_metrics``) with the payload. This
module is that object's logic, free of vLLM imports so that the default test command checks it
against a real ``prometheus_client`` registry; :mod:`statecore.adapters.vllm` wraps it in
vLLM's ``KVConnectorPromMetrics`` base class.

The payload (:func:`stats_payload`) is a flat dict: counter deltas under statecore's counter
names (:class:`statecore.scheduler.SchedulerCounters`), transfer totals under vLLM's stats
names (``kv_offload_load_bytes`` ...), per-job sizes as lists under ``load_sizes`` /
``store_sizes``, and gauges. :class:`OffloadPrometheus` turns it into:

* vLLM's metrics, same names, types and labels: ``vllm:kv_offload_load_bytes``,
  ``vllm:kv_offload_load_time``, ``vllm:kv_offload_store_bytes``,
  ``vllm:kv_offload_store_time`` (counters), ``vllm:kv_offload_load_size``,
  ``vllm:kv_offload_store_size`` (histograms of per-job bytes, vLLM's buckets),
  ``vllm:kv_offload_allocation_failure`` (counter), and vLLM's per-direction series with the
  ``transfer_type`` label (``CPU_to_GPU``, ``GPU_to_CPU``): ``vllm:kv_offload_total_bytes``,
  ``vllm:kv_offload_total_time``, ``vllm:kv_offload_size``;
* statecore's own counters, ``statecore:kv_offload_<counter>`` (lookups, hit tokens, stalled,
  late, stale, failed, discarded and carried jobs, flushes, deferrals, ...), and gauges
  ``statecore:kv_offload_live_jobs``, ``..._stalled_ledger``, ``..._tracked_requests``;
* the secondary tiers' failed jobs by fault kind, ``statecore:kv_offload_tier_failed_jobs``
  with the labels ``tier`` (``redis0``, ``file0``: the tier's stats prefix) and ``kind``
  (``unreachable``, ``out-of-memory``, ``missing``, ``corrupt`` ...:
  :data:`statecore.managers.tiers.FAULT_KINDS`), from the payload's
  ``<tier>.failed_jobs_<kind>`` counters.

Every metric carries the engine's label names first (vLLM passes them), as vLLM's do.

Each :class:`OffloadPrometheus` given a ``registry`` first unregisters the metrics of an
earlier one from it (:func:`unregister_statecore_metrics`), as vLLM unregisters its own
``vllm:`` metrics each time it builds its Prometheus logger (not statecore's): a second engine
in one process (a test, a notebook, an engine built again) would otherwise fail at start with
``prometheus_client``'s ``Duplicated timeseries in CollectorRegistry``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "COUNTERS",
    "DIRECTION_METRICS",
    "GAUGES",
    "TIER_FAILED_JOBS",
    "TRANSFER_SIZE_BUCKETS",
    "VLLM_METRICS",
    "OffloadPrometheus",
    "TransferSizes",
    "metric_names",
    "stats_payload",
    "unregister_statecore_metrics",
]

TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
"""vLLM 0.33's buckets for transfer-size histograms (bytes)."""

VLLM_METRICS: dict[str, tuple[str, str, str]] = {
    # payload key -> (metric name, kind, documentation)
    "kv_offload_load_bytes": (
        "vllm:kv_offload_load_bytes",
        "counter",
        "Total bytes loaded from offload storage to GPU.",
    ),
    "kv_offload_load_time": (
        "vllm:kv_offload_load_time",
        "counter",
        "Total load time from offload storage to GPU, in seconds.",
    ),
    "kv_offload_store_bytes": (
        "vllm:kv_offload_store_bytes",
        "counter",
        "Total bytes stored from GPU to offload storage.",
    ),
    "kv_offload_store_time": (
        "vllm:kv_offload_store_time",
        "counter",
        "Total store time from GPU to offload storage, in seconds.",
    ),
    "load_sizes": (
        "vllm:kv_offload_load_size",
        "histogram",
        "Histogram of KV offload load operation size, in bytes.",
    ),
    "store_sizes": (
        "vllm:kv_offload_store_size",
        "histogram",
        "Histogram of KV offload store operation size, in bytes.",
    ),
    "kv_offload_allocation_failure": (
        "vllm:kv_offload_allocation_failure",
        "counter",
        "Number of KV offload store allocation attempts that failed.",
    ),
}
"""statecore's stats keys exported under vLLM's metric names."""

DIRECTION_METRICS = (
    "vllm:kv_offload_total_bytes",
    "vllm:kv_offload_total_time",
    "vllm:kv_offload_size",
)
"""vLLM's per-direction metrics (label ``transfer_type``): bytes, time, sizes."""

_DIRECTIONS = (
    ("CPU_to_GPU", "kv_offload_load_bytes", "kv_offload_load_time", "load_sizes"),
    ("GPU_to_CPU", "kv_offload_store_bytes", "kv_offload_store_time", "store_sizes"),
)

COUNTERS: dict[str, str] = {
    "lookups": "Lookups answered (get_num_new_matched_tokens).",
    "lookup_hit_tokens": "Tokens found loadable by lookups.",
    "lookups_deferred": "Lookups deferred (the engine asks again later).",
    "load_jobs_created": "Load jobs created.",
    "store_jobs_created": "Store jobs created.",
    "jobs_completed": "Jobs completed on every worker.",
    "jobs_failed": "Jobs a worker failed.",
    "jobs_stalled": "Jobs failed by the stall timeout.",
    "jobs_discarded": "Jobs discarded by a cache reset.",
    "loads_carried": "Loads carried over a cache reset (they complete normally).",
    "late_reports": "Worker reports for stalled jobs (absorbed).",
    "stale_reports": "Worker reports for jobs of an earlier reset epoch (absorbed).",
    "duplicate_reports": "Duplicate worker reports (absorbed).",
    "unknown_reports": "Worker reports for never-issued job ids (absorbed).",
    "flushes_requested": "Jobs put in a step's jobs_to_flush.",
    "resets": "Cache resets.",
    "manager_errors": "Manager errors absorbed by the scheduler.",
}
"""statecore's own counters (payload key -> help), as ``statecore:kv_offload_<key>``."""

GAUGES: dict[str, str] = {
    "live_jobs": "Jobs in flight.",
    "stalled_ledger": "Stalled jobs still absorbing late reports.",
    "tracked_requests": "Requests the scheduler tracks.",
}
"""statecore's gauges (payload key -> help), as ``statecore:kv_offload_<key>``."""


TIER_FAILED_JOBS = "statecore:kv_offload_tier_failed_jobs"
"""The counter of the secondary tiers' failed jobs, labelled by ``tier`` and ``kind``."""

_FAILED_JOBS = ".failed_jobs_"


def _tier_fault(key: str) -> tuple[str, str] | None:
    """``(tier, kind)`` of a payload key ``<tier>.failed_jobs_<kind>``, else ``None``."""
    tier, sep, kind = key.partition(_FAILED_JOBS)
    if not sep or not tier or not kind or "." in tier:
        return None
    return tier, kind.replace("_", "-")


def stats_payload(
    stats: Mapping[str, Any], load_sizes: Sequence[int], store_sizes: Sequence[int]
) -> dict[str, Any]:
    """The stats payload of one ``get_kv_connector_stats`` call: the scheduler's stats plus the
    per-job sizes the workers reported since the last call."""
    out = dict(stats)
    out["load_sizes"] = list(load_sizes)
    out["store_sizes"] = list(store_sizes)
    return out


class TransferSizes:
    """The per-job transfer sizes (bytes) the workers reported since the last :meth:`take`.

    Kept as a count per size, so that memory is bounded by the distinct sizes, not by the
    jobs: an embedding that never asks for stats costs nothing per job (vLLM's engine asks
    every step). :meth:`take` gives every size as often as it was added, grouped by size in
    first-seen order: the same observations for a histogram, the same sum.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()

    def add(self, sizes: Iterable[int]) -> None:
        """Record one size per finished job."""
        self._counts.update(sizes)

    def take(self) -> list[int]:
        """Every size recorded since the last call (one per job), then forget them."""
        counts, self._counts = self._counts, Counter()
        return list(counts.elements())


MetricFactory = Callable[..., Any]


def metric_names() -> frozenset[str]:
    """The names of every metric an :class:`OffloadPrometheus` registers: statecore's own and
    those it registers under vLLM's names."""
    names = {name for name, _, _ in VLLM_METRICS.values()}
    names.update(DIRECTION_METRICS)
    names.update(f"statecore:kv_offload_{key}" for key in (*COUNTERS, *GAUGES))
    names.add(TIER_FAILED_JOBS)
    return frozenset(names)


def unregister_statecore_metrics(registry: Any) -> int:
    """Unregister from ``registry`` (a ``prometheus_client`` ``CollectorRegistry``) every
    collector of one of the metrics an :class:`OffloadPrometheus` registers
    (:func:`metric_names`); returns how many. Under vLLM its own ``vllm:`` metrics are gone
    already (vLLM unregisters them each time it builds its Prometheus logger)."""
    names_of: Mapping[Any, Iterable[str]] | None = getattr(registry, "_collector_to_names", None)
    if names_of is None:
        return 0
    ours = metric_names()
    found = [c for c, names in list(names_of.items()) if not ours.isdisjoint(names)]
    for collector in found:
        registry.unregister(collector)
    return len(found)


class OffloadPrometheus:
    """Prometheus metrics for statecore's stats payloads, one labelled child per engine.

    Args:
        counter, gauge, histogram: metric classes (``prometheus_client``'s, or vLLM's
            wrappers), called as ``cls(name=, documentation=, labelnames=[, buckets=])``.
        labelnames: the engine's label names (they come first on every metric).
        per_engine_labelvalues: engine index -> its label values.
        registry: the registry the metric classes register into; the metrics of an earlier
            instance there are unregistered first (module docstring). ``None``:
            nothing is unregistered (the classes register into a registry of their own).
    """

    def __init__(
        self,
        counter: MetricFactory,
        gauge: MetricFactory,
        histogram: MetricFactory,
        labelnames: Sequence[str],
        per_engine_labelvalues: Mapping[int, Sequence[object]],
        registry: Any = None,
    ) -> None:
        if registry is not None:
            unregister_statecore_metrics(registry)
        names = list(labelnames)
        self._engines = {i: [str(v) for v in vals] for i, vals in per_engine_labelvalues.items()}
        self._vllm: dict[str, tuple[str, Any]] = {}
        for key, (name, kind, doc) in VLLM_METRICS.items():
            if kind == "histogram":
                metric = histogram(
                    name=name, documentation=doc, labelnames=names, buckets=TRANSFER_SIZE_BUCKETS
                )
            else:
                metric = counter(name=name, documentation=doc, labelnames=names)
            self._vllm[key] = (kind, metric)
        per_dir = [*names, "transfer_type"]
        self._dir_bytes = counter(
            name=DIRECTION_METRICS[0],
            documentation="Number of bytes offloaded by KV connector",
            labelnames=per_dir,
        )
        self._dir_time = counter(
            name=DIRECTION_METRICS[1],
            documentation="Total time measured by all KV offloading operations",
            labelnames=per_dir,
        )
        self._dir_size = histogram(
            name=DIRECTION_METRICS[2],
            documentation="Histogram of KV offload transfer size, in bytes.",
            labelnames=per_dir,
            buckets=TRANSFER_SIZE_BUCKETS,
        )
        self._own = {
            key: counter(name=f"statecore:kv_offload_{key}", documentation=doc, labelnames=names)
            for key, doc in COUNTERS.items()
        }
        self._gauges = {
            key: gauge(name=f"statecore:kv_offload_{key}", documentation=doc, labelnames=names)
            for key, doc in GAUGES.items()
        }
        self._tier_failed = counter(
            name=TIER_FAILED_JOBS,
            documentation="Secondary-tier jobs that failed, by tier and fault kind.",
            labelnames=[*names, "tier", "kind"],
        )

    def observe(self, data: Mapping[str, Any], engine_idx: int = 0) -> None:
        """Record one (aggregated) stats payload for engine ``engine_idx``."""
        labels = self._engines.get(engine_idx)
        if labels is None:
            return
        for key, (kind, metric) in self._vllm.items():
            value = data.get(key)
            if not value:
                continue
            child = metric.labels(*labels)
            if kind == "histogram":
                for v in value:
                    child.observe(v)
            else:
                child.inc(value)
        for direction, bkey, tkey, skey in _DIRECTIONS:
            lv = [*labels, direction]
            if data.get(bkey):
                self._dir_bytes.labels(*lv).inc(data[bkey])
            if data.get(tkey):
                self._dir_time.labels(*lv).inc(data[tkey])
            for v in data.get(skey) or ():
                self._dir_size.labels(*lv).observe(v)
        for key, metric in self._own.items():
            value = data.get(key)
            if value:
                metric.labels(*labels).inc(value)
        for key, metric in self._gauges.items():
            value = data.get(key)
            if value is not None:
                metric.labels(*labels).set(value)
        for key, value in data.items():
            if value and isinstance(value, int | float) and _FAILED_JOBS in key:
                fault = _tier_fault(key)
                if fault is not None:
                    self._tier_failed.labels(*labels, *fault).inc(value)

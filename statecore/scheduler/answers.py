"""What the scheduler answers the engine: its counters, the report of
:meth:`~statecore.scheduler.OffloadingScheduler.update_connector_output`, the load an
allocation created, and what a reset did. Plain values: immutable (but the counters), and
they pickle (they cross process boundaries in a multiprocess engine).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from statecore.keys import OffloadKey

__all__ = [
    "COUNTER_NAMES",
    "EMPTY_MAPPING",
    "NO_OUTPUT",
    "ConnectorOutputResult",
    "CreatedLoad",
    "ResetResult",
    "ResetStatus",
    "SchedulerCounters",
]


@dataclass(slots=True)
class SchedulerCounters:
    """Cumulative counters. Every tolerated anomaly has its own counter.

    ``invalid_request_views`` counts request views found malformed while
    ``build_connector_meta`` read them live (a field turned bad after the hook that validated
    it): that request's keys and stores are skipped for the step, nothing else changes.

    Job outcomes: ``jobs_created = live + completed + failed + stalled + discarded``.
    """

    jobs_created: int = 0
    load_jobs_created: int = 0
    store_jobs_created: int = 0
    jobs_completed: int = 0
    jobs_failed: int = 0
    jobs_stalled: int = 0
    jobs_discarded: int = 0
    loads_carried: int = 0
    stalled_retired: int = 0
    stalled_expired: int = 0
    late_reports: int = 0
    stale_reports: int = 0
    duplicate_reports: int = 0
    unknown_reports: int = 0
    over_reports: int = 0
    invalid_report_counts: int = 0
    lookups: int = 0
    lookups_deferred: int = 0
    loader_waits_expired: int = 0
    lookup_hit_tokens: int = 0
    allocation_failures: int = 0
    flushes_requested: int = 0
    resets: int = 0
    implicit_new_requests: int = 0
    untracked_finishes: int = 0
    unknown_scheduled_requests: int = 0
    invalid_transfer_params: int = 0
    invalid_request_views: int = 0
    manager_errors: int = 0
    fence_pairs_missing: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The counters as a plain dict."""
        return dict(zip(COUNTER_NAMES, _counter_values(self), strict=True))

    def values(self) -> tuple[int | float, ...]:
        """The counters in :data:`COUNTER_NAMES` order (one C-level read)."""
        return _counter_values(self)


COUNTER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SchedulerCounters))
"""The names of :class:`SchedulerCounters`, in field order."""

_counter_values = operator.attrgetter(*COUNTER_NAMES)


@dataclass(frozen=True, slots=True)
class ConnectorOutputResult:
    """What the engine learns from :meth:`OffloadingScheduler.update_connector_output`.

    Attributes:
        finished_loads: requests whose load job ended (completed, failed, stalled, or
            discarded by a reset before it was sent); they may resume.
        invalid_block_ids: GPU blocks of loads that did not complete successfully: their
            content is not trustworthy and must be recomputed.
        failed_loads: per request among ``finished_loads`` whose load did not complete
            successfully (failed, stalled, discarded by a reset, or failed before it started),
            its blocks among ``invalid_block_ids``; the requests not in it loaded fine.
            Excluded from the hash (equality compares it).
    """

    finished_loads: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_loads: Mapping[str, frozenset[int]] = field(
        default_factory=lambda: _NO_FAILED_LOADS, hash=False
    )


class _EmptyMapping(Mapping[Any, Any]):
    """An immutable empty mapping that pickles (to the module's one instance).

    ``MappingProxyType`` does not pickle, and what the scheduler answers crosses process
    boundaries: vLLM's multiprocess executor pickles the step's connector metadata to every
    worker, and an unpicklable value there kills the engine core.
    """

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "{}"

    def __reduce__(self) -> str:
        return "EMPTY_MAPPING"


EMPTY_MAPPING: Mapping[Any, Any] = _EmptyMapping()
"""The shared empty answer (no failed loads, no store keys): immutable, and it pickles."""

_NO_FAILED_LOADS: Mapping[str, frozenset[int]] = EMPTY_MAPPING
NO_OUTPUT = ConnectorOutputResult()
"""The answer of a report that ended no load (the usual step)."""


@dataclass(frozen=True, slots=True)
class CreatedLoad:
    """The load job :meth:`OffloadingScheduler.update_state_after_alloc` created.

    The job is in this step's :attr:`~statecore.wire.ConnectorMetadata.load_jobs` under
    ``job_id``; the request is in ``finished_loads`` of the
    :meth:`~OffloadingScheduler.update_connector_output` that ends it (and in
    ``failed_loads``, with ``block_ids``, when it did not complete).

    Attributes:
        job_id: the load's job id.
        req_id: the loading request.
        keys: the offloaded chunks it loads, in order.
        block_ids: the GPU blocks it fills, group after group (the blocks that are invalid
            should the load fail).
    """

    job_id: int
    req_id: str
    keys: tuple[OffloadKey, ...]
    block_ids: tuple[int, ...]


class ResetStatus(enum.Enum):
    """How far :meth:`OffloadingScheduler.reset` got.

    The scheduler's side of a reset is never deferred: it is whole when the call returns.
    Only the manager's ``reset_cache`` can fail, and is then deferred.
    """

    DONE = "done"
    """The scheduler and the manager are reset."""
    MANAGER_RESET_DEFERRED = "manager_reset_deferred"
    """The manager's ``reset_cache`` raised (:attr:`ResetResult.reason`): the scheduler is
    reset, the manager may still hold its chunks. Every ``build_connector_meta`` retries it
    first (its metadata's ``manager_reset`` says when it took) and no lookup hits until then."""


@dataclass(frozen=True, slots=True)
class ResetResult:
    """What :meth:`OffloadingScheduler.reset` did.

    True (as a bool) when :attr:`status` is :attr:`ResetStatus.DONE`, so a caller written
    for :meth:`~OffloadingScheduler.reset_cache`'s bool reads it alike.

    Attributes:
        status: whether the manager's reset took, or was deferred.
        reason: why it was deferred (the manager's error, as text); None when done.
        flushed_jobs: job ids put in the next ``jobs_to_flush`` (every job in flight or
            stalled).
        discarded_jobs: jobs dropped without completion: stores, stalled jobs and loads not
            sent yet (their reports become inert).
        discarded_loads: requests whose unsent load was dropped: the next
            :meth:`~OffloadingScheduler.update_connector_output` reports them in
            ``finished_loads`` and ``failed_loads`` (their blocks are recomputed).
        carried_loads: loads the workers already run, carried over the reset: they complete
            as usual.
    """

    status: ResetStatus
    reason: str | None = None
    flushed_jobs: frozenset[int] = frozenset()
    discarded_jobs: frozenset[int] = frozenset()
    discarded_loads: frozenset[str] = frozenset()
    carried_loads: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return self.status is ResetStatus.DONE

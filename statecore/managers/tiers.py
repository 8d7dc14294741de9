"""Secondary tiers: the protocol the tiering manager drives, and an in-memory double.

A secondary tier keeps chunks below the CPU tier (a disk, an object store, a peer). It never
talks to the GPU: it copies between its storage and slots of the shared CPU pool, which the
tiering manager keeps pinned (cascade stores) or write-pending (promotions) while a job runs.
Every job ends with exactly one :class:`JobResult` from :meth:`SecondaryTier.get_finished`;
I/O failures are results (``success=False``), never exceptions.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from statecore import validate
from statecore.keys import OffloadKey
from statecore.manager import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from statecore.pool import CPUPool

__all__ = [
    "FAULT_KINDS",
    "ExecutorTier",
    "FaultLog",
    "JobResult",
    "MemoryTier",
    "SecondaryTier",
    "failed_job_counter",
]

FAULT_KINDS: dict[str, str] = {
    "unreachable": "the server or the storage did not answer (down, refused, timed out)",
    "out-of-memory": "the server refused a write for lack of memory (maxmemory noeviction)",
    "rejected": "the server refused a write for another reason",
    "missing": "a value the tier expected was not there (evicted, expired, flushed, deleted)",
    "corrupt": "a value failed its checks (truncated, bad header, bad checksum): deleted",
    "foreign": "a value of another layout or key was found under the key: deleted",
    "io-error": "a local read or write failed (disk full, permissions)",
}
"""Why a tier job can fail: kind -> meaning. Each failed job is counted under one kind
(``failed_jobs_<kind>`` in the tier's stats, dashes as underscores) and logged by kind."""


def failed_job_counter(kind: str) -> str:
    """The stats counter of the jobs that failed for ``kind`` (``failed_jobs_out_of_memory``)."""
    return "failed_jobs_" + kind.replace("-", "_")


class FaultLog:
    """A tier's faults, logged by kind as they happen (rate-limited), and its recovery.

    The first fault of a kind is logged at once (WARNING); later ones of that kind are
    counted and logged at most once per ``interval_s``, with how many there were since. A
    fault of a kind in ``outage_kinds`` (the server did not answer) starts an outage; the
    first success after it is logged with how long it lasted and the failures meanwhile, at
    the same level as the faults (whoever sees an outage sees its end), at most once per
    ``interval_s`` too (a flapping server or disk does not flood the log). Called
    from the thread that collects job results; the clock is injected. :attr:`tier` (the
    first words of every line) may be changed to tell several tiers apart.

    Args:
        logger: where to log (one logger per tier module).
        tier: the tier's name, first in every message.
        interval_s: at most one line per kind in this many seconds.
        outage_kinds: the kinds that mean the server or storage is unreachable.
        recovered: what the recovery line says came back.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        logger: logging.Logger,
        tier: str,
        interval_s: float = 10.0,
        outage_kinds: Sequence[str] = ("unreachable",),
        recovered: str = "the server answers again",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recovered = recovered
        self.logger = logger
        self.tier = tier
        self.interval_s = interval_s
        self.outage_kinds = frozenset(outage_kinds)
        self.clock = clock
        self._last: dict[str, float] = {}
        self._seen: set[str] = set()
        self._quiet: Counter[str] = Counter()
        self._last_recovery: float | None = None
        self._quiet_recoveries = 0
        self._down_since: float | None = None
        self._down_jobs = 0

    @property
    def down(self) -> bool:
        """Whether an outage is going on (an unreachable fault not followed by a success)."""
        return self._down_since is not None

    def fault(self, kind: str, keys: int, job: str = "a job", error: str = "") -> None:
        """``job`` (e.g. ``"a store of 4 chunks"``) failed for ``kind`` on ``keys`` of its keys;
        ``error`` is the error met, if any."""
        now = self.clock()
        if kind in self.outage_kinds:
            if self._down_since is None:
                self._down_since = now
                self._down_jobs = 0
            self._down_jobs += 1
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._quiet[kind] += 1
            return
        first = kind not in self._seen
        self._seen.add(kind)
        self._last[kind] = now
        more = self._quiet.pop(kind, 0)
        self.logger.warning(
            "%s: %s: %s failed for %d key%s%s%s%s",
            self.tier,
            kind,
            job,
            keys,
            "" if keys == 1 else "s",
            f" ({error})" if error else "",
            f"; {more} more such failures since the last line" if more else "",
            f" [{kind}: {FAULT_KINDS[kind]}]" if first and kind in FAULT_KINDS else "",
        )

    def success(self) -> None:
        """A job (or a lookup batch) got its answers from the server or storage."""
        if self._down_since is None:
            return
        now = self.clock()
        lasted = now - self._down_since
        jobs = self._down_jobs
        self._down_since = None
        self._down_jobs = 0
        last = self._last_recovery
        if last is not None and now - last < self.interval_s:
            self._quiet_recoveries += 1
            return
        self._last_recovery = now
        more = self._quiet_recoveries
        self._quiet_recoveries = 0
        self.logger.warning(
            "%s: recovered: %s after %.1f s (%d failures meanwhile)%s",
            self.tier,
            self.recovered,
            lasted,
            jobs,
            f"; {more} more outages ended since the last such line" if more else "",
        )


@dataclass(frozen=True, slots=True)
class JobResult:
    """The outcome of one secondary-tier job.

    Attributes:
        job_id: the id the tiering manager passed to ``submit_store``/``submit_load``.
        success: whether every key of the job was copied.
        successful_keys: with ``success=False``, the keys that were copied nevertheless
            (partial success); ``None`` means none.
    """

    job_id: int
    success: bool
    successful_keys: tuple[OffloadKey, ...] | None = None


@runtime_checkable
class SecondaryTier(Protocol):
    """What :class:`~statecore.managers.tiering.TieringOffloadingManager` needs from a tier.

    Attributes:
        medium: where the tier keeps its bytes (matched against ``ReqContext.load_tier_filter``).
        name: a short name, used to prefix the tier's statistics.
    """

    medium: Medium
    name: str

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """HIT (loadable now), MISS, or RETRY (asynchronous lookup running)."""

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """First sighting of a request; a tier may ask for ``REQUEST_LEVEL`` offloading."""

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``keys`` were used (recency bookkeeping)."""

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Copy the chunks in primary ``slots`` (pinned until the result) into the tier."""

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Copy ``keys`` from the tier into primary ``slots`` (write-pending until the result)."""

    def get_finished(self) -> Iterable[JobResult]:
        """Results of the jobs finished since the last call (never blocks)."""

    def on_request_finished(self, ctx: ReqContext) -> None:
        """The request is finished and no cascade for it can follow (INV-ORDER)."""

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """End of an engine step."""

    def has_pending_work(self) -> bool:
        """Whether jobs are still running or results are waiting to be collected."""

    def drain(self) -> None:
        """Block until every submitted job has finished (results stay collectable)."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events for the tier's own storage since the last call."""

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """Metrics since the last call."""

    def shutdown(self) -> None:
        """Stop workers and release resources."""


@dataclass(slots=True)
class _MemJob:
    job_id: int
    is_store: bool
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]


class ExecutorTier:
    """What the tiers that run their jobs on an executor share
    (:class:`~statecore.managers.filetier.FileTier`,
    :class:`~statecore.managers.redistier.RedisTier`): the counters handed out by
    :meth:`get_stats`, the event queue, a job's result, draining and shutting down.

    A subclass sets ``_stats`` (counter name -> int, ``failed_jobs`` among them), ``_events``,
    ``_jobs`` (job id -> a record with a ``future``), ``_executor`` and ``_own_executor``, and
    overrides :meth:`_gauges`, :meth:`_pending_futures` and :meth:`_release` where it has more.
    """

    _stats: dict[str, int]
    _events: list[OffloadingEvent]
    _jobs: dict[int, Any]
    _executor: Executor
    _own_executor: bool

    def _job_result(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        ok: set[OffloadKey],
        faults: Counter[str] | None = None,
    ) -> JobResult:
        """The result of a job whose keys in ``ok`` were copied (counts a failed job, under
        the most frequent kind in ``faults``: fault kind -> keys that failed for it)."""
        if all(k in ok for k in keys):
            return JobResult(job_id, True)
        self._stats["failed_jobs"] += 1
        if faults:
            kind = faults.most_common(1)[0][0]
            name = failed_job_counter(kind)
            self._stats[name] = self._stats.get(name, 0) + 1
        return JobResult(job_id, False, tuple(k for k in keys if k in ok) or None)

    def _pending_futures(self) -> list[Future[Any]]:
        """What :meth:`drain` waits for: every job not collected yet."""
        return [job.future for job in self._jobs.values()]

    def drain(self) -> None:
        """Wait for everything submitted (results stay collectable by ``get_finished``)."""
        futures = self._pending_futures()
        if futures:
            wait_futures(futures)

    def take_events(self) -> list[OffloadingEvent]:
        """The stored and removed events since the last call."""
        events, self._events = self._events, []
        return events

    def _gauges(self) -> dict[str, int]:
        """Values reported as they are now by :meth:`get_stats` (not reset)."""
        return {}

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """Counters since the last call, plus the tier's gauges."""
        stats: dict[str, Any] = dict(self._stats)
        self._stats = dict.fromkeys(self._stats, 0)
        stats.update(self._gauges())
        return stats

    def _release(self) -> None:
        """Release what the tier holds besides its executor (at :meth:`shutdown`)."""

    def shutdown(self) -> None:
        """Wait for running jobs; stop the default executor; release the tier's resources."""
        self.drain()
        if self._own_executor:
            self._executor.shutdown(wait=True)
        self._release()


class MemoryTier:
    """An in-memory secondary tier with controllable completion and failure injection.

    Jobs run when they complete: a store copies the pool rows then (the primary slots are
    still pinned), a load writes them into the pool. By default a job completes on the next
    :meth:`get_finished`; with ``hold=True`` it waits until :meth:`release`. A job touching
    a key in :attr:`fail_keys` fails (a failed load writes nothing).

    Args:
        pool: the shared CPU pool, or ``None`` to track keys without bytes.
        medium: the tier's medium (default STORAGE).
        name: prefix of its statistics.
        policy: what :meth:`on_new_request` answers (``REQUEST_LEVEL`` to see every chunk).
        hold: keep submitted jobs until :meth:`release`.
    """

    def __init__(
        self,
        pool: CPUPool | None = None,
        medium: Medium = Medium.STORAGE,
        name: str = "mem",
        policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL,
        hold: bool = False,
    ) -> None:
        self.pool = pool
        self.medium = medium
        self.name = name
        self.policy = policy
        self.hold = hold
        self.data: dict[OffloadKey, bytes] = {}
        self.fail_keys: set[OffloadKey] = set()
        self.submitted: list[_MemJob] = []
        self.held: list[_MemJob] = []
        self.finished_requests: list[str] = []
        self.touched: list[OffloadKey] = []
        self.drains = 0
        self._done: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._stats = {"stores": 0, "loads": 0, "failed_jobs": 0}

    # -- protocol -----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """HIT when the key's store has completed."""
        return LookupResult.HIT if key in self.data else LookupResult.MISS

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Answer the configured policy."""
        return RequestOffloadingContext(self.policy)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Record the touch (for tests)."""
        self.touched.extend(keys)

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Queue a store of ``keys`` from primary ``slots``."""
        validate.offload_keys(keys, "submit_store")
        validate.slot_list(slots, len(keys), "submit_store")
        self._submit(_MemJob(job_id, True, tuple(keys), tuple(slots)))

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Queue a load of ``keys`` into primary ``slots``."""
        validate.offload_keys(keys, "submit_load")
        validate.slot_list(slots, len(keys), "submit_load")
        self._submit(_MemJob(job_id, False, tuple(keys), tuple(slots)))

    def get_finished(self) -> list[JobResult]:
        """Run the queued jobs (not held ones) and return every result not yet collected."""
        self._run_queued()
        done, self._done = self._done, []
        return done

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Record the finalisation (for tests)."""
        self.finished_requests.append(ctx.req_id)

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Nothing to do."""

    def has_pending_work(self) -> bool:
        """Whether jobs are queued, held or uncollected."""
        return bool(self.submitted or self.held or self._done)

    def drain(self) -> None:
        """Run every queued and held job."""
        self.drains += 1
        self.release()
        self._run_queued()

    def take_events(self) -> list[OffloadingEvent]:
        """Stored events (medium of the tier)."""
        events, self._events = self._events, []
        return events

    def get_stats(self) -> dict[str, float | int | list[float]]:
        """Job counters since the last call."""
        stats: dict[str, float | int | list[float]] = dict(self._stats)
        self._stats = dict.fromkeys(self._stats, 0)
        return stats

    def shutdown(self) -> None:
        """Drop queued work."""
        self.submitted.clear()
        self.held.clear()

    # -- test controls ------------------------------------------------------------------------

    def release(self, job_id: int | None = None) -> None:
        """Let a held job (or every held job) complete on the next poll."""
        keep: list[_MemJob] = []
        for job in self.held:
            if job_id is None or job.job_id == job_id:
                self.submitted.append(job)
            else:
                keep.append(job)
        self.held = keep

    def put(self, key: OffloadKey, data: bytes = b"") -> None:
        """Place ``key`` directly in the tier (test setup)."""
        self.data[key] = data

    # -- internals ----------------------------------------------------------------------------

    def _submit(self, job: _MemJob) -> None:
        (self.held if self.hold else self.submitted).append(job)

    def _run_queued(self) -> None:
        queued, self.submitted = self.submitted, []
        for job in queued:
            self._done.append(self._run(job))

    def _run(self, job: _MemJob) -> JobResult:
        pool = self.pool
        if any(k in self.fail_keys for k in job.keys) or (
            not job.is_store
            and any(
                k not in self.data or (pool is not None and len(self.data[k]) != pool.slot_bytes)
                for k in job.keys
            )
        ):
            self._stats["failed_jobs"] += 1
            return JobResult(job.job_id, False)
        if job.is_store:
            stored: list[OffloadKey] = []
            for key, slot in zip(job.keys, job.slots, strict=True):
                if key not in self.data:
                    stored.append(key)
                self.data[key] = pool.read_slot(slot) if pool is not None else b""
            self._stats["stores"] += len(job.keys)
            if stored:
                self._events.append(OffloadingEvent(tuple(stored), self.medium, removed=False))
        else:
            for key, slot in zip(job.keys, job.slots, strict=True):
                if pool is not None:
                    pool.write_slot(slot, self.data[key])
            self._stats["loads"] += len(job.keys)
        return JobResult(job.job_id, True)

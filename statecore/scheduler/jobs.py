"""The job table: every transfer job the scheduler knows of, in one place.

What it holds, and the rule each part keeps:

========================  =====================================================================
``live``                  job id -> :class:`~statecore.scheduler.records.JobRecord` of every job
                          in flight, in creation order (the stall check stops at the first
                          young one).
``stalled``               the stalled ledger: a job that had no full quorum after
                          ``stall_timeout_s`` was completed with ``success=False`` and flushed;
                          it stays here to absorb its late reports until its remaining worker
                          count reaches 0, and expires after another ``stall_timeout_s``
                          (``stalled_expired``).
``fence``                 INV-FENCE: GPU block id -> the store jobs that read it. A block handed
                          out again while listed here puts those stores in the step's flush,
                          so every worker finishes them before the block is written.
``loading``               offload key -> number of live loads reading it (prefix caching
                          only): a lookup whose hit chunks another request is loading waits for
                          that load instead of loading a second copy.
``next_id``               the id of the next job (ids are never reused).
``stale_threshold``       INV-EPOCH: reports for job ids below it come from before the last
                          reset and are inert (a carried load excepted: it stays live).
``last_stall_check``      when the scheduler last looked for stalled jobs (it looks at most
                          once per ``stall_check_interval_s``).
========================  =====================================================================

Quorum counting (:meth:`JobTable.report_target`): a report's counts go to the job they name
once the report is classified (:func:`~statecore.kernels.classify_report`); the job's
lifecycle then decides, on its ``pending`` and ``failed`` counts, whether it completed. The
table counts, the scheduler fires the event: nothing here moves a lifecycle.

The decisions on counts are the contract-checked kernels of :mod:`statecore.kernels`, called
through the module (``kernels.apply_report``, ...) so that a test can swap one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from statecore import kernels
from statecore.keys import OffloadKey
from statecore.scheduler.answers import SchedulerCounters
from statecore.scheduler.records import JobRecord, RequestRecord
from statecore.wire import TransferJob

if TYPE_CHECKING:
    from statecore.scheduler.effects import SchedulerEffects

__all__ = ["JobTable", "StepBatch", "count_loaders"]


@dataclass(slots=True)
class StepBatch:
    """What the scheduler gathers for the next step's metadata.

    Attributes:
        loads: the load jobs created since the last metadata, by job id.
        flush: the jobs every worker must finish before the step writes a GPU block.
        allocated: the GPU blocks handed out since the last metadata (any owner): a store
            fenced on one of them is flushed.
    """

    loads: dict[int, TransferJob] = field(default_factory=dict)
    flush: set[int] = field(default_factory=set)
    allocated: set[int] = field(default_factory=set)


def count_loaders(loading: dict[OffloadKey, int], keys: Sequence[OffloadKey], delta: int) -> None:
    """Add ``delta`` (1: a load started, -1: it ended) to each key's count of loads in flight;
    a key whose count reaches 0 leaves ``loading``. A key listed twice counts twice.

    The usual load has distinct keys no other load holds: then one dict operation over all of
    them (``dict.update`` / ``map(pop)``) instead of a Python step per key."""
    if delta == 1 and loading.keys().isdisjoint(keys):
        if len(keys) == len(set(keys)):
            loading.update(dict.fromkeys(keys, 1))
            return
    elif delta == -1 and set(map(loading.get, keys)) == {1} and len(keys) == len(set(keys)):
        deque(map(loading.pop, keys), 0)
        return
    for k in keys:
        n = loading.get(k, 0) + delta
        if n > 0:
            loading[k] = n
        else:
            loading.pop(k, None)


class JobTable:
    """Jobs in flight, the stalled ledger, the fence index and the keys being loaded.

    Args:
        num_workers: the quorum: every job waits for this many worker reports.
        counters: the scheduler's counters (shared: the table counts its own anomalies).
        prefix_caching: keep :attr:`loading` (None without prefix caching).
        now: the clock's reading at creation (the first stall check is due from it).
    """

    __slots__ = (
        "counters",
        "fence",
        "last_stall_check",
        "live",
        "loading",
        "next_id",
        "num_workers",
        "stale_threshold",
        "stalled",
    )

    def __init__(
        self, num_workers: int, counters: SchedulerCounters, prefix_caching: bool, now: float
    ) -> None:
        self.num_workers = num_workers
        self.counters = counters
        self.live: dict[int, JobRecord] = {}
        self.stalled: dict[int, JobRecord] = {}
        self.fence: dict[int, set[int]] = {}
        self.loading: dict[OffloadKey, int] | None = {} if prefix_caching else None
        self.next_id = 0
        self.stale_threshold = 0
        self.last_stall_check = now

    def create(
        self,
        owner: SchedulerEffects,
        rec: RequestRecord,
        is_store: bool,
        keys: tuple[OffloadKey, ...],
        blocks: tuple[int, ...],
        now: float,
        fenced: tuple[int, ...] = (),
        deferred_fence: tuple[int, ...] = (),
    ) -> JobRecord:
        """A new job of ``rec``: the next id, live, waiting for every worker."""
        job_id = self.next_id
        self.next_id = job_id + 1
        job = JobRecord(
            owner,
            job_id,
            rec,
            is_store,
            keys,
            blocks,
            self.num_workers,
            now,
            fenced,
            deferred_fence,
        )
        self.live[job_id] = job
        rec.jobs.add(job_id)
        c = self.counters
        c.jobs_created += 1
        if is_store:
            c.store_jobs_created += 1
        else:
            c.load_jobs_created += 1
        return job

    def fence_deferred(self, job: JobRecord) -> None:
        """Enter a store's full-attention sources in the fence index (once: its request
        finished, so the engine may hand those blocks out while the store runs)."""
        if not job.deferred_registered and job.deferred_fence:
            kernels.fence_add(self.fence, job.job_id, job.deferred_fence)
        job.deferred_registered = True

    def end(self, job: JobRecord) -> None:
        """Forget an ended job: out of the fence index and out of the live jobs."""
        c = self.counters
        if job.fenced:
            c.fence_pairs_missing += kernels.fence_remove(self.fence, job.job_id, job.fenced)
        if job.deferred_registered and job.deferred_fence:
            c.fence_pairs_missing += kernels.fence_remove(
                self.fence, job.job_id, job.deferred_fence
            )
        del self.live[job.job_id]

    def report_target(
        self, job_id: int, ok: int, bad: int, ok_mask: int, bad_mask: int
    ) -> JobRecord | None:
        """Count one job's share of a worker report; the job whose lifecycle must now see a
        ``worker_report`` (live or in the stalled ledger), or None when the report is inert
        (stale, unknown, a duplicate, rejected: each counted).

        Rank masks, when the workers send them, count each rank once per job; a count-only
        report claiming more workers than the job still waits for is rejected whole
        (``over_reports``): no job completes before every worker finished (INV-QUORUM)."""
        c = self.counters
        job = self.live.get(job_id)
        stalled = self.stalled.get(job_id) if job is None else None
        kind = kernels.classify_report(
            job_id,
            self.stale_threshold,
            self.next_id,
            job is not None,
            stalled is not None,
        )
        if kind is kernels.ReportKind.STALE:
            c.stale_reports += 1
            return None
        if kind is kernels.ReportKind.UNKNOWN:
            c.unknown_reports += 1
            return None
        if kind is kernels.ReportKind.DUPLICATE:
            c.duplicate_reports += 1
            return None
        target = job if job is not None else stalled
        if target is None:  # not reachable: LIVE and STALLED imply a record
            c.unknown_reports += 1
            return None
        if stalled is not None:
            c.late_reports += 1
        if ok_mask or bad_mask:  # ranks known: each rank counts once per job
            seen, ok, bad, duplicates, invalid = kernels.rank_delta(
                target.seen, ok_mask, bad_mask, self.num_workers
            )
            target.seen = seen
            c.duplicate_reports += duplicates
            c.invalid_report_counts += invalid
            if not ok and not bad:
                return None
        elif kernels.over_report(target.pending, ok, bad):
            c.over_reports += 1  # count-only and more than outstanding: rejected whole
            return None
        pending, _, acc_bad, excess = kernels.apply_report(target.pending, ok, bad)
        c.over_reports += int(excess > 0)
        target.pending = pending
        target.failed += acc_bad
        return target

    def timed_out(self, now: float, timeout: float) -> list[JobRecord]:
        """The live jobs older than ``timeout``: the oldest ones, in creation order."""
        due: list[JobRecord] = []
        for job in self.live.values():  # creation order: stop at the first young job
            if not kernels.stall_due(now, job.created_at, timeout):
                break
            due.append(job)
        return due

    def expire_stalled(self, now: float, timeout: float) -> None:
        """Drop the ledger entries stalled for ``timeout``: their reports, should any still
        come, are absorbed as duplicates (``stalled_expired``)."""
        expired = [
            j for j in self.stalled.values() if kernels.stall_due(now, j.stalled_at, timeout)
        ]
        for job in expired:
            del self.stalled[job.job_id]
            self.counters.stalled_expired += 1

    def reset_plan(self) -> tuple[frozenset[int], int]:
        """What a reset flushes (every live and stalled job) and the new stale threshold."""
        return kernels.reset_plan(
            frozenset(self.live),
            frozenset(self.stalled),
            self.next_id,
            self.stale_threshold,
        )

    def after_reset(self) -> None:
        """Once the reset's job events ran: the ledger, the fences (every store is gone) and
        the keys being loaded (the reset manager knows none) are empty. (The scheduler moves
        :attr:`stale_threshold` once the requests are reset too.)"""
        self.stalled.clear()
        self.fence.clear()  # loads hold no fence; every store is gone
        if self.loading is not None:
            self.loading.clear()  # the reset manager knows none of these keys

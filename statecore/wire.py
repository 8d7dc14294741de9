"""What travels between the scheduler and the workers each engine step.

The scheduler emits one :class:`ConnectorMetadata` per step (load jobs, store jobs, jobs to
flush); every worker (tensor-parallel rank) executes it and answers a :class:`WorkerMetadata`
with, per job id, how many workers completed it and how many failed it. The engine merges the
ranks' answers with :meth:`WorkerMetadata.aggregate` (counts add up) before handing them to
:meth:`statecore.OffloadingScheduler.update_connector_output`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statecore._argerrors import fail, finite
from statecore._pickling import pickled_by_fields
from statecore.keys import OffloadKey
from statecore.manager import LoadStoreSpec

__all__ = [
    "ConnectorMetadata",
    "DirectionStats",
    "GPULoadStoreSpec",
    "TransferJob",
    "TransferStats",
    "WorkerMetadata",
    "check_worker_metadata",
]


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class GPULoadStoreSpec(LoadStoreSpec):
    """GPU blocks of one transfer, flat and ordered by group.

    Attributes:
        block_ids: the GPU block ids, group after group.
        group_sizes: how many of ``block_ids`` belong to each group (sum = ``len(block_ids)``).
        block_indices: per group, the index within the request's block list of the group's
            first block; ``block_indices[g] % blocks_per_chunk`` is the sub-block at which the
            first CPU chunk of the group is entered (the sub-block skip).
    """

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class TransferJob:
    """One transfer between GPU blocks and offloaded chunks.

    For a load ``src`` is the offloaded side and ``dst`` the :class:`GPULoadStoreSpec`; for a
    store it is the other way round.
    """

    req_id: str
    src: LoadStoreSpec
    dst: LoadStoreSpec


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """The scheduler's instructions for one engine step.

    Attributes:
        load_jobs: job id -> load, to submit at the start of the step.
        store_jobs: job id -> store, to submit at the start of the *next* step (so stores
            never delay this step's sampling), unless flushed earlier.
        jobs_to_flush: job ids the worker must submit (if deferred) and wait for before the
            step's compute may write any GPU block (some of their blocks were handed to a new
            owner, or their request was preempted, or the cache was reset).
        store_keys: job id -> the offloaded keys that store job writes, in order (one
            entry per job of ``store_jobs``): what the engine's side needs to account stores
            (KV-cache events) without reading the scheduler's job table. Workers ignore it.
        manager_reset: the manager's deferred reset (see
            :class:`~statecore.scheduler.ResetStatus`) was retried at the start of this step
            and took: nothing offloaded before the reset remains. Workers ignore it.
    """

    load_jobs: Mapping[int, TransferJob] = field(default_factory=dict)
    store_jobs: Mapping[int, TransferJob] = field(default_factory=dict)
    jobs_to_flush: frozenset[int] = frozenset()
    store_keys: Mapping[int, tuple[OffloadKey, ...]] = field(default_factory=dict)
    manager_reset: bool = False


@pickled_by_fields
@dataclass(slots=True)
class DirectionStats:
    """Bytes, seconds and per-job sizes moved in one direction."""

    bytes: int = 0
    seconds: float = 0.0
    sizes: list[int] = field(default_factory=list)

    def record(self, nbytes: int, seconds: float) -> None:
        """Account one finished job."""
        self.bytes += nbytes
        self.seconds += seconds
        self.sizes.append(nbytes)

    def merged(self, other: DirectionStats) -> DirectionStats:
        """A new object holding both."""
        return DirectionStats(
            self.bytes + other.bytes, self.seconds + other.seconds, self.sizes + other.sizes
        )


@pickled_by_fields
@dataclass(slots=True)
class TransferStats:
    """Per-direction transfer statistics of a step."""

    load: DirectionStats = field(default_factory=DirectionStats)
    store: DirectionStats = field(default_factory=DirectionStats)

    def is_empty(self) -> bool:
        """Whether nothing was recorded."""
        return not (self.load.sizes or self.store.sizes)

    def merged(self, other: TransferStats) -> TransferStats:
        """A new object holding both."""
        return TransferStats(self.load.merged(other.load), self.store.merged(other.store))


@pickled_by_fields
@dataclass(slots=True)
class WorkerMetadata:
    """Per-step report of one worker, or of several merged by :meth:`aggregate`.

    Counts say how many workers reported a job; rank masks say which ones. A worker that knows
    its rank sets ``rank`` and its marks set bit ``1 << rank`` too: the scheduler then counts
    each rank at most once per job, so a report delivered twice can never complete a job
    before every rank finished it (INV-QUORUM). Without ranks, counts are trusted (upstream's
    wire format) and an excess over the outstanding count is dropped and counted.

    Attributes:
        completed: job id -> number of workers that finished it successfully.
        failed: job id -> number of workers that could not execute it.
        stats: bytes and time moved.
        rank: the reporting worker's rank, or None (merged reports, legacy workers).
        completed_ranks: job id -> bit mask of the ranks among ``completed``.
        failed_ranks: job id -> bit mask of the ranks among ``failed``.
    """

    completed: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    stats: TransferStats = field(default_factory=TransferStats)
    rank: int | None = None
    completed_ranks: dict[int, int] = field(default_factory=dict)
    failed_ranks: dict[int, int] = field(default_factory=dict)

    def mark_completed(self, job_id: int) -> None:
        """This worker finished ``job_id``."""
        self.completed[job_id] = self.completed.get(job_id, 0) + 1
        if self.rank is not None:
            self.completed_ranks[job_id] = self.completed_ranks.get(job_id, 0) | 1 << self.rank

    def mark_failed(self, job_id: int) -> None:
        """This worker could not execute ``job_id``."""
        self.failed[job_id] = self.failed.get(job_id, 0) + 1
        if self.rank is not None:
            self.failed_ranks[job_id] = self.failed_ranks.get(job_id, 0) | 1 << self.rank

    def is_empty(self) -> bool:
        """Whether the report carries nothing."""
        return not (self.completed or self.failed) and self.stats.is_empty()

    def aggregate(self, other: WorkerMetadata) -> WorkerMetadata:
        """A new report with both reports' counts summed and rank masks merged per job.

        Raises :class:`~statecore.errors.InvalidMetadataError` when either report has a field
        of the wrong type (see :func:`check_worker_metadata`).
        """
        check_worker_metadata(self, "aggregate", entries=True)
        if other is None:
            fail("aggregate", "other", other, "a WorkerMetadata")
        check_worker_metadata(other, "aggregate", entries=True)
        return WorkerMetadata(
            _sum(self.completed, other.completed),
            _sum(self.failed, other.failed),
            self.stats.merged(other.stats),
            None,
            _union(self.completed_ranks, other.completed_ranks),
            _union(self.failed_ranks, other.failed_ranks),
        )


def _sum(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for k, n in b.items():
        out[k] = out.get(k, 0) + n
    return out


def _union(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for k, m in b.items():
        out[k] = out.get(k, 0) | m
    return out


def check_worker_metadata(
    meta: object, call: str = "update_connector_output", entries: bool = False
) -> None:
    """Check the *shape* of a :class:`WorkerMetadata` (or None); the validation layer's
    check of a report (``statecore.validate.worker_metadata`` is this function).

    The four per-job maps must be dicts (their entries are checked by the scheduler, which
    absorbs and counts a count that is not a positive int), ``stats`` a
    :class:`TransferStats` of finite, non-negative numbers, ``rank`` None or an int >= 0.
    With ``entries`` (for :meth:`WorkerMetadata.aggregate`, which does arithmetic on them)
    every job id and count must be an int too. Raises
    :class:`~statecore.errors.InvalidMetadataError` naming ``call`` and the field.
    """
    if meta is None:
        return
    if type(meta) is WorkerMetadata and not entries:  # the common case, in one expression
        stats = meta.stats
        if (
            type(meta.completed) is dict
            and type(meta.failed) is dict
            and type(meta.completed_ranks) is dict
            and type(meta.failed_ranks) is dict
            and (meta.rank is None or (type(meta.rank) is int and meta.rank >= 0))
            and type(stats) is TransferStats
            and _direction_ok(stats.load)
            and _direction_ok(stats.store)
        ):
            return
    if type(meta) is not WorkerMetadata and not isinstance(meta, WorkerMetadata):
        fail(call, "meta", meta, "a WorkerMetadata or None")
    for name in ("completed", "failed", "completed_ranks", "failed_ranks"):
        d = getattr(meta, name)
        if type(d) is not dict and not isinstance(d, Mapping):
            fail(call, f"meta.{name}", d, "a dict of job id -> int")
        if entries:
            for job_id, n in d.items():
                if type(job_id) is not int:
                    fail(call, f"meta.{name} key", job_id, "a job id (int)")
                if type(n) is not int:
                    fail(call, f"meta.{name}[{job_id}]", n, "an int")
    rank = meta.rank
    if rank is not None and (type(rank) is not int or rank < 0):
        fail(call, "meta.rank", rank, "None or an int >= 0")
    stats = meta.stats
    if type(stats) is not TransferStats:
        fail(call, "meta.stats", stats, "a TransferStats")
    for direction in ("load", "store"):
        ds = getattr(stats, direction)
        if type(ds) is not DirectionStats:
            fail(call, f"meta.stats.{direction}", ds, "a DirectionStats")
        if type(ds.bytes) is not int or ds.bytes < 0:
            fail(call, f"meta.stats.{direction}.bytes", ds.bytes, "an int >= 0")
        if not finite(ds.seconds) or ds.seconds < 0:
            fail(call, f"meta.stats.{direction}.seconds", ds.seconds, "a finite number >= 0")
        if type(ds.sizes) is not list:
            fail(call, f"meta.stats.{direction}.sizes", ds.sizes, "a list of ints")


def _direction_ok(ds: Any) -> bool:
    return (
        type(ds) is DirectionStats
        and type(ds.bytes) is int
        and ds.bytes >= 0
        and (type(ds.seconds) is float or type(ds.seconds) is int)
        and 0 <= ds.seconds < math.inf
        and type(ds.sizes) is list
    )

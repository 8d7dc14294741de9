"""What travels between the scheduler and the workers each engine step.

The scheduler emits one :class:`ConnectorMetadata` per step (load jobs, store jobs, jobs to
flush); every worker (tensor-parallel rank) executes it and answers a :class:`WorkerMetadata`
with, per job id, how many workers completed it and how many failed it. The engine merges the
ranks' answers with :meth:`WorkerMetadata.aggregate` (counts add up) before handing them to
:meth:`statecore.OffloadingScheduler.update_connector_output`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from statecore.manager import LoadStoreSpec

__all__ = [
    "ConnectorMetadata",
    "DirectionStats",
    "GPULoadStoreSpec",
    "TransferJob",
    "TransferStats",
    "WorkerMetadata",
]


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


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One transfer between GPU blocks and offloaded chunks.

    For a load ``src`` is the offloaded side and ``dst`` the :class:`GPULoadStoreSpec`; for a
    store it is the other way round.
    """

    req_id: str
    src: LoadStoreSpec
    dst: LoadStoreSpec


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
    """

    load_jobs: Mapping[int, TransferJob] = field(default_factory=dict)
    store_jobs: Mapping[int, TransferJob] = field(default_factory=dict)
    jobs_to_flush: frozenset[int] = frozenset()


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
        of the wrong type (see :func:`statecore.validate.worker_metadata`).
        """
        from statecore import validate

        validate.worker_metadata(self, "aggregate", entries=True)
        if other is None:
            validate._fail("aggregate", "other", other, "a WorkerMetadata")
        validate.worker_metadata(other, "aggregate", entries=True)
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

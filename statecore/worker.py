"""The worker side: executes each step's transfer jobs on one rank and reports back.

Every tensor-parallel rank runs one :class:`OffloadingWorker` over its own
:class:`TransferBackend` (which moves the bytes of its shard of the KV cache). Per engine step
the engine calls, in this order:

1. :meth:`OffloadingWorker.start_step` with the step's :class:`~statecore.wire.ConnectorMetadata`,
   before the model runner updates its block tables: flush handling first (every store
   deferred from the previous step is submitted, together with any of this step's stores that
   is being flushed, then the worker blocks until every job in ``jobs_to_flush`` is done, so
   the step's compute may overwrite reused GPU blocks), then this step's loads are submitted;
2. the forward pass;
3. :meth:`OffloadingWorker.end_step` with the same metadata: this step's stores are queued and
   submitted at the start of the next step, so offloading never delays sampling (a rank that
   is not a *store writer* acknowledges them at once without copying);
4. :meth:`OffloadingWorker.build_worker_metadata`: completions and failures polled from the
   backend, one count per job on this rank, plus bytes and seconds moved.

The engine merges the ranks' reports with :func:`aggregate`. A backend exception never reaches
the engine: the job it concerns is reported as failed (``WorkerMetadata.failed``), exactly once.

This module also holds the pure block-mapping arithmetic shared by every backend
(:func:`plan_spans`, :func:`plan_block_copies`), a fault-injecting wrapper
(:class:`FaultyBackend`) and a pure-Python backend over byte arrays (:class:`MemoryBackend`)
used by tests and the simulator. Nothing here imports torch or does I/O.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from statecore import validate
from statecore.errors import ConfigError, LifecycleError, SpecError, TransferError, describe
from statecore.manager import CPULoadStoreSpec
from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob, WorkerMetadata

__all__ = [
    "BlockCopy",
    "FaultyBackend",
    "GroupSpan",
    "MemoryBackend",
    "OffloadingWorker",
    "TransferBackend",
    "TransferResult",
    "aggregate",
    "job_specs",
    "plan_block_copies",
    "plan_spans",
    "validate_ids",
]


# --------------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A finished job as reported by :meth:`TransferBackend.poll`.

    Attributes:
        job_id: the scheduler's job id.
        success: whether every byte was moved.
        nbytes: bytes moved (0 for a failed job).
        seconds: time the transfer took.
        is_store: GPU -> CPU (True) or CPU -> GPU (False).
    """

    job_id: int
    success: bool
    nbytes: int
    seconds: float
    is_store: bool


class TransferBackend(Protocol):
    """Moves the bytes of transfer jobs between GPU blocks and CPU pool slots on one rank."""

    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Start ``job``. May raise; any exception means the job failed and will not be polled."""
        ...

    def poll(self) -> list[TransferResult]:
        """Jobs finished since the last poll (per direction in submission order)."""
        ...

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until those jobs are done; unknown or already finished ids are ignored.

        Done means every byte is where it belongs: the GPU blocks a store read may be
        overwritten, and the CPU rows it wrote (host-side steps included) hold the data. A
        failed job is done too; its result comes from the next :meth:`poll`.
        """
        ...

    def shutdown(self) -> None:
        """Finish outstanding transfers and release resources."""
        ...


# --------------------------------------------------------------------------------------------
# Block mapping (pure arithmetic)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupSpan:
    """Where one KV-cache group's part of a transfer lies in the GPU and CPU specs.

    Attributes:
        group: group index.
        first_block: position in ``block_ids`` of the group's first GPU block.
        num_blocks: GPU blocks of the group in this transfer.
        first_chunk: position in the CPU spec's slot list of the group's first chunk.
        skip: sub-block of the first chunk at which the group's first block goes.
        num_chunks: CPU chunks the group consumes, ``ceil((num_blocks + skip) / bpc)``.
    """

    group: int
    first_block: int
    num_blocks: int
    first_chunk: int
    skip: int
    num_chunks: int


BlockCopy = tuple[int, int, int, int]
"""One GPU page copy: (group, gpu_block_id, cpu_slot, sub_block)."""


def plan_spans(
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    num_block_ids: int,
    num_chunks: int,
    blocks_per_chunk: int,
) -> list[GroupSpan]:
    """Split a GPU spec and its CPU spec into per-group spans; validate their shapes.

    Group ``g`` with ``n = group_sizes[g]`` GPU blocks enters its first CPU chunk at sub-block
    ``s = block_indices[g] % blocks_per_chunk`` and consumes ``ceil((n + s) / bpc)`` chunks
    (none when ``n == 0``). Both sides must be consumed exactly.

    raises: SpecError
    post: len(__return__) == len(group_sizes)
    post: sum(sp.num_blocks for sp in __return__) == num_block_ids
    post: sum(sp.num_chunks for sp in __return__) == num_chunks
    post: all(0 <= sp.skip < blocks_per_chunk for sp in __return__)
    post: all((sp.num_chunks == 0) == (sp.num_blocks == 0) for sp in __return__)
    post: all(sp.num_blocks + sp.skip <= sp.num_chunks * blocks_per_chunk or not sp.num_blocks for sp in __return__)
    post: all(sp.num_blocks + sp.skip > (sp.num_chunks - 1) * blocks_per_chunk or not sp.num_blocks for sp in __return__)
    post: all(b.first_block == a.first_block + a.num_blocks for a, b in zip(__return__, __return__[1:]))
    post: all(b.first_chunk == a.first_chunk + a.num_chunks for a, b in zip(__return__, __return__[1:]))
    """  # noqa: E501
    if blocks_per_chunk <= 0:
        raise SpecError(f"blocks_per_chunk must be > 0, got {blocks_per_chunk}")
    if len(group_sizes) != len(block_indices):
        raise SpecError(
            f"GPU spec has {len(group_sizes)} group sizes but {len(block_indices)} block indices"
        )
    spans: list[GroupSpan] = []
    block_pos = 0
    chunk_pos = 0
    for g, (n, idx) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if n < 0:
            raise SpecError(f"GPU spec group {g}: negative group size {n}")
        if idx < 0:
            raise SpecError(f"GPU spec group {g}: negative block index {idx}")
        skip = idx % blocks_per_chunk
        chunks = (n + skip + blocks_per_chunk - 1) // blocks_per_chunk if n else 0
        spans.append(GroupSpan(g, block_pos, n, chunk_pos, skip, chunks))
        block_pos += n
        chunk_pos += chunks
    if block_pos != num_block_ids:
        raise SpecError(
            f"GPU spec group sizes sum to {block_pos} but it lists {num_block_ids} block ids"
        )
    if chunk_pos != num_chunks:
        raise SpecError(
            f"GPU spec needs {chunk_pos} CPU chunks (blocks_per_chunk={blocks_per_chunk}, "
            f"group sizes {list(group_sizes)}, block indices {list(block_indices)}) "
            f"but the CPU spec lists {num_chunks} slots"
        )
    return spans


def plan_block_copies(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slots: Sequence[int],
    blocks_per_chunk: int,
) -> list[BlockCopy]:
    """One (group, gpu_block_id, cpu_slot, sub_block) entry per GPU block, in spec order.

    The reference mapping (backends may compute the same arrays vectorised, per
    :func:`plan_spans`). Duplicate slots are rejected (one slot holds one chunk).

    raises: SpecError
    post: len(__return__) == len(block_ids)
    post: [c[1] for c in __return__] == list(block_ids)
    post: all(0 <= c[3] < blocks_per_chunk for c in __return__)
    post: {c[2] for c in __return__} == set(slots)
    post: len({(c[2], c[3]) for c in __return__}) == len(__return__)
    post: [c[0] for c in __return__] == sorted(c[0] for c in __return__)
    """
    if len(set(slots)) != len(slots):
        raise SpecError(f"CPU spec lists a slot twice: {list(slots)}")
    spans = plan_spans(group_sizes, block_indices, len(block_ids), len(slots), blocks_per_chunk)
    out: list[BlockCopy] = []
    for sp in spans:
        for j in range(sp.num_blocks):
            pos = sp.skip + j
            out.append(
                (
                    sp.group,
                    block_ids[sp.first_block + j],
                    slots[sp.first_chunk + pos // blocks_per_chunk],
                    pos % blocks_per_chunk,
                )
            )
    return out


_INT_VALUE: Callable[[Any], int] = int.__index__
"""An id as the exact int it equals (raises TypeError for a non-int, as comparing one did)."""


def validate_ids(
    block_ids: Sequence[int], slots: Sequence[int], num_gpu_blocks: int, num_slots: int
) -> None:
    """Raise :class:`SpecError` unless every id is in range and no slot is listed twice.

    raises: SpecError
    post: all(0 <= b < num_gpu_blocks for b in block_ids)
    post: all(0 <= s < num_slots for s in slots)
    """
    # ids are compared as the ints they equal (int.__index__), never through their own
    # operators: an int subclass whose comparisons lie must not pass as in range
    value = _INT_VALUE
    if block_ids and (
        min(map(value, block_ids)) < 0 or max(map(value, block_ids)) >= num_gpu_blocks
    ):
        bad = [b for b in block_ids if not 0 <= value(b) < num_gpu_blocks]
        raise SpecError(f"GPU block ids {bad[:8]} out of range 0..{num_gpu_blocks - 1}")
    if slots and (min(map(value, slots)) < 0 or max(map(value, slots)) >= num_slots):
        bad = [s for s in slots if not 0 <= value(s) < num_slots]
        raise SpecError(f"CPU slots {bad[:8]} out of range 0..{num_slots - 1}")
    if len(set(slots)) != len(slots):
        raise SpecError(f"CPU spec lists a slot twice: {list(slots)[:16]}")


def job_specs(job: TransferJob, is_store: bool) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    """The (GPU, CPU) specs of ``job``; a store reads the GPU side, a load writes it."""
    gpu, cpu = (job.src, job.dst) if is_store else (job.dst, job.src)
    kind = "store" if is_store else "load"
    if not isinstance(gpu, GPULoadStoreSpec):
        raise SpecError(f"{kind} of request {job.req_id!r}: GPU side is {type(gpu).__name__}")
    if not isinstance(cpu, CPULoadStoreSpec):
        raise SpecError(f"{kind} of request {job.req_id!r}: CPU side is {type(cpu).__name__}")
    return gpu, cpu


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------


class OffloadingWorker:
    """Executes the scheduler's jobs on one rank and reports completions and failures.

    Args:
        backend: moves the bytes of this rank's shard.
        rank: this worker's rank (for error messages).
        store_writer: whether this rank copies stores. With a replicated KV layout only one
            rank needs to; the others acknowledge stores at once but still run loads.

    Each job is reported exactly once per rank (completed or failed). A result the backend
    reports for a job that is not in flight on this worker (unknown, or already reported as
    failed) is ignored and counted in :attr:`ignored_results`.
    """

    __slots__ = (
        "_backend",
        "_closed",
        "_deferred",
        "_inflight",
        "_pulled",
        "_report",
        "ignored_results",
        "rank",
        "store_writer",
    )

    def __init__(self, backend: TransferBackend, rank: int = 0, store_writer: bool = True) -> None:
        for method in ("submit", "poll", "wait", "shutdown"):
            if not callable(getattr(backend, method, None)):
                raise ConfigError(
                    f"OffloadingWorker.backend must be a TransferBackend (no {method}()), got "
                    f"{describe(backend)}",
                    "OffloadingWorker.backend",
                    backend,
                )
        validate.config_int("OffloadingWorker", "rank", rank, 0)
        validate.config_bool("OffloadingWorker", "store_writer", store_writer)
        self._backend = backend
        self.rank = rank
        self.store_writer = store_writer
        self._deferred: dict[int, TransferJob] = {}
        self._inflight: dict[int, bool] = {}  # job id -> is_store
        self._pulled: set[int] = set()
        self._report = WorkerMetadata(rank=rank)
        self._closed = False
        self.ignored_results = 0

    # -- introspection --------------------------------------------------------------------
    @property
    def in_flight(self) -> frozenset[int]:
        """Job ids submitted to the backend and not reported yet."""
        return frozenset(self._inflight)

    @property
    def deferred(self) -> tuple[int, ...]:
        """Store job ids queued for submission at the next step, in order."""
        return tuple(self._deferred)

    # -- per-step hooks ---------------------------------------------------------------------
    def start_step(self, meta: ConnectorMetadata) -> None:
        """Flush handling, then submit this step's loads (before the step's compute).

        Raises :class:`~statecore.errors.InvalidMetadataError` (nothing submitted) when
        ``meta`` is not a well-formed :class:`~statecore.wire.ConnectorMetadata`.
        """
        self._check_open("start_step")
        validate.connector_metadata(meta, "start_step")
        self._pulled = set()
        for job_id in meta.jobs_to_flush:
            job = meta.store_jobs.get(job_id)
            if job is not None:
                self._pulled.add(job_id)
                if self.store_writer:
                    self._deferred[job_id] = job
                else:
                    self._report.mark_completed(job_id)
        if self._deferred:
            deferred, self._deferred = self._deferred, {}
            for job_id, job in deferred.items():
                self._submit(job_id, job, True)
        if meta.jobs_to_flush:
            self._wait(meta.jobs_to_flush)
        for job_id, job in meta.load_jobs.items():
            self._submit(job_id, job, False)

    def end_step(self, meta: ConnectorMetadata) -> None:
        """After the step's compute: queue its stores for the start of the next step."""
        self._check_open("end_step")
        validate.connector_metadata(meta, "end_step")
        for job_id, job in meta.store_jobs.items():
            if job_id in self._pulled:
                continue
            if self.store_writer:
                self._deferred[job_id] = job
            else:
                self._report.mark_completed(job_id)
        self._pulled = set()

    def build_worker_metadata(self) -> WorkerMetadata:
        """Poll the backend; return this rank's report since the last call, and reset it."""
        if not self._closed:
            self._poll()
        report, self._report = self._report, WorkerMetadata(rank=self.rank)
        return report

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until those of ``job_ids`` in flight are done (they are reported next poll)."""
        self._check_open("wait")
        validate.id_collection(job_ids, "wait", "job_ids")
        self._wait(job_ids)

    def shutdown(self) -> None:
        """Wait for every transfer in flight, then shut the backend down.

        Stores still deferred are never submitted: they are reported failed, like any
        in-flight job the backend could not finish; a final :meth:`build_worker_metadata`
        returns them.
        """
        if self._closed:
            return
        for job_id in self._deferred:
            self._report.mark_failed(job_id)
        self._deferred = {}
        if self._inflight:
            self._wait(tuple(self._inflight))
            self._poll()
        for job_id in list(self._inflight):
            self._fail(job_id)
        self._closed = True
        self._backend.shutdown()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise LifecycleError("worker", self.rank, "shut down", call)

    def _submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        if job_id in self._inflight:
            self.ignored_results += 1  # submitted twice: the first submission stands
            return
        try:
            self._backend.submit(job_id, job, is_store)
        except Exception:
            self._report.mark_failed(job_id)
            return
        self._inflight[job_id] = is_store

    def _fail(self, job_id: int) -> None:
        del self._inflight[job_id]
        self._report.mark_failed(job_id)

    def _wait(self, job_ids: Collection[int]) -> None:
        waiting = [j for j in job_ids if j in self._inflight]
        if not waiting:
            return
        try:
            self._backend.wait(waiting)
        except Exception:
            # Completion cannot be confirmed: the job's bytes must not be trusted.
            for job_id in waiting:
                if job_id in self._inflight:
                    self._fail(job_id)

    def _poll(self) -> None:
        try:
            results = self._backend.poll()
        except Exception:
            # Which job broke is unknown. Quiesce what we can, then fail everything in flight
            # so that no job stays pending forever on this rank.
            inflight = tuple(self._inflight)
            with contextlib.suppress(Exception):
                self._backend.wait(inflight)
            for job_id in inflight:
                self._fail(job_id)
            return
        stats = self._report.stats
        for res in results:
            is_store = self._inflight.pop(res.job_id, None)
            if is_store is None:
                self.ignored_results += 1
                continue
            if res.success:
                self._report.mark_completed(res.job_id)
                (stats.store if is_store else stats.load).record(res.nbytes, res.seconds)
            else:
                self._report.mark_failed(res.job_id)


def aggregate(reports: Iterable[WorkerMetadata]) -> WorkerMetadata:
    """Merge several ranks' reports: counts add up per job id, statistics concatenate.

    Each report is checked (entries included) by :meth:`WorkerMetadata.aggregate`.
    """
    out = WorkerMetadata()
    for i, r in enumerate(reports):
        if r is None:
            validate._fail("aggregate", f"reports[{i}]", r, "a WorkerMetadata")
        out = out.aggregate(r)
    return out


# --------------------------------------------------------------------------------------------
# Test and simulation backends
# --------------------------------------------------------------------------------------------


def _never(job_id: int) -> bool:
    return False


def _never_call() -> bool:
    return False


class FaultyBackend:
    """Wraps a backend and injects failures (tests and the simulator).

    Args:
        inner: the backend doing the real work.
        fail_job: jobs for which this is true are not run; ``poll`` reports them failed
            (``success=False``), in order with the other results.
        fail_submit: jobs for which this is true make ``submit`` raise :class:`TransferError`.
        fail_poll: called at each ``poll``; when true, ``poll`` raises :class:`TransferError`.
        fail_wait: called at each ``wait``; when true, ``wait`` raises :class:`TransferError`.
    """

    def __init__(
        self,
        inner: TransferBackend,
        fail_job: Callable[[int], bool] = _never,
        fail_submit: Callable[[int], bool] = _never,
        fail_poll: Callable[[], bool] = _never_call,
        fail_wait: Callable[[], bool] = _never_call,
    ) -> None:
        self.inner = inner
        self.fail_job = fail_job
        self.fail_submit = fail_submit
        self.fail_poll = fail_poll
        self.fail_wait = fail_wait
        self._failed: list[TransferResult] = []

    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Submit to the inner backend unless this job is to fail."""
        if self.fail_submit(job_id):
            raise TransferError(f"injected submit failure for job {job_id}")
        if self.fail_job(job_id):
            self._failed.append(TransferResult(job_id, False, 0, 0.0, is_store))
            return
        self.inner.submit(job_id, job, is_store)

    def poll(self) -> list[TransferResult]:
        """The inner backend's results plus the injected failures."""
        if self.fail_poll():
            raise TransferError("injected poll failure")
        out, self._failed = self._failed, []
        return out + self.inner.poll()

    def wait(self, job_ids: Collection[int]) -> None:
        """Forward to the inner backend."""
        if self.fail_wait():
            raise TransferError("injected wait failure")
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        """Forward to the inner backend."""
        self.inner.shutdown()


class MemoryBackend:
    """A pure-Python backend over byte arrays, with explicit progress (tests, simulator).

    The "GPU" is one ``bytearray`` per canonical tensor (``num_gpu_blocks * page_bytes``), the
    CPU side one ``bytearray`` per tensor of ``num_slots * page_bytes * blocks_per_chunk``
    (or views of a :class:`~statecore.pool.CPUPool`'s regions). A submitted job is validated
    at once but its bytes move only when it runs: at :meth:`progress`, at :meth:`wait` (which
    runs the waited jobs and every earlier job of the same direction: FIFO per direction), or
    at :meth:`poll` when ``auto_progress`` is true.

    Args:
        page_bytes: bytes of one GPU block in each canonical tensor.
        num_gpu_blocks: GPU blocks per tensor.
        cpu: one writable buffer per tensor; row ``slot`` holds a chunk.
        blocks_per_chunk: GPU blocks per CPU chunk.
        group_tensors: per KV-cache group, the canonical tensors it uses (default: one group
            using every tensor).
        auto_progress: run every pending job at each :meth:`poll`.
    """

    def __init__(
        self,
        page_bytes: Sequence[int],
        num_gpu_blocks: int,
        cpu: Sequence[memoryview | bytearray],
        blocks_per_chunk: int,
        group_tensors: Sequence[Sequence[int]] | None = None,
        auto_progress: bool = True,
    ) -> None:
        if len(cpu) != len(page_bytes):
            raise SpecError(f"{len(page_bytes)} GPU tensors but {len(cpu)} CPU regions")
        self.page_bytes = tuple(page_bytes)
        self.num_gpu_blocks = num_gpu_blocks
        self.gpu = [bytearray(num_gpu_blocks * p) for p in page_bytes]
        self.cpu = [memoryview(c).cast("B") for c in cpu]
        self.bpc = blocks_per_chunk
        self.num_slots = min(
            len(c) // (p * blocks_per_chunk) for c, p in zip(self.cpu, page_bytes, strict=True)
        )
        self.group_tensors = (
            [list(range(len(page_bytes)))]
            if group_tensors is None
            else [list(g) for g in group_tensors]
        )
        self.auto_progress = auto_progress
        self._pending: dict[bool, deque[tuple[int, list[BlockCopy]]]] = {
            True: deque(),
            False: deque(),
        }
        self._done: list[TransferResult] = []

    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Validate and queue the job."""
        gpu, cpu = job_specs(job, is_store)
        if len(gpu.group_sizes) != len(self.group_tensors):
            raise SpecError(
                f"job {job_id}: spec has {len(gpu.group_sizes)} groups, "
                f"backend has {len(self.group_tensors)}"
            )
        validate_ids(gpu.block_ids, cpu.slots, self.num_gpu_blocks, self.num_slots)
        plan = plan_block_copies(
            gpu.block_ids, gpu.group_sizes, gpu.block_indices, cpu.slots, self.bpc
        )
        self._pending[is_store].append((job_id, plan))

    def _run_one(self, is_store: bool) -> None:
        job_id, plan = self._pending[is_store].popleft()
        nbytes = 0
        for group, block, slot, sub in plan:
            for t in self.group_tensors[group]:
                p = self.page_bytes[t]
                g0 = block * p
                c0 = (slot * self.bpc + sub) * p
                if is_store:
                    self.cpu[t][c0 : c0 + p] = self.gpu[t][g0 : g0 + p]
                else:
                    self.gpu[t][g0 : g0 + p] = self.cpu[t][c0 : c0 + p]
                nbytes += p
        self._done.append(TransferResult(job_id, True, nbytes, 0.0, is_store))

    def progress(self, max_jobs: int | None = None) -> int:
        """Run up to ``max_jobs`` pending jobs (all by default), stores first; return how many."""
        n = 0
        for is_store in (True, False):
            while self._pending[is_store] and (max_jobs is None or n < max_jobs):
                self._run_one(is_store)
                n += 1
        return n

    def poll(self) -> list[TransferResult]:
        """Results of the jobs that ran since the last poll."""
        if self.auto_progress:
            self.progress()
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: Collection[int]) -> None:
        """Run the waited jobs and every earlier job of their direction."""
        wanted = set(job_ids)
        for is_store in (True, False):
            q = self._pending[is_store]
            last = max((i for i, (j, _) in enumerate(q) if j in wanted), default=-1)
            for _ in range(last + 1):
                self._run_one(is_store)

    def shutdown(self) -> None:
        """Run everything pending."""
        self.progress()

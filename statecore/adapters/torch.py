"""Torch transfer backend: moves KV-cache pages between GPU blocks and the shared CPU pool.

GPU side: the engine's KV-cache tensors, block-first. Each *canonical tensor* is given as a
tensor whose first dimension is the GPU block and whose per-block part is contiguous (any
dtype, any inner shape; a block stride larger than the page, as in packed layouts, is
allowed); it is viewed as ``(num_gpu_blocks, page_bytes)`` bytes. Each KV-cache group lists
the canonical tensors it uses (``group_tensors``; default: one group using all of them).

CPU side: the :class:`statecore.pool.CPUPool` shared with the managers, one region per
canonical tensor, one row of ``page_bytes * blocks_per_chunk`` bytes per slot. The regions
are viewed with :func:`torch.frombuffer` (no copy); sub-row ``slot * bpc + sub`` holds GPU
page ``sub`` of the chunk in ``slot``.

The mapping from a job's specs to page copies is :func:`statecore.worker.plan_spans`
(reference 4.3); every mismatch raises :class:`statecore.errors.SpecError` before any byte
moves.

Execution:

* **CPU** (no CUDA, CI): a job runs inside ``submit``; ``poll`` reports it (synchronous, so
  a simulation replays exactly from its seed). A job is planned as *segments*, one per group
  span and tensor: the GPU block ids and CPU sub-rows (slices of the spec's tuples) with the
  bases and strides that make them addresses, taken once at construction. The compiled loop
  :func:`statecore.adapters._hostcopy.copy_blocks` computes the addresses, merges pages that
  continue each other on both sides, and copies a whole piece with the GIL released once;
  jobs of 1 MiB and more are shared by ``torch.get_num_threads()`` persistent threads that
  claim pieces of the segments. Such jobs *stream*: non-temporal stores (no read of each
  destination line first) while a read-ahead 16 KiB in front of the copy, along the piece's
  pages and across as many as that takes, prefetches the source (what a contiguous copy gets
  from the hardware prefetcher, which stops at every page) and touches each destination page
  once before its stores (its TLB entry). Where the extension was not built (no C compiler
  at install; :func:`host_copy_impl` says which), Python computes the addresses and one
  ctypes ``memmove`` per run does the same more slowly: each call takes the GIL back, so
  only large jobs of long copies are shared.
* **CPU test modes** (``copy_impl="staging"`` or ``"triton"`` on CPU tensors): the CUDA
  paths below, minus streams, pinning and registration, so CI runs their planning, queueing,
  polling and byte movement without a GPU (``"triton"`` in Triton's interpreter).
* **CUDA**: one stream per direction, so completion is FIFO per direction; a store's stream
  first waits for the compute (current) stream; completion is a CUDA event per job;
  ``wait(job_ids)`` synchronises those events. The pool's regions are registered in place
  with ``cudaHostRegister`` (portable + mapped), in bounded chunks with rollback, and every
  failed runtime call is cleared and reported (:mod:`statecore.adapters._pinning`; the calls
  go through the :class:`CudaRuntime` seam, which tests replace with a fake that fails on
  demand). Before choosing a copy implementation the backend checks that its device's
  context is alive (a sticky error raises :class:`TransferError`: nothing can run on it). Two
  copy implementations, chosen at construction (logged):

  - ``"triton"``: one Triton kernel launch per job that copies every page straight between
    its GPU block and its final pinned host row (addresses computed on the host, vectorised,
    and shipped as one small array: :meth:`TorchTransferBackend.kernel_args`). The kernel
    lives in :mod:`statecore.adapters._triton_copy`, imported on first use. Needs Triton, a
    successful registration and a device that addresses registered memory at its host
    address (``cudaDevAttrCanUseHostPointerForRegisteredMem``, checked before any kernel
    touches the pool). The backend launches one kernel variant only (one block size for all
    its jobs; the length argument is not specialised); a warm-up at construction, on the
    backend's device, compiles that variant and checks its bytes, so no job compiles on the
    engine thread. Without a GPU, the tests run ``kernel_args`` and the kernel in Triton's
    interpreter on host addresses.
  - ``"staging"`` (fallback): a fixed ring of preallocated chunks (``staging_chunks`` x
    ``staging_chunk_bytes``, default 4 x 16 MiB: 64 MiB of device memory outside the
    engine's KV budget and 64 MiB pinned host); a job is cut into chunk-sized pieces: GPU
    gather (``index_select``) into a device chunk, one copy to its pinned host chunk, host
    scatter into the pool rows once the piece's event completed (loads: host gather, copy,
    ``index_copy_``). The host gathers and scatters run on a staging thread, not the
    engine's. Used when Triton is missing or unusable, and when registration fails: the pool
    then stays pageable (one extra host copy per byte; the pool stays authoritative).

Failure model (details in the transfers guide): a failed job is reported failed exactly once
and never raises into the engine; a device-side fault kills the CUDA context, after which
every job fails (or ``poll`` raises) and ``wait`` may block as long as the device does.

Factories: :func:`sim_backend` (one simulated rank over its regions of a shared pool),
:func:`backend_from_vllm` (a vLLM worker's KV caches, canonicalised by
:func:`canonical_kv_tensors`, over the worker's own pool).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import importlib
import logging
import mmap
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from statecore.errors import ConfigError, SpecError, TransferError
from statecore.manager import CPULoadStoreSpec
from statecore.pool import CPUPool
from statecore.wire import GPULoadStoreSpec, TransferJob
from statecore.worker import (
    GroupSpan,
    TransferResult,
    job_specs,
    plan_spans,
    validate_ids,
)

from ._pinning import (
    DEFAULT_CHUNK_BYTES,
    CudaCallError,
    CudaRuntime,
    HostRegistration,
    TorchCudaRuntime,
)

__all__ = [
    "DEFAULT_STAGING_CHUNKS",
    "DEFAULT_STAGING_CHUNK_BYTES",
    "CopyImpl",
    "CudaCallError",
    "CudaRuntime",
    "HostRegistration",
    "TorchCudaRuntime",
    "TorchTransferBackend",
    "backend_from_vllm",
    "canonical_kv_tensors",
    "copy_word_bytes",
    "host_copy_impl",
    "run_segments",
    "sim_backend",
    "triton_copy",
]

log = logging.getLogger(__name__)
_cuda: Any = torch.cuda  # partly untyped module

CopyImpl = Literal["auto", "triton", "staging"]

# Host jobs with the ctypes fallback (measured on 2 cores: 32 KiB copies gain nothing from a
# second thread, 48 KiB ones do; 4 MiB jobs of 64 KiB copies gain, 2 MiB ones lose):
_HOST_PARALLEL_MIN_BYTES = 4 << 20  # below this a CPU job is copied on the calling thread
_HOST_PARALLEL_MIN_RUN = 40 << 10  # ... and when its copies are shorter than this on average
_PIECE_BYTES = 256 << 10  # least bytes per piece that copy threads claim in a parallel host job
# With the native copy loop (no GIL fight), a job is shared from this size on:
_NATIVE_PARALLEL_MIN_BYTES = 1 << 20
# ... and from this size on it streams: non-temporal stores, the source prefetched across
# runs (a job this large evicts most of what its destination lines would displace, and its
# destination is not read back by this CPU soon: a store's pool rows, a load's KV blocks)
_STREAM_MIN_BYTES = 1 << 20
DEFAULT_STAGING_CHUNK_BYTES = 16 << 20
"""Bytes of one chunk of the staging ring (at least the largest page)."""
DEFAULT_STAGING_CHUNKS = 4
"""Chunks in the staging ring: with the default, 64 MiB of device and 64 MiB of pinned host
memory per backend, allocated at construction when the staging path is chosen."""


@functools.cache
def triton_copy() -> Any | None:
    """:mod:`statecore.adapters._triton_copy` (the Triton page-copy kernel), or ``None``.

    Imported on first use, so the CPU path never pays for importing Triton.
    """
    try:
        return importlib.import_module("statecore.adapters._triton_copy")
    except ImportError:
        return None


def copy_word_bytes(values: Sequence[int]) -> int:
    """The widest word (8 or 4 bytes) dividing every address and size in ``values``; 0 if none."""
    if all(v % 8 == 0 for v in values):
        return 8
    if all(v % 4 == 0 for v in values):
        return 4
    return 0


# --------------------------------------------------------------------------------------------
# Host copies
# --------------------------------------------------------------------------------------------


def _libc_memmove() -> Callable[[int, int, int], object]:
    """The C library's ``memmove`` with the cheapest argument and result conversions.

    Used only where the native copy loop (:mod:`statecore.adapters._hostcopy`) was not
    built. Each call releases the GIL for the copy and takes it back for the conversions, so
    ``size_t`` arguments and no result keep the time spent holding it short.
    """
    try:
        fn = ctypes.CDLL(None).memmove
    except (OSError, AttributeError, TypeError):  # pragma: no cover - platform dependent
        return ctypes.memmove
    fn.restype = None
    fn.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)  # cheapest conversion
    return fn  # type: ignore[no-any-return,unused-ignore]


_memmove = _libc_memmove()


# One copy run of a CPU job, the arguments of copy_blocks before (start, stop):
# (dst_base, dst_stride, dst_index, src_base, src_stride, src_index, page_bytes)
_Segment = tuple[int, int, Sequence[int], int, int, Sequence[int], int]


def _ctypes_copy_blocks(
    dst_base: int,
    dst_stride: int,
    dst_index: Sequence[int],
    src_base: int,
    src_stride: int,
    src_index: Sequence[int],
    nbytes: int,
    start: int = 0,
    stop: int | None = None,
) -> tuple[int, int]:
    """Fallback of :func:`statecore.adapters._hostcopy.copy_blocks`: addresses computed in
    Python, one ctypes call per merged run."""
    di, si = dst_index[start:stop], src_index[start:stop]
    if not di:
        return 0, 0
    if dst_stride == nbytes == src_stride and 1 in map(operator.sub, di[1:], di):
        first_d, first_s, lengths = _runs(di, si)
        sizes = [k * nbytes for k in lengths]
    else:
        first_d, first_s, sizes = list(di), list(si), [nbytes] * len(di)
    dst = [dst_base + d * dst_stride for d in first_d]
    src = [src_base + x * src_stride for x in first_s]
    deque(map(_memmove, dst, src, sizes), 0)
    return len(di) * nbytes, len(sizes)


_native_copy_blocks: Callable[..., tuple[int, int]] | None
_native_ids_valid: Callable[[Sequence[int], int, Sequence[int], int], bool] | None
try:  # the C loop: reads a piece's indices, then copies all of it without the GIL
    from ._hostcopy import copy_blocks as _native_copy_blocks
    from ._hostcopy import ids_valid as _native_ids_valid
except ImportError:  # pragma: no cover - the extension is optional (no compiler at install)
    _native_copy_blocks = _native_ids_valid = None


def _validate_ids(
    block_ids: Sequence[int], slots: Sequence[int], num_gpu_blocks: int, num_slots: int
) -> None:
    """:func:`statecore.worker.validate_ids`, accepting at C speed where the extension is
    built (a job of 4096 pages: a few microseconds instead of hundreds, while the copy
    threads wait); whatever the C check does not accept, the Python check rules on (and
    names)."""
    if (
        _native_ids_valid is None
        or type(block_ids) not in (tuple, list)
        or type(slots) not in (tuple, list)
        or not _native_ids_valid(block_ids, num_gpu_blocks, slots, num_slots)
    ):
        validate_ids(block_ids, slots, num_gpu_blocks, num_slots)


def host_copy_impl() -> Literal["native", "ctypes"]:
    """Which host copy loop this installation runs: the compiled one, or the ctypes fallback.

    ``"native"``: ``statecore.adapters._hostcopy`` was built at install time; a piece of a
    job is copied with one release of the GIL, so copy threads run truly in parallel.
    ``"ctypes"``: one ``memmove`` call per copy, each taking the GIL back; several threads
    then mostly hand the GIL to each other, and large jobs are still shared but gain less.
    """
    return "native" if _native_copy_blocks is not None else "ctypes"


def _copy_blocks(
    seg: _Segment, start: int = 0, stop: int | None = None, stream: bool = False
) -> tuple[int, int]:
    """Copy pages ``[start, stop)`` of a segment; returns (bytes, memmove calls).

    ``stream``: the native loop's streaming copy (the ctypes fallback ignores it).
    """
    if _native_copy_blocks is not None:
        return _native_copy_blocks(*seg, start, stop, stream)
    return _ctypes_copy_blocks(*seg, start, stop)


def _segment_pieces(
    segments: Sequence[_Segment], nbytes: int, threads: int
) -> deque[tuple[_Segment, int, int]]:
    """Cut a job's segments into pieces ``(segment, a, b)`` for ``threads`` threads to claim.

    About four pieces per thread (at least ``_PIECE_BYTES`` each), so a thread that starts
    late or copies slowly claims fewer and the threads finish together.
    """
    target = max(_PIECE_BYTES, nbytes // (4 * threads))
    out: deque[tuple[_Segment, int, int]] = deque()
    for seg in segments:
        n = len(seg[2])
        per = max(1, target // max(1, seg[6]))
        for a in range(0, n, per):
            out.append((seg, a, min(n, a + per)))
    return out


def run_segments(
    segments: Sequence[_Segment],
    nbytes: int,
    pages: int,
    executor: ThreadPoolExecutor | None,
    threads: int,
) -> None:
    """Run validated host copy segments; large jobs are shared by ``threads`` threads.

    The calling thread is one of them; ``executor`` runs the others. Small jobs stay on the
    calling thread (handing work to another thread costs tens of microseconds). With the
    ctypes fallback, jobs of short pages stay there too: each ``memmove`` call takes the GIL
    back, so several threads mostly fight over it. Jobs of ``_STREAM_MIN_BYTES`` and more
    stream (native loop only: non-temporal stores, the source prefetched across pages).
    """
    stream = nbytes >= _STREAM_MIN_BYTES
    if executor is None or threads <= 1 or pages < 2:
        share = False
    elif _native_copy_blocks is not None:
        share = nbytes >= _NATIVE_PARALLEL_MIN_BYTES
    else:
        share = nbytes >= _HOST_PARALLEL_MIN_BYTES and nbytes >= _HOST_PARALLEL_MIN_RUN * pages
    if not share or executor is None:
        for seg in segments:
            _copy_blocks(seg, 0, None, stream)
        return
    pieces = _segment_pieces(segments, nbytes, threads)
    futures = [executor.submit(_drain_segment_pieces, pieces, stream) for _ in range(threads - 1)]
    _drain_segment_pieces(pieces, stream)
    for f in futures:
        if not f.cancel():  # a helper that has not started yet has nothing left to do
            f.result()


def _drain_segment_pieces(pieces: deque[tuple[_Segment, int, int]], stream: bool) -> None:
    """Claim pieces from ``pieces`` (``popleft`` is atomic) and copy them until none is left."""
    pop = pieces.popleft
    while True:
        try:
            seg, a, b = pop()
        except IndexError:
            return
        _copy_blocks(seg, a, b, stream)


def _runs(ids: Sequence[int], rows: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Maximal runs over which both ``ids`` and ``rows`` go up by one.

    Returns (first id, first row, length) of each run, in order.
    """
    first_ids = [ids[0]]
    first_rows = [rows[0]]
    lengths: list[int] = []
    start = 0
    prev_id, prev_row = ids[0], rows[0]
    for i in range(1, len(ids)):
        g, r = ids[i], rows[i]
        if g != prev_id + 1 or r != prev_row + 1:
            lengths.append(i - start)
            start = i
            first_ids.append(g)
            first_rows.append(r)
        prev_id, prev_row = g, r
    lengths.append(len(ids) - start)
    return first_ids, first_rows, lengths


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


class _HostEvent:
    """Stands in for a CUDA event in the CPU test modes, where a job's device-side work is
    done by the time ``submit`` returns: recorded means complete."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _HostEvent) -> float:
        """Milliseconds from this event to ``end`` (as ``torch.cuda.Event.elapsed_time``)."""
        return (end.t - self.t) * 1000.0


@dataclass(slots=True)
class _Pending:
    job_id: int
    is_store: bool
    nbytes: int
    start: Any  # torch.cuda.Event
    end: Any  # torch.cuda.Event
    on_done: Callable[[], None] | None = None
    keep: list[torch.Tensor] = field(default_factory=list)


@dataclass(slots=True)
class _Span:
    """One KV-cache group's pages of a job: GPU block ids and CPU sub-rows, co-indexed."""

    group: int
    ids: Sequence[int]
    rows: Sequence[int]


@dataclass(slots=True)
class _StagedJob:
    """A staged job: its pages, the compute-stream event its copies wait for, its progress."""

    job_id: int
    is_store: bool
    nbytes: int
    ready: Any  # torch.cuda.Event recorded on the compute stream at submit; None on the CPU
    spans: list[_Span]
    start: Any = None  # event before its first piece
    end: Any = None  # event of its last piece
    pieces_left: int = 0
    submitted: bool = False  # every piece enqueued (or enqueueing failed)
    ok: bool = True
    finished: bool = False  # every piece finished; reported once the jobs before it are


@dataclass(slots=True)
class _Piece:
    """A part of a staged job that fits one ring chunk, enqueued on the job's stream."""

    job: _StagedJob
    slot: int
    event: Any
    segments: list[_Segment]  # host side: a store's scatter after ``event``; a load's gather
    nbytes: int
    pages: int
    keep: list[torch.Tensor]


# (tensor, GPU block ids, CPU sub-rows, byte offset in the chunk) of one run of pages
_Part = tuple[int, Sequence[int], Sequence[int], int]


class _StagingRing:
    """The staging path's fixed ring of preallocated chunks and the thread that drives it.

    ``chunks`` chunks of ``chunk_bytes``, each a device buffer and a host buffer, are
    allocated once (memory cost: ``chunks * chunk_bytes`` of device memory, outside the
    engine's KV budget, and as much host memory, registered page-locked like the pool and
    released at close). A job is cut into *pieces* of at
    most one chunk; a piece takes the next chunk in ring order once the piece that used it
    before is finished (its event completed and, for a store, its bytes scattered into the
    pool rows). Store piece: GPU gather (``index_select``) into the device chunk, one copy to
    the host chunk, later the host scatter into the pool rows. Load piece: host gather into
    the host chunk, one copy to the device chunk, ``index_copy_`` into the GPU blocks. Every
    piece first waits for the compute stream's event recorded when its job was submitted.

    On CUDA the host gathers and scatters and the enqueueing run on one staging thread
    (``statecore-staging``), so ``submit`` returns after planning; jobs finish in submission
    order. ``inline`` (the CPU test mode's default) runs the same steps on the calling thread.
    """

    def __init__(self, be: TorchTransferBackend, chunk_bytes: int, chunks: int, inline: bool):
        if chunks < 1:
            raise ConfigError(f"staging_chunks must be >= 1, got {chunks}")
        self.be = be
        self.chunk_bytes = chunk_bytes
        self.chunks = chunks
        dev = be.device
        self.gpu = [torch.empty(chunk_bytes, dtype=torch.uint8, device=dev) for _ in range(chunks)]
        # Host chunks: one anonymous mapping of exactly chunks * chunk_bytes, registered
        # (page-locked) like the pool, unregistered and unmapped at close; not torch's caching
        # host allocator, which rounds up to a power of two and keeps blocks after use.
        self.host_map = mmap.mmap(-1, chunks * chunk_bytes)
        flat = torch.frombuffer(self.host_map, dtype=torch.uint8)
        self.host = [flat[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)]
        self.host_reg: HostRegistration | None = None
        self.pinned = False
        if be._rt is not None and be.registration is not None:
            self.host_reg = HostRegistration(be._rt, be.registration.chunk_bytes)
            self.pinned = self.host_reg.register([(flat.data_ptr(), flat.numel())])
            if not self.pinned:
                be.cuda_errors.extend(self.host_reg.errors)
                self.host_reg.errors.clear()
                log.warning("staging host chunks not page-locked: host copies are synchronous")
        del flat
        self.last: list[_Piece | None] = [None] * chunks
        self.next_slot = 0
        self.outstanding: deque[_Piece] = deque()  # enqueued, not finished, in ring order
        self.cond = threading.Condition()
        self.jobs: deque[_StagedJob] = deque()  # submitted, not yet enqueued (thread mode)
        self.live: dict[int, _StagedJob] = {}  # submitted, not reported, in submission order
        self.done: list[TransferResult] = []
        self.closing = False
        self.dead = False
        self.thread: threading.Thread | None = None
        if not inline:
            self.thread = threading.Thread(target=self._run, name="statecore-staging", daemon=True)
            self.thread.start()

    def describe(self) -> str:
        """The ring's size and memory cost, for the log."""
        where = "thread" if self.thread is not None else "inline"
        total = self.chunks * self.chunk_bytes
        host = f"{total >> 20} MiB {'pinned ' if self.pinned else ''}host"
        mem = f"{total >> 20} MiB device + {host}" if self.be.is_cuda else host
        return f"{self.chunks} x {self.chunk_bytes >> 10} KiB ({mem}, {where})"

    # -- the calling (engine) thread ----------------------------------------------------------
    def submit(self, job: _StagedJob) -> None:
        with self.cond:
            if self.dead:
                raise TransferError(f"job {job.job_id}: the staging thread has died")
            self.live[job.job_id] = job
            if self.thread is not None:
                self.jobs.append(job)
                self.cond.notify_all()
                return
        self._process(job)
        self._reap(block=False)

    def poll(self) -> list[TransferResult]:
        if self.thread is None:
            self._reap(block=False)
        with self.cond:
            out, self.done = self.done, []
        return out

    def wait(self, job_ids: Collection[int]) -> None:
        def finished() -> bool:
            return not any(j in self.live for j in job_ids)

        if self.thread is None:
            while not finished() and self.outstanding:
                self._finish_oldest(block=True)
            return
        with self.cond:
            self.cond.wait_for(finished)

    def close(self) -> None:
        """Finish every job, stop the thread, and drop the chunks."""
        if self.thread is not None:
            with self.cond:
                self.closing = True
                self.cond.notify_all()
            self.thread.join()
            self.thread = None
        else:
            self._reap(block=True)
        self.gpu, self.host = [], []
        if self.host_reg is not None:
            self.host_reg.release()
            self.be.cuda_errors.extend(self.host_reg.errors)
            self.host_reg.errors.clear()
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when collected
            self.host_map.close()

    # -- the staging thread (or the calling thread when inline) -------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover - every step above catches its own
            log.critical("staging thread died: %s; failing every job in flight", exc)
            with self.cond:
                self.dead = True
                for job in self.live.values():
                    job.ok = False
                    self.done.append(self._result(job))
                self.live.clear()
                self.cond.notify_all()

    def _loop(self) -> None:
        with self.be._device_ctx():
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.jobs or self.outstanding or self.closing)
                    if not self.jobs and not self.outstanding:
                        return  # closing, and nothing left
                    job = self.jobs.popleft() if self.jobs else None
                if job is not None:
                    self._process(job)
                else:
                    self._finish_oldest(block=True)

    def _reap(self, block: bool) -> None:
        while self.outstanding and self._finish_oldest(block):
            pass

    def _process(self, job: _StagedJob) -> None:
        """Enqueue every piece of ``job``; a failure fails the job (pieces enqueued finish)."""
        try:
            for parts in self._pieces(job):
                slot = self.next_slot
                while self.last[slot] is not None:  # the chunk is still in use: finish it
                    self._finish_oldest(block=True)
                self.next_slot = (slot + 1) % self.chunks
                piece = self._enqueue(job, slot, parts)
                job.pieces_left += 1
                job.end = piece.event
                self.last[slot] = piece
                self.outstanding.append(piece)
        except Exception as exc:
            log.error("job %d: staging failed: %s", job.job_id, exc)
            job.ok = False
        job.submitted = True
        if job.pieces_left == 0:
            self._complete(job)

    def _pieces(self, job: _StagedJob) -> Iterator[list[_Part]]:
        """The job's pages, span after span and tensor after tensor, cut into chunks."""
        be, cap = self.be, self.chunk_bytes
        parts: list[_Part] = []
        used = 0
        for sp in job.spans:
            for t in be.group_tensors[sp.group]:
                page, k, a = be.page_bytes[t], len(sp.ids), 0
                while a < k:
                    room = (cap - used) // page
                    if room == 0:
                        yield parts
                        parts, used = [], 0
                        continue
                    b = min(k, a + room)
                    parts.append((t, sp.ids[a:b], sp.rows[a:b], used))
                    used += (b - a) * page
                    a = b
        if parts:
            yield parts

    def _enqueue(self, job: _StagedJob, slot: int, parts: list[_Part]) -> _Piece:
        be, store = self.be, job.is_store
        host, gpu = self.host[slot], self.gpu[slot]
        hbase = host.data_ptr()
        segments: list[_Segment] = []
        nbytes = pages = 0
        for t, ids, rows, off in parts:
            page, k = be.page_bytes[t], len(ids)
            cbase, seq = be._cpu_base_i[t], range(k)
            if store:  # host chunk -> pool rows, once the piece's event has completed
                segments.append((cbase, page, rows, hbase + off, page, seq, page))
            else:  # pool rows -> host chunk, now
                segments.append((hbase + off, page, seq, cbase, page, rows, page))
            nbytes += k * page
            pages += k
        if not store:
            run_segments(segments, nbytes, pages, be._executor, be.threads)
        stream: Any = be._streams[store] if be.is_cuda else None
        event = _cuda.Event(enable_timing=True) if be.is_cuda else _HostEvent()
        keep: list[torch.Tensor] = []
        with be._on(stream):
            if job.ready is not None:
                stream.wait_event(job.ready)
            if job.start is None:
                job.start = _cuda.Event(enable_timing=True) if be.is_cuda else _HostEvent()
                job.start.record(stream)
            index: dict[tuple[int, ...], torch.Tensor] = {}
            views: list[tuple[int, torch.Tensor, torch.Tensor]] = []
            for t, ids, _, off in parts:
                key = tuple(ids)
                idx = index.get(key)
                if idx is None:
                    h = be._pinned(_int64_tensor(key))
                    idx = index[key] = h.to(be.device, non_blocking=True)
                    keep += (h, idx)
                k, page = len(ids), be.page_bytes[t]
                view = gpu[off : off + k * page].view(k, page)
                if store:
                    torch.index_select(be._gpu[t], 0, idx, out=view)
                views.append((t, idx, view))
            if store:
                host[:nbytes].copy_(gpu[:nbytes], non_blocking=True)
            else:
                gpu[:nbytes].copy_(host[:nbytes], non_blocking=True)
                for t, idx, view in views:
                    be._gpu[t].index_copy_(0, idx, view)
            event.record(stream)
        return _Piece(job, slot, event, segments, nbytes, pages, keep)

    def _finish_oldest(self, block: bool) -> bool:
        """Finish the oldest enqueued piece (a store's scatter included); False if ``block``
        is off and its device work is still running."""
        p = self.outstanding[0]
        try:
            if not block and not p.event.query():
                return False
            p.event.synchronize()
            if p.job.is_store:
                run_segments(p.segments, p.nbytes, p.pages, self.be._executor, self.be.threads)
        except Exception as exc:
            log.error("job %d: staged copy failed: %s", p.job.job_id, exc)
            p.job.ok = False
        self.outstanding.popleft()
        if self.last[p.slot] is p:
            self.last[p.slot] = None
        p.keep.clear()
        p.job.pieces_left -= 1
        if p.job.submitted and p.job.pieces_left == 0:
            self._complete(p.job)
        return True

    def _complete(self, job: _StagedJob) -> None:
        """Mark ``job`` finished and report every finished job not behind an unfinished one
        (a job that failed before any piece must not overtake earlier ones: FIFO)."""
        job.finished = True
        with self.cond:
            while self.live:
                first = next(iter(self.live.values()))
                if not first.finished:
                    break
                del self.live[first.job_id]
                self.done.append(self._result(first))
            self.cond.notify_all()

    @staticmethod
    def _result(job: _StagedJob) -> TransferResult:
        seconds = 0.0
        if job.ok and job.end is not None:
            try:
                seconds = job.start.elapsed_time(job.end) / 1000.0
            except Exception:  # a timing query on a failing device: the bytes are what count
                seconds = 0.0
        return TransferResult(
            job.job_id, job.ok, job.nbytes if job.ok else 0, seconds, job.is_store
        )


def _int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of ``values`` (through ``array``: about 3x faster than
    ``torch.tensor`` on a sequence of Python ints)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _block_view(t: torch.Tensor, idx: int) -> tuple[torch.Tensor, int, int]:
    """``(view, page_bytes, row_stride_bytes)`` of a block-first KV tensor as uint8 rows."""
    if t.dim() < 1 or t.shape[0] == 0:
        raise ConfigError(f"gpu_caches[{idx}]: needs a leading block dimension, got {t.shape}")
    es = t.element_size()
    block = t[0]
    if not block.is_contiguous():
        raise ConfigError(
            f"gpu_caches[{idx}]: each block must be contiguous (block-first layout), "
            f"got shape {tuple(t.shape)} strides {t.stride()}"
        )
    page = block.numel() * es
    stride = t.stride(0) * es if t.shape[0] > 1 else page
    if stride < page:
        raise ConfigError(f"gpu_caches[{idx}]: block stride {stride} B < page {page} B")
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(t.untyped_storage(), t.storage_offset() * es, (t.shape[0], page), (stride, 1))
    return raw, page, stride


def _region_view(pool: CPUPool, idx: int, rows: int, page: int) -> torch.Tensor:
    if pool.num_slots == 0:
        return torch.empty((0, page), dtype=torch.uint8)
    flat = torch.frombuffer(pool.region(idx), dtype=torch.uint8)
    return flat.view(rows, page)


class TorchTransferBackend:
    """Executes transfer jobs between torch KV-cache tensors and a :class:`CPUPool`.

    Args:
        gpu_caches: the canonical KV tensors, block-first (see the module docstring); all on
            one device (a CUDA device, or the CPU for CI and tests).
        pool: the shared CPU pool; ``pool.row_bytes[i]`` must be
            ``page_bytes(gpu_caches[i]) * blocks_per_chunk``.
        blocks_per_chunk: GPU blocks per CPU chunk.
        group_tensors: for each KV-cache group (in group order), the indices of the canonical
            tensors it uses. Default: one group that uses every tensor.
        copy_impl: CUDA copy implementation, ``"auto"`` (Triton if usable, else staging),
            ``"triton"`` or ``"staging"``. On the CPU ``"auto"`` copies directly (``impl``
            ``"cpu"``); ``"staging"`` and ``"triton"`` are test modes that run the CUDA
            paths' code on host memory (queued jobs, bounce buffers, the kernel's address
            array) with events that complete at once; ``"triton"`` needs Triton's
            interpreter (``TRITON_INTERPRET=1``).
        register_pool: pin the pool in place with ``cudaHostRegister`` (CUDA only).
        threads: host copy threads (default ``torch.get_num_threads()``).
        pool_regions: the pool region of each KV tensor (default: region ``i`` for tensor
            ``i``, and the pool must have exactly one region per tensor). Several ranks of
            one process (the simulator) share a pool this way.
        cuda_runtime: the CUDA runtime calls the backend makes itself (registration, error
            clearing, the context check). Default on CUDA: :class:`TorchCudaRuntime`. Given
            on the CPU, the device setup (registration, the choice of copy implementation,
            the warm-up) runs against it in the test modes: how tests inject failures.
        register_chunk_bytes: most bytes per ``cudaHostRegister`` call.
        staging_chunk_bytes: bytes of one staging ring chunk (raised to the largest page).
        staging_chunks: chunks in the staging ring.
        staging_thread: run the staging path's host copies and enqueueing on a thread of
            their own (default: on CUDA; the CPU test mode runs them inline).
    """

    def __init__(
        self,
        gpu_caches: Sequence[torch.Tensor],
        pool: CPUPool,
        blocks_per_chunk: int,
        group_tensors: Sequence[Sequence[int]] | None = None,
        *,
        copy_impl: CopyImpl = "auto",
        register_pool: bool = True,
        threads: int | None = None,
        pool_regions: Sequence[int] | None = None,
        cuda_runtime: CudaRuntime | None = None,
        register_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging_chunk_bytes: int = DEFAULT_STAGING_CHUNK_BYTES,
        staging_chunks: int = DEFAULT_STAGING_CHUNKS,
        staging_thread: bool | None = None,
    ) -> None:
        if blocks_per_chunk <= 0:
            raise ConfigError(f"blocks_per_chunk must be > 0, got {blocks_per_chunk}")
        if not gpu_caches:
            raise ConfigError("gpu_caches: at least one KV tensor is needed")
        if pool_regions is None:
            if pool.num_regions != len(gpu_caches):
                raise ConfigError(
                    f"pool has {pool.num_regions} regions but there are {len(gpu_caches)} "
                    "KV tensors"
                )
            pool_regions = range(len(gpu_caches))
        regions = list(pool_regions)
        if len(regions) != len(gpu_caches) or any(not 0 <= r < pool.num_regions for r in regions):
            raise ConfigError(
                f"pool_regions {regions} must name one of the pool's {pool.num_regions} "
                f"regions for each of the {len(gpu_caches)} KV tensors"
            )
        self.pool_regions = regions
        devices = {t.device for t in gpu_caches}
        if len(devices) != 1:
            raise ConfigError(f"gpu_caches on several devices: {sorted(map(str, devices))}")
        self.device: torch.device = next(iter(devices))
        self.is_cuda = self.device.type == "cuda"
        self.bpc = blocks_per_chunk
        self.pool = pool
        self._gpu: list[torch.Tensor] = []
        self.page_bytes: list[int] = []
        self._gpu_stride: list[int] = []
        for i, t in enumerate(gpu_caches):
            v, page, stride = _block_view(t, i)
            if pool.row_bytes[regions[i]] != page * blocks_per_chunk:
                raise ConfigError(
                    f"pool region {regions[i]} rows are {pool.row_bytes[regions[i]]} B, "
                    f"expected page {page} B "
                    f"x blocks_per_chunk {blocks_per_chunk}"
                )
            self._gpu.append(v)
            self.page_bytes.append(page)
            self._gpu_stride.append(stride)
        self.num_gpu_blocks = min(int(t.shape[0]) for t in gpu_caches)
        groups = (
            [list(range(len(gpu_caches)))]
            if group_tensors is None
            else [list(g) for g in group_tensors]
        )
        for g, ts in enumerate(groups):
            if any(not 0 <= t < len(gpu_caches) for t in ts) or len(set(ts)) != len(ts):
                raise ConfigError(f"group_tensors[{g}] = {ts}: bad or repeated tensor index")
        self.group_tensors = groups
        self._cpu = [
            _region_view(pool, regions[i], pool.num_slots * blocks_per_chunk, self.page_bytes[i])
            for i in range(len(gpu_caches))
        ]
        # each region's address as the device sees it (CUDA: set again after registration)
        self._cpu_dev_base = torch.tensor([c.data_ptr() for c in self._cpu], dtype=torch.int64)
        # Host copies plan on Python ints: small torch ops cost more than the arithmetic.
        self._gpu_base_i = [v.data_ptr() for v in self._gpu]
        self._cpu_base_i = [c.data_ptr() for c in self._cpu]
        self.threads = max(1, threads if threads is not None else torch.get_num_threads())
        self._executor: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="statecore-copy")
            if self.threads > 1
            else None
        )
        self._done: list[TransferResult] = []
        self.impl = "cpu"
        self._queues: dict[bool, deque[_Pending]] = {True: deque(), False: deque()}
        self._by_id: dict[int, _Pending] = {}
        self._closed = False
        self._word_bytes = self._kernel_word_bytes()
        self._staging: _StagingRing | None = None
        self.pool_registered = False
        self.warmup_seconds = 0.0
        self.cuda_errors: list[CudaCallError] = []
        """Failed CUDA runtime calls of this backend (registration, unregistration, the
        self-test buffer), each cleared and logged when it happened."""
        if cuda_runtime is None and self.is_cuda:
            cuda_runtime = TorchCudaRuntime()
        self._rt = cuda_runtime
        self.registration = (
            HostRegistration(cuda_runtime, register_chunk_bytes) if cuda_runtime else None
        )
        if self._rt is not None:
            try:
                self._setup_device(copy_impl, register_pool)
            except BaseException:
                self._unregister()
                if self._executor is not None:
                    self._executor.shutdown(wait=False)
                raise
        elif copy_impl == "staging":
            self.impl = "staging"
        elif copy_impl == "triton":
            if triton_copy() is None or os.environ.get("TRITON_INTERPRET") != "1":
                raise ConfigError(
                    "copy_impl='triton' on the CPU runs only in Triton's interpreter "
                    "(TRITON_INTERPRET=1, set before Triton is first used)"
                )
            if self._word_bytes == 0:
                raise ConfigError("copy_impl='triton' needs page sizes that are multiples of 4")
            self.impl = "triton"
        self._build_group_tables()
        if self.impl == "staging":
            inline = not self.is_cuda if staging_thread is None else not staging_thread
            try:
                self._staging = _StagingRing(
                    self, max(staging_chunk_bytes, *self.page_bytes), staging_chunks, inline
                )
            except BaseException:  # e.g. no device memory left for the ring
                self._unregister()
                if self._executor is not None:
                    self._executor.shutdown(wait=False)
                raise
        log.info(
            "TorchTransferBackend: device %s, copy implementation %s%s",
            self.device,
            self.impl,
            f", staging ring {self._staging.describe()}" if self._staging else "",
        )

    def _build_group_tables(self) -> None:
        """Per KV-cache group, its tensors' bases, strides and page sizes as int64 vectors:
        a span's addresses are then one broadcast over the group's tensors (the Triton
        path), not a few torch ops per tensor."""
        cpu_dev = self._cpu_dev_base.tolist()

        def vec(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).unsqueeze(1)

        self._group_bytes = [sum(self.page_bytes[t] for t in ts) for ts in self.group_tensors]
        self._grp_gbase = [vec([self._gpu_base_i[t] for t in ts]) for ts in self.group_tensors]
        self._grp_gstride = [vec([self._gpu_stride[t] for t in ts]) for ts in self.group_tensors]
        self._grp_cbase = [vec([int(cpu_dev[t]) for t in ts]) for ts in self.group_tensors]
        self._grp_page = [vec([self.page_bytes[t] for t in ts]) for ts in self.group_tensors]

    # -- CUDA setup -----------------------------------------------------------------------
    def _device_ctx(self) -> contextlib.AbstractContextManager[Any]:
        """Make the backend's device current (CUDA): launches and runtime calls go there."""
        return torch.cuda.device(self.device) if self.is_cuda else contextlib.nullcontext()

    def _setup_device(self, copy_impl: CopyImpl, register_pool: bool) -> None:
        """Streams, pool registration, the choice of copy implementation and its warm-up.

        Runs on CUDA, and in the CPU test modes when a :class:`CudaRuntime` is injected (the
        registration calls then go to it; nothing else touches a GPU).
        """
        rt = self._rt
        assert rt is not None  # caller's condition
        if self.is_cuda:
            self._streams = {True: _cuda.Stream(self.device), False: _cuda.Stream(self.device)}
        with self._device_ctx():
            stale = rt.get_last_error()  # someone else's failed call must not hit our kernels
            if stale > 0:
                self.cuda_errors.append(
                    CudaCallError("pending before setup", stale, rt.error_name(stale), stale)
                )
                log.warning("cleared a pending CUDA error before setup: %s", rt.error_name(stale))
            registered = register_pool and self._register_pool()
            self.pool_registered = registered
            # a dead context (a sticky error) can neither test the kernel nor stage copies
            self._check_context("at setup")
            kernel = triton_copy()
            host_ptr = rt.can_use_host_pointer(self._device_index()) if registered else None
            missing = [
                why
                for bad, why in (
                    (kernel is None, "Triton is not installed"),
                    (
                        not self.is_cuda and os.environ.get("TRITON_INTERPRET") != "1",
                        "Triton runs on the CPU only in its interpreter (TRITON_INTERPRET=1)",
                    ),
                    (not registered, "the pool is not registered"),
                    (self._word_bytes == 0, "page sizes or addresses are not multiples of 4"),
                    (
                        registered and host_ptr is not True,
                        "the device cannot address registered memory at its host address "
                        f"(cudaDevAttrCanUseHostPointerForRegisteredMem: {host_ptr})",
                    ),
                )
                if bad
            ]
            if copy_impl == "triton" and missing:
                raise ConfigError("copy_impl='triton' unusable: " + "; ".join(missing))
            self.impl = "staging"
            if copy_impl != "staging" and not missing:
                try:
                    self._triton_warmup()
                    self.impl = "triton"
                except Exception as exc:
                    self._check_context(f"after a failed Triton warm-up ({exc})")
                    if copy_impl == "triton":
                        raise ConfigError(f"Triton copy self-test failed: {exc}") from exc
                    log.warning("Triton copy kernel unusable (%s); using staging copies", exc)
            elif copy_impl != "staging":
                log.warning("Triton copies unusable (%s); using staging copies", "; ".join(missing))

    def _device_index(self) -> int:
        return self.device.index if self.device.index is not None else 0

    def _check_context(self, when: str) -> None:
        """Raise :class:`TransferError` if the device's context is dead (a sticky error):
        neither the self-test nor any fallback can run on it."""
        rt = self._rt
        assert rt is not None
        code = rt.device_synchronize()
        if code != 0:
            rt.get_last_error()
            raise TransferError(
                f"backend on {self.device}: CUDA context unusable {when}: "
                f"cudaDeviceSynchronize -> {rt.error_name(code)} ({code})"
            )

    def _kernel_word_bytes(self) -> int:
        """Word size of the Triton kernel's copies: every page size, block stride and base
        address (the pool's as the GPU sees it) must be a multiple of it; 0 if not even 4."""
        return copy_word_bytes(
            [
                *self.page_bytes,
                *self._gpu_stride,
                *self._gpu_base_i,
                *(int(x) for x in self._cpu_dev_base.tolist()),
            ]
        )

    def _register_pool(self) -> bool:
        """Register every pool region in chunks; all or nothing (see :class:`HostRegistration`)."""
        reg = self.registration
        assert reg is not None
        ranges = [(c.data_ptr(), c.numel()) for c in self._cpu if c.numel()]
        if reg.register(ranges):
            return True
        self.cuda_errors.extend(reg.errors)
        reg.errors.clear()
        log.warning("pool not pinned in place: staging copies through pinned bounce chunks")
        return False

    def _unregister(self) -> None:
        """Release the pool's registration; failed calls are cleared and reported."""
        reg = self.registration
        if reg is None:
            return
        reg.release()
        self.cuda_errors.extend(reg.errors)
        reg.errors.clear()

    def kernel_variant(self) -> tuple[int, int]:
        """The one Triton kernel variant this backend launches: ``(word_bytes, block_words)``.

        The kernel is compiled per variant (its ``WORD`` and ``BLOCK`` constants; the length
        argument is not specialised), and the backend uses a single block size for every job,
        set by its largest page, so the warm-up at construction compiles all it will need.
        """
        wb = self._word_bytes
        kernel: Any = triton_copy()
        return wb, int(kernel.block_words(wb, max(self.page_bytes) // wb))

    def _launch_kernel(self, addrs: torch.Tensor, n: int, max_words: int) -> None:
        kernel: Any = triton_copy()
        wb, block = self.kernel_variant()
        kernel.launch_copy_pages(addrs, n, max_words, wb, block)

    def _triton_warmup(self) -> None:
        """Compile the backend's kernel variant and check it: 16 pages of a GPU buffer (on the
        CPU: a host one, in the interpreter) copied into a registered host buffer in a
        shuffled order, byte for byte. The time is kept in :attr:`warmup_seconds`."""

        rt = self._rt
        assert rt is not None
        t0 = time.perf_counter()
        wb, block = self.kernel_variant()
        n = 16
        page = max(wb, min(max(self.page_bytes), 16 << 10) // wb * wb)
        buf = mmap.mmap(-1, n * page)
        host = torch.frombuffer(buf, dtype=torch.uint8)
        assert self.registration is not None
        test_reg = HostRegistration(rt, self.registration.chunk_bytes)
        if not test_reg.register([(host.data_ptr(), host.numel())]):
            self.cuda_errors.extend(test_reg.errors)
            raise TransferError(f"cannot register a self-test buffer: {test_reg.errors[0]}")
        try:
            gen = torch.Generator().manual_seed(0)
            src = torch.randint(0, 256, (n * page,), dtype=torch.uint8, generator=gen)
            src = src.to(self.device)
            perm = torch.randperm(n, generator=gen)
            addrs = torch.stack(
                (
                    src.data_ptr() + torch.arange(n) * page,
                    host.data_ptr() + perm * page,
                    torch.full((n,), page // wb, dtype=torch.int64),
                )
            ).to(self.device)
            self._launch_kernel(addrs, n, page // wb)
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
            want = src.view(n, page).cpu()
            got = host.view(n, page).index_select(0, perm)
            if not torch.equal(want, got):
                raise TransferError("Triton copy self-test: bytes differ")
        finally:
            test_reg.release()
            self.cuda_errors.extend(test_reg.errors)
            del host
            with contextlib.suppress(BufferError):
                buf.close()
        self.warmup_seconds = time.perf_counter() - t0
        log.info(
            "Triton copy kernel (word %d B, block %d words) compiled and checked in %.3f s",
            wb,
            block,
            self.warmup_seconds,
        )

    # -- planning -------------------------------------------------------------------------
    def _validated(
        self, job_id: int, job: TransferJob, is_store: bool
    ) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec, list[GroupSpan]]:
        """The job's specs and per-group spans; raises :class:`SpecError` on any mismatch."""
        gpu, cpu = job_specs(job, is_store)
        if len(gpu.group_sizes) != len(self.group_tensors):
            raise SpecError(
                f"job {job_id}: GPU spec has {len(gpu.group_sizes)} groups, the KV cache has "
                f"{len(self.group_tensors)}"
            )
        spans = plan_spans(
            gpu.group_sizes, gpu.block_indices, len(gpu.block_ids), len(cpu.slots), self.bpc
        )
        _validate_ids(gpu.block_ids, cpu.slots, self.num_gpu_blocks, self.pool.num_slots)
        return gpu, cpu, spans

    def _spans(self, job_id: int, job: TransferJob, is_store: bool) -> list[_Span]:
        """The job's pages per group (validated; groups without pages or tensors left out).

        Per page, Python only slices the spec's tuples (and, with ``blocks_per_chunk > 1``,
        lists the sub-rows).
        """
        gpu, cpu, spans = self._validated(job_id, job, is_store)
        bpc = self.bpc
        out: list[_Span] = []
        for sp in spans:
            nb = sp.num_blocks
            if nb == 0 or not self.group_tensors[sp.group]:
                continue
            ids = gpu.block_ids[sp.first_block : sp.first_block + nb]
            chunks = cpu.slots[sp.first_chunk : sp.first_chunk + sp.num_chunks]
            rows: Sequence[int] = (
                chunks
                if bpc == 1
                else [c * bpc + k for c in chunks for k in range(bpc)][sp.skip : sp.skip + nb]
            )
            out.append(_Span(sp.group, ids, rows))
        return out

    def _nbytes(self, spans: Sequence[_Span]) -> int:
        return sum(len(sp.ids) * self._group_bytes[sp.group] for sp in spans)

    def _host_plan(
        self, job_id: int, job: TransferJob, is_store: bool
    ) -> tuple[list[_Segment], int, int]:
        """``(segments, nbytes, pages)`` of a CPU job: one segment per group span and tensor.

        A segment names its pages by index (GPU block ids, CPU sub-rows) with the bases and
        strides that turn them into addresses; the copy loop computes the addresses and
        merges pages that continue each other on both sides.
        """
        segments: list[_Segment] = []
        nbytes = pages = 0
        for sp in self._spans(job_id, job, is_store):
            ids, rows, nb = sp.ids, sp.rows, len(sp.ids)
            for t in self.group_tensors[sp.group]:
                gbase, gstride = self._gpu_base_i[t], self._gpu_stride[t]
                cbase, page = self._cpu_base_i[t], self.page_bytes[t]
                nbytes += nb * page
                pages += nb
                if is_store:
                    segments.append((cbase, page, rows, gbase, gstride, ids, page))
                else:
                    segments.append((gbase, gstride, ids, cbase, page, rows, page))
        return segments, nbytes, pages

    # -- protocol -------------------------------------------------------------------------
    def submit(self, job_id: int, job: TransferJob, is_store: bool) -> None:
        """Validate the job's specs, then start its copies (on the CPU: run them)."""
        if self._closed:
            raise TransferError(f"job {job_id}: backend is shut down")
        if self.impl == "cpu":
            segments, nbytes, pages = self._host_plan(job_id, job, is_store)
            t0 = time.perf_counter()
            run_segments(segments, nbytes, pages, self._executor, self.threads)
            dt = time.perf_counter() - t0
            self._done.append(TransferResult(job_id, True, nbytes, dt, is_store))
            return
        spans = self._spans(job_id, job, is_store)
        if self.impl == "triton":
            self._submit_triton(job_id, spans, is_store)
            return
        assert self._staging is not None  # impl "staging" always has its ring
        ready = None
        if self.is_cuda:  # the job's copies wait for the compute queued before it
            ready = _cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._staging.submit(_StagedJob(job_id, is_store, self._nbytes(spans), ready, spans))

    def _launch(self, is_store: bool) -> tuple[Any, Any, Any]:
        """(stream, start event, end event) for a queued job; on the CPU (the test modes)
        no stream and :class:`_HostEvent` stand-ins."""
        if not self.is_cuda:
            return None, _HostEvent(), _HostEvent()
        stream = self._streams[is_store]
        # Stores read GPU blocks only after the compute that wrote them (upstream does this);
        # loads also wait, so a block freed and re-allocated is not overwritten while work
        # queued earlier on the compute stream may still read it (costs nothing when idle).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start = _cuda.Event(enable_timing=True)
        end = _cuda.Event(enable_timing=True)
        return stream, start, end

    def kernel_args(
        self, job_id: int, job: TransferJob, is_store: bool
    ) -> tuple[torch.Tensor, int, int]:
        """The Triton kernel's arguments for a job: ``(addrs, n, max_words)``.

        ``addrs`` is an int64 host tensor ``[3, n]``: source address, destination address and
        words (of ``self._word_bytes``) of each page copy; pool addresses are those the GPU
        sees (the mapped registration). Built with one broadcast per group span over the
        group's tensors. On a CPU backend the addresses are host addresses, which is how
        tests run the kernel in Triton's interpreter. Raises :class:`SpecError` like
        :meth:`submit`.
        """
        return self._kernel_table(self._spans(job_id, job, is_store), is_store)

    def _kernel_table(
        self, spans: Sequence[_Span], is_store: bool
    ) -> tuple[torch.Tensor, int, int]:
        wb = self._word_bytes
        if wb == 0:
            raise TransferError("page sizes or addresses are not multiples of 4 bytes")
        gpu_parts: list[torch.Tensor] = []
        cpu_parts: list[torch.Tensor] = []
        word_parts: list[torch.Tensor] = []
        max_page = 0
        for sp in spans:
            g = sp.group
            ids, rows = _int64_tensor(sp.ids), _int64_tensor(sp.rows)
            pages = self._grp_page[g]  # (tensors, 1)
            gpu_parts.append(torch.addcmul(self._grp_gbase[g], ids, self._grp_gstride[g]).ravel())
            cpu_parts.append(torch.addcmul(self._grp_cbase[g], rows, pages).ravel())
            word_parts.append((pages // wb).expand(-1, ids.numel()).ravel())
            max_page = max(max_page, max(self.page_bytes[t] for t in self.group_tensors[g]))
        if not gpu_parts:
            return torch.empty((3, 0), dtype=torch.int64), 0, 0
        gpu_addr, cpu_addr = torch.cat(gpu_parts), torch.cat(cpu_parts)
        src, dst = (gpu_addr, cpu_addr) if is_store else (cpu_addr, gpu_addr)
        return torch.stack((src, dst, torch.cat(word_parts))), gpu_addr.numel(), max_page // wb

    def _submit_triton(self, job_id: int, spans: list[_Span], is_store: bool) -> None:
        addrs, n, max_words = self._kernel_table(spans, is_store)
        addrs = self._pinned(addrs)
        stream, start, end = self._launch(is_store)
        keep: list[torch.Tensor] = [addrs]
        with self._on(stream):
            start.record(stream)
            if n:
                dev = addrs.to(self.device, non_blocking=True)
                keep.append(dev)
                self._launch_kernel(dev, n, max_words)
            end.record(stream)
        self._track(_Pending(job_id, is_store, self._nbytes(spans), start, end, None, keep))

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in page-locked memory for an asynchronous upload (CUDA); ``t`` on the CPU."""
        return t.pin_memory() if self.is_cuda else t

    def _on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current (CUDA); nothing on the CPU."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def _track(self, p: _Pending) -> None:
        self._queues[p.is_store].append(p)
        self._by_id[p.job_id] = p

    def _finish(self, p: _Pending) -> None:
        del self._by_id[p.job_id]
        ok = True
        if p.on_done is not None:
            try:
                p.on_done()
            except Exception as exc:  # pragma: no cover - host copy of validated addresses
                log.error("job %d: host copy failed: %s", p.job_id, exc)
                ok = False
        seconds = p.start.elapsed_time(p.end) / 1000.0
        self._done.append(TransferResult(p.job_id, ok, p.nbytes if ok else 0, seconds, p.is_store))

    def poll(self) -> list[TransferResult]:
        """Jobs finished since the last poll (FIFO per direction)."""
        self._reap()
        out, self._done = self._done, []
        if self._staging is not None:
            out += self._staging.poll()
        return out

    def _reap(self) -> None:
        """Finish (host side included) every queued job whose device work has completed."""
        for q in self._queues.values():
            while q and q[0].end.query():
                self._finish(q.popleft())

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until those jobs are done (unknown or finished ids are ignored).

        Done includes the host side: a staged store's scatter from the bounce buffer into
        the pool rows has run when this returns, not only its GPU-side copies.
        """
        waited = False
        for job_id in job_ids:
            p = self._by_id.get(job_id)
            if p is not None:
                p.end.synchronize()
                waited = True
        if waited:
            self._reap()
        if self._staging is not None:
            self._staging.wait(job_ids)

    def shutdown(self) -> None:
        """Finish every transfer in flight and release the pool registration and threads."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            while q:
                p = q.popleft()
                p.end.synchronize()
                self._finish(p)
        if self._staging is not None:
            self._staging.close()
        if self.is_cuda:
            for s in self._streams.values():
                s.synchronize()
        self._unregister()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


# --------------------------------------------------------------------------------------------
# Factories for the simulator and the vLLM adapter
# --------------------------------------------------------------------------------------------


def sim_backend(
    tensors: Sequence[torch.Tensor], pool: CPUPool, regions: Sequence[int], bpc: int
) -> TorchTransferBackend:
    """The backend of one simulated rank: its KV tensors over its regions of a shared pool.

    Copies run on the calling thread (the simulator is single-threaded and deterministic).
    """
    return TorchTransferBackend(list(tensors), pool, bpc, threads=1, pool_regions=regions)


def canonical_kv_tensors(
    kv_caches: Mapping[str, torch.Tensor],
    group_layers: Sequence[Sequence[str]],
    num_blocks: int,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Block-first canonical tensors and, per group, the ones it uses (reference 4.2).

    A layer's tensor is used as is when its first dimension is the block
    (``(num_blocks, ...)``); a ``(2, num_blocks, ...)`` tensor (K and V stacked first, as
    FlashAttention lays it out) is split into its K and V halves. Layers whose tensors alias
    (same address, shape and strides) share one canonical tensor.
    """
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
    groups: list[list[int]] = []
    for g, layers in enumerate(group_layers):
        used: list[int] = []
        for name in layers:
            if name not in kv_caches:
                raise ConfigError(f"group {g}: layer {name!r} has no KV cache tensor")
            t = kv_caches[name]
            if t.dim() >= 2 and t.shape[0] == num_blocks:
                parts = [t]
            elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
                parts = [t[0], t[1]]
            else:
                raise ConfigError(
                    f"layer {name!r}: KV tensor of shape {tuple(t.shape)} is neither "
                    f"({num_blocks}, ...) nor (2, {num_blocks}, ...)"
                )
            for part in parts:
                key = (part.data_ptr(), tuple(part.shape), tuple(part.stride()))
                idx = seen.get(key)
                if idx is None:
                    idx = seen[key] = len(tensors)
                    tensors.append(part)
                if idx not in used:
                    used.append(idx)
        groups.append(used)
    return tensors, groups


def backend_from_vllm(
    kv_caches: Mapping[str, torch.Tensor], vllm_config: Any, kv_cache_config: Any
) -> TorchTransferBackend:
    """The torch backend of one vLLM worker, over its own CPU pool.

    Groups and layers come from ``kv_cache_config.kv_cache_groups`` (``layer_names``), the
    number of GPU blocks from ``kv_cache_config.num_blocks``; ``blocks_per_chunk`` and the
    pool's capacity in chunks come from the same extra config the scheduler role reads
    (:func:`statecore.adapters.vllm.scheduler_config_from_vllm` and
    :func:`~statecore.adapters.vllm.cpu_chunks_from_config`), so slot ids agree. The pool is
    this worker's: the scheduler process only tracks slot ids.
    """
    import importlib

    vllm_adapter: Any = importlib.import_module("statecore.adapters.vllm")
    cfg = vllm_adapter.scheduler_config_from_vllm(vllm_config, kv_cache_config)
    num_slots = int(
        vllm_adapter.cpu_chunks_from_config(vllm_config, kv_cache_config, cfg.blocks_per_chunk)
    )
    group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
    tensors, groups = canonical_kv_tensors(kv_caches, group_layers, int(kv_cache_config.num_blocks))
    pages = [t[0].numel() * t.element_size() for t in tensors]
    # prefaulted: a serving engine pays the pool's page faults at start-up, not in its stores
    pool = CPUPool(num_slots, [p * cfg.blocks_per_chunk for p in pages], prefault=True)
    return TorchTransferBackend(tensors, pool, cfg.blocks_per_chunk, group_tensors=groups)

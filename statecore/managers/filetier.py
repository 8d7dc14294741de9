"""A file-system secondary tier: one checksummed file per chunk under a directory.

File layout (big-endian): a header ``magic "SCKV" | version (1 byte) | pad | key length
(2 bytes) | payload length (8 bytes) | CRC-32 of the payload (4 bytes)``, the key, then the
payload: the slot's row of every pool region, concatenated. The file name is the key in hex
with the suffix ``.chunk``. The checksum is seeded with the tier's layout (its pool's region
sizes and the ``layout`` tag), so a file of another layout fails it even when its payload has
the same length.

* **Verified reads.** A load serves a file's bytes only when its version, key (a valid file of
  another key under this key's name, as after a copy, a rename or a restore into the wrong
  place, is refused), payload length, layout and checksum match; anything else is a corrupt
  read (counted, the file deleted, the key dropped). A name that is not a regular file any
  more (a directory) is a missing read (counted, the key dropped); any other read error is
  counted (``read_errors``) and fails the job.

* **Atomic writes.** A chunk is written to a temporary file in the same directory and renamed
  over its final name, so a reader sees the old file, the new one, or none, never half of one.
  A crash can leave only temporary files, removed at the next start.
* **Durability** (``fsync=True``): the temporary file is fsynced before the rename and the
  directory after it, in that order, so that once the job reports success both the bytes and
  the directory entry naming them survive a power loss (the manager believes the chunk is
  there). Without ``fsync`` a power loss may lose recent chunks; a torn file is still caught
  by its checksum.
* **No extra copies.** Stores write the pool rows (``memoryview``) straight to the file; loads
  ``readinto`` the primary slot's rows, then verify length and checksum. A slot that fails
  verification is reported as a failed job; the tiering manager then drops the slot (it was
  write-pending), so wrong bytes never become loadable.
* **Asynchronous.** Every job runs on an executor (a bounded thread pool by default, or an
  injected one; :class:`InlineExecutor` runs jobs at submission, for deterministic tests).
  Only the worker functions touch files and pool rows; the index is changed by the thread that
  calls :meth:`FileTier.get_finished`.
* **Restart.** The index is rebuilt from the directory at construction (oldest file first),
  so a new process finds the chunks of the previous one. Files are verified when loaded.
* **Size limit.** With ``max_bytes`` the least recently used files (stores, promotions and
  touches count as uses) are deleted once the total exceeds it; files being loaded are kept.

* **One owner.** A tier takes an exclusive advisory lock (``flock``) on the file
  ``.statecore.lock`` in its directory; a second tier on the same directory, in this process
  or another, gets a :class:`~statecore.errors.ConfigError` naming the holder's process id
  (two owners would delete each other's temporary files and disagree about the index). The
  lock goes with :meth:`FileTier.shutdown`, the tier object, or the process. Where ``fcntl``
  is missing (not POSIX) no lock is taken.
* **Faults, logged.** Every failed job is counted under one fault kind (``io-error``,
  ``corrupt``, ``missing``: ``failed_jobs_<kind>`` in the stats) and logged as it happens on
  the logger ``statecore.managers.filetier`` (WARNING, rate-limited per kind); the first
  success after I/O errors logs the recovery (:class:`~statecore.managers.tiers.FaultLog`,
  the tier's ``fault_log``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import uuid
import weakref
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from statecore import validate
from statecore.errors import ConfigError, InvalidArgumentError, describe
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
from statecore.managers.tiers import ExecutorTier, FaultLog, JobResult, failed_job_counter
from statecore.pool import CPUPool

_fcntl: Any
try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - not POSIX: no directory lock
    _fcntl = None

__all__ = ["LOCK_NAME", "FileTier", "InlineExecutor"]

LOCK_NAME = ".statecore.lock"


def _lock_directory(directory: Path) -> int | None:
    """An exclusive advisory lock on ``directory`` (the descriptor holding it), or ``None``
    where ``fcntl`` is missing. Raises :class:`ConfigError` when another tier holds it."""
    if _fcntl is None:  # pragma: no cover - not POSIX
        return None
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"FileTier: directory {directory} is in use by another FileTier (process "
            f"{holder}); one tier owns a directory at a time"
        ) from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _unlock_directory(fd: int) -> None:
    """Release a lock taken by :func:`_lock_directory` (closing the descriptor releases it)."""
    with contextlib.suppress(OSError):
        os.close(fd)


_log = logging.getLogger(__name__)

_MAGIC = b"SCKV"
_VERSION = 2  # 2: the checksum is seeded with the layout
_HEADER = struct.Struct(">4sBxHQI")
_SUFFIX = ".chunk"
_TMP_SUFFIX = ".tmp"

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Outcome codes of one key in a worker function.
_OK = "ok"
_MISSING = "missing"
_CORRUPT = "corrupt"
_IO_ERROR = "io-error"


class InlineExecutor(Executor):
    """Runs each submitted call at once in the calling thread (deterministic tests)."""

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Run ``fn`` now; the returned future is already done."""
        future: Future[_T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the future carries it, as a thread pool would
            future.set_exception(exc)
        return future


@dataclass(slots=True)
class _FileJob:
    is_store: bool
    keys: tuple[OffloadKey, ...]
    written: tuple[OffloadKey, ...]  # stores: keys actually written (others were present)
    future: Future[list[tuple[str, int]]]


def _nothing() -> None:
    return None


class FileTier(ExecutorTier):
    """A secondary tier keeping chunks as files under ``directory`` (module docstring).

    Args:
        directory: where the chunk files live (created if missing).
        pool: the shared CPU pool whose slots the jobs copy.
        max_bytes: size limit of all chunk files; ``None`` for no limit.
        workers: threads of the default executor.
        executor: an executor to use instead (not shut down by :meth:`shutdown`).
        fsync: fsync each file before renaming it and the directory after (durability across
            power loss; a torn file is caught by its checksum either way).
        name: prefix of the tier's statistics.
        policy: what :meth:`on_new_request` answers.
        layout: the engine's layout tag (model, dtype, KV shape, ...): files written under
            another tag, or over a pool of other region sizes, are refused.
    """

    medium = Medium.STORAGE

    def __init__(
        self,
        directory: str | os.PathLike[str],
        pool: CPUPool,
        max_bytes: int | None = None,
        workers: int = 4,
        executor: Executor | None = None,
        fsync: bool = False,
        name: str = "file",
        policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL,
        layout: str = "",
    ) -> None:
        owner = "FileTier"
        if not isinstance(directory, str | os.PathLike):
            raise ConfigError(
                f"FileTier.directory must be a str or a path, got {describe(directory)}",
                "FileTier.directory",
                directory,
            )
        if not isinstance(pool, CPUPool):
            raise ConfigError(
                f"FileTier.pool must be a CPUPool, got {describe(pool)}", "FileTier.pool", pool
            )
        if max_bytes is not None:
            validate.config_int(owner, "max_bytes", max_bytes, 0)
        if executor is None:
            validate.config_int(owner, "workers", workers, 1)
        elif not isinstance(executor, Executor):
            raise ConfigError(
                f"FileTier.executor must be None or an Executor, got {describe(executor)}",
                "FileTier.executor",
                executor,
            )
        validate.config_bool(owner, "fsync", fsync)
        if not isinstance(name, str):
            raise ConfigError(
                f"FileTier.name must be a str, got {describe(name)}", "FileTier.name", name
            )
        if not isinstance(policy, OffloadPolicy):
            raise ConfigError(
                f"FileTier.policy must be an OffloadPolicy, got {describe(policy)}",
                "FileTier.policy",
                policy,
            )
        if not isinstance(layout, str):
            raise ConfigError(
                f"FileTier.layout must be a str, got {describe(layout)}", "FileTier.layout", layout
            )
        rows = pool.row_bytes
        self._crc_seed = zlib.crc32(
            struct.pack(f">H{len(rows)}Q", len(rows), *rows) + layout.encode("utf-8")
        )
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        lock = _lock_directory(self.directory)
        self._unlock: Callable[[], object] = (
            weakref.finalize(self, _unlock_directory, lock) if lock is not None else _nothing
        )
        self.pool = pool
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.name = name
        self.policy = policy
        self._own_executor = executor is None
        self._executor: Executor = (
            executor
            if executor is not None
            else ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statecore-file")
        )
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()
        self._bytes = 0
        self._storing: set[OffloadKey] = set()
        self._loading: Counter[OffloadKey] = Counter()
        self._jobs: dict[int, _FileJob] = {}
        self._events: list[OffloadingEvent] = []
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "bytes_written",
                "bytes_read",
                "evictions",
                "corrupt_reads",
                "missing_reads",
                "write_errors",
                "read_errors",
                "failed_jobs",
                *(failed_job_counter(kind) for kind in ("io-error", "corrupt", "missing")),
            ),
            0,
        )
        self.fault_log = FaultLog(
            _log,
            f"file tier {name} in {self.directory}",
            outage_kinds=("io-error",),
            recovered="the storage reads and writes again",
        )
        self._rebuild_index()

    # -- index ------------------------------------------------------------------------------------

    def path_of(self, key: OffloadKey) -> Path:
        """The file that holds (or would hold) ``key``."""
        return self.directory / (key.hex() + _SUFFIX)

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, OffloadKey, int]] = []
        with os.scandir(self.directory) as it:
            for entry in it:
                name = entry.name
                if name.endswith(_TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                if not name.endswith(_SUFFIX) or not entry.is_file():
                    continue
                try:
                    key = OffloadKey(bytes.fromhex(name[: -len(_SUFFIX)]))
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, name, key, st.st_size))
        found.sort()
        for _, _, key, size in found:
            self._index[key] = size
            self._bytes += size
        self._enforce_limit()

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def indexed_keys(self) -> list[OffloadKey]:
        """Indexed keys, least recently used first."""
        return list(self._index)

    @property
    def bytes_used(self) -> int:
        """Total size of the indexed files."""
        return self._bytes

    def _drop(self, key: OffloadKey, unlink: bool) -> None:
        size = self._index.pop(key, None)
        if size is None:
            return
        self._bytes -= size
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path_of(key))
        self._events.append(OffloadingEvent((key,), self.medium, removed=True))

    def _enforce_limit(self) -> None:
        limit = self.max_bytes
        if limit is None or self._bytes <= limit:
            return
        victims: list[OffloadKey] = []
        excess = self._bytes - limit
        for key, size in self._index.items():
            if excess <= 0:
                break
            if self._loading[key] > 0:
                continue
            victims.append(key)
            excess -= size
        for key in victims:
            self._drop(key, unlink=True)
        self._stats["evictions"] += len(victims)

    # -- worker functions (run on the executor) ---------------------------------------------------

    def _write_chunks(
        self, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]
    ) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for key, slot in zip(keys, slots, strict=True):
            out.append(self._write_one(key, slot))
        return out

    def _write_one(self, key: OffloadKey, slot: int) -> tuple[str, int]:
        pool = self.pool
        rows = [pool.row(i, slot) for i in range(pool.num_regions)]
        crc = self._crc_seed
        for row in rows:
            crc = zlib.crc32(row, crc)
        header = _HEADER.pack(_MAGIC, _VERSION, len(key), pool.slot_bytes, crc)
        final = self.path_of(key)
        tmp = self.directory / f".{key.hex()}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(key)
                for row in rows:
                    f.write(row)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.fsync:
                self._fsync_directory()
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return _IO_ERROR, 0
        return _OK, _HEADER.size + len(key) + pool.slot_bytes

    def _fsync_directory(self) -> None:
        """Make the rename durable: fsync the directory holding the entry."""
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_chunks(
        self, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]
    ) -> list[tuple[str, int]]:
        return [self._read_one(key, slot) for key, slot in zip(keys, slots, strict=True)]

    def _read_one(self, key: OffloadKey, slot: int) -> tuple[str, int]:
        pool = self.pool
        try:
            with open(self.path_of(key), "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return _CORRUPT, 0
                magic, version, key_len, length, crc = _HEADER.unpack(head)
                if (
                    magic != _MAGIC
                    or version != _VERSION
                    or length != pool.slot_bytes
                    or f.read(key_len) != key
                ):
                    return _CORRUPT, 0
                actual = self._crc_seed
                for i in range(pool.num_regions):
                    row = pool.row(i, slot)
                    if f.readinto(row) != len(row):
                        return _CORRUPT, 0
                    actual = zlib.crc32(row, actual)
                if f.read(1) or actual != crc:
                    return _CORRUPT, 0
        except (FileNotFoundError, IsADirectoryError):  # gone, or no file any more
            return _MISSING, 0
        except OSError:
            return _IO_ERROR, 0
        return _OK, length

    # -- protocol ---------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """HIT when ``key`` has a file (verified only when loaded)."""
        validate.offload_key(key, "lookup")
        return LookupResult.HIT if key in self._index else LookupResult.MISS

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Answer the configured policy."""
        return RequestOffloadingContext(self.policy)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Make the indexed ``keys`` most recently used."""
        validate.offload_keys(keys, "touch")
        index = self._index
        for key in reversed(keys):
            if key in index:
                index.move_to_end(key)

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Write the chunks of primary ``slots`` that the tier does not hold yet."""
        self._check_submit(job_id, keys, slots, "submit_store")
        todo_keys: list[OffloadKey] = []
        todo_slots: list[int] = []
        for key, slot in zip(keys, slots, strict=True):
            if key in self._index:
                self._index.move_to_end(key)
            elif key not in self._storing and key not in todo_keys:
                todo_keys.append(key)
                todo_slots.append(slot)
        self._storing.update(todo_keys)
        written = tuple(todo_keys)
        future = self._executor.submit(self._write_chunks, written, tuple(todo_slots))
        self._jobs[job_id] = _FileJob(True, tuple(keys), written, future)

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Read ``keys`` into primary ``slots``, verifying each before reporting success."""
        self._check_submit(job_id, keys, slots, "submit_load")
        key_tuple = tuple(keys)
        for key in key_tuple:
            self._loading[key] += 1
            if key in self._index:
                self._index.move_to_end(key)
        future = self._executor.submit(self._read_chunks, key_tuple, tuple(slots))
        self._jobs[job_id] = _FileJob(False, key_tuple, (), future)

    def _check_submit(self, job_id: object, keys: object, slots: object, call: str) -> None:
        """A new int job id, offload keys and one pool slot per key (nothing changes else)."""
        if type(job_id) is not int or job_id in self._jobs:
            raise InvalidArgumentError(call, "job_id", job_id, "an int not already submitted")
        validate.offload_keys(keys, call)
        validate.slot_list(slots, len(keys), call, self.pool.num_slots)  # type: ignore[arg-type]

    def get_finished(self) -> list[JobResult]:
        """Results of finished jobs, in submission order; applies them to the index."""
        done = [job_id for job_id, job in self._jobs.items() if job.future.done()]
        results = [self._finish(job_id, self._jobs.pop(job_id)) for job_id in done]
        if done:
            self._enforce_limit()
        return results

    def _finish(self, job_id: int, job: _FileJob) -> JobResult:
        outcomes: list[tuple[str, int]]
        exc = job.future.exception()
        if exc is not None:
            count = len(job.written) if job.is_store else len(job.keys)
            outcomes = [(_IO_ERROR, 0)] * count
        else:
            outcomes = job.future.result()
        ok: set[OffloadKey] = set()
        faults: Counter[str] = Counter(status for status, _ in outcomes if status != _OK)
        if outcomes and _IO_ERROR not in faults:
            self.fault_log.success()
        n_chunks = len(outcomes)
        what = f"{'a store' if job.is_store else 'a load'} of {n_chunks} chunk"
        what += "" if n_chunks == 1 else "s"
        for kind, n in faults.items():
            self.fault_log.fault(kind, n, what)
        if job.is_store:
            stored: list[OffloadKey] = []
            for key, (status, size) in zip(job.written, outcomes, strict=True):
                self._storing.discard(key)
                if status != _OK:
                    self._stats["write_errors"] += 1
                    continue
                old = self._index.pop(key, None)
                if old is not None:
                    self._bytes -= old
                self._index[key] = size
                self._bytes += size
                self._stats["bytes_written"] += size
                stored.append(key)
            if stored:
                self._events.append(OffloadingEvent(tuple(stored), self.medium, removed=False))
            ok = {k for k in job.keys if k in self._index}
        else:
            for key, (status, size) in zip(job.keys, outcomes, strict=True):
                self._loading[key] -= 1
                if self._loading[key] <= 0:
                    del self._loading[key]
                if status == _OK:
                    self._stats["bytes_read"] += size
                    ok.add(key)
                    continue
                if status == _CORRUPT:
                    self._stats["corrupt_reads"] += 1
                    self._drop(key, unlink=True)
                elif status == _MISSING:
                    self._stats["missing_reads"] += 1
                    self._drop(key, unlink=False)
                else:
                    self._stats["read_errors"] += 1
        return self._job_result(job_id, job.keys, ok, faults)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Nothing is kept per request."""

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Nothing to do per step."""

    def has_pending_work(self) -> bool:
        """Whether jobs are running or their results are not collected yet."""
        return bool(self._jobs)

    def _gauges(self) -> dict[str, int]:
        """``files`` and ``bytes_used``, reported by :meth:`get_stats` beside the counters."""
        return {"files": len(self._index), "bytes_used": self._bytes}

    def _release(self) -> None:
        """Release the directory lock (at :meth:`shutdown`)."""
        self._unlock()

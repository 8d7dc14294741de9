"""A secondary tier on a Redis or Valkey server (or cluster), shared by many engine instances.

Every engine instance (each with its own scheduler, CPU tier and pool) that points at the same
server and has the same *layout* reads the chunks the others stored: a prefix computed on one
instance is promoted into another instance's CPU tier instead of being recomputed.

**Keys and values.** A chunk is one string value under the key
``<prefix>:<fingerprint hex>:`` followed by the chunk's :class:`~statecore.keys.OffloadKey`
bytes. The fingerprint (16 bytes of BLAKE2b) covers the :class:`TierLayout` (model, dtype,
block shape, ``blocks_per_chunk``) and the pool's row sizes, so engines whose bytes are not
interchangeable never read each other's values. The value (big-endian) is a header
``magic "SCRD" | version (1) | checksum kind (1) | fingerprint (16) | key length (2) |
payload length (8) | checksum (8)``, the key, then the payload: the slot's row of every pool
region, concatenated. The checksum is XXH3-64 when the ``xxhash`` package is installed (it
runs at memory speed), CRC-32 otherwise; the kind byte says which, and a reader that cannot
compute a value's kind treats the value as foreign.

**Reads never return wrong bytes.** A promotion GETs the value, checks the header, the length,
the fingerprint, the key and the checksum, and only then copies the payload into the primary
slot. A missing value (never stored, expired, evicted by the server's ``maxmemory`` policy) is
a miss: the job fails for that key, the tiering manager drops the write-pending slot and the
engine recomputes. A corrupt, truncated or foreign value fails the same way and is deleted.

**One value wins whole.** A store is one ``SET``: two instances storing the same key at once
leave one of the two values, never a mix (the server applies each command atomically).

**Lookups.** Whether a key is on the server is known only by asking it, which takes a round
trip; the scheduler's lookup must not wait for it. An unknown key answers ``RETRY`` and is
queued; the queued keys are asked in one pipelined ``EXISTS`` batch at the end of the engine
step, and the answers (kept for ``lookup_ttl_steps`` steps, at most ``max_known_keys`` of
them) serve the next lookups. A batch that fails (server down, timeout) answers ``MISS`` for
its keys, so no request waits for a server that does not answer. Keys this instance stored
successfully are known present; a promotion that finds a key missing makes it known absent.

**No lookup is starved.** A key that answered ``RETRY`` to a request is *awaited* by that
request: its answer, once it arrives, is held for the request (whatever its age and whatever
``max_known_keys``) until the request's next lookup of the key reads it or the request
finishes. Without that, requests whose pending lookups outnumber ``max_known_keys`` could
evict each other's answers before reading them and be answered ``RETRY`` forever. What is
held is bounded by the live requests (one entry per key a live request awaits); the bound and
the expiry apply to every other answer.

**Batched, pipelined, off the scheduler's path.** Each store or promotion job is one
pipeline (split at ``max_batch_bytes``) run on an executor (a thread pool by default,
``workers`` threads, each job on one pooled connection); the scheduler thread only builds the
job and collects results in :meth:`RedisTier.get_finished`. A store's ``SET`` commands are
written straight onto a pooled connection with gathered writes (``sendmsg``) of each
command's header and the pool rows where they lie, so the value is never joined into one
buffer (an injected client without a connection pool gets a plain pipeline). Every command
has the socket timeout ``timeout_s``: a server slower than that fails the job
(``success=False``), which the tiering manager turns into a recompute, exactly like a failed
file read. Keep ``timeout_s``
below the scheduler's ``stall_timeout_s``. Connections are re-established by the client on
the next job, so the tier recovers by itself when the server is back; no retries are made
inside a job (a retry would only delay the recompute).

**Cluster.** With ``cluster=True`` the client is ``redis.cluster.RedisCluster``: keys spread
over the hash slots of every primary. A store job is split by the node owning each key's slot
and written to each node directly (a node that fails fails only its keys; a ``MOVED`` reply
rejects that store); promotions and lookups use the client's cluster pipeline, which follows
``MOVED`` and refreshes the slot map.

**What an operator sees.** Every failed job is counted under one fault kind
(:data:`statecore.managers.tiers.FAULT_KINDS`: ``unreachable``, ``out-of-memory``,
``rejected``, ``missing``, ``corrupt``, ``foreign``) in the stats (``failed_jobs_<kind>``)
and logged as it happens on the logger ``statecore.managers.redistier`` (WARNING, at most one
line per kind every ten seconds, with the count of the ones in between); the first success
after an outage logs the recovery (:class:`~statecore.managers.tiers.FaultLog`). The server
URL in logs and messages never shows a password. :func:`probe_server` checks a URL at
start-up; :func:`scan_keys`, :func:`inspect_value` and :func:`delete_keys` serve
``statecore tier``.

The tier's index lives only in the server; what this object keeps (the lookup answers, the
keys being stored) is changed only by the thread that calls :meth:`RedisTier.get_finished`,
:meth:`RedisTier.lookup` and the ``submit_*`` methods (the scheduler's thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from statecore.errors import ConfigError
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

_xxhash: Any
try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = [
    "CHECKSUM_CRC32",
    "CHECKSUM_XXH3",
    "HEADER",
    "RedisTier",
    "RedisTierConfig",
    "TierLayout",
    "ValueInfo",
    "decode_value",
    "delete_keys",
    "encode_value",
    "glob_escape",
    "inspect_value",
    "probe_server",
    "public_url",
    "scan_keys",
    "server_run_id",
    "split_key",
]

_log = logging.getLogger(__name__)

_MAGIC = b"SCRD"
_VERSION = 1
HEADER = struct.Struct(">4sBB16sHQQ")
"""The value header (module docstring)."""
CHECKSUM_CRC32 = 1
"""Checksum kind: CRC-32 (zlib)."""
CHECKSUM_XXH3 = 2
"""Checksum kind: XXH3-64 (the ``xxhash`` package)."""

# Outcome codes of one key in a worker function.
_OK = "ok"
_MISSING = "missing"
_CORRUPT = "corrupt"
_FOREIGN = "foreign"
_REJECTED = "rejected"
_OOM = "out-of-memory"
_IO_ERROR = "io-error"

# outcome -> the fault kind it is counted and logged as (statecore.managers.tiers.FAULT_KINDS)
_FAULT_OF = {
    _MISSING: "missing",
    _CORRUPT: "corrupt",
    _FOREIGN: "foreign",
    _REJECTED: "rejected",
    _OOM: "out-of-memory",
    _IO_ERROR: "unreachable",
}


def public_url(url: str) -> str:
    """``url`` without its password (what logs and messages show)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    auth, _, host = rest.partition("@")
    user = auth.split(":", 1)[0]
    return f"{scheme}://{user + ':***@' if user else '***@'}{host}"


def _refusal(exc: BaseException) -> str:
    """The outcome of a write the server answered with an error."""
    text = str(exc)
    oom = type(exc).__name__ == "OutOfMemoryError" or text.startswith("OOM")
    return _OOM if oom or "maxmemory" in text else _REJECTED


@dataclass(frozen=True, slots=True)
class TierLayout:
    """What makes two engines' chunk bytes interchangeable (part of the key namespace).

    Attributes:
        model: the model's name or path (and revision, if it matters).
        dtype: the KV-cache dtype, e.g. ``"bfloat16"``.
        block_shape: the shape of one GPU block of one KV tensor, e.g.
            ``(2, block_size, num_kv_heads, head_dim)``.
        blocks_per_chunk: GPU blocks per chunk.
    """

    model: str
    dtype: str
    block_shape: tuple[int, ...]
    blocks_per_chunk: int

    def fingerprint(self, row_bytes: Sequence[int]) -> bytes:
        """16 bytes naming this layout together with the pool's row sizes."""
        text = "|".join(
            (
                "statecore-layout-v1",
                self.model,
                self.dtype,
                ",".join(str(int(d)) for d in self.block_shape),
                str(int(self.blocks_per_chunk)),
                ",".join(str(int(r)) for r in row_bytes),
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """How to reach the server and how the tier behaves (see the module docstring).

    Attributes:
        url: ``redis://host:port/db`` (``rediss://`` for TLS); for a cluster, any node.
        layout: the engine's layout (part of every key).
        cluster: use the Redis Cluster / Valkey cluster-mode client.
        prefix: first part of every key.
        ttl_s: expiry of each stored value in seconds (``None``: none; the server's
            ``maxmemory`` policy evicts).
        timeout_s: socket connect and read timeout of every command; a slower server fails
            the job. Keep it below the scheduler's ``stall_timeout_s``.
        workers: threads of the default executor (concurrent jobs).
        max_batch_bytes: a job's pipeline is sent in batches of about this many value bytes.
        lookup_ttl_steps: engine steps a lookup answer is trusted (an answer a request
            awaits is held for it until it reads it: module docstring).
        max_known_keys: at most this many lookup answers are kept (oldest dropped first;
            answers older than ``lookup_ttl_steps`` are dropped at each step's end anyway).
            Answers that live requests await are held besides, outside this bound, until
            read (module docstring): no bound, however small, starves a lookup.
    """

    url: str = "redis://127.0.0.1:6379/0"
    layout: TierLayout = TierLayout("unnamed", "unknown", (), 1)
    cluster: bool = False
    prefix: str = "statecore"
    ttl_s: float | None = None
    timeout_s: float = 5.0
    workers: int = 4
    max_batch_bytes: int = 64 << 20
    lookup_ttl_steps: int = 32
    max_known_keys: int = 1 << 18

    def __post_init__(self) -> None:
        if not self.url:
            raise ConfigError("RedisTierConfig.url: a server URL is needed")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ConfigError(f"RedisTierConfig.ttl_s must be > 0 or None, got {self.ttl_s}")
        if not self.timeout_s > 0:
            raise ConfigError(f"RedisTierConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise ConfigError(f"RedisTierConfig.workers must be >= 1, got {self.workers}")
        if self.max_batch_bytes < 1:
            raise ConfigError(
                f"RedisTierConfig.max_batch_bytes must be >= 1, got {self.max_batch_bytes}"
            )
        if self.lookup_ttl_steps < 1:
            raise ConfigError(
                f"RedisTierConfig.lookup_ttl_steps must be >= 1, got {self.lookup_ttl_steps}"
            )
        if self.max_known_keys < 1:
            raise ConfigError(
                f"RedisTierConfig.max_known_keys must be >= 1, got {self.max_known_keys}"
            )

    def make_client(self) -> Any:
        """A redis-py client for this configuration (connects lazily, never retries)."""
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError(
                'RedisTier needs the redis package: pip install "statecore[redis]"'
            ) from exc
        common: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self.url, **common)
        return redis.Redis.from_url(self.url, max_connections=max(8, 2 * self.workers), **common)


def _checksum(kind: int, parts: Sequence[memoryview | bytes]) -> int | None:
    if kind == CHECKSUM_XXH3 and _xxhash is not None:
        h = _xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        return int(h.intdigest())
    if kind == CHECKSUM_CRC32:
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc
    return None


_DEFAULT_CHECKSUM = CHECKSUM_XXH3 if _xxhash is not None else CHECKSUM_CRC32


def encode_value(
    fingerprint: bytes,
    key: bytes,
    rows: Sequence[memoryview | bytes],
    checksum: int = _DEFAULT_CHECKSUM,
) -> bytes:
    """The stored value of ``key``: header, key, the ``rows`` concatenated (one copy)."""
    digest = _checksum(checksum, rows)
    if digest is None:
        raise ConfigError(f"RedisTier: checksum kind {checksum} is not available")
    length = sum(len(r) for r in rows)
    head = HEADER.pack(_MAGIC, _VERSION, checksum, fingerprint, len(key), length, digest)
    return b"".join((head, key, *rows))


def decode_value(value: bytes, fingerprint: bytes, key: bytes, length: int) -> str | memoryview:
    """The payload of a stored value (a view into ``value``), or why it is unusable:
    ``"corrupt"`` (truncated, bad header or checksum) or ``"foreign"`` (another layout,
    another key, another length, or a checksum kind this process cannot compute)."""
    view = memoryview(value)
    if len(view) < HEADER.size:
        return _CORRUPT
    magic, version, kind, fp, key_len, plen, digest = HEADER.unpack_from(view)
    if magic != _MAGIC or version != _VERSION:
        return _CORRUPT
    if fp != fingerprint or plen != length or key_len != len(key):
        return _FOREIGN
    start = HEADER.size + key_len
    if len(view) != start + plen:
        return _CORRUPT
    if view[HEADER.size : start] != key:
        return _FOREIGN
    payload = view[start:]
    actual = _checksum(kind, (payload,))
    if actual is None:
        return _FOREIGN
    if actual != digest:
        return _CORRUPT
    return payload


def _error_text(exc: BaseException) -> str:
    """One line naming an exception (its type and message)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_IOV_BATCH = 512  # buffers per sendmsg (below every platform's IOV_MAX)


def _send_all(sock: Any, parts: Sequence[bytes | memoryview]) -> None:
    """Send every buffer of ``parts``, in order, with gathered writes (``sendmsg``)."""
    views = [memoryview(p) for p in parts if len(p)]
    i = 0
    while i < len(views):
        sent = int(sock.sendmsg(views[i : i + _IOV_BATCH]))
        while sent:
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


@dataclass(slots=True)
class _RedisJob:
    is_store: bool
    keys: tuple[OffloadKey, ...]
    written: tuple[OffloadKey, ...]  # stores: keys actually sent (others were known present)
    future: Future[list[str]]


class RedisTier(ExecutorTier):
    """A secondary tier on a Redis/Valkey server or cluster (module docstring).

    Args:
        config: the server and the tier's behaviour.
        pool: the shared CPU pool whose slots the jobs copy.
        executor: an executor to run jobs on instead of the default thread pool (not shut
            down by :meth:`shutdown`); :class:`~statecore.managers.filetier.InlineExecutor`
            runs them at submission (deterministic tests, the simulator).
        client: a redis-py client to use instead of ``config.make_client()`` (not closed by
            :meth:`shutdown`).
        name: prefix of the tier's statistics.
        policy: what :meth:`on_new_request` answers.

    Attributes:
        fault_log: logs the tier's faults and recovery (its ``tier`` text starts each line).
    """

    medium = Medium.STORAGE

    def __init__(
        self,
        config: RedisTierConfig,
        pool: CPUPool,
        executor: Executor | None = None,
        client: Any = None,
        name: str = "redis",
        policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL,
    ) -> None:
        self.config = config
        self.pool = pool
        self.name = name
        self.policy = policy
        self.fingerprint = config.layout.fingerprint(pool.row_bytes)
        self.namespace = f"{config.prefix}:{self.fingerprint.hex()}:".encode()
        self._px = None if config.ttl_s is None else max(1, int(config.ttl_s * 1000))
        self._own_client = client is None
        self.client: Any = config.make_client() if client is None else client
        # a standalone redis-py client: stores are written straight onto a pooled connection
        self._direct = not config.cluster and hasattr(self.client, "connection_pool")
        self._own_executor = executor is None
        self._executor: Executor = (
            executor
            if executor is not None
            else ThreadPoolExecutor(
                max_workers=config.workers, thread_name_prefix="statecore-redis"
            )
        )
        self._step = 0
        self._known: OrderedDict[OffloadKey, tuple[bool, int]] = OrderedDict()
        self._to_query: dict[OffloadKey, None] = {}
        self._querying: set[OffloadKey] = set()
        # key -> the requests it answered RETRY and that have not read its answer since
        self._awaited: dict[OffloadKey, set[str]] = {}
        # request -> the keys it awaits (released when it finishes)
        self._awaits: dict[str, set[OffloadKey]] = {}
        # the answers of awaited keys (outside max_known_keys and the expiry, until read)
        self._held: dict[OffloadKey, bool] = {}
        self._queries: list[tuple[tuple[OffloadKey, ...], Future[list[bool]]]] = []
        self._storing: set[OffloadKey] = set()
        self._jobs: dict[int, _RedisJob] = {}
        self._events: list[OffloadingEvent] = []
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "bytes_written",
                "bytes_read",
                "stores_skipped",
                "lookups_queried",
                "lookups_present",
                "lookup_batches_failed",
                "missing_reads",
                "corrupt_reads",
                "foreign_reads",
                "rejected_writes",
                "server_errors",
                "unreachable_keys",
                "out_of_memory_writes",
                "failed_jobs",
                *(failed_job_counter(kind) for kind in _FAULT_OF.values()),
            ),
            0,
        )
        self.fault_log = FaultLog(_log, f"redis tier {name} at {public_url(config.url)}")
        self._last_error = ""

    # -- keys -----------------------------------------------------------------------------------

    def run_id(self) -> str | None:
        """The server's ``run_id`` (one ``INFO`` round trip; ``None`` when it does not answer):
        a change means the server restarted and lost what it held."""
        return server_run_id(self.client)

    def redis_key(self, key: OffloadKey) -> bytes:
        """The server key of ``key`` (namespace, then the key bytes)."""
        return self.namespace + key

    # -- worker functions (run on the executor) -------------------------------------------------

    def _batches(self, n: int) -> list[range]:
        per = max(1, self.config.max_batch_bytes // max(1, self.pool.slot_bytes))
        return [range(i, min(n, i + per)) for i in range(0, n, per)]

    def _write_chunks(self, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> list[str]:
        out: list[str] = []
        try:
            for batch in self._batches(len(keys)):
                if self._direct:
                    out.extend(self._write_direct(self.client, keys, slots, batch))
                elif self.config.cluster:
                    out.extend(self._write_cluster(keys, slots, batch))
                else:
                    out.extend(self._write_pipeline(keys, slots, batch))
        except Exception as exc:  # the server or the connection failed: every key not written
            self._last_error = _error_text(exc)
            out.extend([_IO_ERROR] * (len(keys) - len(out)))
        return out

    def _write_pipeline(
        self, keys: tuple[OffloadKey, ...], slots: tuple[int, ...], batch: range
    ) -> list[str]:
        pool = self.pool
        pipe = self.client.pipeline(transaction=False)
        for i in batch:
            rows = [pool.row(r, slots[i]) for r in range(pool.num_regions)]
            value = encode_value(self.fingerprint, keys[i], rows)
            pipe.set(self.redis_key(keys[i]), value, px=self._px)
        return [
            _refusal(reply) if isinstance(reply, Exception) else (_OK if reply else _REJECTED)
            for reply in pipe.execute(raise_on_error=False)
        ]

    def _write_cluster(
        self, keys: tuple[OffloadKey, ...], slots: tuple[int, ...], batch: range
    ) -> list[str]:
        """The batch split by the node that owns each key's hash slot, each node's part
        written directly; a node that fails fails only its keys. A reply ``MOVED`` (the slot
        map changed) rejects that store; the next promotion's pipeline refreshes the map."""
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i in batch:
            node = self.client.get_node_from_key(self.redis_key(keys[i]))
            node_client = getattr(node, "redis_connection", None)
            if node_client is None or not hasattr(node_client, "connection_pool"):
                return self._write_pipeline(keys, slots, batch)
            groups.setdefault(str(node.name), (node_client, []))[1].append(i)
        results: dict[int, str] = {}
        for node_client, idx in groups.values():
            try:
                got = self._write_direct(node_client, keys, slots, idx)
            except Exception as exc:  # this node is down or slow: its keys are not written
                self._last_error = _error_text(exc)
                got = [_IO_ERROR] * len(idx)
            results.update(zip(idx, got, strict=True))
        return [results[i] for i in batch]

    def _write_direct(
        self,
        client: Any,
        keys: tuple[OffloadKey, ...],
        slots: tuple[int, ...],
        batch: Sequence[int],
    ) -> list[str]:
        """The batch's SETs written straight onto one pooled connection of ``client``, the
        pool rows sent from where they are (no joined copy of the value), then every reply
        read."""
        import redis

        pool = self.pool
        fp = self.fingerprint
        length = pool.slot_bytes
        ms = b"" if self._px is None else str(self._px).encode()
        px = b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms) if ms else b""
        argc = b"*5\r\n" if px else b"*3\r\n"
        parts: list[bytes | memoryview] = []
        tail = b""
        for i in batch:
            key = keys[i]
            rkey = self.redis_key(key)
            rows = [pool.row(r, slots[i]) for r in range(pool.num_regions)]
            digest = _checksum(_DEFAULT_CHECKSUM, rows)
            head = HEADER.pack(_MAGIC, _VERSION, _DEFAULT_CHECKSUM, fp, len(key), length, digest)
            vlen = HEADER.size + len(key) + length
            parts.append(
                b"".join(
                    (
                        tail,
                        argc,
                        b"$3\r\nSET\r\n$%d\r\n" % len(rkey),
                        rkey,
                        b"\r\n$%d\r\n" % vlen,
                        head,
                        key,
                    )
                )
            )
            parts.extend(rows)
            tail = b"\r\n" + px
        parts.append(tail)
        conns = client.connection_pool
        conn = conns.get_connection()
        out: list[str] = []
        try:
            sock = getattr(conn, "_sock", None)
            if sock is None:
                conn.connect()
                sock = getattr(conn, "_sock", None)
            if sock is not None and hasattr(sock, "sendmsg"):
                _send_all(sock, parts)  # gathered: one system call for many buffers
            else:
                conn.send_packed_command(parts, check_health=False)
            for _ in batch:
                try:
                    reply = conn.read_response()
                except redis.ResponseError as exc:  # e.g. OOM under maxmemory noeviction
                    out.append(_refusal(exc))
                    continue
                out.append(_OK if reply else _REJECTED)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            conns.release(conn)
        return out

    def _read_chunks(self, keys: tuple[OffloadKey, ...], slots: tuple[int, ...]) -> list[str]:
        pool = self.pool
        fp = self.fingerprint
        length = pool.slot_bytes
        out: list[str] = []
        bad: list[bytes] = []
        try:
            for batch in self._batches(len(keys)):
                pipe = self.client.pipeline(transaction=False)
                for i in batch:
                    pipe.get(self.redis_key(keys[i]))
                replies = pipe.execute(raise_on_error=False)
                for i, value in zip(batch, replies, strict=True):
                    if isinstance(value, Exception):
                        if str(value).startswith("WRONGTYPE"):  # not a value: another kind
                            out.append(_FOREIGN)  # of thing under its name, refused as one
                            bad.append(self.redis_key(keys[i]))
                        else:
                            self._last_error = _error_text(value)
                            out.append(_IO_ERROR)
                        continue
                    if value is None:
                        out.append(_MISSING)
                        continue
                    payload = decode_value(value, fp, keys[i], length)
                    if isinstance(payload, str):
                        out.append(payload)
                        bad.append(self.redis_key(keys[i]))
                        continue
                    off = 0
                    for r in range(pool.num_regions):
                        row = pool.row(r, slots[i])
                        row[:] = payload[off : off + len(row)]
                        off += len(row)
                    out.append(_OK)
        except Exception as exc:  # the server or the connection failed: the rest is not read
            self._last_error = _error_text(exc)
            out.extend([_IO_ERROR] * (len(keys) - len(out)))
        if bad:
            try:
                pipe = self.client.pipeline(transaction=False)
                for rk in bad:
                    pipe.delete(rk)
                pipe.execute(raise_on_error=False)
            except Exception:  # best effort: the next reader finds it bad again
                pass
        return out

    def _exists(self, keys: tuple[OffloadKey, ...]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.redis_key(key))
        try:
            return [bool(n) for n in pipe.execute()]  # an exception fails the whole batch
        except Exception as exc:
            self._last_error = _error_text(exc)
            raise

    # -- lookup answers ------------------------------------------------------------------------

    def _answer(self, key: OffloadKey, present: bool) -> None:
        if key in self._awaited:
            self._held[key] = present
        known = self._known
        known[key] = (present, self._step)
        known.move_to_end(key)
        while len(known) > self.config.max_known_keys:
            known.popitem(last=False)

    def _unreadable(self, key: OffloadKey) -> None:
        """``key`` could not be asked or read (server down or slow, value missing or bad):
        it answers MISS until the answer ages out, so no request waits on a server that does
        not answer, nor on promotions that keep failing."""
        self._answer(key, False)

    def _collect_queries(self) -> None:
        if not self._queries:
            return
        keep: list[tuple[tuple[OffloadKey, ...], Future[list[bool]]]] = []
        for keys, fut in self._queries:
            if not fut.done():
                keep.append((keys, fut))
                continue
            self._querying.difference_update(keys)
            if fut.exception() is not None:
                self._stats["lookup_batches_failed"] += 1
                self.fault_log.fault("unreachable", len(keys), "a lookup batch", self._last_error)
                for key in keys:
                    self._unreadable(key)
                continue
            self.fault_log.success()
            answers = fut.result()
            self._stats["lookups_present"] += sum(answers)
            for key, present in zip(keys, answers, strict=True):
                self._answer(key, present)
        self._queries = keep

    def _fresh(self, key: OffloadKey) -> bool | None:
        entry = self._known.get(key)
        if entry is None or self._step - entry[1] > self.config.lookup_ttl_steps:
            return None
        return entry[0]

    def forget_answers(self) -> None:
        """Drop every lookup answer (e.g. after the server was flushed): keys are asked again."""
        self._known.clear()
        self._held.clear()

    def _await(self, key: OffloadKey, req_id: str) -> None:
        """``key`` answered RETRY to ``req_id``: hold its answer for the request."""
        waiters = self._awaited.get(key)
        if waiters is None:
            waiters = self._awaited[key] = set()
        waiters.add(req_id)
        keys = self._awaits.get(req_id)
        if keys is None:
            keys = self._awaits[req_id] = set()
        keys.add(key)

    def _unawait(self, key: OffloadKey, req_id: str) -> None:
        """``req_id`` no longer awaits ``key`` (it read the answer, or it finished); an answer
        no request awaits any more is no longer held."""
        waiters = self._awaited.get(key)
        if waiters is None:
            return
        waiters.discard(req_id)
        if not waiters:
            del self._awaited[key]
            self._held.pop(key, None)

    # -- protocol -------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """HIT or MISS from a fresh or held answer; otherwise RETRY, asking the server at step
        end and holding the answer for this request until it reads it."""
        self._collect_queries()
        present = self._held.get(key)
        if present is None:
            present = self._fresh(key)
        if present is not None:
            if key in self._awaited:  # read: this request no longer awaits it
                req_id = ctx.req_id
                keys = self._awaits.get(req_id)
                if keys is not None and key in keys:
                    keys.discard(key)
                    if not keys:
                        del self._awaits[req_id]
                    self._unawait(key, req_id)
            return LookupResult.HIT if present else LookupResult.MISS
        if key not in self._querying:
            self._to_query[key] = None
        self._await(key, ctx.req_id)
        return LookupResult.RETRY

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Answer the configured policy."""
        return RequestOffloadingContext(self.policy)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Nothing: the server's own LRU sees every read."""

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """SET the chunks of primary ``slots`` that are not known present (one pipeline)."""
        todo_keys: list[OffloadKey] = []
        todo_slots: list[int] = []
        skipped = 0
        for key, slot in zip(keys, slots, strict=True):
            if key in self._storing or key in todo_keys:
                continue
            if self._fresh(key):
                skipped += 1
                continue
            todo_keys.append(key)
            todo_slots.append(slot)
        self._stats["stores_skipped"] += skipped
        self._storing.update(todo_keys)
        written = tuple(todo_keys)
        future = self._executor.submit(self._write_chunks, written, tuple(todo_slots))
        self._jobs[job_id] = _RedisJob(True, tuple(keys), written, future)

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """GET ``keys`` into primary ``slots`` (one pipeline), verifying each value first."""
        key_tuple = tuple(keys)
        future = self._executor.submit(self._read_chunks, key_tuple, tuple(slots))
        self._jobs[job_id] = _RedisJob(False, key_tuple, (), future)

    def get_finished(self) -> list[JobResult]:
        """Results of finished jobs, in submission order; applies lookup answers too."""
        self._collect_queries()
        done = [job_id for job_id, job in self._jobs.items() if job.future.done()]
        return [self._finish(job_id, self._jobs.pop(job_id)) for job_id in done]

    def _finish(self, job_id: int, job: _RedisJob) -> JobResult:
        exc = job.future.exception()
        count = len(job.written) if job.is_store else len(job.keys)
        outcomes = [_IO_ERROR] * count if exc is not None else job.future.result()
        slot_bytes = self.pool.slot_bytes
        ok: set[OffloadKey] = set()
        stats = self._stats
        faults: Counter[str] = Counter(_FAULT_OF[o] for o in outcomes if o != _OK)
        if _IO_ERROR in outcomes:
            stats["server_errors"] += 1
            stats["unreachable_keys"] += faults["unreachable"]
        elif count:
            self.fault_log.success()  # the server answered every command of the job
        what = f"{'a store' if job.is_store else 'a promotion'} of {count} chunk"
        what += "" if count == 1 else "s"
        for kind, n in faults.items():
            error = self._last_error if kind == "unreachable" else ""
            self.fault_log.fault(kind, n, what, error)
        if job.is_store:
            stored: list[OffloadKey] = []
            for key, status in zip(job.written, outcomes, strict=True):
                self._storing.discard(key)
                if status == _OK:
                    stats["bytes_written"] += slot_bytes
                    stored.append(key)
                    self._answer(key, True)
                elif status in (_REJECTED, _OOM):
                    stats["rejected_writes"] += 1
                    stats["out_of_memory_writes"] += status == _OOM
            if stored:
                self._events.append(OffloadingEvent(tuple(stored), self.medium, removed=False))
            sent = set(job.written)
            ok = {k for k in job.keys if k not in sent or k in stored}
        else:
            removed: list[OffloadKey] = []
            for key, status in zip(job.keys, outcomes, strict=True):
                if status == _OK:
                    stats["bytes_read"] += slot_bytes
                    ok.add(key)
                    continue
                self._unreadable(key)
                if status == _IO_ERROR:
                    continue
                stats[
                    {_MISSING: "missing_reads", _CORRUPT: "corrupt_reads"}.get(
                        status, "foreign_reads"
                    )
                ] += 1
                removed.append(key)
            if removed:
                self._events.append(OffloadingEvent(tuple(removed), self.medium, removed=True))
        return self._job_result(job_id, job.keys, ok, faults)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Release the answers held for the request (the keys it still awaits)."""
        for key in self._awaits.pop(ctx.req_id, ()):
            self._unawait(key, ctx.req_id)

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """Send the step's queued lookups as one ``EXISTS`` pipeline; start a new step (and
        drop the lookup answers that aged out)."""
        if self._to_query:
            keys = tuple(self._to_query)
            self._to_query.clear()
            self._querying.update(keys)
            self._stats["lookups_queried"] += len(keys)
            self._queries.append((keys, self._executor.submit(self._exists, keys)))
        self._step += 1
        # answers are ordered by age: drop the ones no lookup may use any more
        known = self._known
        oldest = self._step - self.config.lookup_ttl_steps
        while known:
            key, (_, stamp) = next(iter(known.items()))
            if stamp >= oldest:
                break
            del known[key]

    def has_pending_work(self) -> bool:
        """Whether jobs or lookup batches are running or not collected yet."""
        return bool(self._jobs or self._queries)

    def _pending_futures(self) -> list[Future[Any]]:
        """Every job and lookup batch not collected yet (what :meth:`drain` waits for)."""
        futures = super()._pending_futures()
        futures.extend(fut for _, fut in self._queries)
        return futures

    def _gauges(self) -> dict[str, int]:
        """``known_keys`` and ``held_answers`` (answers held for requests that await them),
        reported by :meth:`get_stats` beside the counters."""
        return {"known_keys": len(self._known), "held_answers": len(self._held)}

    def _release(self) -> None:
        """Close the default client (at :meth:`shutdown`)."""
        if self._own_client:
            close: Callable[[], object] | None = getattr(self.client, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):  # a dead server's client: nothing to do
                    close()


# -- operating a server: checks at start-up, namespaces ----------------------------------------


def probe_server(url: str, cluster: bool = False, timeout_s: float = 2.0) -> str:
    """Check that ``url`` parses and that its server answers; its ``run_id``.

    Raises:
        ConfigError: with a one-line message, when the ``redis`` package is missing, the URL
            does not parse, or the server does not answer within ``timeout_s``.
    """
    config = RedisTierConfig(url=url, cluster=cluster, timeout_s=timeout_s)
    try:
        client = config.make_client()
    except ConfigError:
        raise
    except Exception as exc:  # redis-py's ValueError for an unknown scheme, a bad port
        raise ConfigError(f"cannot use Redis URL {public_url(url)!r}: {_error_text(exc)}") from None
    try:
        run_id = server_run_id(client, raise_errors=True)
    except Exception as exc:
        raise ConfigError(
            f"the Redis server at {public_url(url)} does not answer: {_error_text(exc)}"
        ) from None
    finally:
        with contextlib.suppress(Exception):
            client.close()
    return run_id or ""


def server_run_id(client: Any, raise_errors: bool = False) -> str | None:
    """The server's ``run_id`` (``INFO server``): it changes when the server restarts.
    ``None`` when the server does not answer (unless ``raise_errors``); for a cluster, the
    run ids of every node joined by commas."""
    try:
        info = client.info("server")
    except Exception:
        if raise_errors:
            raise
        return None
    if isinstance(info, dict) and "run_id" in info:
        return str(info["run_id"])
    if isinstance(info, dict):  # a cluster client: node -> its INFO
        ids = sorted(str(v.get("run_id", "")) for v in info.values() if isinstance(v, dict))
        return ",".join(ids) or None
    return None


_GLOB_SPECIAL = frozenset(b"*?[]\\")


def glob_escape(prefix: bytes) -> bytes:
    """``prefix`` with the glob characters of ``SCAN MATCH`` escaped."""
    return b"".join(b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c]) for c in prefix)


def scan_keys(client: Any, prefix: bytes = b"", count: int = 1000) -> Iterator[bytes]:
    """Every key that starts with ``prefix`` (``SCAN``, never ``KEYS``), as bytes."""
    match = glob_escape(prefix) + b"*"
    for key in client.scan_iter(match=match, count=count):
        yield key if isinstance(key, bytes) else str(key).encode()


def delete_keys(client: Any, prefix: bytes, batch: int = 1000) -> int:
    """Delete every key that starts with ``prefix`` (``UNLINK`` in batches); how many.

    An empty prefix is refused (it would empty the whole database)."""
    if not prefix:
        raise ConfigError("delete_keys: an empty prefix would delete every key of the database")
    removed = 0
    todo: list[bytes] = []
    for key in scan_keys(client, prefix):
        todo.append(key)
        if len(todo) >= batch:
            removed += int(client.unlink(*todo))
            todo.clear()
    if todo:
        removed += int(client.unlink(*todo))
    return removed


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """What :func:`inspect_value` finds in one stored value.

    Attributes:
        verdict: ``"ok"``, ``"corrupt"`` (truncated, bad header or checksum), ``"foreign"``
            (the key inside is not the key it is stored under), ``"unknown checksum"``.
        magic, version, checksum_kind, fingerprint, key_length, payload_length, checksum:
            the header's fields (``None`` when the value is too short to hold a header).
        key: the chunk key stored inside the value.
        size: the value's length in bytes.
    """

    verdict: str
    size: int
    magic: bytes | None = None
    version: int | None = None
    checksum_kind: int | None = None
    fingerprint: bytes | None = None
    key_length: int | None = None
    payload_length: int | None = None
    checksum: int | None = None
    key: bytes = b""


def inspect_value(value: bytes, key: bytes | None = None) -> ValueInfo:
    """The header fields of a stored value and whether it passes its checks (``key``: the
    chunk key it should hold; ``None``: not compared)."""
    view = memoryview(value)
    if len(view) < HEADER.size:
        return ValueInfo("corrupt", len(view))
    magic, version, kind, fp, key_len, plen, digest = HEADER.unpack_from(view)
    start = HEADER.size + key_len
    inner = bytes(view[HEADER.size : start])
    fields = {
        "magic": magic,
        "version": version,
        "checksum_kind": kind,
        "fingerprint": fp,
        "key_length": key_len,
        "payload_length": plen,
        "checksum": digest,
        "key": inner,
    }
    if magic != _MAGIC or version != _VERSION or len(view) != start + plen:
        return ValueInfo("corrupt", len(view), **fields)
    actual = _checksum(kind, (view[start:],))
    if actual is None:
        verdict = "unknown checksum"
    elif actual != digest:
        verdict = "corrupt"
    elif key is not None and inner != key:
        verdict = "foreign"
    else:
        verdict = "ok"
    return ValueInfo(verdict, len(view), **fields)


def split_key(rkey: bytes) -> tuple[bytes, bytes, bytes] | None:
    """A server key's ``(prefix, fingerprint hex, chunk key)``; ``None`` when it is not
    shaped like a tier's key (``<prefix>:<32 hex digits>:<key>``)."""
    pos = 0
    while True:
        colon = rkey.find(b":", pos)
        if colon < 0:
            return None
        fp = rkey[colon + 1 : colon + 33]
        if len(fp) == 32 and rkey[colon + 33 : colon + 34] == b":":
            try:
                bytes.fromhex(fp.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                pass
            else:
                return rkey[:colon], fp, rkey[colon + 34 :]
        pos = colon + 1

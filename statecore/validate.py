"""The validation layer: pure checks run at the top of every public entry point.

Theory of operation. statecore's public calls (the scheduler's hooks, the manager and tier
APIs, the worker's per-step hooks, the wire types' helpers, the configuration and key
constructors) first hand their arguments to one function of this module, and only then touch
any state. A check either returns (the arguments are well formed) or raises a typed
:mod:`statecore.errors` error naming the call, the argument (with the path into it, e.g.
``new_block_ids[0][3]``), the bad value and, where the caller knows them, the entity and its
state. Because every check runs before the first mutation, a rejected call leaves every
observable state (records, counters, indexes, the manager) exactly as it was; the garbage
fuzzer (``tests/fuzz/test_fuzz_garbage.py``) asserts that with snapshots.

Rules the checks apply everywhere:

* an integer is an ``int`` and never a ``bool`` (``True`` is not a token count);
* a float is a finite ``int`` or ``float`` (NaN and infinities are rejected);
* a sequence argument is a ``list``/``tuple`` (or any ``Sequence`` that is not ``str`` or
  ``bytes``); a set argument is a ``set``/``frozenset``;
* an offload key is ``bytes`` of at least 4 bytes (block hash + group index).

Checks are pure (no state, no I/O) and cheap on the happy path: one ``type(x) is int`` per
scalar, one pass per id list; the detailed diagnosis (which element, why) is computed only on
the error path. Per-entry anomalies that are *documented tolerances* (a report count that is
not a positive int, a report for an unknown job) are not rejected here: the scheduler absorbs
and counts them (see :class:`~statecore.scheduler.SchedulerCounters`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from statecore import _argerrors, _viewerrors
from statecore._viewerrors import scheduled_request
from statecore.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    describe,
)
from statecore.manager import ReqContext as _ReqContext
from statecore.views import ScheduledColumns as _ScheduledColumns
from statecore.views import ScheduledRequest as _ScheduledRequest
from statecore.views import SchedulerOutput as _SchedulerOutput
from statecore.wire import ConnectorMetadata as _ConnectorMetadata
from statecore.wire import TransferJob as _TransferJob
from statecore.wire import check_worker_metadata as worker_metadata

__all__ = [
    "MISSING",
    "Where",
    "block_lists",
    "config_bool",
    "config_float",
    "config_int",
    "connector_metadata",
    "flag",
    "id_collection",
    "is_int",
    "is_sequence",
    "nonneg_int",
    "offload_key",
    "offload_keys",
    "req_context",
    "request_id",
    "request_view",
    "scheduled_request",
    "scheduler_output",
    "scheduler_output_fields",
    "slot_list",
    "worker_metadata",
]

Where = Callable[[object], tuple[str | None, str | None]]
"""Given a request id, the (entity, state) an error should name (computed on error only)."""

MISSING: Any = object()
"""Sentinel for an attribute a foreign object does not have."""

_fail = _argerrors.fail
_finite = _argerrors.finite
_nowhere = _argerrors.nowhere

_SEQ = _viewerrors.SEQ
_SETS = _viewerrors.SETS
_INT_VALUE: Any = _viewerrors.INT_VALUE
_is_seq = _viewerrors.is_seq
_int_list = _viewerrors.int_list
_id_set = _viewerrors.id_set
_BYTES = {bytes}


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return type(value) is int


def nonneg_int(
    value: object,
    call: str,
    argument: str,
    maximum: int | None = None,
    error: type[InvalidArgumentError] = InvalidArgumentError,
) -> None:
    """``value`` is an int (not a bool) ``>= 0`` (and ``<= maximum`` when given)."""
    if type(value) is int and value >= 0 and (maximum is None or value <= maximum):
        return
    expected = "an int >= 0" if maximum is None else f"an int in 0..{maximum}"
    raise error(call, argument, value, expected)


def is_sequence(value: object) -> bool:
    """Whether ``value`` is a sequence argument: a list, a tuple, or any ``Sequence`` that is
    not ``str``/``bytes``."""
    return _is_seq(value)


# ---------------------------------------------------------------------------------------------
# scheduler hooks

_VIEW_INTS = ("num_tokens", "num_prompt_tokens", "num_computed_tokens")


def request_id(request: Any, call: str) -> str:
    """The request's ``request_id``, checked to be a ``str``."""
    rid = getattr(request, "request_id", MISSING)
    if type(rid) is not str and not isinstance(rid, str):
        if rid is MISSING:
            _fail(call, "request", request, "a RequestLike (no request_id attribute)")
        _fail(call, "request.request_id", rid, "a str")
    return str(rid)


def request_view(
    request: Any,
    call: str,
    where: Where = _nowhere,
    hashes_seen: int = 0,
    params: bool = False,
) -> str:
    """Check a :class:`~statecore.views.RequestLike` as the scheduler is about to read it.

    Checks the id, the three token counts (ints >= 0, prompt <= total), ``block_hashes`` (a
    sequence whose entries from ``hashes_seen`` on are bytes: earlier ones were checked when
    first read), the two flags (bools) and, with ``params``, ``kv_transfer_params`` (None or
    a mapping). Returns the request id. An attribute that is missing or raises when read is
    reported as a bad value.
    """
    rid = getattr(request, "request_id", None)
    if type(rid) is not str:  # (one call less on the happy path)
        rid = request_id(request, call)
    try:
        nt = request.num_tokens
        np_ = request.num_prompt_tokens
        nc = request.num_computed_tokens
        hashes = request.block_hashes
        skip = request.skip_reading_prefix_cache
        aborted = request.is_aborted
        kv = request.kv_transfer_params if params else None
    except Exception as exc:
        _fail(call, "request", request, f"a RequestLike ({describe(exc)})", where, rid)
    if not (
        type(nt) is int
        and type(np_) is int
        and type(nc) is int
        and 0 <= np_ <= nt
        and nc >= 0
        and type(skip) is bool
        and type(aborted) is bool
    ):
        for name, value in zip(_VIEW_INTS, (nt, np_, nc), strict=True):
            if type(value) is not int or value < 0:
                _fail(call, f"request.{name}", value, "an int >= 0", where, rid)
        if np_ > nt:
            _fail(call, "request.num_prompt_tokens", np_, f"<= num_tokens ({nt})", where, rid)
        for name, value in (("skip_reading_prefix_cache", skip), ("is_aborted", aborted)):
            if type(value) is not bool:
                _fail(call, f"request.{name}", value, "a bool", where, rid)
    if type(hashes) is not list and not _is_seq(hashes):
        _fail(call, "request.block_hashes", hashes, "a sequence of bytes", where, rid)
    n = len(hashes)
    if n > hashes_seen:
        try:  # C speed: join raises on anything that is not bytes-like
            b"".join(hashes[hashes_seen:n] if hashes_seen else hashes)
        except TypeError:
            for i in range(hashes_seen, n):
                h = hashes[i]
                if not isinstance(h, bytes | bytearray | memoryview):
                    _fail(call, f"request.block_hashes[{i}]", h, "bytes", where, rid)
    if params and kv is not None and not isinstance(kv, Mapping):
        _fail(call, "request.kv_transfer_params", kv, "None or a mapping", where, rid)
    return rid


def block_lists(
    block_ids: Any, n_groups: int, call: str, argument: str, where: Where, req_id: object
) -> None:
    """One sequence of GPU block ids (ints >= 0) per KV-cache group.

    An ``int`` subclass such as ``bool`` is taken as the int it equals, whatever its own
    comparison operators say (the fast path reads every id through ``int.__index__`` at C
    speed); ``None``, strings, floats, objects posing as ints and negatives are rejected.
    """
    if type(block_ids) in _SEQ and len(block_ids) == n_groups:
        try:
            for ids in block_ids:
                if ids and (type(ids) not in _SEQ or min(map(_INT_VALUE, ids)) < 0):
                    break
            else:
                return
        except TypeError:
            pass
    if not _is_seq(block_ids) or len(block_ids) != n_groups:
        _fail(
            call,
            argument,
            block_ids,
            f"a sequence of {n_groups} block-id sequences (one per KV-cache group)",
            where,
            req_id,
        )
    for g, ids in enumerate(block_ids):
        if type(ids) is tuple and not ids:
            continue
        _int_list(ids, call, f"{argument}[{g}]", where, req_id, "GPU block id")


def scheduler_output_fields(output: Any) -> None:
    """Diagnose a :class:`~statecore.views.SchedulerOutput` built with a malformed field
    (raises naming it); when every field is acceptable, normalise it (tuple of entries, the
    per-entry group counts). The views call :mod:`statecore._viewerrors` directly."""
    _viewerrors.scheduler_output_fields(output, _ScheduledRequest, _ScheduledColumns)


def scheduler_output(output: object, n_groups: int, where: Where) -> None:
    """Check a :class:`~statecore.views.SchedulerOutput` before any of its entries is applied.

    The output validated its own fields when it was built (see :mod:`statecore.views`); what
    is left depends on the scheduler: every entry carries one block list per KV-cache group.
    O(1) in the common case (the output computed its set of group counts).
    """
    call = "build_connector_meta"
    if type(output) is not _SchedulerOutput:
        _fail(call, "output", output, "a SchedulerOutput")
    counts = output.group_counts
    if not counts or (len(counts) == 1 and n_groups in counts):
        return
    for i, s in enumerate(output.scheduled):
        if len(s.new_block_ids) != n_groups:
            block_lists(
                s.new_block_ids,
                n_groups,
                call,
                f"output.scheduled[{i}].new_block_ids",
                where,
                s.req_id,
            )
    columns = output.columns
    if columns is not None:
        for i, ids in enumerate(columns.new_block_ids):
            if ids is not None and len(ids) != n_groups:
                block_lists(
                    ids,
                    n_groups,
                    call,
                    f"output.columns.new_block_ids[{i}]",
                    where,
                    columns.req_ids[i],
                )


def id_collection(value: Any, call: str, argument: str) -> None:
    """A collection (not str/bytes) of job ids (ints)."""
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Collection):
        _fail(call, argument, value, "a collection of job ids (ints)")
    for v in value:
        if type(v) is not int:
            _fail(call, f"{argument} item", v, "a job id (int)")


def connector_metadata(meta: object, call: str) -> None:
    """Check a :class:`~statecore.wire.ConnectorMetadata` as a worker is about to run it.

    The job maps must map int job ids to :class:`~statecore.wire.TransferJob` objects and the
    flush set must hold int job ids. The specs inside a job are checked by the backend at
    submission (a bad spec fails that job, reported as failed).
    """
    if type(meta) is not _ConnectorMetadata:
        _fail(call, "meta", meta, "a ConnectorMetadata")
    for name in ("load_jobs", "store_jobs"):
        jobs = getattr(meta, name)
        if type(jobs) is not dict and not isinstance(jobs, Mapping):
            _fail(call, f"meta.{name}", jobs, "a mapping of job id -> TransferJob")
        for job_id, job in jobs.items():
            if type(job_id) is not int:
                _fail(call, f"meta.{name} key", job_id, "a job id (int)")
            if type(job) is not _TransferJob:
                _fail(call, f"meta.{name}[{job_id}]", job, "a TransferJob")
    flush = meta.jobs_to_flush
    if type(flush) not in _SETS and not isinstance(flush, AbstractSet):
        _fail(call, "meta.jobs_to_flush", flush, "a set of job ids (ints)")
    for job_id in flush:
        if type(job_id) is not int:
            _fail(call, "meta.jobs_to_flush item", job_id, "a job id (int)")


# ---------------------------------------------------------------------------------------------
# managers and tiers


def offload_keys(keys: Any, call: str, argument: str = "keys") -> None:
    """A sequence of offload keys: ``bytes`` of at least 4 bytes each.

    Raises :class:`~statecore.errors.InvalidKeyError` (a
    :class:`~statecore.errors.ManagerError`).
    """
    if type(keys) not in _SEQ and not _is_seq(keys):
        raise InvalidKeyError(call, argument, keys, "a sequence of offload keys (bytes)")
    if not keys or (set(map(type, keys)) == _BYTES and min(map(len, keys)) >= 4):
        return  # C speed: no call per key
    for k in keys:
        if type(k) is not bytes or len(k) < 4:
            for i, key in enumerate(keys):
                if type(key) is not bytes or len(key) < 4:
                    raise InvalidKeyError(
                        call, f"{argument}[{i}]", key, "an offload key (bytes, >= 4 bytes)"
                    )


def offload_key(key: object, call: str, argument: str = "key") -> None:
    """One offload key (``bytes`` of at least 4 bytes)."""
    if type(key) is not bytes or len(key) < 4:
        raise InvalidKeyError(call, argument, key, "an offload key (bytes, >= 4 bytes)")


def slot_list(slots: Any, n: int, call: str, capacity: int | None = None) -> None:
    """``n`` slot ids (ints >= 0, below ``capacity`` when given), one per key."""
    if not _is_seq(slots) or len(slots) != n:
        raise InvalidArgumentError(call, "slots", slots, f"a sequence of {n} slot ids")
    for i, s in enumerate(slots):
        if type(s) is not int or s < 0 or (capacity is not None and s >= capacity):
            limit = "" if capacity is None else f" below {capacity}"
            raise InvalidArgumentError(call, f"slots[{i}]", s, f"a slot id (int >= 0{limit})")


def req_context(ctx: object, call: str) -> None:
    """A :class:`~statecore.manager.ReqContext` with a str ``req_id``."""
    if type(ctx) is not _ReqContext and not isinstance(ctx, _ReqContext):
        raise InvalidArgumentError(call, "ctx", ctx, "a ReqContext")
    if not isinstance(ctx.req_id, str):
        raise InvalidArgumentError(call, "ctx.req_id", ctx.req_id, "a str")


def flag(value: object, call: str, argument: str) -> None:
    """A ``bool`` argument (``success``, ...): truthy strings are not accepted."""
    if type(value) is not bool:
        raise InvalidArgumentError(call, argument, value, "a bool")


# ---------------------------------------------------------------------------------------------
# configuration


def config_int(owner: str, name: str, value: object, minimum: int = 0) -> None:
    """A configuration integer: an int (not a bool) ``>= minimum``."""
    if type(value) is int and value >= minimum:
        return
    raise ConfigError(
        f"{owner}.{name} must be an int >= {minimum}, got {describe(value)}",
        f"{owner}.{name}",
        value,
    )


def config_float(owner: str, name: str, value: object, minimum: float = 0.0) -> None:
    """A configuration number: a finite int or float (not a bool) ``> minimum``."""
    if _finite(value) and value > minimum:  # type: ignore[operator]
        return
    raise ConfigError(
        f"{owner}.{name} must be a finite number > {minimum:g}, got {describe(value)}",
        f"{owner}.{name}",
        value,
    )


def config_bool(owner: str, name: str, value: object) -> None:
    """A configuration flag: a ``bool``."""
    if type(value) is bool:
        return
    raise ConfigError(
        f"{owner}.{name} must be a bool, got {describe(value)}", f"{owner}.{name}", value
    )

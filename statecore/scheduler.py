"""The scheduler side of an offloading connector.

:class:`OffloadingScheduler` decides what to look up, load and store, tracks every transfer
job across the workers and protects GPU blocks that get reused while a copy is in flight. It
follows the hooks of vLLM's offloading connector (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
``request_finished``, ...) and adds what upstream lacks:

* every request and job moves through the compiled lifecycles of
  :mod:`statecore.lifecycle`, whose actions call back into this class (the
  :class:`~statecore.lifecycle.LifecycleEffects` hooks at the end of the class);
* a job with no full quorum after ``stall_timeout_s`` is completed with ``success=False``
  through the one completion path, flushed to the workers, and kept in a ledger that absorbs
  its late reports (seed 000);
* worker-reported failures complete jobs with ``success=False``; failed or stalled loads are
  reported as invalid GPU blocks so the engine recomputes them;
* ``reset_cache`` flushes every job and makes every earlier report inert (the seed-004 fix),
  except for loads the workers already run: those are carried over, complete normally and
  release their requests, so a reset never fails a request (vLLM's default
  ``kv_load_failure_policy`` aborts a request whose load fails);
* bad input never asserts: every hook first runs the pure checks of
  :mod:`statecore.validate` on all of its arguments, then mutates; a malformed argument
  raises a typed :mod:`statecore.errors` error with the state unchanged, and documented
  anomalies (reports for unknown jobs, a live request view turned bad, ...) are absorbed and
  counted (see :class:`SchedulerCounters`).

Admission: a lookup never changes a request's block lists or store cursors (so calling it
for a running request is harmless). An allocation (:meth:`update_state_after_alloc`) records
the request's complete block lists; the request's next :class:`~statecore.views.ScheduledRequest`
starts from that fresh allocation, whether it repeats the complete lists (vLLM's new-request
form) or carries only blocks added since. Its store cursors rewind there only if it was looked
up since its last admission: a streaming session resumed with its blocks kept is allocated
and scheduled as a new request without a lookup, and keeps what it stored.

The class is sans-IO: no threads, no files, time only through the injected ``clock``.

Stalled transfers and INV-FENCE: a stalled job may still be running on a worker. At the stall
the job is put in the next step's ``jobs_to_flush``, so every worker waits for it (or finds it
unknown) before that step writes any GPU block, and before any store that reuses its freed CPU
slots is submitted. Its fences can therefore be dropped at the stall. Its ledger entry absorbs
late reports until its remaining worker count reaches 0, and expires after another
``stall_timeout_s`` (counted as ``stalled_expired``): reports arriving later are absorbed as
duplicates.
"""

from __future__ import annotations

import enum
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, le
from typing import Any, cast

from statecore import kernels, validate
from statecore.config import SchedulerConfig
from statecore.errors import ManagerError, MetadataError, UnknownRequestError
from statecore.keys import OffloadKey, make_offload_key
from statecore.lifecycle import (
    JE_RESET,
    JE_STALL_TIMEOUT,
    JE_WORKER_REPORT,
    JOB,
    RE_ALLOC_LOAD,
    RE_FINISH,
    RE_JOB_ENDED,
    RE_LOOKUP,
    RE_PREEMPT,
    RE_RESET,
    RE_SIGNAL_FINISHED,
    RE_STORE_CREATED,
    REQUEST,
)
from statecore.manager import (
    OffloadingEvent,
    OffloadingManager,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
)
from statecore.views import Request, RequestLike, ScheduledRequest, SchedulerOutput
from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob, WorkerMetadata

__all__ = [
    "ConnectorOutputResult",
    "GroupState",
    "JobRecord",
    "OffloadingScheduler",
    "RequestRecord",
    "SchedulerCounters",
]

Clock = Callable[[], float]

_BYTES_ONLY = {bytes}


class GroupState:
    """Per request and KV-cache group: offload keys, GPU block ids and the store cursor.

    Attributes:
        keys: offload key of each whole chunk the request's hashes cover so far.
        block_ids: the request's GPU block ids in this group (0 = null, skipped or stale).
        cursor: first chunk not yet considered for storing (INV-CURSOR).
        skip: chunks loaded at admission, never offered again under the chunk-level policy.
    """

    __slots__ = ("block_ids", "cursor", "keys", "skip")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.block_ids: list[int] = []
        self.cursor = 0
        self.skip = 0


class RequestRecord:
    """Scheduler state of one tracked request. ``state`` indexes ``REQUEST.states``."""

    __slots__ = (
        "_shadow",
        "_sm",
        "admitted",
        "ctx",
        "deferred_since",
        "groups",
        "hashes_ok",
        "jobs",
        "looked_up",
        "max_load_tokens",
        "max_offload_tokens",
        "n_hashes",
        "num_local_computed",
        "num_scheduled",
        "owner",
        "policy",
        "registered",
        "req_id",
        "request",
        "signalled",
        "state",
        "store_cap",
        "store_floor",
    )

    state: int  # set by REQUEST.attach

    def __init__(
        self,
        owner: OffloadingScheduler,
        request: RequestLike,
        ctx: ReqContext,
        policy: OffloadPolicy,
        n_groups: int,
        req_id: str | None = None,
    ) -> None:
        self.owner = owner
        self.req_id = request.request_id if req_id is None else req_id
        self.request = request
        self.ctx = ctx
        self.policy = policy
        self.registered = False
        """The manager's ``on_new_request`` took the request (false while it raised: no
        lookup hits, no stores, no finish notice; retried by the next lookup or store)."""
        self.groups = [GroupState() for _ in range(n_groups)]
        self.jobs: set[int] = set()
        self.max_load_tokens: int | None = None
        self.max_offload_tokens: int | None = None
        self.num_local_computed = 0
        self.num_scheduled = 0
        self.n_hashes = 0  # block hashes already turned into keys
        self.deferred_since: float | None = None
        self.signalled = False
        # no chunk can become storable below this many offloadable tokens (0: unknown)
        self.store_floor = 0
        # offloadable tokens never exceed this (max_offload_tokens, prompt-only)
        self.store_cap = 1 << 62
        # complete block lists of the last allocation, until the next scheduling applies them
        self.admitted: tuple[tuple[int, ...], ...] | None = None
        # looked up since its last admission: the engine (re)starts it from its prefix, so
        # that admission rewinds its store cursors; an admission without a lookup (a streaming
        # session resumed with its blocks kept) keeps them
        self.looked_up = False
        self.hashes_ok = 0  # block hashes already validated (a prefix of the view's list)
        REQUEST.attach(self)


class JobRecord:
    """Scheduler state of one transfer job. ``state`` indexes ``JOB.states``.

    Attributes:
        keys: the job's offload keys (the manager's completion gets exactly these).
        blocks: GPU blocks it reads (store) or writes (load).
        pending: workers that have not reported yet.
        failed: workers that reported a failure.
        seen: bit mask of the ranks that reported, for reports that carry ranks.
        fenced: store sources fenced from creation (sliding-window groups).
        deferred_fence: store sources fenced once the request finishes (full attention).
        deferred_registered: whether ``deferred_fence`` is in the fence index.
        flushed: the job was put in a step's ``jobs_to_flush``: every worker finishes it
            before that step writes any GPU block or submits any load.
        sent: the job went out in a step's metadata (loads are created before that).
        carried: a sent load that outlived a reset: it completes without the manager.
    """

    __slots__ = (
        "_shadow",
        "_sm",
        "blocks",
        "carried",
        "created_at",
        "deferred_fence",
        "deferred_registered",
        "failed",
        "fenced",
        "flushed",
        "is_store",
        "job_id",
        "keys",
        "owner",
        "pending",
        "req",
        "seen",
        "sent",
        "stalled_at",
        "state",
    )

    state: int  # set by JOB.attach

    def __init__(
        self,
        owner: OffloadingScheduler,
        job_id: int,
        req: RequestRecord,
        is_store: bool,
        keys: tuple[OffloadKey, ...],
        blocks: tuple[int, ...],
        pending: int,
        now: float,
        fenced: tuple[int, ...] = (),
        deferred_fence: tuple[int, ...] = (),
    ) -> None:
        self.owner = owner
        self.job_id = job_id
        self.req = req
        self.is_store = is_store
        self.keys = keys
        self.blocks = blocks
        self.pending = pending
        self.failed = 0
        self.seen = 0  # mask of ranks that reported (when reports carry ranks)
        self.created_at = now
        self.stalled_at = 0.0
        self.fenced = fenced
        self.deferred_fence = deferred_fence
        self.deferred_registered = False
        self.flushed = False
        self.sent = is_store  # a store is created while its metadata is built
        self.carried = False
        JOB.attach(self)


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
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
_NO_OUTPUT = ConnectorOutputResult()
_NO_KEYS: Mapping[int, tuple[OffloadKey, ...]] = EMPTY_MAPPING


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


@dataclass(slots=True)
class _StepBatch:
    loads: dict[int, TransferJob] = field(default_factory=dict)
    flush: set[int] = field(default_factory=set)
    allocated: set[int] = field(default_factory=set)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _finished_copy(request: RequestLike) -> Request:
    """What a finished request's final stores read, copied from its view when it finishes:
    the record keeps this, not the engine's request object, so the engine frees that object
    (its token lists) when it drops it, as it does without a connector, instead of the
    connector's next ``build_connector_meta`` freeing it. Taken only when no load of the
    request is in flight: the engine no longer changes such a finished request, so the copy
    reads as the view would. ``block_hashes`` is the view's own sequence (not copied)."""
    return Request(
        request.request_id,
        request.num_prompt_tokens,
        request.num_tokens,
        cast("list[bytes]", request.block_hashes),
        request.num_computed_tokens,
        request.kv_transfer_params,
        request.skip_reading_prefix_cache,
        request.is_aborted,
    )


_SEQ = (list, tuple)
_INT_VALUE: Any = int.__index__
"""An id as the exact int it equals: raises TypeError for anything that is not an int (or
an int subclass such as bool), and ignores a subclass's own comparison operators."""

# the fields of a ScheduledRequest, as the tuple _update_req_states iterates (C speed)
_ENTRY: Callable[[ScheduledRequest], tuple[str, Any, int, bool]] = attrgetter(
    "req_id", "new_block_ids", "num_scheduled_tokens", "resumed_from_preemption"
)


_native_block_lists: Callable[[Any, int], tuple[tuple[int, ...], ...] | None] | None
try:  # the accepting half of _admitted_lists in C (optional: built by the install)
    from statecore._viewcheck import block_lists as _native_block_lists
except ImportError:  # pragma: no cover - the extension is optional (no compiler at install)
    _native_block_lists = None


def _admitted_lists(
    block_ids: Any, n_groups: int, num_external_tokens: Any
) -> tuple[tuple[int, ...], ...] | None:
    """The block lists of :meth:`OffloadingScheduler.update_state_after_alloc` as tuples, or
    None when an argument is malformed (the validation layer then diagnoses).

    The C check (``statecore._viewcheck.block_lists``, where built) accepts the plain form
    (exact lists/tuples of exact ints >= 0); what it declines the Python check below rules
    on, so what is accepted does not depend on whether the extension is built.
    """
    if type(num_external_tokens) is not int or num_external_tokens < 0:
        return None
    if _native_block_lists is not None:
        fast = _native_block_lists(block_ids, n_groups)
        if fast is not None:
            return fast
    if type(block_ids) not in _SEQ or len(block_ids) != n_groups:
        return None
    out: list[tuple[int, ...]] = []
    try:
        for ids in block_ids:
            if type(ids) not in _SEQ:
                return None
            t = tuple(ids)
            if t and min(map(_INT_VALUE, t)) < 0:
                return None
            out.append(t)
    except TypeError:
        return None
    return tuple(out)


def _count_loaders(loading: dict[OffloadKey, int], keys: Sequence[OffloadKey], delta: int) -> None:
    """Add ``delta`` (1: a load started, -1: it ended) to each key's count of loads in flight;
    a key whose count reaches 0 leaves ``loading``. A key listed twice counts twice.

    The usual load has distinct keys no other load holds: then at C speed."""
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


def _param(params: Mapping[str, Any] | None, name: str) -> tuple[int | None, bool]:
    """Read a non-negative int transfer parameter; (value, was_invalid)."""
    if not params or name not in params:
        return None, False
    value = params[name]
    if type(value) is int and value >= 0:
        return value, False
    return None, True


class OffloadingScheduler:
    """Scheduler side of a KV-offloading connector.

    Args:
        config: the validated configuration.
        manager: the cache directory (:class:`~statecore.OffloadingManager`).
        clock: monotonic seconds; injected so that runs replay from a seed.
        checked: evaluate every invariant of :mod:`statecore.specs.invariants` after every
            public call and raise :class:`~statecore.errors.InvariantViolation` on the first
            violation; a call that raises keeps its own error, with a violation found after
            it added as a note. Defaults to the ``STATECORE_CHECKED`` environment variable.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        manager: OffloadingManager,
        clock: Clock = time.monotonic,
        checked: bool | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.clock = clock
        self.counters = SchedulerCounters()
        self._reqs: dict[str, RequestRecord] = {}
        self._jobs: dict[int, JobRecord] = {}
        self._stalled: dict[int, JobRecord] = {}
        self._next_job_id = 0
        self._stale_threshold = 0
        self._fence: dict[int, set[int]] = {}
        # sliding-window block id -> (group state, position) of every tracked request that
        # listed it: when the block is handed out again, those positions are stale
        self._window_blocks: dict[int, list[tuple[GroupState, int]]] = {}
        self._loading_keys: dict[OffloadKey, int] | None = (
            {} if config.enable_prefix_caching else None
        )
        self._batch = _StepBatch()
        self._awaiting_signal: dict[str, RequestRecord] = {}
        # errors a manager raised while a job completed (the completion was applied all the
        # same) or while build_connector_meta offered a store (taken as no room), each with
        # what raised it; raised by update_connector_output once it applied everything else
        self._manager_failures: list[tuple[Exception, str]] = []
        # the manager's reset_cache raised: it may still hold pre-reset chunks and the
        # write-pending and pinned keys of the jobs the reset discarded; no lookup hits until
        # a retry (each build_connector_meta, each reset_cache) succeeds
        self._manager_reset_pending = False
        # Requests whose store cap is below their store floor (no chunk can become storable,
        # e.g. a prompt-only request whose prompt is stored): their columnar entries without
        # new blocks are skipped. Left when the floor is reset (allocation, preemption,
        # resumption, reset) or the request is released (INV-CURSOR checks it).
        self._dormant: set[str] = set()
        self._finished_loads: set[str] = set()
        self._failed_loads: dict[str, set[int]] = {}  # request -> invalid blocks
        self._last_stall_check = clock()
        self._stats_mark = SchedulerCounters()
        n = len(config.groups)
        self._n_groups = n
        self._bpc = config.blocks_per_chunk
        self._tpc = [config.tokens_per_chunk(g) for g in range(n)]
        self._positions = bool(getattr(manager, "wants_key_positions", False))
        self._group_suffix = [make_offload_key(b"", g) for g in range(n)]
        self._tpb = [config.groups[g].tokens_per_block for g in range(n)]
        self._hpc = [config.hashes_per_chunk(g) for g in range(n)]
        self._window = [config.window_chunks(g) for g in range(n)]
        self._sliding = [w is not None for w in self._window]
        self._no_blocks: tuple[tuple[int, ...], ...] = tuple(() for _ in range(n))
        self._any_sliding = int(any(self._sliding))
        # lookup order: full attention first, then sliding window by window size, descending
        self._lookup_order = [g for g in range(n) if not self._sliding[g]] + sorted(
            (g for g in range(n) if self._sliding[g]),
            key=lambda g: -(self._window[g] or 0),
        )
        if checked is None:
            checked = os.environ.get("STATECORE_CHECKED", "") not in ("", "0")
        self.checked = checked
        if checked:
            self._install_checks()

    # ----------------------------------------------------------------------------------------
    # introspection (read-only views for tests, specs and the simulator)

    @property
    def requests(self) -> Mapping[str, RequestRecord]:
        """Tracked requests by id (read-only use)."""
        return self._reqs

    @property
    def jobs(self) -> Mapping[int, JobRecord]:
        """Live (in-flight) jobs by id (read-only use)."""
        return self._jobs

    @property
    def stalled_jobs(self) -> Mapping[int, JobRecord]:
        """The stalled-job ledger: id -> record whose ``pending`` is the remaining count."""
        return self._stalled

    @property
    def fence_index(self) -> Mapping[int, set[int]]:
        """GPU block id -> ids of store jobs that read it (read-only use)."""
        return self._fence

    @property
    def window_index(self) -> Mapping[int, list[tuple[GroupState, int]]]:
        """Sliding-window GPU block id -> (group state, position) of every tracked request that
        lists it there (read-only use): the positions zeroed when the block is handed out."""
        return self._window_blocks

    @property
    def loading_keys(self) -> Mapping[OffloadKey, int] | None:
        """Keys of live load jobs with their multiplicity (None without prefix caching)."""
        return self._loading_keys

    @property
    def stale_threshold(self) -> int:
        """Reports for job ids below this belong to an epoch before the last reset."""
        return self._stale_threshold

    @property
    def _invalid_blocks(self) -> set[int]:
        """The blocks of the failed loads the next :meth:`update_connector_output` reports
        (the union of its ``failed_loads``; the model checker's state reads it)."""
        return set().union(*self._failed_loads.values())

    @property
    def next_job_id(self) -> int:
        """The id the next job will get."""
        return self._next_job_id

    def request_state(self, req_id: str) -> str:
        """The lifecycle state name of a tracked request."""
        rec = self._reqs.get(req_id) if type(req_id) is str else None
        if rec is None:
            raise UnknownRequestError(req_id, "request_state")
        return REQUEST.state_name(rec)

    def request_keys(self, req_id: str) -> tuple[tuple[OffloadKey, ...], ...]:
        """The offload keys of a tracked request, per KV-cache group, in chunk order.

        Key ``i`` of group ``g`` names the chunk covering tokens ``[i * tpc, (i + 1) * tpc)``
        (``tpc = config.tokens_per_chunk(g)``), for every whole chunk the request's block
        hashes covered when the scheduler last read them. Raises
        :class:`~statecore.errors.UnknownRequestError` for an untracked request.
        """
        rec = self._reqs.get(req_id) if type(req_id) is str else None
        if rec is None:
            raise UnknownRequestError(req_id, "request_keys")
        return tuple(tuple(gs.keys) for gs in rec.groups)

    def _where(self, req_id: object) -> tuple[str | None, str | None]:
        """The entity and state an error about ``req_id`` names (error path only)."""
        rec = self._reqs.get(req_id) if type(req_id) is str else None
        state = "untracked" if rec is None else REQUEST.state_name(rec)
        return f"request {req_id!r}", state

    def check_invariants(self) -> None:
        """Evaluate every scheduler invariant; raise the first violation."""
        # checked mode only: the catalogue (above the core) is imported on first use
        from statecore.specs.invariants import check_scheduler

        check_scheduler(self)

    # ----------------------------------------------------------------------------------------
    # engine hooks

    def on_new_request(self, request: RequestLike) -> None:
        """First sighting of ``request``: ask the manager for its policy and track it.

        Raises :class:`~statecore.errors.InvalidMetadataError` (nothing changes) for a request
        view with a field of the wrong type or range.
        """
        rec = self._reqs.get(validate.request_id(request, "on_new_request"))
        validate.request_view(
            request,
            "on_new_request",
            self._where,
            rec.hashes_ok if rec is not None else 0,
            params=rec is None,
        )
        if rec is not None:
            return
        self._track(request)

    def _track(self, request: RequestLike, rid: str | None = None) -> RequestRecord:
        """Track ``request`` (validated by the caller; ``rid``: its ``request_id`` if read)."""
        if rid is None:
            rid = request.request_id
        params = request.kv_transfer_params
        ctx = ReqContext(rid, params)
        if self._positions:  # (the manager ranks a request's chunks by position)
            ctx.key_positions = {}
        rec = RequestRecord(self, request, ctx, OffloadPolicy.CHUNK_LEVEL, self._n_groups, rid)
        self._register(rec)  # the manager's answer sets the policy
        rec.hashes_ok = len(request.block_hashes)  # the caller validated the view
        rec.max_load_tokens, bad_load = _param(params, "max_load_tokens")
        rec.max_offload_tokens, bad_off = _param(params, "max_offload_tokens")
        self.counters.invalid_transfer_params += int(bad_load) + int(bad_off)
        if rec.max_offload_tokens is not None:
            rec.store_cap = rec.max_offload_tokens
        if self.config.offload_prompt_only:
            rec.store_cap = min(rec.store_cap, request.num_prompt_tokens)
        self._reqs[rec.req_id] = rec
        return rec

    def _register(self, rec: RequestRecord) -> bool:
        """``manager.on_new_request`` for ``rec``; on an error the request stays unregistered
        (tracked all the same; no lookup hits, no stores, no finish notice until a retry, at
        its next lookup or store, succeeds) and the error is taken as :meth:`_manager_error`
        takes any. Whether the manager knows the request now."""
        try:
            rec.policy = self.manager.on_new_request(rec.ctx).policy
        except Exception as exc:
            self._manager_error(
                exc,
                f"the manager's on_new_request for request {rec.req_id!r}",
                "(tracked without offloading until a retry succeeds)",
            )
            return False
        rec.registered = True
        return True

    def get_num_new_matched_tokens(
        self,
        request: RequestLike,
        num_computed_tokens: int,
        max_num_new_tokens: int | None = None,
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` can be loaded.

        Returns ``(None, False)`` to defer (ask again in a later step): the request still has
        jobs in flight, a chunk is pending or being located, or another request is loading
        its hit chunks. ``(n, True)`` means ``n`` tokens will be loaded asynchronously after
        :meth:`update_state_after_alloc`; ``(0, False)`` means nothing to load.

        A lookup changes no block list and no store cursor: the allocation that follows it
        (:meth:`update_state_after_alloc`) does. Calling it for a running request only answers.
        A manager whose ``lookup_many`` raises makes the answer ``(0, False)`` (nothing to
        load: the request computes); the error is counted (``manager_errors``) and, when it
        is untyped or checked mode is on, raised by the next :meth:`update_connector_output`.

        Raises :class:`~statecore.errors.LifecycleError` for a finished request and
        :class:`~statecore.errors.InvalidMetadataError` for a malformed request view or
        ``num_computed_tokens`` outside ``0..request.num_tokens`` (nothing changes then).
        """
        call = "get_num_new_matched_tokens"
        raw = getattr(request, "request_id", None)
        rid = raw if type(raw) is str else validate.request_id(request, call)
        rec = self._reqs.get(rid)
        validate.request_view(
            request, call, self._where, rec.hashes_ok if rec is not None else 0, rec is None
        )
        if type(num_computed_tokens) is not int or not (
            0 <= num_computed_tokens <= request.num_tokens
        ):
            validate._fail(
                call,
                "num_computed_tokens",
                num_computed_tokens,
                f"an int in 0..request.num_tokens ({request.num_tokens})",
                self._where,
                rid,
            )
        if max_num_new_tokens is not None and (
            type(max_num_new_tokens) is not int or max_num_new_tokens < 0
        ):
            validate._fail(
                call,
                "max_num_new_tokens",
                max_num_new_tokens,
                "None or an int >= 0",
                self._where,
                rid,
            )
        if rec is None:
            self.counters.implicit_new_requests += 1
            rec = self._track(request, raw if type(raw) is str else None)
        REQUEST.require(rec, RE_LOOKUP)
        rec.looked_up = True
        rec.request = request
        rec.hashes_ok = len(request.block_hashes)
        self.counters.lookups += 1
        if rec.jobs:
            REQUEST.fire(rec, RE_LOOKUP)
            return self._deferred(rec)
        self._update_keys(rec)
        rec.num_local_computed = num_computed_tokens
        hits: int | None = 0
        if not (
            request.skip_reading_prefix_cache
            or self._manager_reset_pending
            or not (rec.registered or self._register(rec))
        ):
            hits = self._lookup(rec, num_computed_tokens, max_num_new_tokens)
        REQUEST.fire(rec, RE_LOOKUP)
        if hits is None:
            return self._deferred(rec)
        rec.deferred_since = None
        self.counters.lookup_hit_tokens += hits
        return hits, hits > 0

    def _deferred(self, rec: RequestRecord) -> tuple[None, bool]:
        self.counters.lookups_deferred += 1
        if rec.deferred_since is None:
            rec.deferred_since = self.clock()
        return None, False

    def _update_keys(self, rec: RequestRecord) -> None:
        """Turn the request's new block hashes into keys (all groups, or none of them).

        Hooks that take the request validate its view first; ``build_connector_meta`` reads
        the views live, so a ``block_hashes`` turned bad is absorbed there: the keys stay as
        they were and ``invalid_request_views`` counts it.
        """
        hashes: Any = rec.request.block_hashes
        if type(hashes) is not list and not validate.is_sequence(hashes):
            self.counters.invalid_request_views += 1
            return
        n_hashes = len(hashes)
        if n_hashes == rec.n_hashes:
            return
        new: list[tuple[list[OffloadKey], Sequence[Any], int, bool]] = []
        sliceable = type(hashes) is list or type(hashes) is tuple
        for g, gs in enumerate(rec.groups):
            hpc = self._hpc[g]
            have = len(gs.keys)
            whole = n_hashes // hpc
            if have < whole:
                # each chunk's key is built from its last hash block: every hpc-th hash
                ends: Sequence[Any]
                if sliceable:
                    ends = hashes[have * hpc + hpc - 1 : whole * hpc : hpc]
                else:
                    ends = [hashes[idx * hpc + hpc - 1] for idx in range(have, whole)]
                plain = set(map(type, ends)) == _BYTES_ONLY  # the usual case, at C speed
                if not plain:
                    for h in ends:
                        if type(h) is not bytes and not isinstance(
                            h, bytes | bytearray | memoryview
                        ):
                            self.counters.invalid_request_views += 1
                            return
                new.append((gs.keys, ends, g, plain))
        rec.n_hashes = n_hashes
        positions = rec.ctx.key_positions
        for keys, ends, g, plain in new:
            # make_offload_key without its argument checks (done above): hash + group bytes
            suffix = self._group_suffix[g]
            have = len(keys)
            if plain:  # (the + operator: twice as fast per key as map(bytes.__add__, ...))
                keys += [h + suffix for h in ends]
            else:
                keys.extend([OffloadKey(bytes(h) + suffix) for h in ends])
            if positions is not None:  # each chunk's end token (vLLM's key position)
                tpc = self._tpc[g]
                ends_at = range((have + 1) * tpc, (len(keys) + 1) * tpc, tpc)
                positions.update(zip(keys[have:], ends_at, strict=True))

    def _lookup(
        self, rec: RequestRecord, num_computed: int, max_num_new_tokens: int | None
    ) -> int | None:
        request = rec.request
        # a full hit is allowed (the engine recomputes the last token after the load, as vLLM
        # does); with a sliding-window group the last token must be computed to fill it
        max_hit = request.num_tokens - self._any_sliding
        # an explicit cap on the tokens loaded is met with whole chunks of every group
        limit = 1 << 62
        if max_num_new_tokens is not None:
            limit = num_computed + max_num_new_tokens
        if rec.max_load_tokens is not None:
            limit = min(limit, num_computed + rec.max_load_tokens)
        max_hit = min(max_hit, limit)
        budget_tokens = self.config.max_recompute_pending_tokens
        lookup_many = self.manager.lookup_many
        ctx = rec.ctx
        defer = False
        changed = True
        # a group's kernel answers the same over its own answer's range again (prefix_hits and
        # window_hits are idempotent under that cut): with one group, one pass is all.
        # A full-attention group covers the hit with the chunks that hold it, its last one
        # maybe in part (the load fills the blocks up to the hit's end, as vLLM's connector
        # does): with groups of different chunk sizes the hit need not end on a boundary
        # of every group's chunks. Whole chunks only under an explicit cap (`limit`), and
        # for a sliding-window group, whose window is counted in whole chunks back from the
        # hit's end.
        single = len(self._lookup_order) == 1
        while changed:
            changed = False
            for g in self._lookup_order:
                tpc = self._tpc[g]
                keys = rec.groups[g].keys
                cap = min(max_hit, len(keys) * tpc)
                start = num_computed // tpc
                window = self._window[g]
                if window is not None or cap <= num_computed:
                    end = cap // tpc
                else:
                    end = min(-(-cap // tpc), limit // tpc, len(keys))
                if end <= start:  # (start + 1) * tpc > num_computed: nothing loadable
                    return 0
                try:
                    if window is None:  # (up to and with the first miss)
                        results = lookup_many(keys[start:end], ctx, True)
                    else:
                        results = lookup_many(keys[start:end], ctx)
                except Exception as exc:  # answered as no hit; raised after the step
                    self._manager_error(
                        exc,
                        f"get_num_new_matched_tokens: the manager's lookup_many for request "
                        f"{rec.req_id!r}",
                        "(answered as no hit)",
                    )
                    return 0
                if window is None:
                    hits = kernels.prefix_hits(results, budget_tokens // tpc)
                else:
                    hits = kernels.window_hits(results, window)
                if hits is None:
                    defer = True
                    continue
                if hits == 0:
                    return 0
                new_max = tpc * (start + hits)  # > num_computed: hits >= 1
                if new_max < max_hit:
                    max_hit = new_max
                    changed = not single
        if defer:
            return None
        # here max_hit > num_computed: a group whose cap is at most num_computed returned 0
        # above, and a lowered max_hit is tpc * (start + hits) > num_computed (hits >= 1)
        loading = self._loading_keys
        if loading and not self._waited_for_loaders(rec):
            listed = loading.keys()
            for g in self._lookup_order:
                tpc = self._tpc[g]
                end = _ceil_div(max_hit, tpc)  # (the chunks the load reads, as above)
                if not listed.isdisjoint(rec.groups[g].keys[num_computed // tpc : end]):
                    return None
        return max_hit - num_computed

    def _waited_for_loaders(self, rec: RequestRecord) -> bool:
        """Whether ``rec`` has been deferred for ``stall_timeout_s`` already: then it stops
        waiting for other requests' loads of its hit chunks and loads its own copy (counted
        as ``loader_waits_expired``). Without the bound, a stream of requests that load a
        shared prefix in turn defers a request forever (INV-LIVE), which happens when the
        engine cannot turn a finished load into a GPU prefix hit (sliding-window groups)."""
        since = rec.deferred_since
        if since is None or self.clock() - since < self.config.stall_timeout_s:
            return False
        self.counters.loader_waits_expired += 1
        return True

    def update_state_after_alloc(
        self,
        request: RequestLike,
        block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> CreatedLoad | None:
        """The engine allocated ``block_ids`` (per group, the request's complete list) for
        ``num_computed + num_external_tokens`` tokens. With external tokens, create the load
        job that fills the blocks beyond the locally computed prefix.

        The lists are recorded as the request's fresh allocation: its next
        :class:`~statecore.views.ScheduledRequest` starts from them (see the module docstring).

        Returns the :class:`CreatedLoad` (job id, keys, blocks to fill) when a load job was
        created, None when none was (no external tokens, or the load failed before it
        started).

        A manager whose ``prepare_load`` raises (a typed error changes nothing) fails the load
        before it starts: no job (None), the request is reported in the next
        :meth:`update_connector_output`'s ``finished_loads`` and ``failed_loads`` with every
        block it was to fill invalid (the engine recomputes them, or fails the request under
        vLLM's default ``kv_load_failure_policy``); the error is counted (``manager_errors``)
        and, untyped or in checked mode, raised by that call.

        Raises :class:`~statecore.errors.UnknownRequestError` for an untracked request,
        :class:`~statecore.errors.LifecycleError` when the request cannot load now (it has
        jobs in flight or finished), :class:`~statecore.errors.InvalidMetadataError` for a
        malformed request view, block lists or token count, and
        :class:`~statecore.errors.MetadataError` for block lists that do not fit; nothing
        changes then.
        """
        call = "update_state_after_alloc"
        # the request id is the only field of the view read here
        rid = getattr(request, "request_id", None)
        if type(rid) is not str:
            rid = validate.request_id(request, call)
        admitted = _admitted_lists(block_ids, self._n_groups, num_external_tokens)
        if admitted is None:
            validate.block_lists(block_ids, self._n_groups, call, "block_ids", self._where, rid)
            validate._fail(
                call, "num_external_tokens", num_external_tokens, "an int >= 0", self._where, rid
            )
        rec = self._reqs.get(rid)
        if rec is None:
            raise UnknownRequestError(rid, call)
        if num_external_tokens == 0:
            local = rec.num_local_computed
            if local:
                for g, ids in enumerate(block_ids):
                    if len(ids) < -(-local // self._tpb[g]):
                        raise MetadataError(
                            f"{call}: request {rid!r} group {g}: {len(ids)} blocks cannot hold "
                            f"the {local} locally computed tokens its lookup reported (the "
                            f"lists are the request's complete block lists)"
                        )
            self._note_allocation(rec, admitted)
            return None
        REQUEST.require(rec, RE_ALLOC_LOAD)
        num_cached = rec.num_local_computed + num_external_tokens
        keys: list[OffloadKey] = []
        dst: list[int] = []
        sizes: list[int] = []
        starts: list[int] = []
        bpc = self._bpc
        for g, gs in enumerate(rec.groups):
            blocks = block_ids[g]
            n_gpu = _ceil_div(num_cached, self._tpb[g])
            end_chunk = _ceil_div(num_cached, self._tpc[g])
            if len(blocks) < n_gpu or len(gs.keys) < end_chunk:
                raise MetadataError(
                    f"update_state_after_alloc: request {rec.req_id!r} group {g}: "
                    f"{len(blocks)} blocks and {len(gs.keys)} keys cannot hold "
                    f"{num_cached} cached tokens"
                )
            start = _ceil_div(rec.num_local_computed, self._tpb[g])
            while start < n_gpu and not blocks[start]:
                start += 1
            dst.extend(blocks[start:n_gpu])
            sizes.append(n_gpu - start)
            starts.append(start)
            if n_gpu > start:
                keys.extend(gs.keys[start // bpc : end_chunk])
        try:
            src = self.manager.prepare_load(keys, rec.ctx)  # a typed error changes nothing
        except Exception as exc:  # the load fails at once: its blocks are reported invalid
            self._manager_error(
                exc,
                f"update_state_after_alloc: the manager's prepare_load for request {rid!r}",
                "(the load failed before it started: its blocks are reported invalid)",
            )
            self._note_allocation(rec, admitted)
            self._finished_loads.add(rec.req_id)
            self._failed_loads.setdefault(rec.req_id, set()).update(dst)
            return None
        self._note_allocation(rec, admitted)
        if rec.policy is OffloadPolicy.CHUNK_LEVEL:
            for g, gs in enumerate(rec.groups):
                gs.skip = max(gs.skip, _ceil_div(num_cached, self._tpc[g]))
        job = self._new_job(rec, False, tuple(keys), tuple(dst))
        REQUEST.fire(rec, RE_ALLOC_LOAD)
        loading = self._loading_keys
        if loading is not None:
            _count_loaders(loading, job.keys, 1)
        self._batch.loads[job.job_id] = TransferJob(
            rec.req_id, src, GPULoadStoreSpec(job.blocks, tuple(sizes), tuple(starts))
        )
        return CreatedLoad(job.job_id, rec.req_id, job.keys, job.blocks)

    def _note_allocation(self, rec: RequestRecord, admitted: tuple[tuple[int, ...], ...]) -> None:
        """Record an allocation: fence-relevant ids, and the lists the next scheduling uses."""
        allocated = self._batch.allocated
        for ids in admitted:
            allocated.update(ids)
        allocated.discard(0)  # the null block is never handed to an owner
        rec.admitted = admitted
        self._dormant.discard(rec.req_id)

    def _new_job(
        self,
        rec: RequestRecord,
        is_store: bool,
        keys: tuple[OffloadKey, ...],
        blocks: tuple[int, ...],
        fenced: tuple[int, ...] = (),
        deferred_fence: tuple[int, ...] = (),
    ) -> JobRecord:
        job_id = self._next_job_id
        self._next_job_id = job_id + 1
        job = JobRecord(
            self,
            job_id,
            rec,
            is_store,
            keys,
            blocks,
            self.config.num_workers,
            self.clock(),
            fenced,
            deferred_fence,
        )
        self._jobs[job_id] = job
        rec.jobs.add(job_id)
        c = self.counters
        c.jobs_created += 1
        if is_store:
            c.store_jobs_created += 1
        else:
            c.load_jobs_created += 1
        return job

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata:
        """Build this step's metadata: load jobs, store jobs and jobs to flush.

        Order: retry a deferred manager reset (the metadata's ``manager_reset`` says whether
        it took now), flush preempted requests (before the step's entries: a request vLLM
        preempted outside scheduling, as ``reset_prefix_cache`` does, comes back resumed in
        the same output), update request states from ``output`` (keys, block ids, stale
        sliding-window ids), ``manager.on_schedule_end``, flush jobs fenced on any block
        handed out this step, build store jobs (running requests, then finished ones), then
        signal finished requests to the manager. A manager whose
        :attr:`~statecore.manager.OffloadingManager.schedule_end_last` is true gets
        ``on_schedule_end`` last instead, after the signals (vLLM 0.33's order).

        A manager whose ``prepare_store`` raises (a typed error changes nothing) does not
        stop the step: that offer is taken as no room (retried next step, cursors untouched),
        the error is counted (``manager_errors``) and, when it is untyped or checked mode is
        on, raised by the next :meth:`update_connector_output`, after it applied its report.
        The step's metadata is whole either way. So are errors of ``on_schedule_end`` (the
        step goes on) and ``on_request_finished`` (taken as delivered: it is never sent
        twice).
        """
        validate.scheduler_output(output, self._n_groups, self._where)
        manager_reset = self._manager_reset_pending and self._reset_manager() is None
        batch = self._batch
        # preemptions first: they happened before this step's scheduling, and a request vLLM
        # preempted outside it (reset_prefix_cache with reset_running_requests) is resumed in
        # this very output; its resumed block lists must survive the preemption
        self._apply_preemptions(output)
        scheduled = self._update_req_states(output)
        end_last = getattr(self.manager, "schedule_end_last", False) is True
        if not end_last:
            self._schedule_end(output)
        fence = self._fence
        if fence and batch.allocated:
            small, large = (
                (batch.allocated, fence)
                if len(batch.allocated) <= len(fence)
                else (fence, batch.allocated)
            )
            for b in small:
                if b in large:
                    batch.flush.update(fence[b])
        store_jobs: dict[int, TransferJob] = {}
        for rec in scheduled:
            self._build_store_jobs(rec, store_jobs, finished=False)
        for rec in list(self._awaiting_signal.values()):
            self._build_store_jobs(rec, store_jobs, finished=True)
            REQUEST.fire(rec, RE_SIGNAL_FINISHED)
        self._awaiting_signal.clear()
        self.counters.flushes_requested += len(batch.flush)
        jobs = self._jobs
        for job_id in batch.loads:
            jobs[job_id].sent = True
        for job_id in batch.flush:
            job = jobs.get(job_id)
            if job is not None:
                job.flushed = True
        meta = ConnectorMetadata(
            batch.loads,
            store_jobs,
            frozenset(batch.flush),
            {job_id: jobs[job_id].keys for job_id in store_jobs} if store_jobs else _NO_KEYS,
            manager_reset,
        )
        self._batch = _StepBatch()
        if end_last:
            self._schedule_end(output)
        return meta

    def _schedule_end(self, output: SchedulerOutput) -> None:
        """``manager.on_schedule_end``; what it raises is counted and raised after the step."""
        try:
            self.manager.on_schedule_end(
                ScheduleEndContext(output.new_req_ids, output.preempted_req_ids)
            )
        except Exception as exc:  # the step goes on; raised after the step
            self._manager_error(
                exc, "build_connector_meta: the manager's on_schedule_end", "(the step went on)"
            )

    def _admit(self, rec: RequestRecord, new_ids: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """The first scheduling after an allocation: start from the allocated lists.

        ``new_ids`` may repeat the complete lists (vLLM's new-request form) or carry only the
        blocks added since the allocation; either way the request's lists become the
        allocation followed by what is new. Cursors rewind when the request was looked up
        since its last admission (the engine starts it from its prefix: a new, preempted or
        reset request). Without a lookup (a streaming session resumed for its next input
        chunk: the engine kept its blocks and computed tokens) they stay where they were, so
        the chunks stored from the kept blocks are not offered again; a cursor beyond the new
        lists' whole chunks (lists that no longer hold what was stored) rewinds all the same.
        """
        admitted = rec.admitted or ()
        rec.admitted = None
        rec.store_floor = 0
        rewind = rec.looked_up
        rec.looked_up = False
        self._unindex_window_positions(rec)
        out: list[Sequence[int]] = []
        bpc = self._bpc
        for gs, adm, ids in zip(rec.groups, admitted, new_ids, strict=True):
            gs.block_ids.clear()
            n = len(adm)
            head = ids[:n]  # ScheduledRequest stores tuples: no conversion in the usual case
            if n and (len(ids) < n or (head if type(head) is tuple else tuple(head)) != adm):
                lists: Sequence[int] = [*adm, *ids]
            else:
                lists = ids
            out.append(lists)
            if rewind or gs.cursor * bpc > len(lists):
                gs.cursor = 0
        return out

    def _apply_preemptions(self, output: SchedulerOutput) -> None:
        """The output's preempted requests: each flushes its in-flight jobs and forgets its
        block lists (the engine freed them). Applied before the step's scheduled entries, so
        a request both preempted and resumed in one output keeps the resumed lists."""
        for req_id in output.preempted_req_ids:
            rec = self._reqs.get(req_id)
            if rec is not None and REQUEST.accepts(rec, RE_PREEMPT):
                REQUEST.fire(rec, RE_PREEMPT)

    def _update_req_states(self, output: SchedulerOutput) -> list[RequestRecord]:
        """Apply the step's entries (``scheduled``, then ``columns``) to the request records;
        return the records that may have a chunk to store.

        A decode entry (no new blocks, under its store floor) costs a record lookup and a few
        comparisons: keys are built when a store or lookup needs them (:meth:`_update_keys`
        from :meth:`_build_store_jobs`), not each time a block hash appears.
        """
        allocated = self._batch.allocated
        scheduled: list[RequestRecord] = []
        get = self._reqs.get
        dormant_add = self._dormant.add
        sliding = self._sliding if self._any_sliding else None
        window_new: list[tuple[int, GroupState, int]] = []
        entries: Iterable[tuple[str, Any, int, bool]] = map(_ENTRY, output.scheduled)
        cols = output.columns
        if cols is not None:
            resumed = cols.resumed_req_ids
            rids = cols.req_ids
            blocks = cols.new_block_ids
            dormant = self._dormant
            if resumed:
                dormant.difference_update(resumed)  # (their block lists start over below)
            col_entries: Iterable[tuple[str, Any, int, bool]] = zip(
                rids,
                blocks,
                cols.num_scheduled_tokens,
                # (most steps resume nobody: no membership test per entry then)
                map(resumed.__contains__, rids) if resumed else repeat(False, len(rids)),
                strict=True,
            )
            if dormant:
                # an entry of a dormant request with no new blocks changes nothing: dropped at
                # C speed (in a large decode batch, most entries). Kept: not dormant, or with
                # new blocks; as booleans, dormant <= has blocks (one call an entry fewer than
                # `not dormant or has blocks`)
                col_entries = compress(
                    col_entries,
                    map(le, map(dormant.__contains__, rids), map(is_not, blocks, repeat(None))),
                )
            entries = chain(entries, col_entries)
        for rid, new_ids, n, resumed_now in entries:
            rec = get(rid)
            if rec is None:
                self._untracked_scheduled(new_ids or (), allocated)
                continue
            if rec.admitted is not None:
                new_ids = self._admit(rec, new_ids or self._no_blocks)
            rec.num_scheduled = n
            if resumed_now:
                self._clear_block_lists(rec)
            if new_ids:
                for g, ids in enumerate(new_ids):
                    if ids:
                        gs = rec.groups[g]
                        if sliding is not None and sliding[g]:
                            base = len(gs.block_ids)
                            window_new.extend((b, gs, base + i) for i, b in enumerate(ids) if b)
                        gs.block_ids.extend(ids)
                        allocated.update(ids)
            # most steps are decode steps that cannot complete a chunk: skip store building
            floor = rec.store_floor
            if floor:
                if rec.store_cap < floor:
                    dormant_add(rid)  # no chunk can become storable: skipped from now on
                    continue
                nc = rec.request.num_computed_tokens
                if type(nc) is int and nc + n < floor:
                    continue  # (a view turned bad is counted in _build_store_jobs)
            scheduled.append(rec)
        allocated.update(output.extra_allocated_block_ids)
        allocated.discard(0)  # the null block is never handed to an owner
        if sliding is not None:
            self._drop_stale_window_blocks(allocated, window_new)
        return scheduled

    def _untracked_scheduled(self, new_ids: Sequence[Sequence[int]], allocated: set[int]) -> None:
        """A scheduled request this connector does not track (another connector's): skipped
        and counted, but its new blocks are handed out all the same, so they count for fences
        and for stale sliding-window blocks."""
        for ids in new_ids:
            allocated.update(ids)
        self.counters.unknown_scheduled_requests += 1

    def _drop_stale_window_blocks(
        self, allocated: set[int], window_new: list[tuple[int, GroupState, int]]
    ) -> None:
        """INV-SRC-VALID for sliding-window groups: a block handed out this step (to anyone,
        tracked or not, in any group) is stale in every position that any tracked request
        listed it at before this step, whether or not that request is scheduled now (the
        engine frees blocks that left the window without telling the connector). Zero those
        positions so they are never stored; then index this step's new positions. Costs
        O(blocks handed out this step)."""
        index = self._window_blocks
        if index:
            fresh = {(id(gs), pos) for _, gs, pos in window_new} if window_new else ()
            for b in allocated:
                held = index.pop(b, None)
                if held is None:
                    continue
                for gs, pos in held:
                    ids = gs.block_ids
                    if pos < len(ids) and ids[pos] == b and (id(gs), pos) not in fresh:
                        ids[pos] = 0
        for b, gs, pos in window_new:
            held = index.get(b)
            if held is None:
                index[b] = [(gs, pos)]
            else:
                held.append((gs, pos))

    def _build_store_jobs(
        self, rec: RequestRecord, store_jobs: dict[int, TransferJob], finished: bool
    ) -> None:
        request = rec.request
        # a running request's view is read live (a finished one's is the copy request_finished
        # made, unless a load was in flight): a field turned bad since the last hook skips this
        # request's stores for the step (counted in invalid_request_views), nothing else
        nc = request.num_computed_tokens
        nt = request.num_tokens
        n_prompt = request.num_prompt_tokens
        aborted = request.is_aborted
        if not (
            type(nc) is int
            and type(nt) is int
            and type(n_prompt) is int
            and type(aborted) is bool
            and nc >= 0
            and 0 <= n_prompt <= nt
        ):
            self.counters.invalid_request_views += 1
            return
        if aborted:
            target = nc
        elif finished:
            # the last sampled token has no KV; and never more than was computed (a request
            # that finishes mid-prefill must not store blocks that were never written)
            target = min(max(n_prompt, nt - 1), nc)
        else:
            target = nc + rec.num_scheduled
        n_off = min(target, nt)
        if rec.max_offload_tokens is not None:
            n_off = min(n_off, rec.max_offload_tokens)
        if self.config.offload_prompt_only:
            n_off = min(n_off, n_prompt)
        if n_off < rec.store_floor:
            return  # the common decode step: no new whole chunk yet
        if not REQUEST.accepts(rec, RE_STORE_CREATED):
            return  # loading or draining: INV-EXCL, retried in a later step
        if self._manager_reset_pending:
            # the manager's reset failed and is retried: whatever it took now, the retry would
            # drop behind the cursors (a hole no prefix gets past); as no room, cursors
            # untouched, offered once the reset went through (INV-STORE-COMPLETE)
            return
        if not (rec.registered or self._register(rec)):
            return  # the manager does not know the request: nothing to offer it yet
        self._update_keys(rec)  # keys of the blocks hashed since they were last needed
        self._store_chunks(rec, n_off, store_jobs, finished)
        chunk_level = rec.policy is OffloadPolicy.CHUNK_LEVEL
        groups = rec.groups
        if len(groups) == 1:  # (no generator for the usual single group)
            gs = groups[0]
            rec.store_floor = (
                (max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1
            ) * self._tpc[0]
            return
        rec.store_floor = min(
            ((max(gs.cursor, gs.skip) if chunk_level else gs.cursor) + 1) * self._tpc[g]
            for g, gs in enumerate(groups)
        )

    def _store_chunks(
        self, rec: RequestRecord, n_off: int, store_jobs: dict[int, TransferJob], finished: bool
    ) -> None:
        bpc = self._bpc
        chunk_level = rec.policy is OffloadPolicy.CHUNK_LEVEL
        storable: list[int] = []
        # offered chunk indices, per group: a range when none of them has a null block
        per_group: list[Sequence[int]] = []
        offer: list[OffloadKey] = []
        for g, gs in enumerate(rec.groups):
            block_ids = gs.block_ids
            n = kernels.storable_chunks(
                max(n_off, 0), self._tpc[g], len(block_ids), bpc, len(gs.keys)
            )
            storable.append(n)
            first = max(gs.cursor, gs.skip) if chunk_level else gs.cursor
            # null or stale (zeroed) blocks are never stored (INV-SRC-VALID)
            head = block_ids[first * bpc : n * bpc]
            if 0 not in head:  # the usual case: every chunk, its keys one slice (C speed)
                per_group.append(range(first, n))
                offer += gs.keys[first:n]
                continue
            valid: list[int]
            if bpc == 1:
                valid = list(compress(range(first, n), head))
            else:
                valid = [c for c in range(first, n) if 0 not in block_ids[c * bpc : (c + 1) * bpc]]
            per_group.append(valid)
            offer.extend(map(gs.keys.__getitem__, valid))
        if not offer:
            self._advance(rec, storable)
            return
        try:
            out = self.manager.prepare_store(offer, rec.ctx)
        except Exception as exc:  # as no room (retried next step), raised after the step
            self._manager_error(
                exc,
                f"build_connector_meta: the manager's prepare_store for request {rec.req_id!r}",
                "(taken as no room; the offer is retried next step)",
            )
            return
        if out is None:
            self.counters.allocation_failures += 1
            return  # retried next step, cursors untouched
        kept = out.keys_to_store
        if not kept:
            self._advance(rec, storable)
            return
        kept_t = kept if type(kept) is tuple else tuple(kept)
        # The manager keeps the offered order. When what it kept is the offer's tail and no
        # key before the tail is one of them (the present keys all come first: a prompt whose
        # shared prefix is stored already, or an offer kept whole), the accepted chunks are
        # the offer's tail, group by group, and the job's keys are what the manager kept: the
        # chunks the filter by key below would accept, without a pass over every offered one.
        cut = len(offer) - len(kept_t)
        accepted: set[OffloadKey] | None = None
        if cut < 0 or tuple(offer[cut:]) != kept_t:
            accepted = set(kept_t)
        elif cut:
            accepted = set(kept_t)
            if accepted.isdisjoint(offer[:cut]):
                accepted = None
        pos = 0  # the offer's index of the group's first offered chunk
        src: list[int] = []
        sizes = [0] * self._n_groups
        starts = [0] * self._n_groups
        fenced: list[int] = []
        deferred: list[int] = []
        keys: list[OffloadKey] = []
        for g, offered in enumerate(per_group):
            gs = rec.groups[g]
            chunks: Sequence[int]
            if accepted is None:
                skip = cut - pos
                pos += len(offered)
                chunks = offered[skip:] if skip > 0 else offered
            else:
                chunks = list(
                    compress(offered, map(accepted.__contains__, map(gs.keys.__getitem__, offered)))
                )
            if not chunks:
                continue
            block_ids = gs.block_ids
            if isinstance(chunks, range):  # (step 1: consecutive chunks, their blocks a slice)
                blocks = block_ids[chunks.start * bpc : chunks.stop * bpc]
            elif bpc == 1:
                blocks = list(map(block_ids.__getitem__, chunks))
            else:
                blocks = [b for c in chunks for b in block_ids[c * bpc : (c + 1) * bpc]]
            starts[g] = chunks[0] * bpc
            sizes[g] = len(blocks)
            src.extend(blocks)
            (fenced if self._sliding[g] else deferred).extend(blocks)
            if accepted is not None:
                keys.extend(map(gs.keys.__getitem__, chunks))
        # one tuple for the source blocks, shared by the job, its fences and its transfer (each
        # object of a step's jobs lives until the workers took the metadata: fewer of them,
        # fewer garbage collections triggered inside the hooks)
        blocks_t = tuple(src)
        job = self._new_job(
            rec,
            True,
            kept_t if accepted is None else tuple(keys),
            blocks_t,
            blocks_t if len(fenced) == len(blocks_t) else tuple(fenced),
            blocks_t if len(deferred) == len(blocks_t) else tuple(deferred),
        )
        if job.fenced:
            kernels.fence_add(self._fence, job.job_id, job.fenced)
        REQUEST.fire(rec, RE_STORE_CREATED)
        if finished:
            self._register_deferred_fence(job)
            allocated = self._batch.allocated
            if any(b in allocated for b in job.deferred_fence):
                self._batch.flush.add(job.job_id)
        self._advance(rec, storable)
        store_jobs[job.job_id] = TransferJob(
            rec.req_id,
            GPULoadStoreSpec(blocks_t, tuple(sizes), tuple(starts)),
            out.store_spec,
        )

    @staticmethod
    def _advance(rec: RequestRecord, storable: list[int]) -> None:
        for gs, n in zip(rec.groups, storable, strict=True):
            gs.cursor = kernels.advance_cursor(gs.cursor, n)

    def _register_deferred_fence(self, job: JobRecord) -> None:
        if not job.deferred_registered and job.deferred_fence:
            kernels.fence_add(self._fence, job.job_id, job.deferred_fence)
        job.deferred_registered = True

    def update_connector_output(self, meta: WorkerMetadata | None) -> ConnectorOutputResult:
        """Apply the workers' aggregated report of one step.

        Counts are applied per job (failures first); a job whose every worker reported
        completes (or fails) through the one completion path. Reports for jobs of an earlier
        reset epoch, never-issued ids, ended jobs and stalled jobs are absorbed and counted;
        invalid counts (not a positive int) are ignored and counted. A count-only report that
        claims more workers than a job still waits for is rejected whole and counted
        (``over_reports``): no job completes before every worker finished. Rank-tagged reports
        count each rank once per job. Then the stall check runs
        (at most once per ``stall_check_interval_s``).

        Raises :class:`~statecore.errors.InvalidMetadataError` (a
        :class:`~statecore.errors.MetadataError`; nothing changes) when ``meta`` is not a
        :class:`~statecore.WorkerMetadata` or None, or one of its fields has the wrong type
        (a per-job map that is not a dict, ``stats`` that is not a
        :class:`~statecore.wire.TransferStats` of finite non-negative numbers, ...). The
        whole report is rejected then, not a part of it.

        A manager that raises while a job completes (``complete_store``/``complete_load``)
        does not stop the completion: the job ends and the rest of the report is applied. A
        :class:`~statecore.errors.ManagerError` is then counted (``manager_errors``) and, in
        checked mode, raised once the whole report is applied; any other exception (a bug in
        the manager) is counted and raised as a :class:`~statecore.errors.ManagerError` naming
        the job, in either mode. The loads that finished in such a call are reported by the
        next call. What the manager raised from ``prepare_store`` during the step's
        :meth:`build_connector_meta` is raised here the same way.

        Duplicates: a count-only report delivered twice cannot be told from two workers'
        reports. Workers that set ``WorkerMetadata.rank`` (as :class:`~statecore.OffloadingWorker`
        does) also send rank masks; the scheduler then counts each rank at most once per job
        and counts a repeated rank in ``duplicate_reports``.
        """
        validate.worker_metadata(meta)
        c = self.counters
        if meta is not None:
            load, store = meta.stats.load, meta.stats.store
            c.load_bytes += load.bytes
            c.load_seconds += load.seconds
            c.store_bytes += store.bytes
            c.store_seconds += store.seconds
            # job id -> [ok count, failed count, ok rank mask, failed rank mask]
            reports: dict[int, list[int]] = {}
            for col, counts in (
                (0, meta.completed),
                (1, meta.failed),
                (2, meta.completed_ranks),
                (3, meta.failed_ranks),
            ):
                for job_id, n in counts.items():
                    if type(n) is not int or n <= 0 or type(job_id) is not int:
                        c.invalid_report_counts += 1
                        continue
                    entry = reports.get(job_id)
                    if entry is None:
                        entry = reports[job_id] = [0, 0, 0, 0]
                    entry[col] = n  # a map names a job once: the column is still 0 here
            for job_id, (ok, bad, ok_mask, bad_mask) in reports.items():
                self._apply_report(job_id, ok, bad, ok_mask, bad_mask)
        self._check_stalls()
        if self._manager_failures:
            self._raise_manager_failures()
        finished = self._finished_loads
        if not finished:
            return _NO_OUTPUT
        failed = self._failed_loads
        if failed:
            self._failed_loads = {}
            per_req = {rid: frozenset(ids) for rid, ids in failed.items()}
            result = ConnectorOutputResult(
                frozenset(finished), frozenset().union(*per_req.values()), per_req
            )
        else:
            result = ConnectorOutputResult(frozenset(finished))
        finished.clear()
        return result

    def _manager_error(self, exc: Exception, what: str, then: str) -> None:
        """A manager call raised ``exc`` inside a hook that goes on as if it had not
        (``what`` raised it, ``then`` says what the hook did instead): counted in
        ``manager_errors``; kept for :meth:`_raise_manager_failures` when it is untyped (a
        manager's bug) or checked mode is on."""
        self.counters.manager_errors += 1
        if self.checked or not isinstance(exc, ManagerError):
            self._manager_failures.append(
                (exc, f"{what} raised {type(exc).__name__}: {exc} {then}")
            )

    def _raise_manager_failures(self) -> None:
        """Raise what the manager raised while this call completed jobs (every completion of
        the call is applied: the jobs ended, their requests moved on) or while the step's
        ``build_connector_meta`` offered stores (each taken as no room): a
        :class:`~statecore.errors.ManagerError` as it is, anything else as a
        :class:`~statecore.errors.ManagerError` naming the call and the job or request (the
        original as its cause); further failures are notes on the first. The loads that
        finished stay to be reported by the next ``update_connector_output``."""
        failures, self._manager_failures = self._manager_failures, []
        errors: list[Exception] = []
        for exc, what in failures:
            if isinstance(exc, ManagerError):
                errors.append(exc)
                continue
            wrapped = ManagerError(what)
            wrapped.__cause__ = exc
            errors.append(wrapped)
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also raised in this call: {type(other).__name__}: {other}")
        raise first

    def _apply_report(self, job_id: int, ok: int, bad: int, ok_mask: int, bad_mask: int) -> None:
        c = self.counters
        job = self._jobs.get(job_id)
        stalled = self._stalled.get(job_id) if job is None else None
        kind = kernels.classify_report(
            job_id,
            self._stale_threshold,
            self._next_job_id,
            job is not None,
            stalled is not None,
        )
        if kind is kernels.ReportKind.STALE:
            c.stale_reports += 1
            return
        if kind is kernels.ReportKind.UNKNOWN:
            c.unknown_reports += 1
            return
        if kind is kernels.ReportKind.DUPLICATE:
            c.duplicate_reports += 1
            return
        target = job if job is not None else stalled
        if target is None:  # not reachable: LIVE and STALLED imply a record
            c.unknown_reports += 1
            return
        if stalled is not None:
            c.late_reports += 1
        if ok_mask or bad_mask:  # ranks known: each rank counts once per job
            seen, ok, bad, duplicates, invalid = kernels.rank_delta(
                target.seen, ok_mask, bad_mask, self.config.num_workers
            )
            target.seen = seen
            c.duplicate_reports += duplicates
            c.invalid_report_counts += invalid
            if not ok and not bad:
                return
        elif kernels.over_report(target.pending, ok, bad):
            c.over_reports += 1  # count-only and more than outstanding: rejected whole
            return
        pending, _, acc_bad, excess = kernels.apply_report(target.pending, ok, bad)
        c.over_reports += int(excess > 0)
        target.pending = pending
        target.failed += acc_bad
        JOB.fire(target, JE_WORKER_REPORT)

    def _check_stalls(self) -> None:
        now = self.clock()
        cfg = self.config
        if now - self._last_stall_check < cfg.stall_check_interval_s:
            return
        self._last_stall_check = now
        timeout = cfg.stall_timeout_s
        due: list[JobRecord] = []
        for job in self._jobs.values():  # creation order: stop at the first young job
            if not kernels.stall_due(now, job.created_at, timeout):
                break
            due.append(job)
        for job in due:
            JOB.fire(job, JE_STALL_TIMEOUT)
        expired = [
            j for j in self._stalled.values() if kernels.stall_due(now, j.stalled_at, timeout)
        ]
        for job in expired:
            del self._stalled[job.job_id]
            self.counters.stalled_expired += 1

    def request_finished(self, request: RequestLike) -> tuple[bool, None]:
        """The request finished (or was aborted); its blocks may be freed at once.

        In-flight stores keep their full-attention source blocks fenced from now on, so a
        reuse of any of them flushes the store first. Final stores are built in the next
        :meth:`build_connector_meta`, after which the manager hears ``on_request_finished``
        exactly once. Unless a load of the request is in flight, the view is read here for the
        last time: the record keeps a copy of its fields (and its ``block_hashes`` sequence),
        never ``request`` itself, so the engine's request object is freed when the engine
        drops it. With a load in flight the engine keeps the request (and its blocks) until
        the load ends and may count the loaded tokens computed then, so the final stores read
        the view live. For a request that was never tracked, the manager sees
        ``on_new_request`` and ``on_request_finished`` at once. Always returns
        ``(False, None)``.

        Raises :class:`~statecore.errors.LifecycleError` when the request already finished and
        :class:`~statecore.errors.InvalidMetadataError` for a malformed request view.
        """
        call = "request_finished"
        rid = validate.request_id(request, call)
        rec = self._reqs.get(rid)
        validate.request_view(
            request, call, self._where, rec.hashes_ok if rec is not None else 0, rec is None
        )
        if rec is None:
            self.counters.untracked_finishes += 1
            ctx = ReqContext(
                req_id=request.request_id, kv_transfer_params=request.kv_transfer_params
            )
            try:
                self.manager.on_new_request(ctx)
                self.manager.on_request_finished(ctx)
            except Exception as exc:  # the finish goes on; raised after the next report
                self._manager_error(
                    exc,
                    f"request_finished of untracked request {rid!r}: the manager's "
                    "on_new_request or on_request_finished",
                    "(the request was finished all the same)",
                )
            return False, None
        REQUEST.require(rec, RE_FINISH)
        rec.request = request
        self._update_keys(rec)
        jobs = self._jobs
        if all(jobs[j].is_store for j in rec.jobs):  # (with a load in flight: read live)
            rec.request = _finished_copy(request)
        REQUEST.fire(rec, RE_FINISH)
        self._awaiting_signal[rec.req_id] = rec
        return False, None

    def take_events(self) -> list[OffloadingEvent]:
        """The manager's stored/removed events since the last call.

        A manager whose ``take_events`` raises (having changed nothing: its events stay
        queued for the next call) gives none this time; the error is counted
        (``manager_errors``) and, when it is untyped or checked mode is on, raised by the
        next :meth:`update_connector_output`.
        """
        try:
            return list(self.manager.take_events())
        except Exception as exc:  # the engine's step goes on; the events come next time
            self._manager_error(
                exc, "the manager's take_events", "(no events this time; they stay queued)"
            )
            return []

    def get_stats(self) -> dict[str, Any]:
        """Counters since the last call (counters add up) merged with the manager's stats.

        A manager whose ``get_stats`` raises (having changed nothing: its figures come with
        the next call) leaves only the scheduler's own; the error is counted
        (``manager_errors``) and, when it is untyped or checked mode is on, raised by the next
        :meth:`update_connector_output`.

        Transfer metrics use upstream's names (``kv_offload_load_bytes``, ...); statecore's
        own counters keep their :class:`SchedulerCounters` names.
        """
        now = self.counters.as_dict()
        before = self._stats_mark.as_dict()
        delta: dict[str, Any] = {k: now[k] - before[k] for k in now}
        self._stats_mark = SchedulerCounters(**now)  # type: ignore[arg-type]
        delta["kv_offload_load_bytes"] = delta.pop("load_bytes")
        delta["kv_offload_load_time"] = delta.pop("load_seconds")
        delta["kv_offload_store_bytes"] = delta.pop("store_bytes")
        delta["kv_offload_store_time"] = delta.pop("store_seconds")
        delta["kv_offload_allocation_failure"] = delta["allocation_failures"]
        delta["live_jobs"] = len(self._jobs)
        delta["stalled_ledger"] = len(self._stalled)
        delta["tracked_requests"] = len(self._reqs)
        try:
            delta.update(self.manager.get_stats())
        except Exception as exc:  # the engine's metrics go on with the scheduler's own
            self._manager_error(
                exc,
                "the manager's get_stats",
                "(the scheduler's own stats only; the manager's come with the next call)",
            )
        return delta

    def has_pending_push_work(self) -> bool:
        """Whether the engine must keep stepping: jobs in flight, finishes to signal, a flush
        not sent yet, or manager work pending.

        A flush (after a reset or a stall) reaches the workers with the next step's metadata;
        the jobs it names may still run there with no request left, so the engine steps once
        more to send it (the flushed jobs' reports are not waited for: they are inert).

        The engine asks before every step (vLLM's ``has_requests``). A manager whose
        ``has_pending_work`` raises is answered for as having none: nothing of the scheduler's
        is pending then, so the engine may idle until a request comes (the manager is asked
        again at the next step), rather than step without end for a manager that keeps
        raising. The error is counted (``manager_errors``) and, when it is untyped or checked
        mode is on, raised by the next :meth:`update_connector_output`."""
        if self._jobs or self._awaiting_signal or self._batch.flush:
            return True
        try:
            return bool(self.manager.has_pending_work())
        except Exception as exc:  # answered as nothing pending; raised after the next step
            self._manager_error(
                exc, "the manager's has_pending_work", "(answered as no pending work)"
            )
            return False

    @property
    def manager_reset_pending(self) -> bool:
        """The manager's ``reset_cache`` raised and has not succeeded since: every
        ``build_connector_meta`` retries it first (see :meth:`reset_cache`)."""
        return self._manager_reset_pending

    def reset_cache(self) -> bool:
        """:meth:`reset`, answered as vLLM's ``reset_connector_cache`` answers: ``False`` when
        the manager's ``reset_cache`` raised (:attr:`ResetStatus.MANAGER_RESET_DEFERRED`)."""
        return self.reset().status is ResetStatus.DONE

    def reset(self) -> ResetResult:
        """Drop everything offloaded (sleep, weight update) and say what was done (a
        :class:`ResetResult`; :meth:`reset_cache` is the same call answering a bool).

        Every in-flight and stalled job is put in the next ``jobs_to_flush``, and the stale
        threshold moves to the next job id (INV-EPOCH). Stores, stalled jobs and loads not
        sent yet are discarded: their reports become inert, and an unsent load ends at once
        with its blocks invalid (recompute). A load the workers already run is *carried
        over*: the flush makes every worker finish it before any post-reset store can
        overwrite its CPU source (the manager quarantines the slots of pinned keys), its
        reports still count, and it completes as usual, releasing its request with valid
        blocks; only the reset manager hears nothing of it. Finished requests without a
        carried load are finalised; the manager is reset; surviving requests rewind their
        store cursors to chunk 0 (seed 004).

        The engine learns about the loads that ended here from the *next*
        :meth:`update_connector_output` (call it with ``None`` if no report is due): their
        requests are in ``finished_loads`` and their blocks in ``invalid_block_ids``.

        The scheduler's side of the reset is whole before the manager is asked (the stale
        threshold has moved, the reset is counted). A manager whose ``reset_cache`` raises
        may still hold its pre-reset chunks, and the write-pending and pinned keys of the jobs
        the reset discarded (which get no completion: INV-TERM). The result's status is then
        :attr:`ResetStatus.MANAGER_RESET_DEFERRED` with the error as its reason
        (:meth:`reset_cache` returns ``False``: vLLM's "the connector's reset failed") and the
        manager's reset stays pending: every ``build_connector_meta`` retries it before
        anything else (its metadata's ``manager_reset`` says when it took), no lookup hits
        until it succeeds (nothing from before the reset is loaded), and resetting again
        retries too. Each error is counted (``manager_errors``) and,
        when it is untyped or checked mode is on, raised by the next
        :meth:`update_connector_output`.
        """
        batch = self._batch
        flush, threshold = kernels.reset_plan(
            frozenset(self._jobs),
            frozenset(self._stalled),
            self._next_job_id,
            self._stale_threshold,
        )
        batch.flush.update(flush)
        discarded_loads: set[str] = set()
        for job_id in list(batch.loads):
            job = self._jobs[job_id]
            rid = job.req.req_id
            self._finished_loads.add(rid)
            self._failed_loads.setdefault(rid, set()).update(job.blocks)
            discarded_loads.add(rid)
        batch.loads.clear()
        for job in list(self._jobs.values()):
            JOB.fire(job, JE_RESET)
        for job in list(self._stalled.values()):
            JOB.fire(job, JE_RESET)
        carried = frozenset(self._jobs)  # the loads the workers run outlive the reset
        self._stalled.clear()
        self._fence.clear()  # loads hold no fence; every store is gone
        if self._loading_keys is not None:
            self._loading_keys.clear()  # the reset manager knows none of these keys
        for rec in list(self._reqs.values()):
            REQUEST.fire(rec, RE_RESET)
        self._awaiting_signal.clear()
        self._stale_threshold = threshold
        self.counters.resets += 1
        reason = self._reset_manager()
        return ResetResult(
            ResetStatus.DONE if reason is None else ResetStatus.MANAGER_RESET_DEFERRED,
            reason,
            flush,
            flush - carried,
            frozenset(discarded_loads),
            carried,
        )

    def _reset_manager(self) -> str | None:
        """``manager.reset_cache()``; on an error, the reset stays pending (no lookup hits,
        retried by the next ``build_connector_meta`` or ``reset``) and the error is taken as
        :meth:`_manager_error` takes any. None when the manager is reset now, else the
        error as text."""
        try:
            self.manager.reset_cache()
        except Exception as exc:  # the scheduler's side is reset; the engine hears False
            self._manager_reset_pending = True
            self._manager_error(
                exc,
                "the manager's reset_cache",
                "(the scheduler's state was reset; the manager's reset is retried by the "
                "next build_connector_meta, and no lookup hits until it succeeds)",
            )
            return f"{type(exc).__name__}: {exc}"
        self._manager_reset_pending = False
        return None

    def shutdown(self) -> None:
        """Shut the manager down.

        Raises :class:`~statecore.errors.ManagerError` when the manager's ``shutdown``
        raises: a typed one as it is, anything else wrapped (naming the call, the original as
        its cause). Nothing goes on after a shutdown, so the error is not tolerated; it is
        counted (``manager_errors``) all the same."""
        try:
            self.manager.shutdown()
        except ManagerError:
            self.counters.manager_errors += 1
            raise
        except Exception as exc:
            self.counters.manager_errors += 1
            raise ManagerError(
                f"the manager's shutdown raised {type(exc).__name__}: {exc}"
            ) from exc

    # ----------------------------------------------------------------------------------------
    # lifecycle effects (called by lifecycle actions only)

    def complete_job(self, job: JobRecord, success: bool) -> None:
        """The one completion path (seed 000 ``_complete_job``).

        Notifies the manager (``complete_store(success=...)`` or ``complete_load``), updates
        the chunks-being-loaded index, removes the job's fences, forgets the job and ends it
        in its request. Never calls ``on_request_finished``.
        """
        c = self.counters
        rec = job.req
        try:
            if job.is_store:
                self.manager.complete_store(job.keys, rec.ctx, success)
            elif not job.carried:  # a carried load's keys went with the reset
                self.manager.complete_load(job.keys, rec.ctx)
        except Exception as exc:  # the completion goes on; raised after the call
            call = "complete_store" if job.is_store else "complete_load"
            self._manager_error(
                exc,
                f"update_connector_output: job {job.job_id} of request {rec.req_id!r}: "
                f"the manager's {call}",
                "(the job was ended)",
            )
        if not job.is_store:
            loading = self._loading_keys
            if loading is not None and not job.carried:
                _count_loaders(loading, job.keys, -1)
            self._finished_loads.add(rec.req_id)
            if not success:
                self._failed_loads.setdefault(rec.req_id, set()).update(job.blocks)
        if job.fenced:
            c.fence_pairs_missing += kernels.fence_remove(self._fence, job.job_id, job.fenced)
        if job.deferred_registered and job.deferred_fence:
            c.fence_pairs_missing += kernels.fence_remove(
                self._fence, job.job_id, job.deferred_fence
            )
        del self._jobs[job.job_id]
        if success:
            c.jobs_completed += 1
        elif job.pending == 0:
            c.jobs_failed += 1
        rec.jobs.discard(job.job_id)
        REQUEST.fire(rec, RE_JOB_ENDED)

    def stall_job(self, job: JobRecord) -> None:
        """Complete a timed-out job with ``success=False``, flush it, keep it in the ledger."""
        self.complete_job(job, False)
        job.stalled_at = self.clock()
        self._stalled[job.job_id] = job
        self._batch.flush.add(job.job_id)
        self.counters.jobs_stalled += 1

    def forget_stalled(self, job: JobRecord) -> None:
        """A stalled job's late reports all arrived: drop it from the ledger."""
        del self._stalled[job.job_id]
        self.counters.stalled_retired += 1

    def discard_job(self, job: JobRecord) -> None:
        """A reset drops the job: forget it (its request forgets it too); no completion."""
        del self._jobs[job.job_id]
        job.req.jobs.discard(job.job_id)
        self.counters.jobs_discarded += 1

    def carry_load(self, job: JobRecord) -> None:
        """A reset carries the sent load over (it is in the reset's flush)."""
        job.carried = True
        self.counters.loads_carried += 1

    def flush_request(self, req: RequestRecord) -> None:
        """Flush every in-flight job of a preempted request, except the loads created in this
        step: the engine preempted the request before this step's scheduling (preemptions
        are applied first), so such a load comes from its re-admission after the preemption
        and writes its new blocks, which no other owner holds; flushing it would make the
        workers wait for it, a synchronous load."""
        loads = self._batch.loads
        if loads:
            self._batch.flush.update(j for j in req.jobs if j not in loads)
        else:
            self._batch.flush.update(req.jobs)

    def drop_block_lists(self, req: RequestRecord) -> None:
        """A preempted request's blocks are freed: its block lists and store cursors start
        over (INV-CURSOR), so no store (a final one after an abort, say) can read a block
        that the engine has handed to another owner since. The next scheduling brings the
        new lists."""
        self._clear_block_lists(req)

    def _clear_block_lists(self, req: RequestRecord) -> None:
        self._unindex_window_positions(req)
        req.store_floor = 0
        self._dormant.discard(req.req_id)
        for gs in req.groups:
            gs.block_ids.clear()
            gs.cursor = 0

    def _unindex_window_positions(self, req: RequestRecord) -> None:
        """Take ``req``'s sliding-window positions out of the window index, before its block
        lists are dropped or it is released: an entry never outlives the position it names
        (INV-REF). O(the request's sliding-window blocks)."""
        index = self._window_blocks
        if not index:
            return
        sliding = self._sliding
        for g, gs in enumerate(req.groups):
            if not sliding[g]:
                continue
            for b in set(gs.block_ids):
                held = index.get(b)
                if held:
                    held[:] = [e for e in held if e[0] is not gs]
                    if not held:
                        del index[b]

    def on_finish(self, req: RequestRecord) -> None:
        """Fence the full-attention sources of the finished request's in-flight stores."""
        for job_id in req.jobs:
            job = self._jobs[job_id]
            if job.is_store:
                self._register_deferred_fence(job)

    def notify_finished(self, req: RequestRecord) -> None:
        """Send ``on_request_finished`` to the manager, exactly once (INV-ORDER); what it
        raises is counted and raised after the call (the request is released all the same)."""
        req.signalled = True
        if not req.registered:
            return  # the manager never took the request: nothing to finish there
        try:
            self.manager.on_request_finished(req.ctx)
        except Exception as exc:
            self._manager_error(
                exc,
                f"the manager's on_request_finished for request {req.req_id!r}",
                "(taken as delivered; the request was released)",
            )

    def release_request(self, req: RequestRecord) -> None:
        """Forget the request (and its sliding-window block positions)."""
        self._reqs.pop(req.req_id, None)
        self._awaiting_signal.pop(req.req_id, None)
        self._unindex_window_positions(req)
        self._dormant.discard(req.req_id)

    def rewind_request(self, req: RequestRecord) -> None:
        """After a reset: rewind the request's store cursors (its carried load stays)."""
        req.store_floor = 0
        self._dormant.discard(req.req_id)
        for gs in req.groups:
            gs.cursor = 0
            gs.skip = 0

    # ----------------------------------------------------------------------------------------
    # checked mode

    def _install_checks(self) -> None:
        for name in (
            "on_new_request",
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
            "update_connector_output",
            "request_finished",
            "reset_cache",
        ):
            setattr(self, name, self._checked_call(getattr(self, name)))

    def _checked_call(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = method(*args, **kwargs)
            except BaseException as error:
                self._check_after_error(error)
                raise
            self.check_invariants()
            return result

        call.__name__ = method.__name__
        call.__doc__ = method.__doc__
        return call

    def _check_after_error(self, error: BaseException) -> None:
        """Checked mode after a call that raised ``error``: the caller gets ``error`` itself
        (a manager's typed error, say), never an invariant violation in its place; a violation
        the state shows afterwards (a call interrupted half-way often leaves one) is added to
        ``error`` as a note (``__notes__``, printed with its traceback), not hidden."""
        try:
            self.check_invariants()
        except Exception as violation:  # a violation, or a checker that cannot run
            error.add_note(
                f"checked mode: after this error, {type(violation).__name__}: {violation}"
            )

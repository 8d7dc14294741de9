"""The scheduler side of an offloading connector: the engine's hooks and every decision.

:class:`OffloadingScheduler` decides what to look up, load and store, tracks every transfer
job across the workers and protects GPU blocks that get reused while a copy is in flight. It
follows the hooks of vLLM's offloading connector and adds what upstream lacks (stalled jobs,
failed loads reported as invalid blocks, a reset that fails no request, typed errors for bad
input, a manager that raises without stopping the engine).

A map for the reader
--------------------

The package (:mod:`statecore.scheduler`) is this module and the ones beside it:

* :mod:`~statecore.scheduler.state`: what the scheduler holds (:class:`SchedulerState`, this
  class's base: every field, the read-only views, manager errors held for the next report,
  the block lists and the sliding-window index, checked mode);
* :mod:`~statecore.scheduler.records`: one record per request and per job, each attached to
  its compiled lifecycle (:mod:`statecore.lifecycle`);
* :mod:`~statecore.scheduler.jobs`: the job table (live jobs, the stalled ledger, the fence
  index, the keys being loaded, the quorum count of reports);
* :mod:`~statecore.scheduler.planning`: pure functions that work out what a lookup hits, what
  a load fills and what a store offers and takes (every speed trick lives there);
* :mod:`~statecore.scheduler.effects`: what the lifecycles' actions do (the
  :class:`~statecore.lifecycle.LifecycleEffects` hooks), private to the package;
* :mod:`~statecore.scheduler.answers`: the values the engine gets back.

An engine call reaches an effect in three steps, each in one place: the hook here fires an
event (``REQUEST.fire(rec, RE_PREEMPT)``); the lifecycle's table
(:mod:`statecore.lifecycle.machines`, the one source of truth) picks the transition and runs
its actions; each action calls one hook of :class:`~statecore.scheduler.effects.SchedulerEffects`.

The hooks, in the order an engine step calls them, and the decisions (methods of
:class:`OffloadingScheduler`) each one takes:

* ``on_new_request``: track the request (``_track``: its policy, its transfer limits);
* ``get_num_new_matched_tokens``: whether the request may look up (its lifecycle), the hit
  (``_lookup``), whether it waits for another request's load of its chunks
  (``_waited_for_loaders``);
* ``update_state_after_alloc``: the allocation (``_note_allocation``), what to load
  (``_create_load``);
* ``build_connector_meta``: preemptions (``_apply_preemptions``), the step's entries
  (``_update_req_states``, ``_admit``, ``_drop_stale_window_blocks``), the fences the step's
  allocation reaches (``_flush_fenced``), whether and what to store (``_build_store_jobs``,
  ``_store_chunks``);
* ``update_connector_output``: quorum (the job table's ``report_target``), when a job stalls
  (``_check_stalls``);
* ``request_finished``: finish (the final stores wait for the next step's metadata);
* ``reset`` / ``reset_cache``: what a reset flushes, discards and carries over
  (``_reset_manager`` for the manager's part);
* ``has_pending_push_work``, ``get_stats``, ``take_events``, ``shutdown``: the engine's loop.

Rules every hook keeps:

* bad input never asserts: every hook first runs the pure checks of
  :mod:`statecore.validate` on all of its arguments, then mutates; a malformed argument
  raises a typed :mod:`statecore.errors` error with the state unchanged, and documented
  anomalies (reports for unknown jobs, a live request view turned bad, ...) are absorbed and
  counted (see :class:`~statecore.scheduler.answers.SchedulerCounters`);
* a manager that raises does not stop the hook: :meth:`OffloadingScheduler._manager_error`
  counts the error and keeps it for the next :meth:`~OffloadingScheduler.update_connector_output`;
* the class is sans-IO: no threads, no files, time only through the injected ``clock``.

Admission: a lookup never changes a request's block lists or store cursors (so calling it
for a running request is harmless). An allocation (``update_state_after_alloc``) records the
request's complete block lists; the request's next :class:`~statecore.views.ScheduledRequest`
starts from that fresh allocation, whether it repeats the complete lists (vLLM's new-request
form) or carries only blocks added since. Its store cursors rewind there only if it was looked
up since its last admission: a streaming session resumed with its blocks kept is allocated and
scheduled as a new request without a lookup, and keeps what it stored.

Stalled transfers and INV-FENCE: a job with no full quorum after ``stall_timeout_s`` is
completed with ``success=False`` through the one completion path (seed 000). It may still be
running on a worker: at the stall it is put in the next step's ``jobs_to_flush``, so every
worker waits for it (or finds it unknown) before that step writes any GPU block, and before any
store that reuses its freed CPU slots is submitted. Its fences can therefore be dropped at the
stall. Its ledger entry absorbs late reports until its remaining worker count reaches 0, and
expires after another ``stall_timeout_s`` (counted as ``stalled_expired``): reports arriving
later are absorbed as duplicates.

``reset_cache`` flushes every job and makes every earlier report inert (the seed-004 fix),
except for loads the workers already run: those are carried over, complete normally and
release their requests, so a reset never fails a request (vLLM's default
``kv_load_failure_policy`` aborts a request whose load fails).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from statecore import kernels, validate
from statecore.config import SchedulerConfig
from statecore.errors import ManagerError, MetadataError, UnknownRequestError
from statecore.keys import OffloadKey
from statecore.lifecycle import (
    JE_RESET,
    JE_STALL_TIMEOUT,
    JE_WORKER_REPORT,
    JOB,
    RE_ALLOC_LOAD,
    RE_FINISH,
    RE_LOOKUP,
    RE_PREEMPT,
    RE_RESET,
    RE_SIGNAL_FINISHED,
    RE_STORE_CREATED,
    REQUEST,
)
from statecore.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
)
from statecore.scheduler import planning
from statecore.scheduler.answers import (
    COUNTER_NAMES,
    EMPTY_MAPPING,
    NO_OUTPUT,
    ConnectorOutputResult,
    CreatedLoad,
    ResetResult,
    ResetStatus,
    SchedulerCounters,
)
from statecore.scheduler.jobs import StepBatch, count_loaders
from statecore.scheduler.records import GroupState, RequestRecord
from statecore.scheduler.state import Clock, SchedulerState
from statecore.views import Request, RequestLike, SchedulerOutput
from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob, WorkerMetadata

__all__ = ["OffloadingScheduler"]

_NO_KEYS: Mapping[int, tuple[OffloadKey, ...]] = EMPTY_MAPPING
"""The store keys of a step with no store job (it pickles: see ``EMPTY_MAPPING``)."""


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


def _param(params: Mapping[str, Any] | None, name: str) -> tuple[int | None, bool]:
    """Read a non-negative int transfer parameter; (value, was_invalid)."""
    if not params or name not in params:
        return None, False
    value = params[name]
    if type(value) is int and value >= 0:
        return value, False
    return None, True


def _upstream_names(delta: dict[str, Any]) -> dict[str, Any]:
    """The transfer counters of a stats delta under upstream's metric names."""
    delta["kv_offload_load_bytes"] = delta.pop("load_bytes")
    delta["kv_offload_load_time"] = delta.pop("load_seconds")
    delta["kv_offload_store_bytes"] = delta.pop("store_bytes")
    delta["kv_offload_store_time"] = delta.pop("store_seconds")
    delta["kv_offload_allocation_failure"] = delta["allocation_failures"]
    return delta


_NO_COUNTS = _upstream_names(
    {k: v - v for k, v in zip(COUNTER_NAMES, SchedulerCounters().values(), strict=True)}
)
"""The counters' part of :meth:`OffloadingScheduler.get_stats` when nothing was counted."""


class OffloadingScheduler(SchedulerState):
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
        super().__init__(config, manager, clock, checked)

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
        rec = RequestRecord(
            self._effects, request, ctx, OffloadPolicy.CHUNK_LEVEL, self._n_groups, rid
        )
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
        """Turn the request's new block hashes into keys (all groups, or none of them:
        :func:`~statecore.scheduler.planning.extend_keys`).

        Hooks that take the request validate its view first; ``build_connector_meta`` reads
        the views live, so a ``block_hashes`` turned bad is absorbed there: the keys stay as
        they were and ``invalid_request_views`` counts it.
        """
        n_hashes = planning.extend_keys(
            rec.groups,
            rec.request.block_hashes,
            rec.n_hashes,
            self._hpc,
            self._group_suffix,
            self._tpc,
            rec.ctx.key_positions,
        )
        if n_hashes is None:
            self.counters.invalid_request_views += 1
        else:
            rec.n_hashes = n_hashes

    def _lookup(
        self, rec: RequestRecord, num_computed: int, max_num_new_tokens: int | None
    ) -> int | None:
        """The lookup hit: how many tokens beyond ``num_computed`` are loaded (0: none), or
        None to defer: a chunk is pending or being located, or another request is loading
        the hit's chunks (:meth:`_waited_for_loaders` bounds that wait).

        A full hit is allowed (the engine recomputes the last token after the load, as vLLM
        does); with a sliding-window group the last token must be computed to fill it. An
        explicit cap on the tokens loaded (``max_num_new_tokens``, the request's
        ``max_load_tokens``) is met with whole chunks of every group. A manager whose
        ``lookup_many`` raises answers no hit. The plan itself:
        :func:`~statecore.scheduler.planning.lookup_hits`.
        """
        request = rec.request
        max_hit = request.num_tokens - self._any_sliding
        limit = 1 << 62
        if max_num_new_tokens is not None:
            limit = num_computed + max_num_new_tokens
        if rec.max_load_tokens is not None:
            limit = min(limit, num_computed + rec.max_load_tokens)
        max_hit = min(max_hit, limit)
        lookup_many = self.manager.lookup_many
        observe = self.lookup_observer
        if observe is not None:
            inner = lookup_many

            def lookup_many(
                keys: Sequence[OffloadKey], ctx: ReqContext, until_miss: bool = False
            ) -> list[LookupResult]:
                results = inner(keys, ctx, until_miss)
                observe(rec.req_id, keys, results)
                return results

        try:
            hits = planning.lookup_hits(
                rec.groups,
                self._lookup_order,
                self._tpc,
                self._window,
                num_computed,
                max_hit,
                limit,
                self.config.max_recompute_pending_tokens,
                lookup_many,
                rec.ctx,
            )
        except planning.LookupFailed as failed:  # answered as no hit; raised after the step
            self._manager_error(
                failed.error,
                f"get_num_new_matched_tokens: the manager's lookup_many for request {rec.req_id!r}",
                "(answered as no hit)",
            )
            return 0
        if not hits:
            return hits
        loading = self._table.loading
        if (
            loading
            and not self._waited_for_loaders(rec)
            and planning.hit_chunks_loading(
                rec.groups,
                self._lookup_order,
                self._tpc,
                num_computed,
                num_computed + hits,
                loading.keys(),
            )
        ):
            return None
        return hits

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
        admitted = planning.admitted_lists(block_ids, self._n_groups, num_external_tokens)
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
        return self._create_load(rec, block_ids, admitted, num_external_tokens)

    def _create_load(
        self,
        rec: RequestRecord,
        block_ids: Sequence[Sequence[int]],
        admitted: tuple[tuple[int, ...], ...],
        num_external_tokens: int,
    ) -> CreatedLoad | None:
        """What to load: the chunks from the locally computed prefix up to
        ``num_external_tokens`` more (:func:`~statecore.scheduler.planning.load_plan`), into
        the blocks allocated for them. The manager's ``prepare_load`` locates them; should it
        raise, the load fails before it starts (no job; its blocks are reported invalid).
        Under the chunk-level policy the loaded chunks are never offered for storing again."""
        num_cached = rec.num_local_computed + num_external_tokens
        keys, dst, sizes, starts = planning.load_plan(
            rec.groups,
            block_ids,
            rec.num_local_computed,
            num_cached,
            self._tpb,
            self._tpc,
            self._bpc,
            rec.req_id,
        )
        try:
            src = self.manager.prepare_load(keys, rec.ctx)  # a typed error changes nothing
        except Exception as exc:  # the load fails at once: its blocks are reported invalid
            self._manager_error(
                exc,
                f"update_state_after_alloc: the manager's prepare_load for request {rec.req_id!r}",
                "(the load failed before it started: its blocks are reported invalid)",
            )
            self._note_allocation(rec, admitted)
            self._finished_loads.add(rec.req_id)
            self._failed_loads.setdefault(rec.req_id, set()).update(dst)
            return None
        self._note_allocation(rec, admitted)
        if rec.policy is OffloadPolicy.CHUNK_LEVEL:
            for g, gs in enumerate(rec.groups):
                gs.skip = max(gs.skip, planning.ceil_div(num_cached, self._tpc[g]))
        job = self._table.create(self._effects, rec, False, tuple(keys), tuple(dst), self.clock())
        REQUEST.fire(rec, RE_ALLOC_LOAD)
        loading = self._table.loading
        if loading is not None:
            count_loaders(loading, job.keys, 1)
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
        self._flush_fenced(batch)
        store_jobs: dict[int, TransferJob] = {}
        for rec in scheduled:
            self._build_store_jobs(rec, store_jobs, finished=False)
        for rec in list(self._awaiting_signal.values()):
            self._build_store_jobs(rec, store_jobs, finished=True)
            REQUEST.fire(rec, RE_SIGNAL_FINISHED)
        self._awaiting_signal.clear()
        self.counters.flushes_requested += len(batch.flush)
        jobs = self._table.live
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
        self._batch = StepBatch()
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

    def _flush_fenced(self, batch: StepBatch) -> None:
        """INV-FENCE: every store reading a block handed out since the last metadata (to
        anyone) goes in this step's flush, so the workers finish it before the block is
        written. Costs O(the smaller of the step's allocation and the fence index)."""
        fence = self._table.fence
        if fence and batch.allocated:
            small, large = (
                (batch.allocated, fence)
                if len(batch.allocated) <= len(fence)
                else (fence, batch.allocated)
            )
            for b in small:
                if b in large:
                    batch.flush.update(fence[b])

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
        from :meth:`_build_store_jobs`), not each time a block hash appears. A request whose
        store cap is below its store floor is *dormant*: no chunk of it can become storable,
        and its column entries without new blocks are not even read
        (:func:`~statecore.scheduler.planning.scheduled_entries`).
        """
        allocated = self._batch.allocated
        scheduled: list[RequestRecord] = []
        get = self._reqs.get
        dormant_add = self._dormant.add
        sliding = self._sliding if self._any_sliding else None
        window_new: list[tuple[int, GroupState, int]] = []
        cols = output.columns
        if cols is not None and cols.resumed_req_ids:
            # (their block lists start over below)
            self._dormant.difference_update(cols.resumed_req_ids)
        for rid, new_ids, n, resumed_now in planning.scheduled_entries(output, self._dormant):
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

    def _build_store_jobs(
        self, rec: RequestRecord, store_jobs: dict[int, TransferJob], finished: bool
    ) -> None:
        """Whether ``rec`` stores this step, and up to which token: a running request up to
        what this step computes, a finished one up to what it computed (not its last sampled
        token, which has no KV), an aborted one up to what it computed; never beyond its
        ``max_offload_tokens`` or, prompt-only, its prompt. Nothing below the store floor,
        nothing while the request loads or drains (INV-EXCL), nothing while a failed manager
        reset is pending, nothing for a request the manager does not know. Then the offer
        (:meth:`_store_chunks`) and the request's next store floor."""
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
        rec.store_floor = planning.store_floor(
            rec.groups, self._tpc, rec.policy is OffloadPolicy.CHUNK_LEVEL
        )

    def _store_chunks(
        self, rec: RequestRecord, n_off: int, store_jobs: dict[int, TransferJob], finished: bool
    ) -> None:
        """What to store: the chunks up to ``n_off`` tokens past each group's cursor are
        offered to the manager's ``prepare_store``
        (:func:`~statecore.scheduler.planning.store_offer`); the chunks it keeps become one
        store job (:func:`~statecore.scheduler.planning.accepted_store`), whose
        sliding-window sources are fenced at once and, for a finished request, whose
        full-attention sources too (flushed at once if a block was handed out this step).

        The cursors advance past every storable chunk once the manager answered (kept or
        present); no room (``None``) or a manager error leaves them for the next step."""
        chunk_level = rec.policy is OffloadPolicy.CHUNK_LEVEL
        storable, per_group, offer = planning.store_offer(
            rec.groups, n_off, self._tpc, self._bpc, chunk_level
        )
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
        keys, blocks, sizes, starts, fenced, deferred = planning.accepted_store(
            rec.groups,
            per_group,
            offer,
            kept if type(kept) is tuple else tuple(kept),
            self._bpc,
            self._sliding,
        )
        table = self._table
        job = table.create(self._effects, rec, True, keys, blocks, self.clock(), fenced, deferred)
        if job.fenced:
            kernels.fence_add(table.fence, job.job_id, job.fenced)
        REQUEST.fire(rec, RE_STORE_CREATED)
        if finished:
            table.fence_deferred(job)
            allocated = self._batch.allocated
            if any(b in allocated for b in job.deferred_fence):
                self._batch.flush.add(job.job_id)
        self._advance(rec, storable)
        store_jobs[job.job_id] = TransferJob(
            rec.req_id,
            GPULoadStoreSpec(blocks, tuple(sizes), tuple(starts)),
            out.store_spec,
        )

    @staticmethod
    def _advance(rec: RequestRecord, storable: list[int]) -> None:
        """Move each group's store cursor past its storable chunks (never backwards)."""
        for gs, n in zip(rec.groups, storable, strict=True):
            gs.cursor = kernels.advance_cursor(gs.cursor, n)

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
            report_target = self._table.report_target
            for job_id, (ok, bad, ok_mask, bad_mask) in reports.items():
                job = report_target(job_id, ok, bad, ok_mask, bad_mask)
                if job is not None:  # the job's lifecycle decides whether it completed
                    JOB.fire(job, JE_WORKER_REPORT)
        self._check_stalls()
        if self._manager_failures:
            self._raise_manager_failures()
        finished = self._finished_loads
        if not finished:
            return NO_OUTPUT
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

    def _check_stalls(self) -> None:
        """When a job stalls: at most once per ``stall_check_interval_s``, every live job
        older than ``stall_timeout_s`` sees ``stall_timeout`` (its lifecycle completes it as
        failed and keeps it in the stalled ledger), then ledger entries stalled that long
        expire."""
        now = self.clock()
        cfg = self.config
        table = self._table
        if now - table.last_stall_check < cfg.stall_check_interval_s:
            return  # (every step asks: no call for the usual answer)
        table.last_stall_check = now
        timeout = cfg.stall_timeout_s
        for job in table.timed_out(now, timeout):
            JOB.fire(job, JE_STALL_TIMEOUT)
        table.expire_stalled(now, timeout)

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
        jobs = self._table.live
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
        now = self.counters.values()
        before = self._stats_mark.values()
        if now == before:  # nothing counted since the last call (an engine asks every step)
            delta: dict[str, Any] = dict(_NO_COUNTS)
        else:
            delta = _upstream_names(
                {k: a - b for k, a, b in zip(COUNTER_NAMES, now, before, strict=True)}
            )
            self._stats_mark = SchedulerCounters(*now)  # type: ignore[arg-type]
        delta["live_jobs"] = len(self._table.live)
        delta["stalled_ledger"] = len(self._table.stalled)
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
        if self._table.live or self._awaiting_signal or self._batch.flush:
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
        table = self._table
        flush, threshold = table.reset_plan()
        batch.flush.update(flush)
        discarded_loads: set[str] = set()
        for job_id in list(batch.loads):
            job = table.live[job_id]
            rid = job.req.req_id
            self._finished_loads.add(rid)
            self._failed_loads.setdefault(rid, set()).update(job.blocks)
            discarded_loads.add(rid)
        batch.loads.clear()
        for job in list(table.live.values()):
            JOB.fire(job, JE_RESET)
        for job in list(table.stalled.values()):
            JOB.fire(job, JE_RESET)
        carried = frozenset(table.live)  # the loads the workers run outlive the reset
        table.after_reset()
        for rec in list(self._reqs.values()):
            REQUEST.fire(rec, RE_RESET)
        self._awaiting_signal.clear()
        table.stale_threshold = threshold
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

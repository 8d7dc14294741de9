"""What the scheduler holds: its fields, the read-only views of them, and the checked mode.

:class:`SchedulerState` is the base of :class:`~statecore.scheduler.OffloadingScheduler`: it
sets up every field the hooks and the lifecycle effects share, and gives tests, specs and the
simulator read-only views of them. It decides nothing; :mod:`statecore.scheduler.core` does.

==========================  =====================================================================
field                       what it holds
==========================  =====================================================================
``_reqs``                   request id -> :class:`~statecore.scheduler.records.RequestRecord`
                            of every tracked request
``_table``                  the :class:`~statecore.scheduler.jobs.JobTable`: live jobs, the
                            stalled ledger, the fence index, the keys being loaded, the epoch
``_effects``                the :class:`~statecore.scheduler.effects.SchedulerEffects` every
                            record's lifecycle calls (its ``owner``)
``_batch``                  the :class:`~statecore.scheduler.jobs.StepBatch` of the next
                            metadata: loads created, jobs to flush, blocks handed out
``_window_blocks``          sliding-window block id -> the (group, position) pairs that list it
``_awaiting_signal``        finished requests whose final stores and finish notice the next
                            ``build_connector_meta`` sends
``_dormant``                requests that can store no chunk: their decode entries are skipped
``_finished_loads``,        what the next ``update_connector_output`` reports: requests whose
``_failed_loads``           load ended, and the blocks of those that failed
``_manager_failures``,      manager errors held for the next ``update_connector_output``, and
``_manager_reset_pending``  whether a failed manager reset is retried
``_tpc``, ``_tpb``, ...     the configuration as per-group lists (read on the hot path)
==========================  =====================================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from statecore.config import SchedulerConfig
from statecore.errors import ManagerError, UnknownRequestError
from statecore.keys import OffloadKey, make_offload_key
from statecore.lifecycle import REQUEST
from statecore.manager import LookupResult, OffloadingManager
from statecore.scheduler.answers import SchedulerCounters
from statecore.scheduler.effects import SchedulerEffects
from statecore.scheduler.jobs import JobTable, StepBatch
from statecore.scheduler.records import GroupState, JobRecord, RequestRecord

__all__ = ["Clock", "LookupObserver", "SchedulerState"]

Clock = Callable[[], float]
LookupObserver = Callable[[str, Sequence[OffloadKey], Sequence[LookupResult]], None]
"""What a lookup's observer hears: the request id, the keys asked, the manager's answers."""


class SchedulerState:
    """The scheduler's fields (see the module docstring) and read-only views of them; its
    arguments are :class:`~statecore.scheduler.OffloadingScheduler`'s."""

    def __init__(
        self,
        config: SchedulerConfig,
        manager: OffloadingManager,
        clock: Clock,
        checked: bool | None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.clock = clock
        self.counters = SchedulerCounters()
        self._reqs: dict[str, RequestRecord] = {}
        # what the request and job lifecycles call (every record's owner)
        self._effects = SchedulerEffects(self)
        # live jobs, the stalled ledger, fences, keys being loaded, report epochs
        self._table = JobTable(
            config.num_workers, self.counters, config.enable_prefix_caching, clock()
        )
        # sliding-window block id -> (group state, position) of every tracked request that
        # listed it: when the block is handed out again, those positions are stale
        self._window_blocks: dict[int, list[tuple[GroupState, int]]] = {}
        self._batch = StepBatch()
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
        self._stats_mark = SchedulerCounters()
        self.lookup_observer: LookupObserver | None = None
        """Called after each ``lookup_many`` of a lookup with the request id, the keys asked
        and the manager's answers (the vLLM adapter records the KV-event payloads of hits)."""
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
        return self._table.live

    @property
    def stalled_jobs(self) -> Mapping[int, JobRecord]:
        """The stalled-job ledger: id -> record whose ``pending`` is the remaining count."""
        return self._table.stalled

    @property
    def fence_index(self) -> Mapping[int, set[int]]:
        """GPU block id -> ids of store jobs that read it (read-only use)."""
        return self._table.fence

    @property
    def window_index(self) -> Mapping[int, list[tuple[GroupState, int]]]:
        """Sliding-window GPU block id -> (group state, position) of every tracked request that
        lists it there (read-only use): the positions zeroed when the block is handed out."""
        return self._window_blocks

    @property
    def loading_keys(self) -> Mapping[OffloadKey, int] | None:
        """Keys of live load jobs with their multiplicity (None without prefix caching)."""
        return self._table.loading

    @property
    def stale_threshold(self) -> int:
        """Reports for job ids below this belong to an epoch before the last reset."""
        return self._table.stale_threshold

    @property
    def _invalid_blocks(self) -> set[int]:
        """The blocks of the failed loads the next :meth:`update_connector_output` reports
        (the union of its ``failed_loads``; the model checker's state reads it)."""
        return set().union(*self._failed_loads.values())

    @property
    def next_job_id(self) -> int:
        """The id the next job will get."""
        return self._table.next_id

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
        # checked mode only: the catalogue (above the core) is imported on first use; it
        # reads the scheduler, of which this class is the state
        from statecore.scheduler.core import OffloadingScheduler
        from statecore.specs.invariants import check_scheduler

        check_scheduler(cast(OffloadingScheduler, self))

    # ----------------------------------------------------------------------------------------
    # manager errors (a hook that catches one goes on; the next report raises it)

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

    # ----------------------------------------------------------------------------------------
    # block lists (the lifecycle effects of statecore.scheduler.effects use these too)

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

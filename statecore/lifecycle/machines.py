"""The request and transfer-job lifecycles: the single source of truth.

Both are python-statemachine ``StateMachine`` classes (the strict base: an event with no
allowed transition raises). Guards and actions are plain module functions of one argument,
``model`` (the entity's record): python-statemachine injects the record by that parameter name,
and :mod:`statecore.lifecycle.table` compiles the same functions into the dispatch table that
the hot path runs. Nothing else in statecore lists states or transitions.

Actions do not reach into the scheduler directly; they call the hooks of the record's
``owner`` (see :class:`LifecycleEffects`), which the scheduler implements.

Transitions are named after the call or report that triggers them:

* request: ``lookup`` (``get_num_new_matched_tokens``), ``alloc_load``
  (``update_state_after_alloc`` with a load), ``store_created`` (a store job built in
  ``build_connector_meta``), ``job_ended`` (one of its jobs reached a terminal outcome),
  ``preempt``, ``finish`` (``request_finished``), ``signal_finished`` (``on_request_finished``
  sent to the manager in ``build_connector_meta``), ``reset`` (``reset_cache``);
* job: ``worker_report`` (aggregated worker counts applied), ``stall_timeout`` (no quorum
  within the stall timeout), ``reset`` (``reset_cache``).

A reset discards every store and every load not yet sent to the workers, but a load the
workers already run is *carried over*: it is flushed like every other job, completes through
the one completion path (without reaching the reset manager) and releases its request as a
normal hit would, so no request fails because of a reset (vLLM's default
``kv_load_failure_policy`` aborts a request whose load fails).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from statemachine import State, StateMachine

__all__ = [
    "EFFECT_HOOKS",
    "JobLifecycle",
    "LifecycleEffects",
    "RequestLifecycle",
    "effects_class",
]


class LifecycleEffects(Protocol):
    """What lifecycle actions call on a record's ``owner`` (the scheduler implements it)."""

    def complete_job(self, job: Any, success: bool) -> None:
        """The unified completion path: manager notification and index cleanup."""

    def stall_job(self, job: Any) -> None:
        """Complete a stalled job with ``success=False`` and keep it for late reports."""

    def forget_stalled(self, job: Any) -> None:
        """Drop a stalled job whose late reports have all arrived."""

    def flush_request(self, req: Any) -> None:
        """Put every in-flight job of the request in this step's flush set."""

    def drop_block_lists(self, req: Any) -> None:
        """The engine freed the request's blocks (preemption): forget its block lists."""

    def on_finish(self, req: Any) -> None:
        """The request finished: fence the sources of its in-flight stores."""

    def notify_finished(self, req: Any) -> None:
        """Send ``on_request_finished`` to the manager (exactly once per request)."""

    def release_request(self, req: Any) -> None:
        """Forget the request's state."""

    def rewind_request(self, req: Any) -> None:
        """After a reset: rewind its store cursors to chunk 0 (carried loads stay)."""

    def discard_job(self, job: Any) -> None:
        """A reset drops the job: forget it in its request; no completion."""

    def carry_load(self, job: Any) -> None:
        """A reset carries a sent load over: it completes, without the reset manager."""


EFFECT_HOOKS: tuple[str, ...] = tuple(
    name for name, value in vars(LifecycleEffects).items() if callable(value) and name[0] != "_"
)
"""The hook names of :class:`LifecycleEffects`, in declaration order (read from it)."""


def effects_class(
    name: str, hook: Callable[[str], Callable[..., None]], doc: str = ""
) -> type[Any]:
    """A class implementing every :class:`LifecycleEffects` hook as ``hook(hook_name)``.

    For owners whose hooks all do the same thing (nothing, or record the call): built from
    :data:`EFFECT_HOOKS`, so they cannot fall behind the protocol. ``hook(hook_name)`` returns
    the method, called as ``method(self, record, *args)``.
    """
    body: dict[str, Any] = {h: hook(h) for h in EFFECT_HOOKS}
    body["__slots__"] = ()
    body["__doc__"] = doc
    return type(name, (), body)


# ---------------------------------------------------------------------------------------------
# Request guards and actions


def has_jobs(model: Any) -> bool:
    """The request still has in-flight jobs."""
    return bool(model.jobs)


def no_jobs(model: Any) -> bool:
    """The request has no in-flight job."""
    return not model.jobs


def flush_request(model: Any) -> None:
    """Flush every in-flight job of the request (preemption)."""
    model.owner.flush_request(model)


def drop_block_lists(model: Any) -> None:
    """Forget the preempted request's block lists: the engine freed them (INV-CURSOR)."""
    model.owner.drop_block_lists(model)


def on_finish(model: Any) -> None:
    """Fence the sources of the finished request's in-flight stores."""
    model.owner.on_finish(model)


def notify_finished(model: Any) -> None:
    """Tell the manager that no more submissions come for the request."""
    model.owner.notify_finished(model)


def release_request(model: Any) -> None:
    """Forget the request."""
    model.owner.release_request(model)


def rewind_request(model: Any) -> None:
    """Rewind the request's store cursors (its discarded jobs are already forgotten)."""
    model.owner.rewind_request(model)


class RequestLifecycle(StateMachine):
    """Scheduler-side lifecycle of one request.

    INV-EXCL is structural here: ``loading`` holds exactly one load job and accepts no
    ``store_created``; ``alloc_load`` is accepted only from ``no_transfer``.

    ``reset`` fires after every job of the reset was discarded or carried over, so ``jobs``
    then holds only carried loads: a request keeps waiting for its carried load.
    """

    no_transfer = State("no transfer", initial=True)
    """The request has no transfer job in flight. Every tracked request starts here (on its
    first lookup or ``on_new_request``) and comes back here whenever its last job ends. Lookups
    are answered normally: the scheduler probes the manager, and a hit leads to ``alloc_load``.
    A store built for it in ``build_connector_meta`` moves it to ``storing``. A reset leaves it
    here with its store cursors rewound."""

    loading = State("loading")
    """Exactly one load job is in flight, writing offloaded KV into the request's newly
    allocated GPU blocks. No store may start (INV-EXCL is structural: ``store_created`` is not
    accepted here), and a second load is impossible since ``alloc_load`` is only accepted from
    ``no_transfer``. A lookup in this state is deferred (the engine asks again later). When the
    load ends, however it ends, the request returns to ``no_transfer`` and the engine learns it
    through ``finished_loads`` (and the blocks to recompute through ``invalid_block_ids`` if it
    failed). A reset leaves it here: a load the workers already run is carried over and
    completes normally."""

    storing = State("storing")
    """One or more store jobs are copying the request's computed KV from its GPU blocks to
    offloaded chunks. More stores may be added as decoding produces whole chunks. Lookups are
    deferred while any store is in flight. The last job to end returns the request to
    ``no_transfer``."""

    preempted_draining = State("preempted, stores draining")
    """The engine preempted the request (its GPU blocks were freed) while jobs were in flight.
    Entering this state flushes every one of its jobs, so the workers finish them before any
    reused block is written. Lookups are deferred until the jobs have drained; then the request
    is back in ``no_transfer`` and its offloaded chunks are ordinary hits when it is
    re-admitted."""

    finished_pending_final = State("finished, final stores to build")
    """``request_finished`` was called. The full-attention source blocks of its in-flight stores
    are fenced from now on (the engine frees them at once). The next ``build_connector_meta``
    builds the final stores of the request and then fires ``signal_finished``, which sends
    ``on_request_finished`` to the manager exactly once (INV-ORDER) and either releases the
    request or waits for its jobs."""

    finished_draining = State("finished and signalled, jobs draining")
    """The manager has been told the request finished, but some of its jobs are still in flight.
    Their completions still reach the manager (completions may follow ``on_request_finished``);
    the last one releases the request."""

    released = State("released", final=True)
    """The scheduler forgot the request: it is no longer tracked and holds no job, fence or
    index entry. A late report for one of its jobs is absorbed and counted."""

    lookup = (
        no_transfer.to.itself(internal=True)
        | loading.to.itself(internal=True)
        | storing.to.itself(internal=True)
        | preempted_draining.to.itself(internal=True)
    )
    alloc_load = no_transfer.to(loading)
    store_created = (
        no_transfer.to(storing)
        | storing.to.itself(internal=True)
        | finished_pending_final.to.itself(internal=True)
    )
    job_ended = (
        loading.to(no_transfer, cond=no_jobs)
        | storing.to.itself(internal=True, cond=has_jobs)
        | storing.to(no_transfer, cond=no_jobs)
        | preempted_draining.to.itself(internal=True, cond=has_jobs)
        | preempted_draining.to(no_transfer, cond=no_jobs)
        | finished_pending_final.to.itself(internal=True)
        | finished_draining.to.itself(internal=True, cond=has_jobs)
        | finished_draining.to(released, cond=no_jobs, on=release_request)
    )
    preempt = (
        no_transfer.to.itself(internal=True, on=drop_block_lists)
        | loading.to(preempted_draining, on=[flush_request, drop_block_lists])
        | storing.to(preempted_draining, on=[flush_request, drop_block_lists])
        | preempted_draining.to.itself(internal=True, on=drop_block_lists)
    )
    finish = (
        no_transfer.to(finished_pending_final, on=on_finish)
        | loading.to(finished_pending_final, on=on_finish)
        | storing.to(finished_pending_final, on=on_finish)
        | preempted_draining.to(finished_pending_final, on=on_finish)
    )
    signal_finished = finished_pending_final.to(
        released, cond=no_jobs, on=[notify_finished, release_request]
    ) | finished_pending_final.to(finished_draining, cond=has_jobs, on=notify_finished)
    reset = (
        no_transfer.to(no_transfer, on=rewind_request)
        | loading.to(loading, cond=has_jobs, on=rewind_request)
        | loading.to(no_transfer, cond=no_jobs, on=rewind_request)
        | storing.to(no_transfer, on=rewind_request)
        | preempted_draining.to(preempted_draining, cond=has_jobs, on=rewind_request)
        | preempted_draining.to(no_transfer, cond=no_jobs, on=rewind_request)
        | finished_pending_final.to(finished_draining, cond=has_jobs, on=notify_finished)
        | finished_pending_final.to(released, cond=no_jobs, on=[notify_finished, release_request])
        | finished_draining.to.itself(internal=True, cond=has_jobs)
        | finished_draining.to(released, cond=no_jobs, on=release_request)
    )


# ---------------------------------------------------------------------------------------------
# Job guards and actions


def outstanding(model: Any) -> bool:
    """Some workers have not reported the job yet."""
    return bool(model.pending > 0)


def all_ok(model: Any) -> bool:
    """Every worker reported, none reported a failure."""
    return bool(model.pending == 0 and model.failed == 0)


def any_failed(model: Any) -> bool:
    """Every worker reported, at least one reported a failure."""
    return bool(model.pending == 0 and model.failed > 0)


def drained(model: Any) -> bool:
    """No worker report is outstanding any more."""
    return bool(model.pending == 0)


def carries_over(model: Any) -> bool:
    """A load the workers already run (sent in a step's metadata): it survives a reset."""
    return bool(not model.is_store and model.sent)


def dropped_at_reset(model: Any) -> bool:
    """A store, or a load not sent to the workers yet: a reset discards it."""
    return bool(model.is_store or not model.sent)


def complete_ok(model: Any) -> None:
    """Complete the job with ``success=True``."""
    model.owner.complete_job(model, True)


def complete_failed(model: Any) -> None:
    """Complete the job with ``success=False`` (a worker failed it)."""
    model.owner.complete_job(model, False)


def stall_job(model: Any) -> None:
    """Complete the timed-out job with ``success=False``; keep absorbing its reports."""
    model.owner.stall_job(model)


def forget_stalled(model: Any) -> None:
    """The last late report of a stalled job arrived: forget it."""
    model.owner.forget_stalled(model)


def discard_job(model: Any) -> None:
    """A reset drops the job: no completion reaches the manager."""
    model.owner.discard_job(model)


def carry_load(model: Any) -> None:
    """A reset carries the sent load over: flushed, it completes normally."""
    model.owner.carry_load(model)


class JobLifecycle(StateMachine):
    """Scheduler-side lifecycle of one transfer job (load or store).

    ``pending`` counts workers that have not reported; ``failed`` counts failure reports.
    Terminal outcomes (INV-TERM): ``completed``, ``failed``, ``retired`` (a stalled job whose
    late reports drained) and ``discarded`` (by reset; no completion reaches the manager).
    ``carried`` is a sent load that outlived a reset: flushed to the workers, it completes
    (or fails) on its reports like any live job, but no completion reaches the reset manager.
    """

    in_flight = State("in flight", initial=True)
    """The job was created (a load in ``update_state_after_alloc``, a store in
    ``build_connector_meta``) and no worker has reported it yet; ``pending`` equals the number
    of workers. Its keys are pinned or write-pending in the manager and, for a store, its source
    blocks may be fenced."""

    partial = State("partially reported")
    """Some workers reported, others have not: ``0 < pending < num_workers``. Nothing is
    completed on a partial quorum (INV-QUORUM), so a store is never visible while another rank
    is still copying."""

    carried = State("carried over a reset, flushing")
    """A load the workers were already running when ``reset_cache`` was called. It is in the
    reset's ``jobs_to_flush``, so every worker finishes it before any post-reset store can
    overwrite its CPU source (the manager quarantines those slots), and its reports still count
    (INV-EPOCH exempts it from the stale threshold). It completes or fails through the one
    completion path like a live job, releasing its request with valid blocks, but the reset
    manager hears nothing of it. A reset never fails a request this way (vLLM's default
    ``kv_load_failure_policy`` aborts a request whose load fails)."""

    stalled = State("stalled, absorbing late reports")
    """No full quorum arrived within ``stall_timeout_s``. The job was completed with
    ``success=False`` through the one completion path (the manager drops a store's pending keys
    and releases a load's pins; a load's GPU blocks are reported for recompute) and put in the
    next step's ``jobs_to_flush``, so a transfer that is still running cannot land on reused
    memory. The record stays in a ledger that absorbs the late reports still on their way."""

    completed = State("completed", final=True)
    """Every worker reported success; the manager received ``complete_store`` (``success=True``)
    or ``complete_load`` exactly once."""

    failed = State("failed", final=True)
    """Every worker reported and at least one reported a failure. A store is completed with
    ``success=False`` (its bytes never become loadable, INV-NO-PARTIAL); a load releases its
    pins and its GPU blocks are reported for recompute."""

    retired = State("retired", final=True)
    """A stalled job whose late reports all arrived: it leaves the ledger. (A ledger entry whose
    reports never arrive expires after another ``stall_timeout_s``.)"""

    discarded = State("discarded by reset", final=True)
    """``reset_cache`` dropped the job (a store, or a load not yet sent to the workers): it was
    flushed to the workers, the manager receives no completion for it (the manager itself is
    reset), and any report that still arrives for it belongs to an earlier epoch and is ignored
    (INV-EPOCH)."""

    worker_report = (
        in_flight.to(partial, cond=outstanding)
        | in_flight.to(completed, cond=all_ok, on=complete_ok)
        | in_flight.to(failed, cond=any_failed, on=complete_failed)
        | partial.to.itself(internal=True, cond=outstanding)
        | partial.to(completed, cond=all_ok, on=complete_ok)
        | partial.to(failed, cond=any_failed, on=complete_failed)
        | carried.to.itself(internal=True, cond=outstanding)
        | carried.to(completed, cond=all_ok, on=complete_ok)
        | carried.to(failed, cond=any_failed, on=complete_failed)
        | stalled.to.itself(internal=True, cond=outstanding)
        | stalled.to(retired, cond=drained, on=forget_stalled)
    )
    stall_timeout = (
        in_flight.to(stalled, on=stall_job)
        | partial.to(stalled, on=stall_job)
        | carried.to(stalled, on=stall_job)
    )
    reset = (
        in_flight.to(carried, cond=carries_over, on=carry_load)
        | in_flight.to(discarded, cond=dropped_at_reset, on=discard_job)
        | partial.to(carried, cond=carries_over, on=carry_load)
        | partial.to(discarded, cond=dropped_at_reset, on=discard_job)
        | carried.to.itself(internal=True)
        | stalled.to(discarded)
    )

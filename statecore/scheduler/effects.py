"""The lifecycle effects: what the compiled request and job machines do to the scheduler.

The machines of :mod:`statecore.lifecycle.machines` are the one source of truth on *when* an
effect runs: their actions call ``record.owner.<hook>(record)``, and every record's ``owner``
is the scheduler's :class:`SchedulerEffects`. Nothing else calls these hooks (the scheduler's
hooks fire events; they never run an effect themselves), and they are not methods of
:class:`~statecore.scheduler.OffloadingScheduler`: an engine cannot call one by mistake.

=====================  ===============================  =====================================
hook                   action (machine)                 effect
=====================  ===============================  =====================================
``complete_job``       ``complete_ok``,                 the one completion path: the manager
                       ``complete_failed`` (job)        hears ``complete_store``/
                                                        ``complete_load``, fences and loading
                                                        counts go, the request sees
                                                        ``job_ended``
``stall_job``          ``stall_job`` (job)              completed as failed, flushed, kept in
                                                        the stalled ledger
``forget_stalled``     ``forget_stalled`` (job)         its last late report came: out of the
                                                        ledger
``discard_job``        ``discard_job`` (job)            a reset drops it: no completion
``carry_load``         ``carry_load`` (job)             a reset carries a sent load over
``flush_request``      ``flush_request`` (request)      preemption: its jobs are flushed
``drop_block_lists``   ``drop_block_lists`` (request)   preemption: its freed block lists go
``on_finish``          ``on_finish`` (request)          finish: its stores' full-attention
                                                        sources are fenced
``notify_finished``    ``notify_finished`` (request)    ``on_request_finished``, once
``release_request``    ``release_request`` (request)    the request is forgotten
``rewind_request``     ``rewind_request`` (request)     reset: its store cursors rewind
=====================  ===============================  =====================================

The effects share the scheduler's state (they are part of it, kept apart so that the
scheduler's public surface is the engine's hooks alone): they read and write its fields
directly, as its own methods would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statecore.lifecycle import RE_JOB_ENDED, REQUEST
from statecore.scheduler.jobs import count_loaders
from statecore.scheduler.records import JobRecord, RequestRecord

if TYPE_CHECKING:
    from statecore.scheduler.state import SchedulerState

__all__ = ["SchedulerEffects"]


class SchedulerEffects:
    """The :class:`~statecore.lifecycle.LifecycleEffects` of one scheduler (every record's
    ``owner``)."""

    __slots__ = ("sched",)

    def __init__(self, sched: SchedulerState) -> None:
        self.sched = sched

    # ----------------------------------------------------------------------------------------
    # job effects

    def complete_job(self, job: JobRecord, success: bool) -> None:
        """The one completion path (seed 000 ``_complete_job``).

        Notifies the manager (``complete_store(success=...)`` or ``complete_load``), updates
        the chunks-being-loaded index, removes the job's fences, forgets the job and ends it
        in its request. Never calls ``on_request_finished``.
        """
        sched = self.sched
        rec = job.req
        try:
            if job.is_store:
                sched.manager.complete_store(job.keys, rec.ctx, success)
            elif not job.carried:  # a carried load's keys went with the reset
                sched.manager.complete_load(job.keys, rec.ctx)
        except Exception as exc:  # the completion goes on; raised after the call
            call = "complete_store" if job.is_store else "complete_load"
            sched._manager_error(
                exc,
                f"update_connector_output: job {job.job_id} of request {rec.req_id!r}: "
                f"the manager's {call}",
                "(the job was ended)",
            )
        table = sched._table
        if not job.is_store:
            loading = table.loading
            if loading is not None and not job.carried:
                count_loaders(loading, job.keys, -1)
            sched._finished_loads.add(rec.req_id)
            if not success:
                sched._failed_loads.setdefault(rec.req_id, set()).update(job.blocks)
        table.end(job)
        c = sched.counters
        if success:
            c.jobs_completed += 1
        elif job.pending == 0:
            c.jobs_failed += 1
        rec.jobs.discard(job.job_id)
        REQUEST.fire(rec, RE_JOB_ENDED)

    def stall_job(self, job: JobRecord) -> None:
        """Complete a timed-out job with ``success=False``, flush it, keep it in the ledger."""
        self.complete_job(job, False)
        sched = self.sched
        job.stalled_at = sched.clock()
        sched._table.stalled[job.job_id] = job
        sched._batch.flush.add(job.job_id)
        sched.counters.jobs_stalled += 1

    def forget_stalled(self, job: JobRecord) -> None:
        """A stalled job's late reports all arrived: drop it from the ledger."""
        sched = self.sched
        del sched._table.stalled[job.job_id]
        sched.counters.stalled_retired += 1

    def discard_job(self, job: JobRecord) -> None:
        """A reset drops the job: forget it (its request forgets it too); no completion."""
        sched = self.sched
        del sched._table.live[job.job_id]
        job.req.jobs.discard(job.job_id)
        sched.counters.jobs_discarded += 1

    def carry_load(self, job: JobRecord) -> None:
        """A reset carries the sent load over (it is in the reset's flush)."""
        job.carried = True
        self.sched.counters.loads_carried += 1

    # ----------------------------------------------------------------------------------------
    # request effects

    def flush_request(self, req: RequestRecord) -> None:
        """Flush every in-flight job of a preempted request, except the loads created in this
        step: the engine preempted the request before this step's scheduling (preemptions
        are applied first), so such a load comes from its re-admission after the preemption
        and writes its new blocks, which no other owner holds; flushing it would make the
        workers wait for it, a synchronous load."""
        batch = self.sched._batch
        if batch.loads:
            batch.flush.update(j for j in req.jobs if j not in batch.loads)
        else:
            batch.flush.update(req.jobs)

    def drop_block_lists(self, req: RequestRecord) -> None:
        """A preempted request's blocks are freed: its block lists and store cursors start
        over (INV-CURSOR), so no store (a final one after an abort, say) can read a block
        that the engine has handed to another owner since. The next scheduling brings the
        new lists."""
        self.sched._clear_block_lists(req)

    def on_finish(self, req: RequestRecord) -> None:
        """Fence the full-attention sources of the finished request's in-flight stores."""
        table = self.sched._table
        live = table.live
        for job_id in req.jobs:
            job = live[job_id]
            if job.is_store:
                table.fence_deferred(job)

    def notify_finished(self, req: RequestRecord) -> None:
        """Send ``on_request_finished`` to the manager, exactly once (INV-ORDER); what it
        raises is counted and raised after the call (the request is released all the same)."""
        req.signalled = True
        if not req.registered:
            return  # the manager never took the request: nothing to finish there
        sched = self.sched
        try:
            sched.manager.on_request_finished(req.ctx)
        except Exception as exc:
            sched._manager_error(
                exc,
                f"the manager's on_request_finished for request {req.req_id!r}",
                "(taken as delivered; the request was released)",
            )

    def release_request(self, req: RequestRecord) -> None:
        """Forget the request (and its sliding-window block positions)."""
        sched = self.sched
        sched._reqs.pop(req.req_id, None)
        sched._awaiting_signal.pop(req.req_id, None)
        sched._unindex_window_positions(req)
        sched._dormant.discard(req.req_id)

    def rewind_request(self, req: RequestRecord) -> None:
        """After a reset: rewind the request's store cursors (its carried load stays)."""
        req.store_floor = 0
        self.sched._dormant.discard(req.req_id)
        for gs in req.groups:
            gs.cursor = 0
            gs.skip = 0

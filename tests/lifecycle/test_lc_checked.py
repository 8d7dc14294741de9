"""Checked mode and rejected events.

``checked_mode()`` makes ``fire`` run a real machine beside the table; any disagreement is an
``InvariantViolation`` with code ``INV-TABLE``. A rejected event is a ``LifecycleError`` that
names the entity, its id, its state and the event, and leaves the record unchanged.
"""

from __future__ import annotations

import contextlib

import pytest
from lifecycle_harness import JobRec, RecordingOwner, ReqRec

from statecore.errors import InvariantViolation, LifecycleError
from statecore.lifecycle import (
    J_COMPLETED,
    J_IN_FLIGHT,
    J_PARTIAL,
    JE_RESET,
    JE_STALL_TIMEOUT,
    JE_WORKER_REPORT,
    JOB,
    R_FINISHED_PENDING,
    R_LOADING,
    R_RELEASED,
    RE_ALLOC_LOAD,
    RE_FINISH,
    RE_LOOKUP,
    RE_SIGNAL_FINISHED,
    RE_STORE_CREATED,
    REQUEST,
    CompiledLifecycle,
    JobLifecycle,
    checked_mode,
    compile_lifecycle,
)


def fresh_job_table() -> CompiledLifecycle:
    return compile_lifecycle(JobLifecycle, "job", "job_id")


def test_checked_mode_switches_both_lifecycles_and_restores() -> None:
    fast_req, fast_job = REQUEST.fire, JOB.fire
    assert (REQUEST.checked, JOB.checked) == (False, False)
    with checked_mode():
        assert (REQUEST.checked, JOB.checked) == (True, True)
        assert REQUEST.fire != fast_req and JOB.fire != fast_job
    assert (REQUEST.checked, JOB.checked) == (False, False)
    assert REQUEST.fire == fast_req and JOB.fire == fast_job


def test_checked_mode_restores_after_an_error() -> None:
    with pytest.raises(RuntimeError), checked_mode(JOB):
        assert (JOB.checked, REQUEST.checked) == (True, False)
        raise RuntimeError("boom")
    assert not JOB.checked


def test_checked_mode_runs_the_machine_and_its_actions_once() -> None:
    owner = RecordingOwner()
    req = ReqRec(owner)
    with checked_mode():
        REQUEST.attach(req)
        assert req._shadow == "no_transfer"
        REQUEST.fire(req, RE_ALLOC_LOAD)
        assert req.state == R_LOADING and req._shadow == "loading"
        req.jobs = {3}
        REQUEST.fire(req, RE_FINISH)
        REQUEST.fire(req, RE_SIGNAL_FINISHED)
    assert req._shadow == "finished_draining"
    assert owner.calls == [("on_finish", "req-1"), ("notify_finished", "req-1")]


def test_checked_mode_adopts_a_record_attached_before_it_was_on() -> None:
    owner = RecordingOwner()
    job = JobRec(owner)
    JOB.attach(job)
    job.pending = 1
    JOB.fire(job, JE_WORKER_REPORT)
    assert job.state == J_PARTIAL
    with checked_mode(JOB):
        job.pending = 0
        JOB.fire(job, JE_WORKER_REPORT)
    assert job.state == J_COMPLETED and job._shadow == "completed"
    assert owner.calls == [("complete_job", 7, True)]


def test_tampered_target_raises_inv_table() -> None:
    lc = fresh_job_table()
    row = J_IN_FLIGHT * len(lc.events) + JE_STALL_TIMEOUT
    ((guard, _, actions),) = lc._rows[row]
    lc._rows = tuple(
        ((guard, J_PARTIAL, actions),) if i == row else r for i, r in enumerate(lc._rows)
    )
    job = JobRec(RecordingOwner())
    with checked_mode(lc):
        lc.attach(job)
        with pytest.raises(InvariantViolation) as info:
            lc.fire(job, JE_STALL_TIMEOUT)
    assert info.value.code == "INV-TABLE"
    assert "'partial'" in str(info.value) and "'stalled'" in str(info.value)


def test_table_rejecting_what_the_machine_accepts_raises_inv_table() -> None:
    lc = fresh_job_table()
    row = J_IN_FLIGHT * len(lc.events) + JE_RESET
    lc._rows = tuple(() if i == row else r for i, r in enumerate(lc._rows))
    job = JobRec(RecordingOwner())
    with checked_mode(lc):
        lc.attach(job)
        with pytest.raises(InvariantViolation) as info:
            lc.fire(job, JE_RESET)
    assert info.value.code == "INV-TABLE" and "machine accepts" in str(info.value)


def test_table_accepting_what_the_machine_rejects_raises_inv_table() -> None:
    lc = fresh_job_table()
    row = J_COMPLETED * len(lc.events) + JE_RESET
    lc._rows = tuple(((None, J_COMPLETED, ()),) if i == row else r for i, r in enumerate(lc._rows))
    job = JobRec(RecordingOwner())
    job.pending = 0
    with checked_mode(lc):
        lc.attach(job)
        lc.fire(job, JE_WORKER_REPORT)  # in_flight -> completed, both agree
        with pytest.raises(InvariantViolation) as info:
            lc.fire(job, JE_RESET)
    assert info.value.code == "INV-TABLE" and "machine rejects" in str(info.value)


def test_diverged_record_state_raises_inv_table() -> None:
    job = JobRec(RecordingOwner())
    with checked_mode(JOB):
        JOB.attach(job)
        job.state = J_PARTIAL  # someone wrote the state behind the machine's back
        with pytest.raises(InvariantViolation) as info:
            JOB.fire(job, JE_WORKER_REPORT)
    assert info.value.code == "INV-TABLE" and "machine state 'in_flight'" in str(info.value)


@pytest.mark.parametrize("checked", [False, True], ids=["fast", "checked"])
def test_rejected_event_names_entity_id_state_event(checked: bool) -> None:
    owner = RecordingOwner()
    job = JobRec(owner)
    job.pending = 0
    with checked_mode(JOB) if checked else contextlib.nullcontext():
        JOB.attach(job)
        JOB.fire(job, JE_WORKER_REPORT)
        with pytest.raises(LifecycleError) as info:
            JOB.fire(job, JE_STALL_TIMEOUT)
    err = info.value
    assert (err.entity, err.entity_id, err.state, err.event) == (
        "job",
        7,
        "completed",
        "stall_timeout",
    )
    assert str(err) == "job 7 in state 'completed' does not accept event 'stall_timeout'"
    assert job.state == J_COMPLETED
    assert owner.calls == [("complete_job", 7, True)]


@pytest.mark.parametrize("checked", [False, True], ids=["fast", "checked"])
def test_rejected_request_event_leaves_it_unchanged(checked: bool) -> None:
    owner = RecordingOwner()
    req = ReqRec(owner, "r-9")
    with checked_mode(REQUEST) if checked else contextlib.nullcontext():
        REQUEST.attach(req)
        REQUEST.fire(req, RE_FINISH)
        assert req.state == R_FINISHED_PENDING
        with pytest.raises(LifecycleError) as info:
            REQUEST.fire(req, RE_LOOKUP)
        REQUEST.fire(req, RE_STORE_CREATED)  # still usable after the rejection
    assert (info.value.entity, info.value.entity_id, info.value.state, info.value.event) == (
        "request",
        "r-9",
        "finished_pending_final",
        "lookup",
    )
    assert req.state == R_FINISHED_PENDING


def test_accepts_choose_require_have_no_effect() -> None:
    owner = RecordingOwner()
    req = ReqRec(owner)
    REQUEST.attach(req)
    REQUEST.fire(req, RE_FINISH)
    req.jobs = set()
    assert REQUEST.choose(req, RE_SIGNAL_FINISHED) == R_RELEASED
    assert REQUEST.accepts(req, RE_SIGNAL_FINISHED)
    REQUEST.require(req, RE_SIGNAL_FINISHED)
    assert not REQUEST.accepts(req, RE_ALLOC_LOAD)
    with pytest.raises(LifecycleError):
        REQUEST.require(req, RE_ALLOC_LOAD)
    assert req.state == R_FINISHED_PENDING
    assert owner.calls == [("on_finish", "req-1")]

"""Per-job flags the invariants read, and checked mode's effect on manager errors.

``flushed`` says a job went out in a step's ``jobs_to_flush``: every worker finishes it
before that step writes any GPU block. INV-SRC-VALID accepts a store reading blocks that an
unfinished load writes only if the store was flushed first; a job starts unflushed, and the
step that flushes it marks it.

A manager that raises on a completion is an anomaly the scheduler counts
(``manager_errors``) and survives: the job still ends and the rest of the report is applied
first. In checked mode a typed manager error then propagates, and an untyped one propagates in
either mode as a ManagerError naming the job; the state is whole, so no violation goes with
it. When a call does leave a violation and raises, the violation is a note on the call's own
error, never raised in its place, and a call that raises nothing still raises the violation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sched_harness import (
    Harness,
    admit_with_load,
    chain_hashes,
    config,
    make_manager,
    offloaded,
    prefill,
)

from statecore import (
    ConnectorOutputResult,
    InvalidMetadataError,
    InvariantViolation,
    OffloadingScheduler,
    Request,
    SchedulerCounters,
    WorkerMetadata,
)
from statecore.errors import ManagerError, ManagerStateError, UnknownKeyError
from statecore.manager import OffloadPolicy
from statecore.specs.fakes import RecordingManager


def test_store_is_unflushed_until_a_step_flushes_it(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1, 2, 3, 4], 16)
    h.add("c", list(range(50, 58)))
    (store,) = prefill(h, "c")
    assert not h.sched.jobs[store].flushed and not h.sched.jobs[load].flushed
    # make the sent load write the blocks the store reads (a clash only a flush excuses)
    h.sched.jobs[load].blocks = h.sched.jobs[store].blocks
    with pytest.raises(InvariantViolation, match="INV-SRC-VALID"):
        h.sched.check_invariants()
    meta = h.step(preempted=["c"])  # the preemption flushes c's store
    assert store in meta.jobs_to_flush
    assert h.sched.jobs[store].flushed and not h.sched.jobs[load].flushed
    h.sched.check_invariants()


class _ForgetfulManager(RecordingManager):
    """Raises on its first store completion, as a manager that lost the keys would (or, with
    ``untyped``, as a manager with a bug would)."""

    failures: int = 1
    untyped: bool = False

    def complete_store(self, keys, ctx, success=True):  # type: ignore[no-untyped-def]
        if self.failures:
            self.failures -= 1
            if self.untyped:
                raise KeyError(keys[0])
            raise UnknownKeyError(keys[0], "complete_store")
        super().complete_store(keys, ctx, success)


@pytest.mark.parametrize("untyped", [False, True], ids=["typed", "untyped"])
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_manager_error_on_completion_ends_the_job_first(checked: bool, untyped: bool) -> None:
    """The completion is applied whatever the manager raises: the job ends, the rest of the
    report is applied, and the scheduler's invariants hold. A typed manager error is counted
    (and raised in checked mode once the report is applied); anything else is raised as a
    ManagerError naming the job, in either mode."""
    manager = _ForgetfulManager()
    manager.untyped = untyped
    h = Harness(manager, config())
    h.sched = OffloadingScheduler(h.config, h.manager, h.clock, checked=checked)
    h.add("a", list(range(8)))
    h.add("b", list(range(50, 58)))
    (job_a,) = prefill(h, "a")
    (job_b,) = prefill(h, "b")
    raises = checked or untyped
    if raises:
        want = ManagerError if untyped else UnknownKeyError
        with pytest.raises(want) as err:
            h.report([job_a, job_b])  # both complete in one report; a's raises
        assert not getattr(err.value, "__notes__", [])  # no violation left behind
        if untyped:
            assert f"job {job_a} of request 'a'" in str(err.value)
            assert isinstance(err.value.__cause__, KeyError)
    else:
        h.report([job_a, job_b])
    s = h.sched
    assert job_a not in s.jobs and job_b not in s.jobs  # both ended, a's despite the error
    assert not s.requests["a"].jobs and not s.requests["b"].jobs
    s.check_invariants()
    c = s.counters
    assert (c.manager_errors, c.jobs_completed, c.jobs_failed) == (1, 2, 0)
    assert h.report().finished_loads == frozenset()  # the next call goes through


def test_a_load_finished_in_a_call_that_raised_is_reported_by_the_next(kind: str) -> None:
    """A manager error raised after a report is applied does not lose the loads that
    finished in it: the next update_connector_output reports them."""

    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1, 2, 3, 4], 16)
    manager = h.sched.manager
    real = manager.complete_load

    def broken(keys: Any, ctx: Any) -> None:  # applies the completion, then has a bug
        real(keys, ctx)
        raise RuntimeError("bug")

    manager.complete_load = broken  # type: ignore[method-assign]
    with pytest.raises(ManagerError, match="complete_load raised RuntimeError: bug"):
        h.report([load])
    manager.complete_load = real  # type: ignore[method-assign]
    assert load not in h.sched.jobs
    h.sched.check_invariants()
    assert h.report().finished_loads == {"b"}


def test_counters_reject_a_name_that_is_not_a_counter() -> None:
    """A misspelt counter is an error, never a new attribute nobody reads."""
    c = SchedulerCounters()
    with pytest.raises(AttributeError):
        c.jobs_complete = 1  # type: ignore[attr-defined]
    assert "jobs_complete" not in c.as_dict()


def test_connector_output_result_is_immutable_and_hashable(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    result = h.report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.finished_loads = frozenset({"x"})  # type: ignore[misc]
    assert hash(result) == hash(ConnectorOutputResult())


@pytest.mark.parametrize("computed", [-1, 17])
def test_lookup_with_computed_tokens_out_of_range_is_refused(kind: str, computed: int) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(16)))
    with pytest.raises(InvalidMetadataError, match="num_computed_tokens"):
        h.sched.get_num_new_matched_tokens(a, computed)
    assert h.sched.counters.lookups == 0  # nothing changed
    assert h.sched.get_num_new_matched_tokens(a, 16) == (0, False)  # the bound itself is valid


def test_load_completes_without_prefix_caching(kind: str) -> None:
    h = Harness(make_manager(kind), config(enable_prefix_caching=False))
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1, 2, 3, 4], 16)
    assert h.sched.loading_keys is None
    assert h.report([load]).finished_loads == {"b"}
    assert h.sched.counters.jobs_completed == 2


def test_rank_report_after_a_count_only_one_counts_its_excess(kind: str) -> None:
    """Two workers: one reports without ranks, then a rank-tagged report names both ranks.
    The job completes with the one report it still waited for; the extra one is counted."""
    h = Harness(make_manager(kind), config(workers=2))
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")
    h.sched.update_connector_output(WorkerMetadata(completed={job: 1}))
    assert h.sched.jobs[job].pending == 1
    h.sched.update_connector_output(WorkerMetadata(completed={job: 2}, completed_ranks={job: 0b11}))
    assert job not in h.sched.jobs
    c = h.sched.counters
    assert (c.over_reports, c.jobs_completed, c.duplicate_reports) == (1, 1, 0)


def test_allocation_for_a_request_id_that_is_not_a_string_is_refused(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    ghost = Request(5, num_prompt_tokens=8, num_tokens=8, block_hashes=[])  # type: ignore[arg-type]
    with pytest.raises(InvalidMetadataError, match="request_id"):
        h.sched.update_state_after_alloc(ghost, [[1, 2]], 0)


def test_block_hash_turned_bad_after_validation_is_counted_and_keeps_the_keys(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(8)))
    h.admit("a")
    keys = h.sched.request_keys("a")
    a.block_hashes.append(12345)  # type: ignore[arg-type]  # the engine's view turned bad
    a.num_tokens = a.num_prompt_tokens = 12
    h.step([h.schedule("a", 12)], new=["a"])
    assert h.sched.counters.invalid_request_views == 1
    assert h.sched.request_keys("a") == keys  # no key from the bad hash, none lost


@pytest.mark.parametrize("bad", [None, 7, {b"x"}])
def test_block_hashes_turned_into_a_non_sequence_are_counted_and_keep_the_keys(
    kind: str, bad: object
) -> None:
    """A ``block_hashes`` that stopped being a sequence after the lookup: the step counts it
    once, keeps the keys built at the lookup, and stores with them."""
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(8)))
    h.admit("a")
    keys = h.sched.request_keys("a")
    a.block_hashes = bad  # type: ignore[assignment]
    meta = h.step([h.schedule("a", 8)], new=["a"])
    assert h.sched.counters.invalid_request_views == 1
    assert h.sched.request_keys("a") == keys
    ((job, _),) = meta.store_jobs.items()
    assert h.sched.jobs[job].keys == keys[0]


def test_job_ids_start_at_0_and_a_report_for_an_unissued_id_is_unknown(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    assert h.sched.next_job_id == 0
    h.sched.update_connector_output(WorkerMetadata(completed={0: 1}))  # nothing issued yet
    c = h.sched.counters
    assert (c.unknown_reports, c.duplicate_reports) == (1, 0)
    h.add("a", list(range(8)))
    assert list(prefill(h, "a")) == [0]


def test_transfer_params_are_checked_at_the_first_sighting_only(kind: str) -> None:
    """kv_transfer_params are read once, when the request is first seen: a malformed value
    is refused then (nothing tracked), and a tracked request's later value is not read."""
    h = Harness(make_manager(kind), config())
    bad = Request("b", num_prompt_tokens=8, num_tokens=8, kv_transfer_params=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidMetadataError, match="kv_transfer_params"):
        h.sched.get_num_new_matched_tokens(bad, 0)
    assert "b" not in h.sched.requests
    a = h.add("a", list(range(8)))
    a.kv_transfer_params = 5  # type: ignore[assignment]
    assert h.sched.get_num_new_matched_tokens(a, 0) == (0, False)


def test_on_new_request_checks_transfer_params_at_the_first_sighting_only(kind: str) -> None:
    """on_new_request refuses a new request with malformed kv_transfer_params (nothing is
    tracked, the manager hears nothing); for a request already tracked it reads them no more."""
    manager = make_manager(kind)
    h = Harness(manager, config())
    bad = Request("b", num_prompt_tokens=8, num_tokens=8, kv_transfer_params=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidMetadataError, match="kv_transfer_params"):
        h.sched.on_new_request(bad)
    assert "b" not in h.sched.requests
    assert h.sched.counters.invalid_transfer_params == 0
    a = h.add("a", list(range(8)))
    a.kv_transfer_params = 5  # type: ignore[assignment]
    h.sched.on_new_request(a)  # a repeated sighting: the params are not read again
    assert h.sched.request_state("a") == "no_transfer"


def test_request_finished_checks_transfer_params_of_an_untracked_request_only(kind: str) -> None:
    """request_finished is the first sighting of a request never tracked: its malformed
    kv_transfer_params are refused (the manager hears nothing); a tracked request's are not
    read again, so a value turned bad since does not stop its finish."""
    h = Harness(make_manager(kind), config())
    ghost = Request("g", num_prompt_tokens=8, num_tokens=8, kv_transfer_params=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidMetadataError, match="kv_transfer_params"):
        h.sched.request_finished(ghost)
    assert h.sched.counters.untracked_finishes == 0
    a = h.add("a", list(range(8)))
    prefill(h, "a")
    a.kv_transfer_params = 5  # type: ignore[assignment]
    assert h.sched.request_finished(a) == (False, None)
    assert h.sched.request_state("a") == "finished_pending_final"


def test_lookup_with_a_negative_new_token_bound_is_refused(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(16)))
    with pytest.raises(InvalidMetadataError, match="max_num_new_tokens"):
        h.sched.get_num_new_matched_tokens(a, 0, max_num_new_tokens=-1)
    assert h.sched.counters.lookups == 0
    assert h.sched.get_num_new_matched_tokens(a, 0, max_num_new_tokens=0) == (0, False)


def test_block_hashes_given_as_a_tuple_are_a_valid_view(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    tokens = list(range(8))
    a = Request("a", num_prompt_tokens=8, num_tokens=8, block_hashes=tuple(chain_hashes(tokens, 4)))  # type: ignore[arg-type]
    h.reqs["a"] = a
    h.sched.on_new_request(a)
    (job,) = prefill(h, "a")
    assert len(h.sched.jobs[job].keys) == 2
    assert h.sched.counters.invalid_request_views == 0


def test_request_finished_never_delays_freeing_the_blocks(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(8)))
    prefill(h, "a")
    assert h.sched.request_finished(a) == (False, None)  # tracked, a store in flight
    ghost = Request("ghost", num_prompt_tokens=4, num_tokens=4, block_hashes=[])
    assert h.sched.request_finished(ghost) == (False, None)  # never tracked


@pytest.mark.parametrize("policy", [OffloadPolicy.CHUNK_LEVEL, OffloadPolicy.REQUEST_LEVEL])
def test_reset_rewinds_a_running_request_to_chunk_0(policy: OffloadPolicy) -> None:
    """The reset manager forgot every chunk: a request that keeps running offers its chunks
    again from chunk 0 (seed 004), the ones stored before the reset included. Under either
    policy the stores after the reset hold each key once, in chunk order (none from past the
    end)."""
    fake = RecordingManager(policy=policy)
    h = Harness(fake, config())
    h.add("a", list(range(16)))
    h.admit("a")
    h.report(list(h.step([h.schedule("a", 8)], new=["a"]).store_jobs))
    h.sched.reset_cache()
    h.report()
    h.step([h.schedule("a", 8)])
    keys = h.sched.request_keys("a")[0]
    offered = [c.keys for c in fake.methods("prepare_store")]
    assert offered == [tuple(keys[:2]), tuple(keys[:4])]


class _ErrorLeavesAViolation(RecordingManager):
    """Its first ``complete_store`` applies the store, breaks the scheduler's state, then
    raises a typed error (a stand-in for any call interrupted half-way)."""

    sched: OffloadingScheduler | None = None
    done: int = 0

    def complete_store(self, keys, ctx, success=True):  # type: ignore[no-untyped-def]
        super().complete_store(keys, ctx, success)
        self.done += 1
        if self.done > 1:
            return
        assert self.sched is not None
        for job in self.sched.jobs.values():
            job.pending = 0  # INV-QUORUM: a live job nobody waits for
        raise ManagerStateError(f"request {ctx.req_id!r}", "storing", "complete_store")


def test_checked_mode_reports_the_call_error_first_and_keeps_the_violation() -> None:
    """Either way round, nothing is hidden: a call that raises a typed error raises that
    error, with the violation its state shows as a note; a call that returns normally with
    a violated invariant raises the InvariantViolation."""
    manager = _ErrorLeavesAViolation()
    h = Harness(manager, config())
    h.sched = OffloadingScheduler(h.config, h.manager, h.clock, checked=True)
    manager.sched = h.sched
    h.add("a", list(range(8)))
    (job_a,) = prefill(h, "a")
    h.add("b", list(range(50, 58)))
    prefill(h, "b")  # a second store in flight: the live job the manager breaks
    # the completion's error is raised once the report is applied (checked mode)
    with pytest.raises(ManagerStateError, match="complete_store") as err:
        h.report([job_a])
    (note,) = err.value.__notes__
    assert note.startswith("checked mode: after this error, InvariantViolation: INV-QUORUM")
    with pytest.raises(InvariantViolation, match="INV-QUORUM"):  # no error: the violation
        h.sched.update_connector_output(None)


class _ShutdownRaises(RecordingManager):
    """A manager whose shutdown raises: typed (a ManagerError) or, with ``untyped``, a bug."""

    untyped: bool = False

    def shutdown(self) -> None:
        if self.untyped:
            raise OSError("the tier's file is gone")
        raise ManagerStateError("the manager", "shut down", "shutdown")


@pytest.mark.parametrize("untyped", [False, True], ids=["typed", "untyped"])
def test_a_managers_shutdown_error_is_a_manager_error_naming_the_call(untyped: bool) -> None:
    manager = _ShutdownRaises()
    manager.untyped = untyped
    h = Harness(manager, config())
    with pytest.raises(ManagerError) as err:
        h.sched.shutdown()
    if untyped:
        assert "the manager's shutdown raised OSError" in str(err.value)
        assert isinstance(err.value.__cause__, OSError)
    else:
        assert isinstance(err.value, ManagerStateError)
    assert h.sched.counters.manager_errors == 1

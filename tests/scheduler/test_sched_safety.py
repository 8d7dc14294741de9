"""OffloadingScheduler: fencing, finish, reset, stalls, failures, bad input, events, invariants
(issue items 5-12), against the recording fake and the real CPU manager, in checked mode."""

from __future__ import annotations

from typing import Any

import pytest
from sched_harness import (
    Harness,
    admit_with_load,
    config,
    finished_order,
    impostor,
    make_manager,
    offloaded,
    prefill,
)

from statecore import (
    InvalidMetadataError,
    InvariantViolation,
    LifecycleError,
    LookupResult,
    MetadataError,
    ReqContext,
    Request,
    UnknownRequestError,
    WorkerMetadata,
)
from statecore.specs.fakes import RecordingManager
from statecore.views import ScheduledRequest


def snapshot(h: Harness) -> Any:
    """Everything observable about scheduler state (counters excluded)."""
    s = h.sched
    return (
        {r: (s.request_state(r), sorted(rec.jobs)) for r, rec in s.requests.items()},
        {j: (job.state, job.pending, job.failed) for j, job in s.jobs.items()},
        {j: job.pending for j, job in s.stalled_jobs.items()},
        {b: sorted(js) for b, js in s.fence_index.items()},
        s.stale_threshold,
        s.next_job_id,
    )


def loadable(h: Harness, keys: tuple[bytes, ...]) -> bool:
    ctx = ReqContext("probe")
    return all(h.manager.lookup(k, ctx) is LookupResult.HIT for k in keys)  # type: ignore[arg-type]


# -- 5. fencing ----------------------------------------------------------------------------------


def test_sliding_window_sources_fenced_at_creation(kind: str) -> None:
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("a", list(range(16)))
    (job_id,) = prefill(h, "a")
    job = h.sched.jobs[job_id]
    swa_blocks = set(h.blocks["a"][1])
    full_blocks = set(h.blocks["a"][0])
    assert set(job.fenced) == swa_blocks
    assert set(h.sched.fence_index) == swa_blocks  # full-attention blocks not yet fenced
    assert not full_blocks & set(h.sched.fence_index)


def test_full_attention_sources_fenced_at_finish_and_reuse_flushes(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    (job_id,) = prefill(h, "a")
    assert not h.sched.fence_index
    h.finish("a")
    assert set(h.sched.fence_index) == set(h.blocks["a"][0])
    h.step(finished=["a"])
    assert h.sched.request_state("a") == "finished_draining"
    # the engine frees a's blocks at once and hands one to a new request: flush first
    reused = h.blocks["a"][0][2]
    meta = h.step(extra_allocated=[reused])
    assert job_id in meta.jobs_to_flush
    h.report([job_id])
    assert not h.sched.fence_index and "a" not in h.sched.requests


def test_final_store_fenced_and_flushed_in_the_same_step(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    h.admit("a")
    h.step([h.schedule("a", 8)], new=["a"])
    first = set(h.sched.jobs)
    h.reqs["a"].num_tokens = 13
    from sched_harness import chain_hashes

    h.reqs["a"].block_hashes = chain_hashes(list(range(13)), 4)
    h.blocks["a"][0].extend([90, 91])
    h.sched.requests["a"].groups[0].block_ids.extend([90, 91])
    h.reqs["a"].num_computed_tokens = 12
    h.finish("a")
    meta = h.step(finished=["a"], extra_allocated=[90])  # block 90 already reused
    (final,) = set(meta.store_jobs) - first
    assert final in meta.jobs_to_flush


def test_preempted_request_flushes_stores_and_defers_readmission(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    (job_id,) = prefill(h, "a")
    meta = h.step(preempted=["a"])
    assert meta.jobs_to_flush == {job_id}
    assert h.sched.request_state("a") == "preempted_draining"
    assert h.sched.get_num_new_matched_tokens(h.reqs["a"], 0) == (None, False)
    h.report([job_id])
    assert h.sched.request_state("a") == "no_transfer"
    # its stored chunks are plain hits on re-admission (a full hit: the engine recomputes
    # the last token after the load, as vLLM does)
    assert h.sched.get_num_new_matched_tokens(h.reqs["a"], 0) == (16, True)


def test_stale_sliding_window_ids_are_zeroed_never_stored() -> None:
    fake = RecordingManager()
    fake.fail_prepare_store = True  # stores cannot be placed: cursors stay behind
    h = Harness(fake, config(sliding=8))
    h.add("a", list(range(8)))
    h.admit("a")
    h.step([h.schedule("a", 8)], new=["a"])
    swa_first = h.blocks["a"][1][0]
    # the sliding-window block left the window, was freed and handed to someone else
    h.reqs["a"].num_tokens = 12
    from sched_harness import chain_hashes

    h.reqs["a"].block_hashes = chain_hashes(list(range(12)), 4)
    h.step([h.schedule("a", 4)], extra_allocated=[swa_first])
    assert h.sched.requests["a"].groups[1].block_ids[0] == 0
    fake.fail_prepare_store = False
    meta = h.step([h.schedule("a", 0)])
    for job in meta.store_jobs.values():
        assert swa_first not in job.src.block_ids  # type: ignore[attr-defined]
        assert 0 not in job.src.block_ids  # type: ignore[attr-defined]


def _stale_window_setup(h: Harness) -> int:
    """Request a stores nothing at first (no CPU room); its first sliding-window block left
    the window. Returns that block."""
    h.add("a", list(range(8)))
    h.admit("a")
    h.step([h.schedule("a", 8)], new=["a"])
    from sched_harness import chain_hashes

    h.reqs["a"].num_tokens = 12
    h.reqs["a"].block_hashes = chain_hashes(list(range(12)), 4)
    return h.blocks["a"][1][0]


def test_window_block_handed_out_while_owner_not_scheduled_is_never_stored() -> None:
    """Bug 1: the owner is not scheduled in the step its freed sliding-window block
    is handed to another request; its store in a later step must not read it."""
    fake = RecordingManager()
    fake.fail_prepare_store = True
    h = Harness(fake, config(sliding=8))
    swa_first = _stale_window_setup(h)
    other = ScheduledRequest("ghost", ((), (swa_first,)), 1)  # any owner, tracked or not
    h.step([other])  # a is not scheduled in this step
    fake.fail_prepare_store = False
    meta = h.step([h.schedule("a", 4)])
    assert meta.store_jobs
    for job in meta.store_jobs.values():
        assert swa_first not in job.src.block_ids  # type: ignore[attr-defined]
        assert 0 not in job.src.block_ids  # type: ignore[attr-defined]


def test_final_store_skips_window_block_handed_out_in_the_same_step() -> None:
    """Bug 1: a finished request's final store is built in the step its freed
    sliding-window block is handed out again: the block is not read."""
    fake = RecordingManager()
    fake.fail_prepare_store = True
    h = Harness(fake, config(sliding=8))
    swa_first = _stale_window_setup(h)
    h.reqs["a"].num_computed_tokens = 11
    h.finish("a")
    fake.fail_prepare_store = False
    h.add("b", list(range(100, 104)))
    h.admit("b")
    meta = h.step(
        [ScheduledRequest("b", ((h.alloc(1)[0],), (swa_first,)), 4)], finished=["a"], new=["b"]
    )
    final = [job for job in meta.store_jobs.values() if job.req_id == "a"]
    sources = [b for job in final for b in job.src.block_ids]  # type: ignore[attr-defined]
    assert sources and swa_first not in sources


def test_blocks_handed_to_an_untracked_request_flush_the_stores_reading_them(kind: str) -> None:
    """Bug 2: another connector's request gets a block under an in-flight store;
    the scheduler skips (and counts) the request but still flushes the store."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    (job_id,) = prefill(h, "a")
    h.finish("a")
    h.step(finished=["a"])
    reused = h.blocks["a"][0][1]
    meta = h.step([ScheduledRequest("other-connector", ((reused,),), 4)])
    assert job_id in meta.jobs_to_flush
    assert h.sched.counters.unknown_scheduled_requests == 1


# -- 6. finish -----------------------------------------------------------------------------------


def test_on_request_finished_once_after_last_prepare_store(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    h.finish("a")
    h.step(finished=["a"])
    h.report([job_id])
    order = [m for m, r in finished_order(h.manager) if r == "a"]
    assert order.count("on_request_finished") == 1
    last_prepare = max(i for i, m in enumerate(order) if m == "prepare_store")
    assert order.index("on_request_finished") > last_prepare
    assert "a" not in h.sched.requests  # released when its last job ended
    with pytest.raises(UnknownRequestError):
        h.sched.request_state("a")


def test_second_finish_is_a_typed_error_with_state_unchanged(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    prefill(h, "a")
    h.finish("a")
    before = snapshot(h)
    with pytest.raises(LifecycleError, match=r"finished_pending_final.*'finish'"):
        h.finish("a")
    assert snapshot(h) == before


def test_finish_of_untracked_request_reaches_manager_once() -> None:
    fake = RecordingManager()
    h = Harness(fake, config())
    h.sched.request_finished(Request("ghost", 4, 4))
    assert [c.method for c in fake.calls] == ["on_new_request", "on_request_finished"]
    assert h.sched.counters.untracked_finishes == 1


# -- 7. reset (seed 004) -------------------------------------------------------------------------


def test_seed_004_reset_with_store_in_flight(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    (job_id,) = prefill(h, "a")
    h.sched.reset_cache()
    # the per-request in-flight set was cleared: the request is scheduled again at once
    assert h.sched.request_state("a") == "no_transfer"
    assert h.sched.get_num_new_matched_tokens(h.reqs["a"], 0) == (0, False)
    meta = h.step()
    assert job_id in meta.jobs_to_flush  # the old job is flushed to the workers
    before = snapshot(h)
    h.report([job_id])  # its late report is inert
    assert snapshot(h) == before
    assert h.sched.counters.stale_reports == 1
    # and the rewound cursor offers the chunks again
    h.reqs["a"].num_computed_tokens = 0
    stores = h.step([h.schedule("a", 16, resumed=True)]).store_jobs
    assert sum(len(h.sched.jobs[j].keys) for j in stores) == 4


def test_reset_finalises_finished_requests_and_releases_loads(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    offloaded(h, "e", list(range(100, 116)))
    h.add("b", list(range(16)) + [1])
    assert h.admit("b") == (16, True)
    h.add("c", list(range(50, 54)))
    prefill(h, "c")  # its step also sends b's load to the workers
    (load,) = h.sched.requests["b"].jobs
    h.finish("c")  # finished, not yet signalled
    h.add("d", list(range(100, 116)) + [2])
    assert h.admit("d") == (16, True)  # d's load is created but not sent yet
    h.sched.reset_cache()
    assert "c" not in h.sched.requests
    assert [m for m, r in finished_order(h.manager) if r == "c"].count("on_request_finished") == 1
    result = h.report()
    # d's load never reached the workers: it ends at once, its blocks to recompute
    assert result.finished_loads == {"d"} and result.invalid_block_ids
    h.step()
    result = h.report([load])  # b's load was carried over: it completes with valid blocks
    assert result.finished_loads == {"b"} and not result.invalid_block_ids
    assert not h.sched.jobs and not h.sched.fence_index and not h.sched.loading_keys
    assert not h.sched.has_pending_push_work()


@pytest.mark.parametrize("workers", [1, 2])
def test_reset_carries_a_sent_load_over_and_it_completes_valid(kind: str, workers: int) -> None:
    h = Harness(make_manager(kind), config(workers=workers))
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1], 16)
    if workers == 2:
        h.report([load], workers=1)  # one rank already reported before the reset
    h.sched.reset_cache()
    assert h.sched.request_state("b") == "loading"  # still waiting on its load
    assert h.sched.jobs[load].carried and h.sched.counters.loads_carried == 1
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (None, False)  # deferred
    meta = h.step()
    assert load in meta.jobs_to_flush  # every worker finishes it before post-reset stores
    result = h.report([load], workers=1)  # the remaining rank; its report is not stale
    assert result.finished_loads == {"b"} and not result.invalid_block_ids
    assert h.sched.counters.stale_reports == 0 and h.sched.counters.jobs_completed >= 1
    assert h.sched.request_state("b") == "no_transfer" and not h.sched.jobs
    before = snapshot(h)
    h.report([load])  # a late duplicate after completion: below the threshold, inert
    assert snapshot(h) == before and h.sched.counters.stale_reports == 1


def test_carried_load_that_fails_reports_its_blocks_invalid(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1], 16)
    h.sched.reset_cache()
    h.step()
    result = h.report(failed=[load])
    assert result.finished_loads == {"b"} and result.invalid_block_ids
    assert h.sched.counters.jobs_failed == 1 and not h.sched.jobs


def test_reset_keeps_a_finished_request_until_its_carried_load_ends(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    load = admit_with_load(h, "b", list(range(16)) + [1], 16)
    h.finish("b")  # aborted while loading
    h.sched.reset_cache()
    assert h.sched.request_state("b") == "finished_draining"
    assert [m for m, r in finished_order(h.manager) if r == "b"].count("on_request_finished") == 1
    h.step()
    h.report([load])
    assert "b" not in h.sched.requests and not h.sched.has_pending_push_work()
    assert [m for m, r in finished_order(h.manager) if r == "b"].count("on_request_finished") == 1


# -- 8. stalls (seed 000) ------------------------------------------------------------------------


def test_seed_000_stall_absorbs_late_reports_and_empties_ledger(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=3))
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    keys = h.sched.jobs[job_id].keys
    h.report([job_id], workers=1)  # one of three workers reported
    h.clock.now = 299.0
    h.report()
    assert job_id in h.sched.jobs  # not yet
    h.clock.now = 311.0
    h.report()
    assert job_id not in h.sched.jobs
    assert h.sched.stalled_jobs[job_id].pending == 2
    assert not loadable(h, keys)  # success=False: never visible
    assert h.sched.counters.jobs_stalled == 1
    assert job_id in h.step().jobs_to_flush  # a late transfer cannot land on reused memory
    h.report([job_id], workers=1)
    assert h.sched.stalled_jobs[job_id].pending == 1
    h.report([job_id], workers=1)
    assert job_id not in h.sched.stalled_jobs
    c = h.sched.counters
    assert (c.late_reports, c.stalled_retired) == (2, 1)
    h.report([job_id])  # anything later is a counted duplicate
    assert h.sched.counters.duplicate_reports == 1
    assert "a" in h.sched.requests and not h.sched.requests["a"].jobs


def test_stall_check_runs_at_most_once_per_interval(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.clock.now = 5.0
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    h.clock.now = 10.0
    h.report()  # the check runs (10 s since construction) and finds nothing due
    assert job_id in h.sched.jobs
    h.clock.now = 306.0  # 301 s after creation, 296 s after the last check: runs, stalls
    h.report()
    assert job_id not in h.sched.jobs
    h2 = Harness(make_manager(kind), config(stall_check_interval_s=100.0))
    h2.add("a", list(range(8)))
    (j2,) = prefill(h2, "a")
    h2.clock.now = 250.0
    h2.report()  # check at 250: not due
    h2.clock.now = 320.0
    h2.report()  # due, but the interval since 250 has not passed
    assert j2 in h2.sched.jobs
    h2.clock.now = 350.0
    h2.report()
    assert j2 not in h2.sched.jobs


def test_stalled_load_is_reported_for_recompute_and_ledger_expires(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=2))
    offloaded(h, "a", list(range(8)))
    h.add("b", list(range(8)) + [1])
    h.admit("b")
    (load,) = h.step().load_jobs
    h.clock.now = 400.0
    result = h.report()
    assert result.finished_loads == {"b"}
    assert set(result.invalid_block_ids) == set(h.blocks["b"][0][:2])
    assert h.sched.request_state("b") == "no_transfer"
    h.clock.now = 800.0
    h.report()
    assert load not in h.sched.stalled_jobs
    assert h.sched.counters.stalled_expired == 1


# -- 9. failures ---------------------------------------------------------------------------------


def test_worker_failure_discards_store(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=2))
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    keys = h.sched.jobs[job_id].keys
    meta = WorkerMetadata()
    meta.mark_completed(job_id)
    meta.mark_failed(job_id)
    h.sched.update_connector_output(meta)
    assert job_id not in h.sched.jobs and h.sched.counters.jobs_failed == 1
    assert not loadable(h, keys)
    assert h.sched.get_num_new_matched_tokens(h.reqs["a"], 0) == (0, False)


def test_worker_failure_of_load_reports_blocks_for_recompute(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(8)))
    h.add("b", list(range(8)) + [1])
    h.admit("b")
    (load,) = h.step().load_jobs
    result = h.report(failed=[load])
    assert result.finished_loads == {"b"}
    assert set(result.invalid_block_ids) == set(h.blocks["b"][0][:2])
    # the CPU copy is fine and unpinned: a later lookup hits again
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (8, True)


# -- 10. bad input -------------------------------------------------------------------------------


def test_bad_reports_are_absorbed_counted_and_change_nothing(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=2))
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    before = snapshot(h)
    meta = WorkerMetadata(completed={999: 1, job_id: 0}, failed={job_id: -3})
    h.sched.update_connector_output(meta)
    assert snapshot(h) == before
    c = h.sched.counters
    assert (c.unknown_reports, c.invalid_report_counts) == (1, 2)
    with pytest.raises(MetadataError, match="must be a WorkerMetadata"):
        h.sched.update_connector_output({"completed": {job_id: 2}})  # type: ignore[arg-type]
    assert snapshot(h) == before
    # more count-only reports than outstanding workers: rejected whole and counted, so no
    # job completes before every worker finished; the real reports then complete it once
    h.sched.update_connector_output(WorkerMetadata(completed={job_id: 5}))
    assert snapshot(h) == before
    assert (h.sched.counters.over_reports, h.sched.counters.jobs_completed) == (1, 0)
    h.sched.update_connector_output(WorkerMetadata(completed={job_id: 1}))
    assert h.sched.jobs[job_id].pending == 1
    h.sched.update_connector_output(WorkerMetadata(completed={job_id: 2}))  # 2 > 1: rejected
    assert h.sched.jobs[job_id].pending == 1
    h.sched.update_connector_output(WorkerMetadata(completed={job_id: 1}))
    assert job_id not in h.sched.jobs
    assert (h.sched.counters.over_reports, h.sched.counters.jobs_completed) == (2, 1)


def test_unknown_request_ids_get_typed_errors(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    with pytest.raises(UnknownRequestError, match="update_state_after_alloc"):
        h.sched.update_state_after_alloc(Request("nope", 4, 4), [[1]], 4)
    ghost = Request("ghost", 8, 8)
    assert h.sched.get_num_new_matched_tokens(ghost, 0) == (0, False)
    assert h.sched.counters.implicit_new_requests == 1
    with pytest.raises(MetadataError):
        h.sched.build_connector_meta("not an output")  # type: ignore[arg-type]
    with pytest.raises(MetadataError, match="one per KV-cache group"):
        h.sched.update_state_after_alloc(ghost, [[1], [2]], 0)


@pytest.mark.parametrize(
    "call", ["on_new_request", "get_num_new_matched_tokens", "request_finished"]
)
def test_a_first_sighting_checks_every_block_hash_from_the_first(kind: str, call: str) -> None:
    """A request the scheduler has never seen has no hash checked yet: a bad first block
    hash is refused by whichever hook sees the request first, and nothing is tracked."""
    manager = make_manager(kind)
    h = Harness(manager, config())
    good = h.add("a", list(range(12))).block_hashes
    bad = Request("b", 12, 12, block_hashes=["not bytes", *good[1:]])  # type: ignore[list-item]
    before = list(finished_order(manager))
    hook = getattr(h.sched, call)
    with pytest.raises(InvalidMetadataError, match=r"request.block_hashes\[0\]"):
        hook(bad) if call != "get_num_new_matched_tokens" else hook(bad, 0)
    assert set(h.sched.requests) == {"a"}
    assert finished_order(manager) == before
    assert h.sched.counters.untracked_finishes == 0


def test_a_request_id_that_is_not_a_str_is_refused_however_it_compares(kind: str) -> None:
    """Request ids must be str by type: an id equal to a tracked one whose class even compares
    equal to str is refused by the allocation hook and unknown to request_state."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    fake_id = impostor("a")
    assert fake_id == "a" and type(fake_id) == str  # noqa: E721
    twin = Request("a", 8, 8)
    twin.request_id = fake_id  # type: ignore[assignment]
    with pytest.raises(InvalidMetadataError, match="request_id"):
        h.sched.update_state_after_alloc(twin, [[1, 2]], 0)
    with pytest.raises(UnknownRequestError):
        h.sched.request_state(fake_id)  # type: ignore[arg-type]
    with pytest.raises(UnknownRequestError):
        h.sched.request_keys(fake_id)  # type: ignore[arg-type]
    assert h.sched.request_state("a") == "no_transfer"


def test_an_allocation_for_a_load_needs_both_the_blocks_and_the_keys(kind: str) -> None:
    """The cached tokens need enough GPU blocks and enough chunk keys: either one short is a
    typed error that creates no load; the allocation that holds them creates one."""
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    b = h.add("b", list(range(16)) + [7, 7, 7, 7])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (16, True)
    with pytest.raises(MetadataError, match="3 blocks and 5 keys cannot hold 16 cached tokens"):
        h.sched.update_state_after_alloc(b, [h.alloc(3)], 16)  # 16 tokens need 4 blocks
    with pytest.raises(MetadataError, match="6 blocks and 5 keys cannot hold 24 cached tokens"):
        h.sched.update_state_after_alloc(b, [h.alloc(6)], 24)  # 5 keys hold 20 tokens
    assert not h.sched.requests["b"].jobs
    h.sched.update_state_after_alloc(b, [h.alloc(4)], 16)
    assert len(h.step().load_jobs) == 1


def test_a_report_for_a_job_id_that_is_not_an_int_is_absorbed(kind: str) -> None:
    """Job ids in a report must be ints by type, not merely compare equal to one: an impostor
    id completes nothing and is counted."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    fake_id = impostor(job_id)
    assert fake_id == job_id and type(fake_id) == int  # noqa: E721
    h.sched.update_connector_output(WorkerMetadata(completed={fake_id: 1}))  # type: ignore[dict-item]
    assert h.sched.jobs[job_id].pending == 1
    assert (h.sched.counters.invalid_report_counts, h.sched.counters.jobs_completed) == (1, 0)


# -- 11. events and stats ------------------------------------------------------------------------


def test_events_and_stats(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    meta = WorkerMetadata()
    meta.mark_completed(job_id)
    meta.stats.store.record(4096, 0.001)
    h.sched.update_connector_output(meta)
    events = h.sched.take_events()
    stored = [k for e in events if not e.removed for k in e.keys]
    assert set(stored) == set(h.sched.requests["a"].groups[0].keys)
    assert h.sched.take_events() == []
    stats = h.sched.get_stats()
    assert stats["kv_offload_store_bytes"] == 4096 and stats["jobs_completed"] == 1
    assert h.sched.get_stats()["jobs_completed"] == 0  # counters add: deltas per call


# -- 12. invariants ------------------------------------------------------------------------------


def test_checked_mode_catches_a_corrupted_state(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    h.sched.requests["a"].jobs.add(12345)  # a dangling job id (the seed-004 symptom)
    with pytest.raises(InvariantViolation) as err:
        h.sched.check_invariants()
    assert err.value.code == "INV-REF" and "12345" in str(err.value)
    h.sched.requests["a"].jobs.discard(12345)
    h.sched.jobs[job_id].pending = 0
    with pytest.raises(InvariantViolation, match="INV-QUORUM"):
        h.sched.check_invariants()


def test_load_into_a_block_a_store_still_reads_flushes_the_store_first(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    (store_a,) = prefill(h, "a")
    offloaded(h, "x", list(range(100, 108)))
    h.finish("a")
    h.step(finished=["a"])  # a's blocks are freed at once; its store keeps them fenced
    b = h.add("b", list(range(100, 108)) + [1])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (8, True)
    reused = h.blocks["a"][0][:3]  # the allocator hands a's blocks to b's load
    h.sched.update_state_after_alloc(b, [reused], 8)
    meta = h.step()
    assert store_a in meta.jobs_to_flush and len(meta.load_jobs) == 1
    assert h.sched.jobs[store_a].flushed
    h.sched.check_invariants()  # INV-SRC-VALID holds because the store is flushed first
    h.sched.jobs[store_a].flushed = False
    with pytest.raises(InvariantViolation, match="INV-SRC-VALID"):
        h.sched.check_invariants()
    h.sched.jobs[store_a].flushed = True


def test_rank_identity_keeps_a_repeated_report_from_completing_a_job_early(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=2))
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    rank0 = WorkerMetadata(rank=0)
    rank0.mark_completed(job_id)
    h.sched.update_connector_output(rank0)
    h.sched.update_connector_output(rank0)  # the same rank's report delivered twice
    assert h.sched.jobs[job_id].pending == 1
    assert h.sched.counters.duplicate_reports == 1
    rank5 = WorkerMetadata(rank=5)  # there is no rank 5
    rank5.mark_completed(job_id)
    h.sched.update_connector_output(rank5)
    assert h.sched.jobs[job_id].pending == 1
    assert h.sched.counters.invalid_report_counts == 1
    rank1 = WorkerMetadata(rank=1)
    rank1.mark_completed(job_id)
    h.sched.update_connector_output(rank0.aggregate(rank1))
    assert job_id not in h.sched.jobs
    assert (h.sched.counters.jobs_completed, h.sched.counters.duplicate_reports) == (1, 2)


def test_a_load_admitted_after_a_preemption_notice_is_not_flushed() -> None:
    """A request preempted outside scheduling (vLLM's prefix-cache reset with running
    requests) is looked up and loads again before the output that carries its preemption
    reaches the connector: that load writes the request's new blocks, so the preemption
    flushes only the jobs it had before, and the load stays asynchronous."""
    h = Harness(make_manager("cpu"), config())
    offloaded(h, "a", list(range(16)))
    h.reqs["a"].num_computed_tokens = 0  # preempted: the engine starts it from its prefix
    assert h.admit("a") == (16, True)
    meta = h.step(preempted=["a"])
    (load,) = meta.load_jobs
    assert load not in meta.jobs_to_flush
    h.report([load])
    assert h.sched.request_state("a") == "no_transfer"
    assert not h.sched.jobs

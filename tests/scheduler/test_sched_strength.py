"""Scheduler behaviour that a sampled mutation run found unasserted.

Each test pins one behaviour whose loss no other test noticed: the exact counter values of a
realistic run, checked mode really evaluating the invariants (by argument and by
environment), the store cursor advancing, a fence set holding several store jobs, and a
chunk still being written at index 0 of a lookup never counted as a hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sched_harness import Harness, chain_hashes, config, make_manager, prefill

from statecore import (
    InvalidMetadataError,
    InvariantViolation,
    LookupResult,
    OffloadingScheduler,
    ReqContext,
    Request,
    ScheduledRequest,
    WorkerMetadata,
    kernels,
    make_offload_key,
)
from statecore.specs.fakes import RecordingManager

# -- counters ------------------------------------------------------------------------------------


def _integer_counters(h: Harness) -> dict[str, int | float]:
    return {k: v for k, v in h.sched.counters.as_dict().items() if not k.endswith("_seconds")}


def test_counters_have_exact_values_after_a_realistic_run(kind: str) -> None:
    """Store, load, a deferred lookup, bad and late reports, a stall, a finish and a reset:
    every counter holds exactly the number of events of its kind."""
    h = Harness(make_manager(kind), config(workers=2))
    h.add("a", list(range(17)))
    (store_a,) = prefill(h, "a")  # lookup 1 (no hit), store job 1 (4 chunks)
    done = WorkerMetadata()
    done.mark_completed(store_a)
    done.stats.store.record(4096, 0.5)
    h.sched.update_connector_output(done)
    h.sched.update_connector_output(done)  # second worker: the job completes
    h.report([store_a], workers=1)  # a third report: duplicate
    h.sched.update_connector_output(WorkerMetadata(completed={777: 1}))  # unknown job
    h.add("b", list(range(16)) + [5, 5, 5, 5])
    h.add("c", list(range(16)) + [6, 6, 6, 6])
    assert h.admit("b") == (16, True)  # lookup 2: 16 hit tokens
    assert h.sched.get_num_new_matched_tokens(h.reqs["c"], 0) == (None, False)  # lookup 3
    (load_b,) = h.step().load_jobs  # load job 2
    load_meta = WorkerMetadata()
    load_meta.mark_completed(load_b)
    load_meta.stats.load.record(1000, 0.25)
    h.sched.update_connector_output(load_meta)
    h.sched.update_connector_output(load_meta)  # load job completes
    h.add("d", list(range(100, 108)))
    (store_d,) = prefill(h, "d")  # lookup 4, store job 3
    h.clock.now = 1000.0
    h.report()  # store job 3 stalls
    assert store_d not in h.sched.jobs
    h.finish("a")
    h.sched.reset_cache()
    assert _integer_counters(h) == {
        "jobs_created": 3,
        "load_jobs_created": 1,
        "store_jobs_created": 2,
        "jobs_completed": 2,
        "jobs_failed": 0,
        "jobs_stalled": 1,
        "jobs_discarded": 0,
        "loads_carried": 0,
        "stalled_retired": 0,
        "stalled_expired": 0,
        "late_reports": 0,
        "stale_reports": 0,
        "duplicate_reports": 1,
        "unknown_reports": 1,
        "over_reports": 0,
        "invalid_report_counts": 0,
        "lookups": 4,
        "lookups_deferred": 1,
        "loader_waits_expired": 0,
        "lookup_hit_tokens": 16,
        "allocation_failures": 0,
        "flushes_requested": 0,
        "resets": 1,
        "implicit_new_requests": 0,
        "untracked_finishes": 0,
        "unknown_scheduled_requests": 0,
        "invalid_transfer_params": 0,
        "invalid_request_views": 0,
        "manager_errors": 0,
        "fence_pairs_missing": 0,
        "load_bytes": 2000,
        "store_bytes": 8192,
    }
    c = h.sched.counters
    assert (c.load_seconds, c.store_seconds) == (0.5, 1.0)


def test_counters_count_each_kind_of_bad_report_once(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=2))
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")
    bad = WorkerMetadata(completed={job: 0, 4242: 1}, failed={job: -1})
    h.sched.update_connector_output(bad)
    h.sched.update_connector_output(WorkerMetadata(completed={job: 3}))  # one over quorum
    assert h.sched.jobs[job].pending == 2  # rejected whole: no job completes early
    h.sched.update_connector_output(WorkerMetadata(completed={job: 2}))
    h.sched.update_connector_output(WorkerMetadata(completed={-5: 1}))  # never issued
    c = h.sched.counters
    assert (c.invalid_report_counts, c.unknown_reports, c.over_reports) == (2, 2, 1)
    assert (c.jobs_completed, c.duplicate_reports, c.late_reports) == (1, 0, 0)


# -- checked mode --------------------------------------------------------------------------------


def _corrupted(checked: bool | None) -> Harness:
    """A scheduler with one in-flight store whose pending count was zeroed behind its back
    (INV-QUORUM broken), built with ``checked`` as given."""
    h = Harness(make_manager("cpu"), config())
    h.sched = OffloadingScheduler(h.config, h.manager, h.clock, checked=checked)
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")
    h.sched.jobs[job].pending = 0
    return h


def test_checked_true_evaluates_invariants_after_every_public_call() -> None:
    h = _corrupted(True)
    assert h.sched.checked
    with pytest.raises(InvariantViolation, match="INV-QUORUM"):
        h.step()  # build_connector_meta
    with pytest.raises(InvariantViolation, match="INV-QUORUM"):
        h.sched.update_connector_output(WorkerMetadata())


def test_unchecked_scheduler_does_not_evaluate_invariants() -> None:
    h = _corrupted(False)
    assert not h.sched.checked
    h.step()  # the corruption goes unnoticed: nothing evaluates the invariants
    with pytest.raises(InvariantViolation, match="INV-QUORUM"):
        h.sched.check_invariants()


@pytest.mark.parametrize(("value", "active"), [("1", True), ("yes", True), ("0", False)])
def test_statecore_checked_environment_turns_checked_mode_on(
    monkeypatch: pytest.MonkeyPatch, value: str, active: bool
) -> None:
    monkeypatch.setenv("STATECORE_CHECKED", value)
    h = _corrupted(None)
    assert h.sched.checked is active
    if active:
        with pytest.raises(InvariantViolation, match="INV-QUORUM"):
            h.step()
    else:
        h.step()


def test_no_statecore_checked_environment_means_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATECORE_CHECKED", raising=False)
    h = _corrupted(None)
    assert not h.sched.checked
    h.step()


# -- store cursor --------------------------------------------------------------------------------


def test_store_cursor_advances_and_each_chunk_is_offered_once() -> None:
    fake = RecordingManager()
    h = Harness(fake, config())
    h.add("a", list(range(16)))
    h.admit("a")
    keys = list(h.sched.requests["a"].groups[0].keys)
    first = h.step([h.schedule("a", 8)], new=["a"])
    assert h.sched.requests["a"].groups[0].cursor == 2
    second = h.step([h.schedule("a", 8)])
    assert h.sched.requests["a"].groups[0].cursor == 4
    offered = [c.keys for c in fake.methods("prepare_store")]
    assert offered == [tuple(keys[:2]), tuple(keys[2:4])]
    (j1,) = first.store_jobs
    (j2,) = second.store_jobs
    assert h.sched.jobs[j1].keys == tuple(keys[:2])
    assert h.sched.jobs[j2].keys == tuple(keys[2:4])
    h.step([h.schedule("a", 0)])  # nothing new computed: nothing offered again
    assert len(fake.methods("prepare_store")) == 2


def test_advance_cursor_kernel() -> None:
    assert kernels.advance_cursor(2, 5) == 5
    assert kernels.advance_cursor(5, 2) == 5
    assert kernels.advance_cursor(3, 3) == 3


# -- fence sets with several store jobs ----------------------------------------------------------


def test_fence_set_keeps_every_store_job_reading_a_block() -> None:
    index: dict[int, set[int]] = {}
    kernels.fence_add(index, 1, [5, 6])
    kernels.fence_add(index, 2, [6, 7])
    kernels.fence_add(index, 3, [6])
    assert index == {5: {1}, 6: {1, 2, 3}, 7: {2}}
    assert kernels.fence_remove(index, 1, [5, 6]) == 0
    assert index == {6: {2, 3}, 7: {2}}  # block 6 still fenced by jobs 2 and 3
    assert kernels.fence_remove(index, 3, [6, 6]) == 1  # the repeated id is a counted anomaly
    assert index == {6: {2}, 7: {2}}
    assert kernels.fence_remove(index, 2, [6, 7]) == 0
    assert index == {}


def test_two_store_jobs_of_one_block_both_flushed_on_reuse(kind: str) -> None:
    """Two finished requests whose stores read the same GPU block (a shared prefix block):
    reusing the block flushes both stores, and it stays fenced until the last one ends."""
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("a", list(range(16)))
    (job_a,) = prefill(h, "a")
    h.add("b", list(range(50, 66)))
    h.admit("b")
    shared = h.blocks["a"][1][-1]
    sched = h.schedule("b", 16)
    ids = [list(g) for g in sched.new_block_ids]
    ids[1][-1] = shared  # the engine shares a's last sliding-window block with b
    h.blocks["b"][1][-1] = shared
    sched = ScheduledRequest("b", tuple(tuple(g) for g in ids), 16)
    (job_b,) = dict(h.step([sched], new=["b"]).store_jobs)
    assert h.sched.fence_index[shared] == {job_a, job_b}
    meta = h.step(extra_allocated=[shared])
    assert {job_a, job_b} <= set(meta.jobs_to_flush)
    h.report([job_a])
    assert h.sched.fence_index[shared] == {job_b}
    h.report([job_b])
    assert shared not in h.sched.fence_index


# -- a chunk being written is never a hit --------------------------------------------------------


@pytest.mark.parametrize(
    ("results", "budget", "expected"),
    [
        ([kernels.HIT_PENDING, kernels.HIT, kernels.HIT, kernels.MISS], 5, 0),
        ([kernels.HIT_PENDING, kernels.HIT, kernels.HIT, kernels.MISS], 3, 0),
        ([kernels.HIT_PENDING, kernels.HIT, kernels.HIT, kernels.MISS], 2, None),
        ([kernels.HIT_PENDING], 0, None),
        ([kernels.HIT_PENDING], 1, 0),
        ([kernels.HIT, kernels.HIT_PENDING, kernels.HIT_PENDING], 2, 1),
        ([kernels.HIT, kernels.HIT_PENDING, kernels.HIT_PENDING], 1, None),
        ([kernels.HIT, kernels.HIT, kernels.MISS, kernels.HIT], 0, 2),
        ([kernels.HIT, kernels.RETRY, kernels.HIT], 9, None),
        ([], 0, 0),
    ],
)
def test_prefix_hits_never_counts_a_pending_chunk(
    results: list[int], budget: int, expected: int | None
) -> None:
    assert kernels.prefix_hits(results, budget) == expected


def test_lookup_with_the_first_chunk_pending_loads_nothing() -> None:
    fake = RecordingManager()
    h = Harness(fake, config(max_recompute_pending_tokens=12))
    h.add("b", list(range(24)))
    h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)
    keys = list(h.sched.requests["b"].groups[0].keys)
    ctx = ReqContext("seed")
    out = fake.prepare_store(keys[1:3], ctx)
    assert out is not None
    fake.complete_store(list(out.keys_to_store), ctx)
    fake.lookup_override[keys[0]] = LookupResult.HIT_PENDING
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (0, False)
    h2 = Harness(RecordingManager(), config())  # no pending budget: defer instead
    h2.add("b", list(range(24)))
    h2.sched.get_num_new_matched_tokens(h2.reqs["b"], 0)
    k2 = list(h2.sched.requests["b"].groups[0].keys)
    h2.manager.lookup_override[k2[0]] = LookupResult.HIT_PENDING  # type: ignore[attr-defined]
    assert h2.sched.get_num_new_matched_tokens(h2.reqs["b"], 0) == (None, False)


# -- sliding window: a chunk being written blocks the window it falls in -------------------------

H, P, M, R = kernels.HIT, kernels.HIT_PENDING, kernels.MISS, kernels.RETRY


@pytest.mark.parametrize(
    ("results", "window", "expected"),
    [
        ([H, H, H, H], 2, 4),  # the rightmost full window
        ([H, H, P, H], 2, None),  # the rightmost window holds a pending chunk: defer
        ([H, H, M, H], 2, 2),  # the window left of the miss
        ([P, H], 3, None),  # no full window; the leading run has a pending chunk
        ([H, H], 3, 2),  # no full window: the leading run of hits
        ([M, H], 3, 0),  # no full window and no leading hit: nothing
        ([H, R, H, H], 2, 4),  # a RETRY left of the chosen window does not matter
        ([H, R, H], 2, None),  # a RETRY before any full window is found: defer
        ([P, M, H, H], 2, 4),  # a pending chunk outside the chosen window does not matter
        ([], 1, 0),
    ],
)
def test_window_hits_never_reads_a_pending_chunk(
    results: list[int], window: int, expected: int | None
) -> None:
    assert kernels.window_hits(results, window) == expected


# -- first scheduling after an allocation: both forms of the block lists -------------------------


@pytest.mark.parametrize("form", ["complete", "delta"])
def test_first_scheduling_after_a_load_keeps_the_allocated_blocks(kind: str, form: str) -> None:
    """vLLM may repeat the complete block lists or send only the blocks added since the
    allocation; either way the request's blocks are the allocation followed by the new ones
    (whatever their ids), and its stores read the new blocks."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    h.report(list(prefill(h, "a")))
    h.add("b", list(range(16)) + list(range(500, 516)))
    assert h.admit("b") == (16, True)
    (load,) = h.step().load_jobs
    assert h.report([load]).finished_loads == {"b"}
    allocated = list(h.blocks["b"][0])
    added = [900, 901, 902, 903]  # ids above the allocation's (the engine's free list order)
    sent = allocated + added if form == "complete" else added
    h.reqs["b"].num_computed_tokens = 16
    meta = h.step([ScheduledRequest("b", (tuple(sent),), 16)])
    assert list(h.sched.requests["b"].groups[0].block_ids) == allocated + added
    (store,) = meta.store_jobs.values()
    assert list(store.src.block_ids) == added  # type: ignore[attr-defined]


def test_first_scheduling_that_repeats_exactly_the_allocation(kind: str) -> None:
    """The allocation already covers the tokens scheduled next (as in vLLM): the complete
    lists sent at the first scheduling equal the allocation and are taken once, not twice."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    h.report(list(prefill(h, "a")))
    b = h.add("b", list(range(16)) + [7, 7, 7, 7])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (16, True)
    blocks = h.alloc(5)  # 16 loaded tokens and the 4 computed next
    h.sched.update_state_after_alloc(b, [blocks], 16)
    (load,) = h.step().load_jobs
    h.report([load])
    b.num_computed_tokens = 16
    meta = h.step([ScheduledRequest("b", (tuple(blocks),), 4)])
    assert list(h.sched.requests["b"].groups[0].block_ids) == blocks
    (store,) = meta.store_jobs.values()
    assert list(store.src.block_ids) == blocks[4:]  # type: ignore[attr-defined]


# -- errors name the entity and its state --------------------------------------------------------


def test_input_error_names_the_tracked_request_and_its_state(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(16)))
    h.add("b", list(range(50, 58)))
    (_,) = prefill(h, "b")
    h.finish("b")
    with pytest.raises(InvalidMetadataError) as err:
        h.sched.update_state_after_alloc(a, [[1, "x"]], 0)  # type: ignore[list-item]
    assert (err.value.entity, err.value.state) == ("request 'a'", "no_transfer")
    assert "[request 'a' in state 'no_transfer']" in str(err.value)
    with pytest.raises(InvalidMetadataError) as err:
        h.sched.update_state_after_alloc(h.reqs["b"], [[1]], -1)
    assert err.value.state == h.sched.request_state("b") != "no_transfer"
    ghost = Request("ghost", num_prompt_tokens=1, num_tokens=1, block_hashes=[])
    with pytest.raises(InvalidMetadataError) as err:
        h.sched.update_state_after_alloc(ghost, [[1]], -1)
    assert err.value.state == "untracked"


# -- block hashes of any bytes-like type give the same keys --------------------------------------


@pytest.mark.parametrize("as_type", [bytearray, memoryview])
def test_bytes_like_block_hashes_give_the_same_keys(kind: str, as_type: type) -> None:
    h = Harness(make_manager(kind), config())
    tokens = list(range(16))
    h.add("a", tokens)
    (job,) = prefill(h, "a")
    h.report([job])
    hashes = chain_hashes(tokens + [9, 9, 9, 9], h.tph)
    b = Request("b", num_prompt_tokens=20, num_tokens=20, block_hashes=[as_type(x) for x in hashes])
    h.reqs["b"] = b
    h.sched.on_new_request(b)
    assert h.admit("b") == (16, True)  # a's keys: the same bytes, whatever the hash type
    keys = h.sched.request_keys("b")[0]
    assert all(type(k) is bytes for k in keys)
    assert keys[:4] == h.sched.request_keys("a")[0]


def test_a_chunk_key_is_made_from_the_last_hash_of_the_chunk(kind: str) -> None:
    """Three hashes a chunk (blocks of 4 tokens, 3 blocks a chunk): chunk ``i``'s key is
    hash ``3 * i + 2`` with the group's suffix, for every chunk, not only the first."""
    h = Harness(make_manager(kind), config(tokens_per_block=4, blocks_per_chunk=3))
    tokens = list(range(36))
    h.add("a", tokens)
    h.admit("a")
    hashes = chain_hashes(tokens, h.tph)
    assert len(hashes) == 9
    assert h.sched.request_keys("a")[0] == tuple(make_offload_key(hashes[i], 0) for i in (2, 5, 8))


class _HashSeq(Sequence[bytes]):
    """block_hashes as a Sequence that is neither a list nor a tuple."""

    def __init__(self, items: list[bytes]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        if isinstance(i, slice):
            raise TypeError("no slices")  # a Sequence need not take them
        return self._items[i]


@pytest.mark.parametrize("wrap", [list, tuple, _HashSeq])
@pytest.mark.parametrize("bpc", [1, 2, 3])
def test_keys_are_each_chunks_last_hash_and_group(kind: str, wrap: type, bpc: int) -> None:
    """Key i of a group is make_offload_key(hash of the chunk's last block, group), for
    block hashes in any Sequence, whole chunks only; keys grow as hashes arrive."""
    h = Harness(make_manager(kind), config(blocks_per_chunk=bpc, sliding=8))
    hashes = chain_hashes(list(range(40)), h.tph)  # 10 hashes
    req = Request("a", num_prompt_tokens=40, num_tokens=40, block_hashes=wrap(hashes[:7]))
    h.reqs["a"] = req
    h.sched.get_num_new_matched_tokens(req, 0)
    want = [make_offload_key(hashes[i * bpc + bpc - 1], 0) for i in range(7 // bpc)]
    assert list(h.sched.request_keys("a")[0]) == want
    assert list(h.sched.request_keys("a")[1]) == [
        make_offload_key(hashes[i * bpc + bpc - 1], 1) for i in range(7 // bpc)
    ]
    req.block_hashes = wrap(hashes)
    h.sched.get_num_new_matched_tokens(req, 0)
    want = [make_offload_key(hashes[i * bpc + bpc - 1], 0) for i in range(10 // bpc)]
    assert list(h.sched.request_keys("a")[0]) == want
    assert all(type(key) is bytes for g in h.sched.request_keys("a") for key in g)


# -- found by the third sample (seed 4242) -------------------------------------------------------


def test_storable_chunks_is_bounded_by_each_limit() -> None:
    # (tokens, tokens per chunk, block ids, blocks per chunk, keys)
    assert kernels.storable_chunks(64, 8, 4, 2, 10) == 2  # the blocks bind
    assert kernels.storable_chunks(20, 8, 16, 2, 10) == 2  # the tokens bind
    assert kernels.storable_chunks(64, 8, 16, 2, 3) == 3  # the keys bind
    assert kernels.storable_chunks(64, 8, 5, 2, 10) == 2  # a partial chunk of blocks is not one


def test_view_turned_bad_before_the_step_is_counted_and_stores_nothing(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    h.admit("a")
    sched = h.schedule("a", 16)
    h.reqs["a"].num_computed_tokens = -1  # the engine's view turned bad after the lookup
    meta = h.step([sched], new=["a"])
    assert not meta.store_jobs
    assert h.sched.counters.invalid_request_views == 1


def test_view_turned_bad_in_a_step_under_the_store_floor_is_counted(kind: str) -> None:
    """A step that cannot complete a chunk skips store building, but only on a valid view:
    a ``num_computed_tokens`` turned bad still reaches the store path, which counts it."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(32)))
    h.admit("a")
    (store,) = h.step([h.schedule("a", 16)], new=["a"]).store_jobs
    h.report([store])
    assert not h.step([h.schedule("a", 1)]).store_jobs  # 17 tokens: under the next chunk
    assert h.sched.counters.invalid_request_views == 0
    sched = h.schedule("a", 1)
    h.reqs["a"].num_computed_tokens = 17.0  # type: ignore[assignment]
    assert not h.step([sched]).store_jobs
    assert h.sched.counters.invalid_request_views == 1


def test_a_step_under_the_store_floor_does_not_read_the_rest_of_the_view(kind: str) -> None:
    """A decode step that cannot complete a chunk costs a few comparisons: the view's other
    fields are not read then, so a bad one is not counted until a step could store."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(32)))
    h.admit("a")
    (store,) = h.step([h.schedule("a", 16)], new=["a"]).store_jobs
    h.report([store])
    sched = h.schedule("a", 1)
    h.reqs["a"].num_tokens = None  # type: ignore[assignment]  # turned bad, not read here
    assert not h.step([sched]).store_jobs
    assert h.sched.counters.invalid_request_views == 0


def test_lookup_with_more_computed_than_loadable_answers_zero(kind: str) -> None:
    """A sliding-window request computed to its last token locally: nothing is loadable
    (the last token must be computed), so the lookup answers 0 without deferring."""
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("a", list(range(16)))
    h.report(list(prefill(h, "a")))
    b = h.add("b", list(range(16)))
    assert h.sched.get_num_new_matched_tokens(b, 16) == (0, False)
    assert h.sched.get_num_new_matched_tokens(b, 15) == (0, False)


def test_sliding_window_load_skips_leading_null_blocks(kind: str) -> None:
    """Blocks of a sliding-window group that fell out of the window are the null block (0):
    the load writes only the blocks after them (found by a scan that must advance)."""
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("a", list(range(32)))
    h.report(list(prefill(h, "a")))
    b = h.add("b", list(range(32)) + [3, 3, 3, 3])
    hits, _ = h.sched.get_num_new_matched_tokens(b, 0)
    assert hits == 32
    full = h.alloc(8)
    swa = [0] * 6 + h.alloc(2)  # only the last two blocks lie inside the window
    h.sched.update_state_after_alloc(b, [full, swa], 32)
    (load,) = h.step().load_jobs.values()
    assert list(load.dst.block_ids) == full + swa[6:]  # type: ignore[attr-defined]

"""Store building step by step: layouts, chunk boundaries, limits.

A request computed a few tokens at a time stores each chunk in the step that completes it,
exactly then and never earlier, with the GPU layout the worker needs (block ids, blocks per
group, index of the first block); limits from the transfer parameters hold exactly at their
value; the allocation that follows a lookup checks that its lists hold the locally computed
tokens; the engine keeps stepping while any of the three kinds of pending work exists.
"""

from __future__ import annotations

import weakref

import pytest
from sched_harness import Harness, chain_hashes, config, make_manager, prefill

from statecore import (
    GroupConfig,
    InvalidMetadataError,
    MetadataError,
    Request,
    ScheduledRequest,
    SchedulerConfig,
)
from statecore.manager import LookupResult, OffloadPolicy, ReqContext
from statecore.managers import CPUOffloadingManager, MemoryTier, TieringOffloadingManager
from statecore.specs.fakes import RecordingManager


def _layout(meta_store: object) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    src = meta_store.src  # type: ignore[attr-defined]
    return tuple(src.block_ids), tuple(src.group_sizes), tuple(src.block_indices)


def _request(h: Harness, rid: str, n: int, params: dict[str, object] | None = None) -> Request:
    tokens = list(range(1000 * len(h.reqs), 1000 * len(h.reqs) + n))
    req = Request(
        rid,
        num_prompt_tokens=n,
        num_tokens=n,
        block_hashes=chain_hashes(tokens, h.tph),
        kv_transfer_params=params,
    )
    h.reqs[rid] = req
    h.sched.on_new_request(req)
    return req


@pytest.mark.parametrize("bpc", [1, 2])
def test_each_chunk_is_stored_in_the_step_that_completes_it(kind: str, bpc: int) -> None:
    h = Harness(make_manager(kind), config(tokens_per_block=4, blocks_per_chunk=bpc))
    tpc = 4 * bpc
    h.add("a", list(range(3 * tpc)))
    assert h.admit("a") == (0, False)
    # (tokens scheduled, chunk stored in that step or None)
    plan = [(tpc, 0), (tpc, 1), (tpc - 1, None), (1, 2)]
    stored: list[int] = []
    for step, (n, chunk) in enumerate(plan):
        meta = h.step([h.schedule("a", n)], new=["a"] if step == 0 else [])
        if chunk is None:
            assert not meta.store_jobs, step
            continue
        ((job, store),) = meta.store_jobs.items()
        blocks = h.blocks["a"][0][chunk * bpc : (chunk + 1) * bpc]
        assert _layout(store) == (tuple(blocks), (bpc,), (chunk * bpc,))
        assert h.sched.jobs[job].keys == (h.sched.request_keys("a")[0][chunk],)
        assert h.sched.requests["a"].groups[0].cursor == chunk + 1
        stored.append(chunk)
        h.report([job])
    assert stored == [0, 1, 2]
    assert h.sched.counters.store_jobs_created == 3


def test_blocks_per_chunk_two_stores_whole_chunks_only(kind: str) -> None:
    """With two blocks a chunk, a step that computes one and a half chunks stores one; the
    half chunk follows with the step that completes it, entered at block index 2."""
    h = Harness(make_manager(kind), config(tokens_per_block=4, blocks_per_chunk=2))
    h.add("a", list(range(24)))
    h.admit("a")
    meta = h.step([h.schedule("a", 12)], new=["a"])
    (s1,) = meta.store_jobs.values()
    b = h.blocks["a"][0]
    assert _layout(s1) == ((b[0], b[1]), (2,), (0,))
    meta = h.step([h.schedule("a", 12)])
    ((j2, s2),) = meta.store_jobs.items()
    assert _layout(s2) == ((b[2], b[3], b[4], b[5]), (4,), (2,))
    assert h.sched.jobs[j2].keys == tuple(h.sched.request_keys("a")[0][1:3])


def test_max_offload_tokens_stores_up_to_exactly_its_value(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    _request(h, "a", 16, {"max_offload_tokens": 8})
    h.admit("a")
    keys: list[bytes] = []
    for step, n in enumerate([4, 4, 8]):
        meta = h.step([h.schedule("a", n)], new=["a"] if step == 0 else [])
        for job in meta.store_jobs:
            keys.extend(h.sched.jobs[job].keys)
            h.report([job])
    assert keys == list(h.sched.request_keys("a")[0][:2])  # tokens 0..7: two chunks
    assert h.sched.counters.invalid_transfer_params == 0


def test_zero_transfer_limits_are_valid_and_mean_nothing(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    h.report(list(prefill(h, "a")))
    b = _request(h, "b", 20, {"max_load_tokens": 0, "max_offload_tokens": 0})
    assert h.sched.get_num_new_matched_tokens(b, 0) == (0, False)  # would hit 16 otherwise
    h.sched.update_state_after_alloc(b, [h.alloc(5)], 0)
    meta = h.step([h.schedule("b", 20)], new=["b"])
    assert not meta.store_jobs
    c = h.sched.counters
    assert (c.invalid_transfer_params, c.lookup_hit_tokens, c.store_jobs_created) == (0, 0, 1)


def test_zero_offload_limit_stores_nothing_with_one_token_chunks(kind: str) -> None:
    """With one token a chunk, nothing to offload is still nothing: no chunk 0 is offered."""
    h = Harness(make_manager(kind), config(tokens_per_block=1))
    _request(h, "a", 4, {"max_offload_tokens": 0})
    h.admit("a")
    for step in range(2):
        meta = h.step([h.schedule("a", 2)], new=["a"] if step == 0 else [])
        assert not meta.store_jobs
    h.finish("a")
    assert not h.step(finished=["a"]).store_jobs
    assert h.sched.counters.store_jobs_created == 0


def test_final_store_never_includes_the_last_token() -> None:
    """The last token of a finished request is the sampled one, whose KV is never stored, even
    when the engine's view counts it computed: the final store ends one token short."""
    fake = RecordingManager(fail_prepare_store=True)
    h = Harness(fake, config())
    h.add("a", list(range(16)), prompt=12)
    h.admit("a")
    assert not h.step([h.schedule("a", 16)], new=["a"]).store_jobs  # the manager refused
    assert h.reqs["a"].num_computed_tokens == h.reqs["a"].num_tokens == 16
    fake.fail_prepare_store = False
    h.finish("a")
    (job,) = h.step(finished=["a"]).store_jobs
    assert h.sched.jobs[job].keys == h.sched.request_keys("a")[0][:3]  # tokens 0..11


class _Referenced(Request):
    """A request view that can be weakly referenced (no slots): to see who still holds it."""


def test_a_finished_request_object_is_not_held_until_its_final_stores() -> None:
    """The scheduler reads a finished request's view for the last time in request_finished:
    its record keeps a copy of the fields, so the engine's object is freed as soon as the
    engine drops it (by reference counting: no cycle either), and the final store built in the
    next step is the one the live view gives."""
    fake = RecordingManager(fail_prepare_store=True)
    h = Harness(fake, config())
    tokens = list(range(16))
    req = _Referenced(
        "a", num_prompt_tokens=12, num_tokens=16, block_hashes=chain_hashes(tokens, h.tph)
    )
    h.reqs["a"] = req
    h.sched.on_new_request(req)
    h.admit("a")
    assert not h.step([h.schedule("a", 16)], new=["a"]).store_jobs  # the manager refused
    fake.fail_prepare_store = False
    h.finish("a")
    gone = weakref.ref(req)
    del h.reqs["a"], req
    assert gone() is None
    assert h.sched.request_state("a") == "finished_pending_final"
    (job,) = h.step(finished=["a"]).store_jobs
    assert h.sched.jobs[job].keys == h.sched.request_keys("a")[0][:3]  # tokens 0..11


def test_allocation_must_hold_the_locally_computed_tokens(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(16)))
    assert h.sched.get_num_new_matched_tokens(a, 8) == (0, False)  # 8 tokens computed locally
    with pytest.raises(MetadataError, match="cannot hold the 8 locally computed tokens"):
        h.sched.update_state_after_alloc(a, [h.alloc(1)], 0)
    h.sched.update_state_after_alloc(a, [h.alloc(2)], 0)  # exactly enough: accepted
    h.sched.get_num_new_matched_tokens(a, 9)
    with pytest.raises(MetadataError):
        h.sched.update_state_after_alloc(a, [h.alloc(2)], 0)  # 9 tokens need 3 blocks
    h.sched.update_state_after_alloc(a, [h.alloc(3)], 0)


def test_engine_keeps_stepping_while_any_work_is_pending(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    assert not h.sched.has_pending_push_work()
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")
    assert h.sched.has_pending_push_work()  # a job in flight
    h.report([job])
    assert not h.sched.has_pending_push_work()
    h.finish("a")
    assert h.sched.has_pending_push_work()  # a finish to signal to the manager
    h.step(finished=["a"])
    assert not h.sched.has_pending_push_work()


def test_a_flush_not_yet_sent_keeps_the_engine_stepping(kind: str) -> None:
    """A reset with a store in flight and no request left: the flushed store may still be
    running on the workers, and the flush reaches them only with a step's metadata, so the
    engine steps once more to send it (the CPU tier's quarantine clock then moves on); the
    reports of the flushed store are not waited for."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")
    h.finish("a")
    h.step(finished=["a"])
    h.sched.reset_cache()
    assert not h.sched.jobs and not h.sched.requests
    assert h.sched.has_pending_push_work()
    assert h.step().jobs_to_flush == frozenset({job})
    assert not h.sched.has_pending_push_work()


def test_manager_work_alone_keeps_the_engine_stepping() -> None:
    tier = MemoryTier()
    manager = TieringOffloadingManager(CPUOffloadingManager(8), [tier])
    h = Harness(manager, config())
    b = h.add("b", list(range(8)))
    keys = h.sched.request_keys("b")  # no keys before a lookup
    assert keys == ((),)
    h.sched.get_num_new_matched_tokens(b, 0)
    first = h.sched.request_keys("b")[0][0]
    tier.put(first)
    assert not h.sched.has_pending_push_work()
    assert manager.lookup(first, ReqContext("x")) is LookupResult.HIT_PENDING  # queued
    assert h.sched.has_pending_push_work()
    assert not h.sched.jobs


def test_sliding_window_chunk_with_a_null_block_is_not_stored(kind: str) -> None:
    """Two blocks a chunk: a sliding-window chunk is stored only when none of its blocks is
    the null block, whichever of its blocks that is."""
    h = Harness(make_manager(kind), config(tokens_per_block=4, blocks_per_chunk=2, sliding=8))
    h.add("a", list(range(24)))
    h.admit("a")
    full = h.alloc(6)
    x, y, z = h.alloc(3)
    swa = (0, 0, x, y, 0, z)  # chunk 0 out of the window; chunk 2's first block is null
    meta = h.step([ScheduledRequest("a", (tuple(full), swa), 24)], new=["a"])
    ((job, store),) = meta.store_jobs.items()
    assert _layout(store) == ((*full, x, y), (6, 2), (0, 2))
    keys = h.sched.request_keys("a")
    assert h.sched.jobs[job].keys == (*keys[0], keys[1][1])


def test_a_group_with_no_chunk_in_a_store_has_no_blocks_in_its_layout(kind: str) -> None:
    """Groups with different block sizes complete chunks in different steps: a store that
    holds a chunk of one group only lists 0 blocks (at index 0) for the other."""
    cfg = SchedulerConfig(groups=(GroupConfig(4), GroupConfig(8)))
    h = Harness(make_manager(kind), cfg)
    h.add("a", list(range(16)))
    h.admit("a")
    ((job, store),) = h.step([h.schedule("a", 4)], new=["a"]).store_jobs.items()
    (b0,), (c0,) = h.blocks["a"]
    assert _layout(store) == ((b0,), (1, 0), (0, 0))
    assert h.sched.jobs[job].keys == (h.sched.request_keys("a")[0][0],)
    h.report([job])
    ((job, store),) = h.step([h.schedule("a", 4)]).store_jobs.items()
    assert _layout(store) == ((h.blocks["a"][0][1], c0), (1, 1), (1, 0))


def test_released_request_leaves_other_holders_of_a_window_block_indexed(kind: str) -> None:
    """Two requests list the same sliding-window block from the same step on (a shared
    prefix); the first one is released. When the engine hands the block out again, the second
    one's position is still known and zeroed, so its later store never reads the block
    (INV-SRC-VALID)."""
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("a", list(range(16)))
    h.add("b", list(range(50, 74)))
    h.admit("a")
    h.admit("b")
    sa = h.alloc(4)
    shared = sa[3]
    sb = (*h.alloc(3), shared, *h.alloc(2))  # b lists a's last sliding-window block too
    meta = h.step(
        [
            ScheduledRequest("a", (tuple(h.alloc(4)), tuple(sa)), 16),
            ScheduledRequest("b", (tuple(h.alloc(6)), sb), 4),
        ],
        new=["a", "b"],
    )
    h.report(list(meta.store_jobs))
    h.finish("a")
    h.step(finished=["a"])
    assert "a" not in h.sched.requests
    meta = h.step([ScheduledRequest("b", ((), ()), 20)], extra_allocated=[shared])
    assert h.sched.requests["b"].groups[1].block_ids == [*sb[:3], 0, *sb[4:]]
    ((job, store),) = meta.store_jobs.items()
    assert shared not in store.src.block_ids  # type: ignore[attr-defined]
    keys = h.sched.request_keys("b")
    assert h.sched.jobs[job].keys == (*keys[0][1:6], *keys[1][1:3], *keys[1][4:6])


def test_handing_out_a_block_a_request_listed_before_its_preemption_spares_its_new_list(
    kind: str,
) -> None:
    """A preempted request resumes with new blocks; when the engine hands out one of its old
    sliding-window blocks, the new block at that position stays (only a position still
    holding the handed-out block is stale) and its chunk is stored."""
    h = Harness(make_manager(kind), config(sliding=8))
    a = h.add("a", list(range(16)))
    h.admit("a")
    old = (h.alloc(4), h.alloc(4))
    meta = h.step([ScheduledRequest("a", (tuple(old[0]), tuple(old[1])), 4)], new=["a"])
    h.report(list(meta.store_jobs))
    h.step(preempted=["a"])
    a.num_computed_tokens = 0
    new = (h.alloc(3), h.alloc(3))  # one block shorter than the old lists
    resumed = ScheduledRequest("a", (tuple(new[0]), tuple(new[1])), 4, True)
    h.report(list(h.step([resumed], extra_allocated=[old[1][3]]).store_jobs))
    more = (h.alloc(1), h.alloc(1))
    new[0].extend(more[0])
    new[1].extend(more[1])
    meta = h.step(
        [ScheduledRequest("a", (tuple(more[0]), tuple(more[1])), 12)], extra_allocated=[old[1][2]]
    )
    assert h.sched.requests["a"].groups[1].block_ids == new[1]
    ((job, store),) = meta.store_jobs.items()
    assert store.src.block_ids == (*new[0][1:], *new[1][1:])  # type: ignore[attr-defined]
    keys = h.sched.request_keys("a")
    assert h.sched.jobs[job].keys == (*keys[0][1:], *keys[1][1:])


def test_window_index_forgets_dropped_lists_and_released_requests(kind: str) -> None:
    """The sliding-window index names only positions a tracked request lists now: a
    preemption's dropped lists leave it at once, a resumed request's new list replaces them,
    and a released request leaves nothing behind (before, those entries stayed until the
    engine handed the block out again)."""
    h = Harness(make_manager(kind), config(sliding=8))
    a = h.add("a", list(range(16)))
    h.admit("a")
    old = (h.alloc(4), h.alloc(4))
    meta = h.step([ScheduledRequest("a", (tuple(old[0]), tuple(old[1])), 4)], new=["a"])
    gs = h.sched.requests["a"].groups[1]
    assert {b: [p for _, p in held] for b, held in h.sched.window_index.items()} == {
        b: [i] for i, b in enumerate(old[1])
    }
    h.report(list(meta.store_jobs))
    h.step(preempted=["a"])
    assert dict(h.sched.window_index) == {}
    a.num_computed_tokens = 0
    new = (h.alloc(3), h.alloc(3))
    h.report(
        list(h.step([ScheduledRequest("a", (tuple(new[0]), tuple(new[1])), 4, True)]).store_jobs)
    )
    assert {b: held for b, held in h.sched.window_index.items()} == {
        b: [(gs, i)] for i, b in enumerate(new[1])
    }
    h.finish("a")
    h.step(finished=["a"])
    assert "a" not in h.sched.requests and dict(h.sched.window_index) == {}


def test_long_request_without_limits_stores_every_chunk(kind: str) -> None:
    """No transfer limit and no prompt-only rule: a long request stores all its chunks,
    however far they lie (a 4096-token request, chunk by chunk in 512-token steps)."""
    h = Harness(make_manager(kind, capacity=2048), config())
    h.add("a", list(range(4096)))
    h.admit("a")
    stored: list[bytes] = []
    for step in range(8):
        meta = h.step([h.schedule("a", 512)], new=["a"] if step == 0 else [])
        for job in meta.store_jobs:
            stored.extend(h.sched.jobs[job].keys)
            h.report([job])
    assert stored == list(h.sched.request_keys("a")[0])
    assert len(stored) == 1024


@pytest.mark.parametrize("prompt_only", [False, True])
def test_decode_step_that_completes_a_chunk_stores_it_at_once(kind: str, prompt_only: bool) -> None:
    """Prompt of 8 tokens, then decode: the step that computes the KV of token 11 completes
    chunk 2, which is stored in that very step, unless only the prompt is offloaded."""
    h = Harness(make_manager(kind), config(offload_prompt_only=prompt_only))
    tokens = list(range(100, 108))
    a = h.add("a", tokens)
    h.report(list(prefill(h, "a")))
    stored: list[int] = []
    for step in range(4):  # computes tokens 8, 9, 10, 11
        tokens.append(step)
        a.num_tokens = len(tokens)
        a.block_hashes = chain_hashes(tokens, 4)
        meta = h.step([h.schedule("a", 1)])
        stored.extend(step for _ in meta.store_jobs)
        h.report(list(meta.store_jobs))
    assert stored == ([] if prompt_only else [3])


@pytest.mark.parametrize("bad", [[1, -1], [-2], [1, 2.5], [2.0]])
def test_allocation_with_a_negative_or_float_block_id_is_refused(
    kind: str, bad: list[object]
) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(16)))
    assert h.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    with pytest.raises(InvalidMetadataError, match="block_ids"):
        h.sched.update_state_after_alloc(a, [bad], 0)
    assert h.sched.requests["a"].admitted is None  # nothing recorded
    h.sched.update_state_after_alloc(a, [[1, True]], 0)  # a bool is the int it equals
    assert h.sched.requests["a"].admitted == ((1, True),)


def test_allocation_before_any_lookup_assumes_nothing_computed(kind: str) -> None:
    """A tracked request that was never looked up has no locally computed tokens: an
    allocation of no blocks is accepted, and its first scheduling stores from chunk 0."""
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(8)))
    h.sched.update_state_after_alloc(a, [[]], 0)
    assert h.sched.requests["a"].num_local_computed == 0
    h.sched.get_num_new_matched_tokens(a, 0)  # the keys
    meta = h.step([h.schedule("a", 8)], new=["a"])
    ((job, _),) = meta.store_jobs.items()
    assert h.sched.jobs[job].keys == h.sched.request_keys("a")[0]


def test_request_level_store_without_an_allocation_starts_at_chunk_0() -> None:
    """A request scheduled without an allocation hook (its lists come with the scheduling)
    offers its chunks from chunk 0, in order, each once (request-level policy: nothing is
    skipped)."""
    fake = RecordingManager(policy=OffloadPolicy.REQUEST_LEVEL)
    h = Harness(fake, config())
    a = h.add("a", list(range(16)))
    h.sched.get_num_new_matched_tokens(a, 0)
    h.step([ScheduledRequest("a", (tuple(h.alloc(2)),), 8)], new=["a"])
    keys = h.sched.request_keys("a")[0]
    assert [c.keys for c in fake.methods("prepare_store")] == [tuple(keys[:2])]


def test_request_of_one_chunk_stores_and_hits_it(kind: str) -> None:
    """The smallest request that has a key: one block hash, one chunk."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(4)))
    (job,) = prefill(h, "a")
    assert len(h.sched.jobs[job].keys) == 1
    h.report([job])
    b = h.add("b", list(range(4)) + [9])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (4, True)


def test_chunk_level_policy_never_offers_the_loaded_chunks_again() -> None:
    fake = RecordingManager()  # chunk-level
    h = Harness(fake, config())
    h.add("a", list(range(8)))
    h.report(list(prefill(h, "a")))
    h.add("b", list(range(12)) + [1])
    assert h.admit("b") == (8, True)
    (load,) = h.step().load_jobs
    h.report([load])
    h.reqs["b"].num_computed_tokens = 8
    h.step([h.schedule("b", 5)])
    offered = [c.keys for c in fake.methods("prepare_store") if c.req_id == "b"]
    assert offered == [(h.sched.request_keys("b")[0][2],)]  # chunk 2 only, never 0 and 1


def test_a_load_of_part_of_a_chunk_into_null_window_blocks_loads_no_window_key(
    kind: str,
) -> None:
    """Two blocks a chunk, 12 of a 16-token hit taken (the engine may take less than the
    hit): the full-attention group loads its two chunks; the sliding-window group, whose
    three blocks are all null, loads nothing, not even the key of its half chunk."""
    h = Harness(make_manager(kind), config(tokens_per_block=4, blocks_per_chunk=2, sliding=8))
    h.add("a", list(range(16)))
    h.report(list(prefill(h, "a")))
    b = h.add("b", list(range(16)) + [5, 5, 5, 5])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (16, True)
    full = h.alloc(3)
    h.sched.update_state_after_alloc(b, [full, [0, 0, 0]], 12)
    ((job, load),) = h.step().load_jobs.items()
    assert h.sched.jobs[job].keys == tuple(h.sched.request_keys("b")[0][:2])
    assert list(load.dst.block_ids) == full  # type: ignore[attr-defined]


def test_load_into_an_all_null_sliding_window_list_writes_no_sliding_block(kind: str) -> None:
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("a", list(range(32)))
    h.report(list(prefill(h, "a")))
    b = h.add("b", list(range(32)) + [3, 3, 3, 3])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (32, True)
    full = h.alloc(8)
    h.sched.update_state_after_alloc(b, [full, [0] * 8], 32)
    (load,) = h.step().load_jobs.values()
    dst = load.dst  # type: ignore[attr-defined]
    assert (list(dst.block_ids), dst.group_sizes) == (full, (8, 0))


def test_a_resumed_streaming_session_offers_only_its_new_chunks() -> None:
    """A streaming session's next input chunk: the engine keeps the session's blocks, looks
    nothing up (its tokens are computed), allocates for the new input and schedules it as a
    new request with its complete lists. The chunks stored from the kept blocks stay stored:
    the session offers its new chunks only (vLLM's connector keeps its store index there)."""
    fake = RecordingManager()
    h = Harness(fake, config())
    prompt = list(range(8))
    s = h.add("s", prompt)
    h.report(list(prefill(h, "s")))  # chunks 0 and 1
    # one sampled token computed, then the turn stops (its last sampled token is dropped)
    s.num_tokens = 9
    h.report(list(h.step([h.schedule("s", 1)]).store_jobs))
    assert s.num_computed_tokens == 9
    # the next input chunk: 12 tokens; the lists grow, the kept blocks stay
    tokens = [*prompt, 100, *range(200, 212)]
    s.num_tokens = s.num_prompt_tokens = len(tokens)
    s.block_hashes = chain_hashes(tokens, h.tph)
    kept = h.blocks["s"][0]
    lists = [kept + h.alloc(h.blocks_for(len(tokens)) - len(kept))]
    h.sched.update_state_after_alloc(s, lists, 0)
    meta = h.step([ScheduledRequest("s", (tuple(lists[0]),), 12, False)], new=["s"])
    ((job, store),) = meta.store_jobs.items()
    keys = h.sched.request_keys("s")[0]
    assert h.sched.jobs[job].keys == tuple(keys[2:5])
    assert _layout(store) == (tuple(lists[0][2:5]), (3,), (2,))
    offered = [c.keys for c in fake.methods("prepare_store")]
    assert offered == [tuple(keys[:2]), tuple(keys[2:5])]

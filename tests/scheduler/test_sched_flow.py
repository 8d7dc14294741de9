"""OffloadingScheduler: API, configuration, lookups, loads and stores (issue items 1-4).

Every test runs against the recording fake and against the real CPU manager, with the
scheduler in checked mode (invariants after every call) and the lifecycles in checked mode
(the real python-statemachine machines beside the compiled tables).
"""

from __future__ import annotations

import pytest
from sched_harness import Harness, admit_with_load, config, make_manager, offloaded, prefill

from statecore import (
    ConfigError,
    GroupConfig,
    LifecycleError,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
    SchedulerConfig,
    make_offload_key,
)
from statecore.specs.fakes import Call, RecordingManager


def seed(h: Harness, keys: list[bytes]) -> None:
    """Make ``keys`` present and ready in the manager."""
    ctx = ReqContext("seed")
    out = h.manager.prepare_store(keys, ctx)  # type: ignore[arg-type]
    assert out is not None
    h.manager.complete_store(list(out.keys_to_store), ctx)


def keys_of(h: Harness, rid: str, group: int = 0) -> list[bytes]:
    return list(h.sched.requests[rid].groups[group].keys)


# -- 1. API --------------------------------------------------------------------------------------


def test_store_then_load_roundtrip(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(17)))
    stores = prefill(h, "a")
    assert len(stores) == 1
    (job_id,) = stores
    assert len(h.sched.jobs[job_id].keys) == 4  # 17 tokens = 4 whole chunks of 4
    h.report([job_id])
    assert h.sched.request_state("a") == "no_transfer"
    h.add("b", list(range(16)) + [99, 98, 97, 96])
    hits, is_async = h.admit("b")
    assert (hits, is_async) == (16, True)
    assert h.sched.request_state("b") == "loading"
    meta = h.step()
    (load_id,) = meta.load_jobs
    job = meta.load_jobs[load_id]
    assert job.req_id == "b" and len(job.dst.block_ids) == 4  # type: ignore[attr-defined]
    result = h.report([load_id])
    assert result.finished_loads == {"b"} and not result.invalid_block_ids
    assert h.sched.request_state("b") == "no_transfer"


def test_quorum_spans_workers_and_steps(kind: str) -> None:
    h = Harness(make_manager(kind), config(workers=3))
    h.add("a", list(range(8)))
    (job_id,) = prefill(h, "a")
    h.report([job_id], workers=1)
    assert h.sched.jobs[job_id].pending == 2
    h.report([job_id], workers=2)
    assert job_id not in h.sched.jobs
    assert h.sched.counters.jobs_completed == 1


# -- 2. configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"groups": ()}, "at least one"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk"),
        ({"num_workers": 0}, "num_workers"),
        ({"max_recompute_pending_tokens": -1}, "max_recompute_pending_tokens"),
        ({"stall_timeout_s": 0}, "stall_timeout_s"),
        ({"stall_check_interval_s": 400.0}, "stall_check_interval_s"),
        ({"groups": (GroupConfig(16),), "tokens_per_hash": 5}, "multiple of tokens_per_hash"),
    ],
)
def test_config_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [({"tokens_per_block": 0}, "tokens_per_block"), ({"sliding_window": 0}, "sliding_window")],
)
def test_group_config_validation(kwargs: dict[str, int], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        GroupConfig(**{"tokens_per_block": 16, **kwargs})


def test_config_derived_sizes() -> None:
    cfg = SchedulerConfig(
        groups=(GroupConfig(16), GroupConfig(32, sliding_window=100)), blocks_per_chunk=2
    )
    assert cfg.hash_tokens == 16
    assert cfg.tokens_per_chunk(1) == 64 and cfg.hashes_per_chunk(1) == 4
    assert cfg.window_chunks(0) is None and cfg.window_chunks(1) == 2


# -- 3. lookup -----------------------------------------------------------------------------------


def test_lookup_maximal_prefix_stops_at_miss(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("b", list(range(24)))
    keys = keys_of(h, "b") or None
    h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)  # grows keys
    keys = keys_of(h, "b")
    seed(h, [keys[0], keys[1], keys[3]])  # chunk 2 missing
    assert h.admit("b") == (8, True)


def _scripted(
    seeded: int, scripted: LookupResult, **cfg: object
) -> tuple[Harness, RecordingManager, list[bytes]]:
    """Request "b" (6 chunks) whose first ``seeded`` chunks are ready and whose next chunk
    answers ``scripted``."""
    fake = RecordingManager()
    h = Harness(fake, config(**cfg))  # type: ignore[arg-type]
    h.add("b", list(range(24)))
    h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)
    keys = keys_of(h, "b")
    seed(h, keys[:seeded])
    fake.lookup_override[keys[seeded]] = scripted
    return h, fake, keys


def test_lookup_pending_run_defers_or_is_recomputed(kind: str) -> None:
    h, _, _ = _scripted(2, LookupResult.HIT_PENDING)
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (None, False)
    # a budget of one chunk: the pending chunk is recomputed instead of waited for
    h2, _, _ = _scripted(2, LookupResult.HIT_PENDING, max_recompute_pending_tokens=4)
    assert h2.sched.get_num_new_matched_tokens(h2.reqs["b"], 0) == (8, True)


def test_lookup_retry_defers_and_counts(kind: str) -> None:
    h, fake, keys = _scripted(1, LookupResult.RETRY)
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (None, False)
    assert h.sched.requests["b"].deferred_since == 0.0
    del fake.lookup_override[keys[1]]
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (4, True)
    assert h.sched.requests["b"].deferred_since is None


def test_lookup_defers_while_another_request_loads_the_chunks(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    h.add("b", list(range(16)) + [7, 7, 7, 7])
    h.add("c", list(range(16)) + [8, 8, 8, 8])
    assert h.admit("b") == (16, True)
    assert h.sched.get_num_new_matched_tokens(h.reqs["c"], 0) == (None, False)
    (load,) = h.step().load_jobs
    h.report([load])
    assert h.sched.get_num_new_matched_tokens(h.reqs["c"], 0) == (16, True)


def test_lookup_without_prefix_caching_does_not_defer(kind: str) -> None:
    h = Harness(make_manager(kind), config(enable_prefix_caching=False))
    offloaded(h, "a", list(range(16)))
    h.add("b", list(range(16)) + [7])
    h.add("c", list(range(16)) + [8])
    assert h.admit("b") == (16, True)
    assert h.admit("c") == (16, True)


def test_lookup_respects_max_load_tokens_and_skip_flag(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    b = h.add("b", list(range(16)) + [1])
    b.kv_transfer_params = {"max_load_tokens": 6}
    h.sched.requests["b"].max_load_tokens = 6
    assert h.sched.get_num_new_matched_tokens(b, 0) == (4, True)
    c = h.add("c", list(range(16)) + [2])
    c.skip_reading_prefix_cache = True
    assert h.sched.get_num_new_matched_tokens(c, 0) == (0, False)
    d = h.add("d", list(range(16)) + [3])
    assert h.sched.get_num_new_matched_tokens(d, 0, max_num_new_tokens=9) == (8, True)
    assert h.sched.get_num_new_matched_tokens(d, 4) == (12, True)  # local prefix counted


def test_transfer_params_parsed_strictly(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    r = h.add("x", list(range(8)))
    assert h.sched.requests["x"].max_load_tokens is None
    from statecore import Request

    bad = Request("y", 8, 8, kv_transfer_params={"max_load_tokens": True, "max_offload_tokens": -1})
    h.sched.on_new_request(bad)
    assert h.sched.counters.invalid_transfer_params == 2
    good = Request("z", 8, 8, kv_transfer_params={"max_offload_tokens": 4})
    h.sched.on_new_request(good)
    assert h.sched.requests["z"].max_offload_tokens == 4
    assert r.request_id == "x"


def test_sliding_window_lookup_converges_across_groups(kind: str) -> None:
    h = Harness(make_manager(kind), config(sliding=8))  # window = 2 chunks
    h.add("b", list(range(21)))
    h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)
    full, swa = keys_of(h, "b", 0), keys_of(h, "b", 1)
    seed(h, full[:5])
    seed(h, [swa[1], swa[2]])  # the rightmost complete window ends at chunk 3
    # full attention hits 5 chunks (capped to 4 by num_tokens - 1 = 20 -> 5 chunks... the
    # window of 2 chunks ending at chunk 3 wins: 12 tokens, then full attention agrees
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (12, True)


def test_sliding_window_lookup_prefix_fallback(kind: str) -> None:
    h = Harness(make_manager(kind), config(sliding=8))
    h.add("b", list(range(21)))
    h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)
    full, swa = keys_of(h, "b", 0), keys_of(h, "b", 1)
    seed(h, full[:5])
    seed(h, [swa[0]])  # only a leading run shorter than the window
    assert h.sched.get_num_new_matched_tokens(h.reqs["b"], 0) == (4, True)


def test_groups_of_different_chunk_sizes_cover_the_hit_with_the_chunks_that_hold_it(
    kind: str,
) -> None:
    """Two full-attention groups of 12- and 16-token blocks (4-token hashes): every chunk is
    stored, so group 0 hits 84 tokens (7 chunks) and group 1 80 (5 chunks). The hit is 80
    tokens: group 0 loads the 7 chunks that hold them, its last one partly (as vLLM's
    connector answers), not only the 6 chunks below 80 (which would lower the hit to a
    boundary common to both groups, 48 tokens)."""
    cfg = SchedulerConfig(groups=(GroupConfig(12), GroupConfig(16)), tokens_per_hash=4)
    h = Harness(make_manager(kind), cfg)
    offloaded(h, "a", [7] * 96)
    h.add("b", [7] * 85)
    assert h.admit("b") == (80, True)
    ((job, load),) = h.step().load_jobs.items()
    assert h.sched.jobs[job].keys == (*keys_of(h, "b", 0)[:7], *keys_of(h, "b", 1)[:5])
    assert load.dst.group_sizes == (7, 5)  # type: ignore[attr-defined]
    assert load.dst.block_indices == (0, 0)  # type: ignore[attr-defined]


def test_groups_of_different_chunk_sizes_after_a_local_prefix(kind: str) -> None:
    """The same two groups, 48 tokens computed locally (4 and 3 blocks): the hit goes on to
    80 tokens, group 0 loading its blocks 4 to 6 and group 1 its blocks 3 and 4."""
    cfg = SchedulerConfig(groups=(GroupConfig(12), GroupConfig(16)), tokens_per_hash=4)
    h = Harness(make_manager(kind), cfg)
    offloaded(h, "a", [7] * 96)
    h.add("b", [7] * 85)
    assert h.admit("b", num_computed=48) == (32, True)
    (load,) = h.step().load_jobs.values()
    assert load.dst.group_sizes == (3, 2)  # type: ignore[attr-defined]
    assert load.dst.block_indices == (4, 3)  # type: ignore[attr-defined]


# -- 4. loads and stores -------------------------------------------------------------------------


def test_load_job_layout_with_local_prefix_and_sub_block_skip(kind: str) -> None:
    h = Harness(make_manager(kind), config(tokens_per_block=4, blocks_per_chunk=2))
    offloaded(h, "a", list(range(24)))
    h.add("b", list(range(24)) + [5])
    # 4 tokens computed locally (one GPU block): the first chunk is entered at sub-block 1
    assert h.admit("b", num_computed=4) == (20, True)
    (load,) = h.step().load_jobs.values()
    assert load.dst.block_indices == (1,)  # type: ignore[attr-defined]
    assert load.dst.group_sizes == (5,)  # type: ignore[attr-defined]
    assert len(load.src.slots) == 3  # type: ignore[attr-defined]


def _decode_then_finish(total_tokens: int) -> tuple[RecordingManager, list[bytes]]:
    """Prompt of 8 tokens, decode until the request holds ``total_tokens``, finish it."""
    from sched_harness import chain_hashes

    fake = RecordingManager()
    h = Harness(fake, config())
    tokens = list(range(100, 108))
    a = h.add("a", tokens)
    prefill(h, "a")
    tokens.append(0)  # the token sampled by the prefill
    while True:
        a.num_tokens = len(tokens)
        a.block_hashes = chain_hashes(tokens, 4)
        if len(tokens) == total_tokens:
            break
        h.step([h.schedule("a", 1)])  # computes the KV of the last sampled token
        tokens.append(len(tokens))  # and samples the next one
    h.finish("a")
    keys = keys_of(h, "a")  # final hashes are read at finish
    h.step(finished=["a"])
    return fake, keys


def test_final_sampled_token_never_stored() -> None:
    # 12 tokens: the 12th (sampled last) has no KV, so chunk 2 (tokens 8..11) is not stored
    fake, keys = _decode_then_finish(12)
    offered = {k for c in fake.methods("prepare_store") for k in c.keys}
    assert len(keys) == 3 and keys[:2] == [k for k in keys if k in offered]
    assert keys[2] not in offered
    # 13 tokens: tokens 8..11 all have KV now, so chunk 2 is stored at finish
    fake, keys = _decode_then_finish(13)
    offered = {k for c in fake.methods("prepare_store") for k in c.keys}
    assert keys[2] in offered


def test_aborted_request_stores_computed_tokens_only(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    a = h.add("a", list(range(16)))
    h.admit("a")
    h.step([h.schedule("a", 5)], new=["a"])  # chunked prefill: 5 of 16 tokens
    jobs_before = set(h.sched.jobs)
    a.is_aborted = True
    h.finish("a")
    h.step(finished=["a"])
    new_jobs = [h.sched.jobs[j] for j in set(h.sched.jobs) - jobs_before]
    stored = sum(len(j.keys) for j in h.sched.jobs.values())
    assert stored == 1  # only the one whole computed chunk
    assert not new_jobs


def test_prompt_only_and_max_offload_tokens(kind: str) -> None:
    h = Harness(make_manager(kind), config(offload_prompt_only=True))
    a = h.add("a", list(range(16)), prompt=8)
    a.num_computed_tokens = 0
    stores = prefill(h, "a", tokens=16)
    assert sum(len(h.sched.jobs[j].keys) for j in stores) == 2
    h2 = Harness(make_manager(kind), config())
    b = h2.add("b", list(range(16)))
    b.kv_transfer_params = {"max_offload_tokens": 4}
    h2.sched.requests["b"].max_offload_tokens = 4
    stores = prefill(h2, "b")
    assert sum(len(h2.sched.jobs[j].keys) for j in stores) == 1


def test_request_level_policy_reoffers_hits() -> None:
    fake = RecordingManager(policy=OffloadPolicy.REQUEST_LEVEL)
    h = Harness(fake, config())
    offloaded(h, "a", list(range(8)))
    load = admit_with_load(h, "b", list(range(12)) + [1], 8)
    h.report([load])
    h.reqs["b"].num_computed_tokens = 8
    h.step([h.schedule("b", 5)])
    offered = [c.keys for c in fake.methods("prepare_store") if c.req_id == "b"]
    assert offered and len(offered[-1]) == 3  # the two hit chunks are offered again


def test_chunk_level_policy_skips_hits(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(8)))
    load = admit_with_load(h, "b", list(range(12)) + [1], 8)
    h.report([load])
    h.reqs["b"].num_computed_tokens = 8
    stores = h.step([h.schedule("b", 5)]).store_jobs
    assert [len(h.sched.jobs[j].keys) for j in stores] == [1]


class _FailFor(RecordingManager):
    def __init__(self, fail_req: str) -> None:
        super().__init__()
        self.fail_req = fail_req
        self.failing = False

    def prepare_store(self, keys, ctx):  # type: ignore[no-untyped-def]
        if ctx.req_id == self.fail_req and self.failing:
            return None
        return super().prepare_store(keys, ctx)


def test_failed_prepare_store_is_retried_without_skipping_others() -> None:
    fake = _FailFor("a")
    h = Harness(fake, config())
    h.add("a", list(range(8)))
    h.add("b", list(range(100, 108)))
    h.admit("a")
    h.admit("b")
    fake.failing = True
    meta = h.step([h.schedule("a", 8), h.schedule("b", 8)], new=["a", "b"])
    assert [j.req_id for j in meta.store_jobs.values()] == ["b"]
    assert h.sched.counters.allocation_failures == 1
    assert h.sched.requests["a"].groups[0].cursor == 0
    fake.failing = False
    meta = h.step([h.schedule("a", 0)])
    assert [j.req_id for j in meta.store_jobs.values()] == ["a"]


def test_one_load_or_many_stores_is_a_guard(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    (job,) = prefill(h, "a")
    # a lookup while stores are in flight defers instead of asserting
    assert h.sched.get_num_new_matched_tokens(h.reqs["a"], 0) == (None, False)
    # an engine that ignores the deferral gets a typed error and nothing changes
    with pytest.raises(LifecycleError) as err:
        h.sched.update_state_after_alloc(h.reqs["a"], [[1, 2, 3, 4]], 8)
    assert err.value.entity == "request" and err.value.state == "storing"
    assert err.value.event == "alloc_load"
    assert set(h.sched.jobs) == {job}


def test_stores_wait_while_loading(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    b = h.add("b", list(range(16)) + [4, 4, 4, 4, 4])
    assert h.admit("b") == (16, True)
    # even if the engine scheduled it, no store is built while its load is in flight
    b.num_computed_tokens = 16
    meta = h.step([h.schedule("b", 5)])
    assert not meta.store_jobs and len(meta.load_jobs) == 1


def test_offload_key_format() -> None:
    k = make_offload_key(b"\x01\x02", 7)
    assert k == b"\x01\x02\x00\x00\x00\x07"


def test_finished_request_never_stores_more_than_it_computed(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    h.admit("a")
    h.step([h.schedule("a", 5)], new=["a"])  # 5 of 16 prompt tokens computed
    h.finish("a")  # finished (not aborted) mid-prefill, e.g. by the engine's stop logic
    h.step(finished=["a"])
    assert sum(len(j.keys) for j in h.sched.jobs.values()) == 1


class _StepOrderManager(RecordingManager):
    """Records ``on_schedule_end`` and ``on_request_finished`` beside the recorded calls."""

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.calls.append(Call("on_schedule_end"))

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.calls.append(Call("on_request_finished", ctx.req_id))


@pytest.mark.parametrize("last", [False, True])
def test_on_schedule_end_comes_where_the_manager_asks(last: bool) -> None:
    """statecore's order calls ``on_schedule_end`` before the step's store jobs are built; a
    manager with ``schedule_end_last`` (vLLM 0.33's contract, which vLLM's managers behind
    the out-of-tree-spec path follow) gets it after every other call of the step, the store
    preparations and ``on_request_finished`` included."""
    fake = _StepOrderManager()
    fake.schedule_end_last = last
    h = Harness(fake, config())
    h.add("b", list(range(100, 108)))
    h.report(list(prefill(h, "b")))
    h.finish("b")  # b's finish is signalled in the next step
    h.add("a", list(range(8)))
    h.admit("a")
    fake.calls.clear()
    h.step([h.schedule("a", 8)], new=["a"], finished=["b"])  # a's prompt is stored
    names = [c.method for c in fake.calls]
    assert {"prepare_store", "on_request_finished"} <= set(names)
    assert names.count("on_schedule_end") == 1
    if last:
        assert names[-1] == "on_schedule_end"
    else:
        assert names.index("on_schedule_end") < names.index("prepare_store")


def test_lookup_observer_sees_every_answer_of_a_lookup(kind: str) -> None:
    """The scheduler's ``lookup_observer`` hears each request's keys and the manager's
    answers as a lookup asks them (the vLLM adapter records KV-event payloads of hits)."""
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(17)))
    (store_id,) = prefill(h, "a")
    h.report([store_id])
    heard: list[tuple[str, list[bytes], list[LookupResult]]] = []
    h.sched.lookup_observer = lambda rid, keys, results: heard.append(
        (rid, list(keys), [LookupResult(r) for r in results])
    )
    h.add("b", list(range(8)) + [99] * 9)
    hits, _ = h.admit("b")
    assert hits == 8
    (rid, keys, results) = heard[0]
    assert rid == "b" and keys[:2] == keys_of(h, "b")[:2]
    assert results[:2] == [LookupResult.HIT, LookupResult.HIT]
    assert LookupResult.MISS in results

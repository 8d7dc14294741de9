"""TieringOffloadingManager with in-memory secondary tiers."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
)
from statecore.managers import (
    CPUOffloadingManager,
    JobResult,
    MemoryTier,
    TieringOffloadingManager,
)
from statecore.pool import CPUPool

END = ScheduleEndContext()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def stack(
    slots: int = 4, *tiers: MemoryTier
) -> tuple[TieringOffloadingManager, CPUOffloadingManager]:
    primary = CPUOffloadingManager(slots)
    return TieringOffloadingManager(primary, list(tiers)), primary


def store(m: TieringOffloadingManager, ctx: ReqContext, *ids: int, success: bool = True) -> None:
    out = m.prepare_store([k(i) for i in ids], ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx, success)


def settle(m: TieringOffloadingManager) -> None:
    """End two scheduler steps: the tiers are polled at most once per step, so by then every
    cascade or promotion an immediate tier ran has been submitted and its result collected."""
    m.on_schedule_end(END)
    m.on_schedule_end(END)


def test_cascade_pins_primary_until_each_tier_reports() -> None:
    pool = CPUPool(4, [8])
    a, b = MemoryTier(pool, hold=True, name="a"), MemoryTier(pool, hold=True, name="b")
    m, primary = stack(4, a, b)
    ctx = ReqContext("r")
    out = m.prepare_store([k(1), k(2)], ctx)
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
    for slot in out.store_spec.slots:
        pool.write_slot(slot, bytes([slot + 7]) * 8)
    m.complete_store(out.keys_to_store, ctx)
    assert primary.ref_count(k(1)) == 2 and primary.ref_count(k(2)) == 2
    assert m.in_flight_jobs() == 2 and m.has_pending_work()
    m.on_schedule_end(END)  # this step already polled (prepare_store)
    a.release()
    m.on_schedule_end(END)  # first call of the next step polls
    assert primary.ref_count(k(1)) == 1
    b.fail_keys.add(k(2))  # a failed cascade still releases its pins
    b.release()
    m.on_schedule_end(END)
    assert primary.ref_count(k(1)) == 0 and primary.ref_count(k(2)) == 0
    assert a.data[k(1)] == bytes([7]) * 8 and a.data[k(2)] == bytes([8]) * 8
    assert not b.data  # one job for both keys: it failed as a whole
    assert not m.has_pending_work()
    primary.check_invariants()
    stats = m.get_stats()
    assert stats["cascades_submitted"] == 2 and stats["cascades_failed"] == 1
    assert stats["b1.failed_jobs"] == 1


def test_failed_store_cascades_nothing() -> None:
    tier = MemoryTier()
    m, primary = stack(4, tier)
    store(m, ReqContext("r"), 1, success=False)
    assert not tier.submitted and not tier.held and m.in_flight_jobs() == 0
    assert primary.lookup(k(1), ReqContext("r")) is LookupResult.MISS


def test_secondary_finalised_after_finish_and_last_primary_store() -> None:
    tier = MemoryTier()
    m, _ = stack(4, tier)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    first = m.prepare_store([k(1)], ctx)
    second = m.prepare_store([k(2)], ctx)
    assert first is not None and second is not None
    assert m.pending_primary_stores("r") == 2
    m.on_request_finished(ctx)
    assert tier.finished_requests == []
    m.complete_store(first.keys_to_store, ctx)
    assert tier.finished_requests == []
    m.complete_store(second.keys_to_store, ctx, success=False)
    assert tier.finished_requests == ["r"] and m.tracked_requests() == []


def test_finished_without_stores_finalises_at_once_and_lazy_state() -> None:
    tier = MemoryTier()
    m, _ = stack(4, tier)
    m.on_request_finished(ReqContext("idle"))
    assert tier.finished_requests == ["idle"]
    ctx = ReqContext("never-announced")
    store(m, ctx, 1)  # prepare_store without on_new_request: state is created lazily
    m.on_request_finished(ctx)
    assert tier.finished_requests == ["idle", "never-announced"]


def test_promotion_hit_pending_then_hit_after_step_end() -> None:
    pool = CPUPool(4, [4, 2])
    tier = MemoryTier(pool)
    m, primary = stack(4, tier)
    tier.put(k(1), b"abcdef")
    tier.put(k(2), b"ghijkl")
    ctx = ReqContext("r")
    assert m.lookup(k(1), ctx) is LookupResult.HIT_PENDING
    assert m.lookup(k(1), ctx) is LookupResult.HIT_PENDING  # not promoted twice
    assert m.lookup(k(2), ctx) is LookupResult.HIT_PENDING
    assert m.has_pending_work() and not tier.submitted
    m.on_schedule_end(END)
    assert len(tier.submitted) == 1 and tier.submitted[0].keys == (k(1), k(2))  # one batch
    assert m.lookup(k(1), ctx) is LookupResult.HIT  # first call of the step polls
    spec = m.prepare_load([k(2), k(1)], ctx)
    assert isinstance(spec, CPULoadStoreSpec)
    assert [pool.read_slot(s) for s in spec.slots] == [b"ghijkl", b"abcdef"]
    m.complete_load([k(2), k(1)], ctx)
    assert primary.ref_count(k(1)) == 0
    assert m.get_stats()["promotions_submitted"] == 1


def test_promotions_batched_per_tier_and_request() -> None:
    tier = MemoryTier()
    m, _ = stack(4, tier)
    for i in (1, 2, 3):
        tier.put(k(i))
    m.lookup(k(1), ReqContext("a"))
    m.lookup(k(2), ReqContext("b"))
    m.lookup(k(3), ReqContext("a"))
    m.on_schedule_end(END)
    assert sorted(j.keys for j in tier.submitted) == [(k(1), k(3)), (k(2),)]


def test_failed_promotion_drops_primary_slot() -> None:
    tier = MemoryTier()
    m, primary = stack(4, tier)
    tier.put(k(1))
    tier.fail_keys.add(k(1))
    ctx = ReqContext("r")
    assert m.lookup(k(1), ctx) is LookupResult.HIT_PENDING
    m.on_schedule_end(END)
    m.on_schedule_end(END)  # polls: the promotion failed
    assert primary.ref_count(k(1)) is None and primary.counters().free == 4
    assert m.get_stats()["promotions_failed"] == 1
    primary.check_invariants()


def test_partial_promotion_success() -> None:
    class Partial(MemoryTier):
        def get_finished(self) -> list[JobResult]:
            return [
                JobResult(r.job_id, False, (k(1),)) if not r.success else r
                for r in super().get_finished()
            ]

    tier = Partial()
    m, primary = stack(4, tier)
    tier.put(k(1))
    tier.put(k(2))
    tier.fail_keys.add(k(2))
    ctx = ReqContext("r")
    m.lookup(k(1), ctx)
    m.lookup(k(2), ctx)
    settle(m)
    assert primary.is_ready(k(1)) and primary.ref_count(k(2)) is None


def test_tier_filter_retry_and_full_primary() -> None:
    class Retrying(MemoryTier):
        def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
            return LookupResult.RETRY

    tier = MemoryTier()
    tier.put(k(1))
    m, primary = stack(1, tier)
    none = ReqContext("r", load_tier_filter=TierFilter(()))
    assert m.lookup(k(1), none) is LookupResult.MISS
    cpu_only = ReqContext("r", load_tier_filter=TierFilter((TierMatcher(Medium.CPU),)))
    assert m.lookup(k(1), cpu_only) is LookupResult.MISS
    pending = m.prepare_store([k(9)], ReqContext("w"))  # fills the primary
    assert pending is not None
    assert m.lookup(k(1), ReqContext("r")) is LookupResult.MISS  # no room to promote
    m2, _ = stack(2, Retrying(), tier)
    assert m2.lookup(k(1), ReqContext("r")) is LookupResult.HIT_PENDING
    assert m2.lookup(k(5), ReqContext("r")) is LookupResult.RETRY
    assert primary.ref_count(k(1)) is None


def test_polls_once_per_step() -> None:
    class Counting(MemoryTier):
        polls = 0

        def get_finished(self) -> list[JobResult]:
            self.polls += 1
            return super().get_finished()

    tier = Counting()
    m, _ = stack(4, tier)
    ctx = ReqContext("r")
    m.lookup(k(1), ctx)
    m.lookup(k(2), ctx)
    m.prepare_store([k(1)], ctx)
    m.prepare_load([], ctx)
    assert tier.polls == 1
    m.on_schedule_end(END)
    assert tier.polls == 1
    m.lookup(k(1), ctx)
    assert tier.polls == 2


def test_request_level_tier_cascades_warm_keys() -> None:
    chunk = MemoryTier(name="chunk")
    whole = MemoryTier(name="whole", policy=OffloadPolicy.REQUEST_LEVEL)
    m, primary = stack(4, chunk, whole)
    first = ReqContext("first")
    assert m.on_new_request(first).policy is OffloadPolicy.REQUEST_LEVEL
    store(m, first, 1)
    settle(m)
    whole.data.clear()  # pretend the whole-request tier lost it
    ctx = ReqContext("second")
    m.on_new_request(ctx)
    out = m.prepare_store([k(1)], ctx)  # fully warm: nothing new in the primary
    assert out is not None and out.keys_to_store == ()
    assert primary.ref_count(k(1)) == 1  # pinned for the request-level cascade only
    settle(m)
    assert k(1) in whole.data and primary.ref_count(k(1)) == 0
    chunk_only = TieringOffloadingManager(CPUOffloadingManager(2), [MemoryTier()])
    assert chunk_only.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL


def test_complete_load_touches_only_primary_and_touch_reaches_all() -> None:
    tier = MemoryTier()
    m, primary = stack(4, tier)
    ctx = ReqContext("r")
    store(m, ctx, 1)
    settle(m)
    m.prepare_load([k(1)], ctx)
    m.complete_load([k(1)], ctx)
    assert primary.ref_count(k(1)) == 0 and tier.touched == []
    m.touch([k(1)], ctx)
    assert tier.touched == [k(1)]


def test_reset_drains_finalises_and_drops_promotions() -> None:
    tier = MemoryTier(hold=True)
    m, primary = stack(4, tier)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store([k(1)], ctx)
    assert out is not None
    m.on_request_finished(ctx)
    tier.put(k(7))
    assert m.lookup(k(7), ReqContext("p")) is LookupResult.HIT_PENDING  # queued promotion
    m.complete_store(out.keys_to_store, ctx)
    pinned_store = m.prepare_store([k(2)], ReqContext("live"))  # discarded by the reset
    assert pinned_store is not None and m.in_flight_jobs() == 1
    m.reset_cache()
    assert tier.drains == 1 and k(1) in tier.data  # the held cascade ran
    assert tier.finished_requests == ["r"]
    assert m.tracked_requests() == ["live"] and m.pending_primary_stores("live") == 0
    assert len(primary) == 0 and m.in_flight_jobs() == 0 and not m.has_pending_work()
    assert m.get_stats()["promotions_dropped"] == 1
    m.on_schedule_end(END)
    assert not tier.held and not tier.submitted  # the dropped promotion was never submitted
    primary.check_invariants()


def test_unknown_job_results_are_counted() -> None:
    class Bogus(MemoryTier):
        def get_finished(self) -> Iterable[JobResult]:  # type: ignore[override]
            return [JobResult(12345, True)]

    m, _ = stack(2, Bogus())
    assert m.lookup(k(1), ReqContext("r")) is LookupResult.MISS
    assert m.get_stats()["unknown_job_results"] == 1


def test_events_and_shutdown() -> None:
    tier = MemoryTier()
    m, _ = stack(2, tier)
    ctx = ReqContext("r")
    store(m, ctx, 1)
    settle(m)
    media = [(e.medium, e.removed) for e in m.take_events()]
    assert media == [(Medium.CPU, False), (Medium.STORAGE, False)]
    tier.hold = True
    store(m, ctx, 2)
    m.shutdown()
    assert not tier.held


@pytest.mark.parametrize("success", [True, False])
def test_complete_store_without_prepare_is_harmless(success: bool) -> None:
    m, primary = stack(2, MemoryTier())
    m.complete_store([k(1)], ReqContext("r"), success)
    assert len(primary) == 0 and m.in_flight_jobs() == 0


def test_promotion_never_evicts_a_key_that_hit_this_step() -> None:
    tier = MemoryTier()
    m, primary = stack(1, tier)
    ctx = ReqContext("r")
    store(m, ctx, 1)
    settle(m)
    tier.put(k(2))
    assert m.lookup(k(1), ctx) is LookupResult.HIT
    assert m.lookup(k(2), ctx) is LookupResult.MISS  # the only slot holds a key that hit
    m.prepare_load([k(1)], ctx)  # still loadable
    m.complete_load([k(1)], ctx)
    m.on_schedule_end(END)
    assert m.lookup(k(2), ctx) is LookupResult.HIT_PENDING  # next step: k1 may be evicted
    assert primary.ref_count(k(1)) is None


# -- the slot-reuse rule: promotions skip quarantined primary slots ----------------------------


def _promotion_slot(m: TieringOffloadingManager, primary: CPUOffloadingManager, i: int) -> int:
    assert m.lookup(k(i), ReqContext("p")) is LookupResult.HIT_PENDING
    slot = primary.slot_of(k(i))
    assert slot is not None
    return slot


def test_promotion_skips_slots_freed_by_reset_until_second_schedule_end() -> None:
    """reset_cache with a store in flight: the scheduler flushes it in the next step's metadata,
    so a promotion submitted in that step's on_schedule_end must not write its slot."""
    tier = MemoryTier()
    for i in (7, 8):
        tier.put(k(i))
    m, primary = stack(2, tier)
    live = m.prepare_store([k(1)], ReqContext("live"))
    assert live is not None and live.store_spec == CPULoadStoreSpec((0,))
    m.reset_cache()  # store k1 -> slot 0 may still land (flushed in the next step)
    assert primary.is_quarantined(0) and primary.counters().quarantined == 1
    assert _promotion_slot(m, primary, 7) == 1  # not the quarantined (and lower) slot 0
    assert m.lookup(k(8), ReqContext("p")) is LookupResult.MISS  # only slot 0 is left
    m.on_schedule_end(END)  # #1: its metadata carries the flush; k7's promotion goes out
    assert tier.submitted[-1].slots == (1,)
    assert m.lookup(k(7), ReqContext("p")) is LookupResult.HIT  # promoted, and now protected
    assert m.lookup(k(8), ReqContext("p")) is LookupResult.MISS
    m.on_schedule_end(END)  # #2: the workers have executed the flush
    assert not primary.is_quarantined(0)
    assert m.lookup(k(7), ReqContext("p")) is LookupResult.HIT
    assert _promotion_slot(m, primary, 8) == 0
    m.on_schedule_end(END)
    assert tier.submitted[-1].keys == (k(8),) and tier.submitted[-1].slots == (0,)
    primary.check_invariants()


def test_promotion_skips_slot_of_failed_store_until_second_schedule_end() -> None:
    """A stalled store is completed with success=False at the stall and flushed in the next
    step's metadata: its freed slot is quarantined for promotions the same way."""
    tier = MemoryTier()
    tier.put(k(7))
    m, primary = stack(1, tier)
    ctx = ReqContext("r")
    out = m.prepare_store([k(1)], ctx)
    assert out is not None and out.store_spec == CPULoadStoreSpec((0,))
    m.complete_store(out.keys_to_store, ctx, success=False)  # the stall
    assert primary.counters().free == 1 and primary.is_quarantined(0)
    assert m.lookup(k(7), ctx) is LookupResult.MISS
    m.on_schedule_end(END)
    assert m.lookup(k(7), ctx) is LookupResult.MISS
    m.on_schedule_end(END)
    assert _promotion_slot(m, primary, 7) == 0
    primary.check_invariants()


def test_scheduler_stores_reuse_quarantined_slots_at_once() -> None:
    """Workers order GPU stores after the flush: prepare_store keeps its full capacity."""
    tier = MemoryTier()
    tier.put(k(7))
    m, primary = stack(1, tier)
    ctx = ReqContext("r")
    out = m.prepare_store([k(1)], ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx, success=False)
    again = m.prepare_store([k(2)], ctx)
    assert again is not None and again.store_spec == CPULoadStoreSpec((0,))
    assert not primary.is_quarantined(0)  # the mark went with the reuse
    m.complete_store(again.keys_to_store, ctx)
    m.on_schedule_end(END)
    # k2 is ready and idle: a promotion may evict it and take its slot at once
    assert _promotion_slot(m, primary, 7) == 0 and primary.ref_count(k(2)) is None


def test_promotion_evicts_rather_than_taking_a_quarantined_slot() -> None:
    tier = MemoryTier()
    tier.put(k(7))
    m, primary = stack(2, tier)
    ctx = ReqContext("r")
    store(m, ctx, 1)  # slot 0, ready and idle
    m.on_schedule_end(END)
    m.on_schedule_end(END)  # the cascade to the tier completed: k1 unpinned
    pending = m.prepare_store([k(2)], ctx)  # slot 1
    assert pending is not None
    m.complete_store(pending.keys_to_store, ctx, success=False)
    assert _promotion_slot(m, primary, 7) == 0  # k1 evicted; quarantined slot 1 untouched
    assert primary.ref_count(k(1)) is None and primary.is_quarantined(1)
    primary.check_invariants()


def test_reset_quarantines_pinned_slots_and_failed_promotions_do_not_quarantine() -> None:
    tier = MemoryTier()
    tier.put(k(7))
    tier.fail_keys.add(k(7))
    m, primary = stack(2, tier)
    ctx = ReqContext("r")
    store(m, ctx, 1)
    settle(m)
    m.prepare_load([k(1)], ctx)  # a GPU load reading slot 0 is in flight at the reset
    m.reset_cache()
    assert primary.is_quarantined(0) and not primary.is_quarantined(1)
    assert _promotion_slot(m, primary, 7) == 1
    m.on_schedule_end(END)
    m.on_schedule_end(END)  # polls: the promotion failed; the tier is done with slot 1
    assert primary.ref_count(k(7)) is None
    assert not primary.is_quarantined(1) and primary.counters().quarantined == 0
    primary.check_invariants()


def test_request_level_tier_does_not_cascade_a_key_another_request_is_writing() -> None:
    whole = MemoryTier(name="whole", policy=OffloadPolicy.REQUEST_LEVEL)
    m, primary = stack(4, whole)
    first, second = ReqContext("first"), ReqContext("second")
    m.on_new_request(first)
    m.on_new_request(second)
    assert m.prepare_store([k(1)], first) is not None  # k1 write-pending for "first"
    out = m.prepare_store([k(1), k(2)], second)
    assert out is not None and out.keys_to_store == (k(2),)
    assert primary.ref_count(k(1)) == -1 and m.in_flight_jobs() == 0  # nothing cascaded


class _CountingTier(MemoryTier):
    polls = 0

    def get_finished(self) -> list[JobResult]:
        self.polls += 1
        return super().get_finished()


def test_reset_lets_the_next_call_of_the_step_poll_the_tiers_again() -> None:
    tier = _CountingTier()
    m, _ = stack(4, tier)
    ctx = ReqContext("r")
    m.lookup(k(1), ctx)
    m.lookup(k(1), ctx)
    assert tier.polls == 1  # once per step
    m.reset_cache()  # drains and collects (a forced poll) ...
    assert tier.polls == 2
    m.lookup(k(1), ctx)  # ... and the step's next call polls again
    assert tier.polls == 3


def test_a_late_store_report_after_a_reset_does_not_hide_a_later_pending_store() -> None:
    m, _ = stack(4, MemoryTier())
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    assert m.prepare_store([k(1)], ctx) is not None
    m.reset_cache()  # the request's pending primary stores are forgotten
    m.complete_store([k(1)], ctx)  # the reset store's late report: nothing left to count down
    later = m.prepare_store([k(2)], ctx)
    assert later is not None and later.keys_to_store == (k(2),)
    m.on_request_finished(ctx)
    assert "r" in m.tracked_requests()  # its store is still pending: not finalised yet
    m.complete_store(later.keys_to_store, ctx)
    settle(m)
    assert "r" not in m.tracked_requests()

"""CPUOffloadingManager: allocation, eviction, reuse filter, events, stats, typed errors."""

from __future__ import annotations

import pytest

from statecore.errors import (
    ConfigError,
    InvalidKeyError,
    InvariantViolation,
    KeyNotReadyError,
    PinUnderflowError,
    UnknownKeyError,
)
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
)
from statecore.managers import CPUOffloadingManager, LRUCachePolicy, WritePendingPinError

CTX = ReqContext("r")
END = ScheduleEndContext()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def stored(m: CPUOffloadingManager, *ids: int) -> tuple[int, ...]:
    out = m.prepare_store([k(i) for i in ids], CTX)
    assert out is not None
    m.complete_store(out.keys_to_store, CTX)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    return out.store_spec.slots


def snapshot(m: CPUOffloadingManager) -> tuple[object, ...]:
    return (
        m.counters(),
        {key: (m.ref_count(key), m.slot_of(key)) for key in m.present_keys()},
        list(m.policy.evictable_keys()),  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_allocation_fresh_ascending_then_recycled_lifo(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    assert stored(m, 0, 1, 2, 3) == (0, 1, 2, 3)
    m.touch([k(0)], CTX)  # k0 most recent (ARC: to T2), so 1, 2, 3 are the oldest idle keys
    out = m.prepare_store([k(10), k(11), k(12)], CTX)
    assert out is not None
    assert out.evicted_keys == (k(1), k(2), k(3))
    assert out.store_spec == CPULoadStoreSpec((3, 2, 1))
    m.check_invariants()


def test_prepare_store_filters_present_and_duplicates() -> None:
    m = CPUOffloadingManager(4)
    stored(m, 1)
    pending = m.prepare_store([k(2)], CTX)
    assert pending is not None
    out = m.prepare_store([k(1), k(2), k(3), k(3)], CTX)
    assert out is not None and out.keys_to_store == (k(3),)
    empty = m.prepare_store([k(1), k(2)], CTX)
    assert empty is not None and empty.keys_to_store == () and empty.evicted_keys == ()


def test_lookup_states() -> None:
    m = CPUOffloadingManager(2)
    assert m.lookup(k(1), CTX) is LookupResult.MISS
    out = m.prepare_store([k(1)], CTX)
    assert out is not None
    assert m.lookup(k(1), CTX) is LookupResult.HIT_PENDING
    m.complete_store([k(1)], CTX)
    assert m.lookup(k(1), CTX) is LookupResult.HIT


def test_failed_prepare_store_changes_nothing_and_never_evicts_offered_keys() -> None:
    m = CPUOffloadingManager(2)
    stored(m, 1, 2)
    before = snapshot(m)
    # k1 is offered, so only k2 is evictable: two new keys cannot fit
    assert m.prepare_store([k(1), k(3), k(4)], CTX) is None
    assert snapshot(m) == before
    # everything pinned: nothing evictable
    m.prepare_load([k(1), k(2)], CTX)
    before = snapshot(m)
    assert m.prepare_store([k(5)], CTX) is None
    assert snapshot(m) == before
    assert m.take_events()[-1].removed is False  # no removal event was recorded


def test_complete_store_failure_drops_and_frees() -> None:
    m = CPUOffloadingManager(2)
    out = m.prepare_store([k(1), k(2)], CTX)
    assert out is not None
    m.take_events()
    m.complete_store([k(1), k(2)], CTX, success=False)
    assert m.lookup(k(1), CTX) is LookupResult.MISS
    assert m.counters().free == 2 and m.counters().write_pending == 0
    assert m.take_events() == []
    # the freed slots are recycled LIFO
    again = m.prepare_store([k(3), k(4)], CTX)
    assert again is not None and again.store_spec == CPULoadStoreSpec((1, 0))
    m.check_invariants()


def test_complete_store_ignores_absent_and_ready_keys() -> None:
    m = CPUOffloadingManager(2)
    stored(m, 1)
    m.take_events()
    m.complete_store([k(1), k(9)], CTX)
    m.complete_store([k(1), k(9)], CTX, success=False)
    assert m.lookup(k(1), CTX) is LookupResult.HIT
    assert m.take_events() == []


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_complete_store_lists_each_changed_key_once(policy: str) -> None:
    """A key listed twice, or beside a ready or absent key, changes once (the batch path is
    only for a job's own keys, each write-pending and listed once)."""
    m = CPUOffloadingManager(8, policy)
    stored(m, 1)
    out = m.prepare_store([k(2), k(3), k(4)], CTX)
    assert out is not None
    m.take_events()
    assert m.complete_write([k(2), k(2), k(1), k(9), k(3)], CTX) == [k(2), k(3)]
    c = m.counters()
    assert (c.write_pending, c.evictable, c.keys) == (1, 3, 4)
    assert m.take_events() == [OffloadingEvent((k(2), k(3)), Medium.CPU, removed=False)]
    m.check_invariants()
    # a failure drops the keys listed, once each
    assert m.complete_write([k(4), k(4)], CTX, success=False) == [k(4)]
    assert m.counters().free == 8 - 3 and m.counters().write_pending == 0
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_complete_store_makes_a_job_ready_in_offered_order(policy: str) -> None:
    m = CPUOffloadingManager(3, policy)
    out = m.prepare_store([k(3), k(1), k(2)], CTX)
    assert out is not None and out.store_spec == CPULoadStoreSpec((0, 1, 2))
    m.take_events()
    assert m.complete_write(list(out.keys_to_store), CTX) == [k(3), k(1), k(2)]
    assert [m.slot_of(k(i)) for i in (3, 1, 2)] == [0, 1, 2]
    assert m.ref_count(k(3)) == 0 and m.counters().evictable == 3
    assert m.take_events() == [OffloadingEvent((k(3), k(1), k(2)), Medium.CPU, removed=False)]
    # the oldest ready key (the first of the job) is evicted first
    again = m.prepare_store([k(4)], CTX)
    assert again is not None and again.evicted_keys == (k(3),)
    m.check_invariants()


def test_pins_protect_from_eviction_and_release() -> None:
    m = CPUOffloadingManager(2)
    stored(m, 1, 2)
    spec = m.prepare_load([k(2), k(1), k(2)], CTX)
    assert spec == CPULoadStoreSpec((1, 0, 1))  # co-indexed with the keys
    assert m.ref_count(k(2)) == 2 and m.counters().evictable == 0
    assert m.prepare_store([k(3)], CTX) is None
    m.complete_load([k(2), k(1)], CTX)
    out = m.prepare_store([k(3)], CTX)
    assert out is not None and out.evicted_keys == (k(1),)
    m.check_invariants()


def test_typed_errors_leave_state_unchanged() -> None:
    m = CPUOffloadingManager(3)
    stored(m, 1, 2)
    m.prepare_store([k(3)], CTX)
    before = snapshot(m)
    with pytest.raises(UnknownKeyError) as e1:
        m.prepare_load([k(1), k(9)], CTX)
    assert e1.value.key == k(9) and e1.value.call == "prepare_load"
    with pytest.raises(KeyNotReadyError):
        m.prepare_load([k(1), k(3)], CTX)
    with pytest.raises(UnknownKeyError):
        m.complete_load([k(9)], CTX)
    with pytest.raises(PinUnderflowError):
        m.complete_load([k(1)], CTX)
    with pytest.raises(WritePendingPinError):
        m.complete_load([k(3)], CTX)
    assert snapshot(m) == before
    m.prepare_load([k(1)], CTX)
    before = snapshot(m)
    with pytest.raises(PinUnderflowError):  # one pin, two releases in one call
        m.complete_load([k(1), k(1)], CTX)
    with pytest.raises(PinUnderflowError):  # the first key is fine, the second is not
        m.complete_load([k(1), k(2)], CTX)
    assert snapshot(m) == before


def test_reuse_filter() -> None:
    m = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2)
    m.lookup(k(1), CTX)
    out = m.prepare_store([k(1)], CTX)
    assert out is not None and out.keys_to_store == ()
    assert m.get_stats()["stores_skipped"] == 1
    m.lookup(k(1), CTX)
    out = m.prepare_store([k(1)], CTX)
    assert out is not None and out.keys_to_store == (k(1),)
    # the tracker is bounded: k2 and k3 push k1's count out
    m.complete_store([k(1)], CTX)
    for i in (2, 3):
        m.lookup(k(i), CTX)
    m.lookup(k(4), CTX)
    m.lookup(k(4), CTX)
    m.lookup(k(2), CTX)  # k2 was dropped by k4: its count restarts at 1
    out = m.prepare_store([k(2), k(4)], CTX)
    assert out is not None and out.keys_to_store == (k(4),)
    assert m.get_stats()["stores_skipped"] == 1
    # promotions bypass the filter
    out = m.prepare_write([k(7)], CTX, bypass_reuse_filter=True)
    assert out is not None and out.keys_to_store == (k(7),)


def test_events() -> None:
    m = CPUOffloadingManager(1)
    stored(m, 1)
    out = m.prepare_store([k(2)], CTX)
    assert out is not None
    m.complete_store([k(2)], CTX)
    m.reset_cache()
    assert m.take_events() == [
        OffloadingEvent((k(1),), Medium.CPU, removed=False),
        OffloadingEvent((k(1),), Medium.CPU, removed=True),
        OffloadingEvent((k(2),), Medium.CPU, removed=False),
        OffloadingEvent((k(2),), Medium.CPU, removed=True),
    ]
    assert m.take_events() == []
    quiet = CPUOffloadingManager(1, enable_events=False)
    stored(quiet, 1)
    assert quiet.take_events() == []


def test_stats() -> None:
    m = CPUOffloadingManager(4)
    assert m.get_stats() == {
        "cpu_cache_usage_perc": 0.0,
        "write_usage": 0.0,
        "read_usage": 0.0,
        "allocation_sizes": [],
    }
    stored(m, 1, 2)
    m.prepare_store([k(3)], CTX)
    m.prepare_load([k(1)], CTX)
    stats = m.get_stats()
    assert stats["cpu_cache_usage_perc"] == 0.5
    assert stats["write_usage"] == 0.25
    assert stats["read_usage"] == 0.25
    assert stats["allocation_sizes"] == [2.0, 1.0]
    assert m.get_stats()["allocation_sizes"] == []
    assert "stores_skipped" not in stats
    # a store that cannot make room still asked for its slots (vLLM's histogram counts it)
    assert m.prepare_store([k(5), k(6), k(7)], CTX) is None
    assert m.get_stats()["allocation_sizes"] == [3.0]
    assert CPUOffloadingManager(0).get_stats()["cpu_cache_usage_perc"] == 0.0


def test_reset_cache() -> None:
    m = CPUOffloadingManager(2)
    stored(m, 1)
    m.prepare_load([k(1)], CTX)
    m.prepare_store([k(2)], CTX)
    m.reset_cache()
    assert len(m) == 0 and m.counters().free == 2 and m.counters().high_water == 0
    assert stored(m, 3) == (0,)
    m.check_invariants()


def test_policy_resolution() -> None:
    m = CPUOffloadingManager(2, "statecore.managers.policies:ARCCachePolicy")
    assert type(m.policy).__name__ == "ARCCachePolicy"
    custom = LRUCachePolicy(2)
    assert CPUOffloadingManager(2, custom).policy is custom
    with pytest.raises(ConfigError):
        CPUOffloadingManager(2, "fifo")
    with pytest.raises(ConfigError):
        CPUOffloadingManager(2, "statecore.nowhere:Policy")
    with pytest.raises(ConfigError):
        CPUOffloadingManager(2, "statecore.keys:OffloadKey")
    with pytest.raises(ConfigError):
        CPUOffloadingManager(-1)


# -- quarantine: slots freed with transfers possibly in flight, held back from promotions -------


def promote(m: CPUOffloadingManager, *ids: int) -> tuple[int, ...] | None:
    out = m.prepare_write([k(i) for i in ids], CTX, bypass_reuse_filter=True, skip_quarantined=True)
    if out is None:
        return None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    return out.store_spec.slots


def test_reset_quarantines_pending_and_pinned_slots_for_two_schedule_ends() -> None:
    m = CPUOffloadingManager(6)
    stored(m, 1, 2, 3)  # slots 0, 1, 2
    m.prepare_load([k(2)], CTX)  # slot 1 pinned
    m.prepare_store([k(4)], CTX)  # slot 3 write-pending
    m.reset_cache()
    c = m.counters()
    assert c.free == 6 and c.quarantined == 2 and m.num_free_for_promotion == 4
    assert [s for s in range(6) if m.is_quarantined(s)] == [1, 3]
    m.check_invariants()
    # promotions pass over the quarantined fresh ids (they move to the free list) ...
    assert promote(m, 10, 11, 12) == (0, 2, 4)
    m.check_invariants()
    assert promote(m, 13) == (5,)
    assert promote(m, 14) is None  # ... and never take them, even when nothing else is left
    m.on_schedule_end(END)
    assert promote(m, 14) is None and m.counters().quarantined == 2
    m.on_schedule_end(END)
    assert m.counters().quarantined == 0
    assert promote(m, 14, 15) == (3, 1)  # released: recycled LIFO again
    m.check_invariants()


def test_failed_store_quarantines_and_scheduler_stores_reuse_at_once() -> None:
    m = CPUOffloadingManager(3)
    out = m.prepare_store([k(1), k(2)], CTX)
    assert out is not None and out.store_spec == CPULoadStoreSpec((0, 1))
    m.complete_store([k(1), k(2)], CTX, success=False)
    assert m.is_quarantined(0) and m.is_quarantined(1) and m.counters().free == 3
    assert promote(m, 5) == (2,)
    m.check_invariants()
    # a scheduler store keeps the usual allocation (recycled LIFO) and ends the quarantine
    again = m.prepare_store([k(3)], CTX)
    assert again is not None and again.store_spec == CPULoadStoreSpec((1,))
    assert not m.is_quarantined(1) and m.is_quarantined(0)
    m.check_invariants()
    assert promote(m, 6) is None  # slot 0 is the only free one
    # a failed promotion result (quarantine=False) frees without quarantine
    m.complete_write([k(5)], CTX, success=False, quarantine=False)
    assert not m.is_quarantined(2) and promote(m, 6) == (2,)


def test_promotion_evicts_idle_keys_instead_of_taking_quarantined_slots() -> None:
    m = CPUOffloadingManager(2)
    stored(m, 1)  # slot 0, idle
    out = m.prepare_store([k(2)], CTX)
    assert out is not None
    m.complete_store([k(2)], CTX, success=False)  # slot 1 quarantined
    before = snapshot(m)
    m.prepare_load([k(1)], CTX)
    assert promote(m, 3) is None  # k1 pinned: no room outside the quarantine, nothing changed
    m.complete_load([k(1)], CTX)
    assert snapshot(m) == before
    got = m.prepare_write([k(3)], CTX, bypass_reuse_filter=True, skip_quarantined=True)
    assert got is not None and got.evicted_keys == (k(1),)
    assert got.store_spec == CPULoadStoreSpec((0,)) and m.is_quarantined(1)
    m.check_invariants()


def test_quarantine_release_order_and_requarantine() -> None:
    m = CPUOffloadingManager(2)
    out = m.prepare_store([k(1), k(2)], CTX)
    assert out is not None
    m.complete_store([k(1)], CTX, success=False)  # slot 0 until end 2
    m.on_schedule_end(END)
    m.complete_store([k(2)], CTX, success=False)  # slot 1 until end 3
    m.on_schedule_end(END)
    assert not m.is_quarantined(0) and m.is_quarantined(1)
    m.check_invariants()
    assert m.prepare_store([k(3)], CTX) is not None  # slot 1 (recycled LIFO): mark dropped
    assert m.slot_of(k(3)) == 1
    assert m.counters().quarantined == 0
    m.reset_cache()  # k3 write-pending in slot 1: quarantined again, until end 4
    assert m.counters().quarantined == 1 and m.counters().schedule_ends == 2
    m.on_schedule_end(END)
    assert m.is_quarantined(1)
    m.on_schedule_end(END)
    assert not m.is_quarantined(1)
    m.check_invariants()


def test_check_invariants_catches_quarantine_corruption() -> None:
    m = CPUOffloadingManager(2)
    stored(m, 1)
    m._quarantine[0] = 5  # slot 0 is in use
    with pytest.raises(InvariantViolation):
        m.check_invariants()
    m._quarantine.clear()
    m._quarantine[1] = 0  # expired but still listed
    with pytest.raises(InvariantViolation):
        m.check_invariants()


@pytest.mark.parametrize("threshold", [0, 2])
@pytest.mark.parametrize("until_miss", [False, True])
def test_lookup_many_answers_as_lookups_in_order(threshold: int, until_miss: bool) -> None:
    """Ready, write-pending and absent keys; with until_miss nothing after the first miss is
    looked up (the reuse filter counts exactly the keys looked up)."""
    ms = [CPUOffloadingManager(8, store_threshold=threshold) for _ in range(2)]
    for m in ms:
        for _ in range(2):  # reuse filter: two lookups admit a key
            for i in (1, 2):
                m.lookup(k(i), CTX)
        stored(m, 1)
        assert m.prepare_store([k(2)], CTX) is not None
    keys = [k(1), k(2), k(9), k(1), k(3)]
    bulk = ms[0].lookup_many(keys, CTX, until_miss)
    one: list[LookupResult] = []
    for key in keys:
        one.append(ms[1].lookup(key, CTX))
        if until_miss and one[-1] is LookupResult.MISS:
            break
    assert bulk == one
    assert all(type(r) is LookupResult for r in bulk)
    H, P, M = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
    assert bulk == ([H, P, M] if until_miss else [H, P, M, H, M])
    if threshold:  # the tracker saw the same lookups: k(9) counted once, k(3) only without stop
        assert ms[0]._tracker == ms[1]._tracker
        assert (k(3) in ms[0]._tracker) is not until_miss  # type: ignore[operator]
    assert ms[0].lookup_many([], CTX) == []


def test_lookup_many_refuses_a_bad_key_as_lookup_does() -> None:
    m = CPUOffloadingManager(2)
    with pytest.raises(InvalidKeyError):
        m.lookup_many([k(1), b"x"], CTX)  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError):
        m.lookup(b"x", CTX)  # type: ignore[arg-type]


def test_lookup_many_until_miss_looks_at_nothing_after_the_miss() -> None:
    """A key after the first miss is never looked up, so never checked (as per-key lookups
    that stop there); a bad key at or before the miss raises."""
    m = CPUOffloadingManager(4)
    stored(m, 1)
    H, M = LookupResult.HIT, LookupResult.MISS
    assert m.lookup_many([k(1), k(9), b"x"], CTX, until_miss=True) == [H, M]  # type: ignore[list-item]
    assert m.lookup_many([k(1), k(1)], CTX, until_miss=True) == [H, H]
    with pytest.raises(InvalidKeyError):
        m.lookup_many([k(1), b"x", k(9)], CTX, until_miss=True)  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError):
        m.lookup_many([k(1), [1], k(9)], CTX, until_miss=True)  # type: ignore[list-item]

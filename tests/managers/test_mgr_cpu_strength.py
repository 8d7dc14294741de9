"""CPU manager (and one tiering) behaviour that mutation testing found unasserted
(docs/mutation.md): key and flag checks on every path, the walk over every key, the invariant
checker's own checks, defaults, and how many finalised request ids tiering remembers."""

from __future__ import annotations

import dataclasses

import pytest

from statecore.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    InvariantViolation,
    ManagerStateError,
    PinUnderflowError,
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
from statecore.managers import CPUOffloadingManager, MemoryTier, TieringOffloadingManager
from statecore.managers.cpu import MAX_SLOTS, CPUManagerCounters, _entry
from statecore.managers.policies import LRUCachePolicy
from statecore.pool import CPUPool

CTX = ReqContext("r")


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.mark.parametrize(
    "bad",
    [["abcd"], [k(1), "wxyz"], [b"abc"], None, 7],
    ids=["str-key", "str-after-a-good-key", "short-bytes", "none", "int"],
)
def test_complete_store_refuses_what_is_not_a_sequence_of_offload_keys(bad: object) -> None:
    m = CPUOffloadingManager(2)
    assert m.prepare_store([k(1)], CTX) is not None
    with pytest.raises(InvalidKeyError) as err:
        m.complete_store(bad, CTX)  # type: ignore[arg-type]
    assert err.value.call == "complete_store"
    assert m.counters().write_pending == 1 and m.lookup(k(1), CTX) is LookupResult.HIT_PENDING


@pytest.mark.parametrize("success", [True, False])
def test_complete_store_reaches_pending_keys_after_absent_and_ready_ones(success: bool) -> None:
    m = CPUOffloadingManager(4)
    first = m.prepare_store([k(1)], CTX)
    assert first is not None
    m.complete_store([k(1)], CTX)
    assert m.prepare_store([k(2), k(3)], CTX) is not None
    m.take_events()
    m.complete_store([k(9), k(1), k(2), k(3)], CTX, success=success)
    expected = LookupResult.HIT if success else LookupResult.MISS
    assert [m.lookup(k(i), CTX) for i in (2, 3)] == [expected, expected]
    assert m.counters().write_pending == 0
    assert m.counters().evictable == (3 if success else 1)
    if success:
        assert m.take_events() == [OffloadingEvent((k(2), k(3)), Medium.CPU, removed=False)]
    m.check_invariants()


def test_cpu_manager_reuse_tracker_default_is_upstreams() -> None:
    # upstream's CPU manager bounds its reuse tracker at 64 000 keys unless configured
    assert CPUOffloadingManager(4, store_threshold=2).max_tracker_size == 64_000


def test_prepare_load_refuses_a_one_shot_iterator_and_pins_nothing() -> None:
    # keys must be a sequence: a generator is consumed by the check and would pin nothing
    m = CPUOffloadingManager(2)
    m.prepare_store([k(1)], CTX)
    m.complete_store([k(1)], CTX)
    with pytest.raises(ValueError):
        m.prepare_load(iter([k(1)]), CTX)  # type: ignore[arg-type]
    assert m.ref_count(k(1)) == 0 and m.counters().evictable == 1


# -- seed 5521 survivors: key checks on every path, the invariant checker's own checks ----------


@pytest.mark.parametrize("threshold", [1, 2])
def test_lookup_and_prepare_store_refuse_a_str_key(threshold: int) -> None:
    m = CPUOffloadingManager(4, store_threshold=threshold)
    with pytest.raises(InvalidKeyError):
        m.lookup("abcd", CTX)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        m.prepare_store(["abcd"], CTX)  # type: ignore[list-item]
    assert m.counters().keys == 0


def test_lookup_refuses_a_key_whose_class_claims_to_be_bytes() -> None:
    """A key must be ``bytes`` by type identity: a bytes subclass whose metaclass even makes
    the class compare equal to ``bytes`` (so ``type(key) != bytes`` is False) is refused,
    and the lookup changes nothing (the reuse filter does not count it)."""

    class _ClaimsBytes(type):
        def __eq__(cls, other: object) -> bool:
            return other is bytes or type.__eq__(cls, other)

        __hash__ = type.__hash__

    class Impostor(bytes, metaclass=_ClaimsBytes):
        pass

    m = CPUOffloadingManager(4, store_threshold=2)
    fake = Impostor(k(1))
    assert fake == k(1) and type(fake) == bytes  # noqa: E721  (what `!=` would see)
    assert m.lookup(k(1), CTX) is LookupResult.MISS  # one lookup: below the threshold
    with pytest.raises(InvalidKeyError, match="lookup"):
        m.lookup(fake, CTX)
    out = m.prepare_store([k(1)], CTX)  # the refused lookup was not a second one
    assert out is not None and out.keys_to_store == ()


def test_is_ready_only_for_a_present_readable_key() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    assert not m.is_ready(k(1)) and not m.is_ready(k(9))
    m.complete_store([k(1)], CTX)
    assert m.is_ready(k(1))


def test_check_invariants_holds_with_many_write_pending_keys() -> None:
    # counts above the small-int cache: compared by value, not identity
    m = CPUOffloadingManager(600)
    assert m.prepare_store([k(i) for i in range(300)], CTX) is not None
    m.check_invariants()
    m.complete_store([k(i) for i in range(300)], CTX)
    m.check_invariants()


def test_check_invariants_catches_a_ref_below_minus_one() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    m._entries[k(1)] = _entry(-2, m.slot_of(k(1)) or 0)
    assert m.ref_count(k(1)) == -2 and m.slot_of(k(1)) == 0
    m._write_pending = 0
    with pytest.raises(InvariantViolation, match="INV-PIN"):
        m.check_invariants()


def test_check_invariants_catches_a_slot_lost_from_the_tiling() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1), k(2)], CTX) is not None
    m.complete_store([k(1), k(2)], CTX, success=False)  # slots 0 and 1 back on the free list
    m._free.pop()  # a slot neither used nor free, high water within capacity
    with pytest.raises(InvariantViolation, match="do not tile"):
        m.check_invariants()


def test_fresh_counters_default_to_no_quarantine_and_no_schedule_end() -> None:
    c = CPUManagerCounters(4, 0, 0, 0, 0, 4, 0)
    assert (c.quarantined, c.schedule_ends) == (0, 0)


def test_complete_write_defaults_to_success_and_returns_the_changed_keys() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    assert m.complete_write([k(1)], CTX) == [k(1)]
    assert m.is_ready(k(1))


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_complete_store_refuses_a_success_flag_that_is_not_a_bool(flag: object) -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    with pytest.raises(InvalidArgumentError, match="success"):
        m.complete_store([k(1)], CTX, success=flag)  # type: ignore[arg-type]
    assert m.ref_count(k(1)) == -1  # still write-pending


def test_reset_announces_only_the_keys_that_were_announced_stored() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    m.complete_store([k(1)], CTX)
    assert m.prepare_store([k(2)], CTX) is not None  # write-pending: never announced
    m.take_events()
    m.reset_cache()
    assert m.take_events() == [OffloadingEvent((k(1),), Medium.CPU, removed=True)]


# -- seed 6007 survivors: the snapshot, the policy cross-check, big promotions ------------------


def test_counters_are_an_immutable_hashable_snapshot() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    before = m.counters()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.keys = 0  # type: ignore[misc]
    m.complete_store([k(1)], CTX)
    after = m.counters()
    assert (before.keys, before.write_pending, after.evictable) == (1, 1, 1)
    assert {before, after, m.counters()} == {before, after}  # equal snapshots hash equal


def test_check_invariants_catches_an_idle_key_the_policy_lost() -> None:
    m = CPUOffloadingManager(4)
    for i in (1, 2):
        assert m.prepare_store([k(i)], CTX) is not None
        m.complete_store([k(i)], CTX)
    m.check_invariants()
    m.policy.remove(k(1))  # the policy lists fewer idle keys than the tier holds
    with pytest.raises(InvariantViolation, match="evictable keys differ"):
        m.check_invariants()


def test_a_promotion_of_many_keys_takes_exactly_that_many_fresh_slots() -> None:
    # counts above the small-int cache: the slot loop stops at n by value, not identity
    m = CPUOffloadingManager(700)
    assert m.prepare_store([k(0)], CTX) is not None
    m.complete_store([k(0)], CTX, success=False)  # slot 0 quarantined: promotions avoid it
    keys = [k(i) for i in range(1, 301)]
    out = m.prepare_write(keys, CTX, bypass_reuse_filter=True, skip_quarantined=True)
    assert out is not None and out.store_spec == CPULoadStoreSpec(tuple(range(1, 301)))
    c = m.counters()
    assert (c.high_water, c.write_pending, c.free, c.quarantined) == (301, 300, 400, 1)
    m.check_invariants()


# -- tiering: its configuration is checked tier by tier -------------------------------------------


@pytest.mark.parametrize("at", [0, 1])
def test_tiering_refuses_a_secondary_that_is_not_a_tier(at: int) -> None:
    tiers: list[object] = [MemoryTier(CPUPool(2, [4]))]
    tiers.insert(at, "disk")
    with pytest.raises(ConfigError, match=rf"secondaries\[{at}\] must be a SecondaryTier"):
        TieringOffloadingManager(CPUOffloadingManager(2), tiers)  # type: ignore[arg-type]


# -- tiering: how many finalised request ids are remembered --------------------------------------


def test_tiering_remembers_exactly_the_last_finalized_memory_request_ids() -> None:
    m = TieringOffloadingManager(CPUOffloadingManager(2), [MemoryTier(CPUPool(2, [4]))])
    n = TieringOffloadingManager.FINALIZED_MEMORY
    m.on_request_finished(ReqContext("first"))
    with pytest.raises(ManagerStateError, match="already finished"):
        m.on_request_finished(ReqContext("first"))  # the latest id is remembered
    for i in range(n):
        m.on_request_finished(ReqContext(f"r{i}"))
    m.on_request_finished(ReqContext("first"))  # pushed out by n newer ids: a new request
    with pytest.raises(ManagerStateError, match="already finished"):
        m.on_request_finished(ReqContext("r1"))  # still among the last n
    assert n == 65_536  # upstream-sized: a step's finished requests never come close


def test_a_key_pinned_many_times_in_a_high_slot_keeps_its_count_and_slot() -> None:
    """Entries pack the reference count above the slot id: neither leaks into the other, at
    the highest slot a tier may have and with counts far above 1."""
    m = CPUOffloadingManager(MAX_SLOTS)
    m._high_water = MAX_SLOTS - 2  # (no list of 2**40 slots: the next ones handed out)
    out = m.prepare_store([k(1), k(2)], CTX)
    assert out is not None and out.store_spec == CPULoadStoreSpec((MAX_SLOTS - 2, MAX_SLOTS - 1))
    assert m.ref_count(k(2)) == -1 and m.slot_of(k(2)) == MAX_SLOTS - 1
    assert m.lookup(k(2), CTX) is LookupResult.HIT_PENDING
    m.complete_store([k(1), k(2)], CTX)
    assert m.ref_count(k(2)) == 0 and m.slot_of(k(2)) == MAX_SLOTS - 1 and m.is_ready(k(2))
    for _ in range(300):
        assert m.prepare_load([k(2)], CTX) == CPULoadStoreSpec((MAX_SLOTS - 1,))
    assert m.ref_count(k(2)) == 300 and m.counters().pinned == 1
    for _ in range(300):
        m.complete_load([k(2)], CTX)
    assert m.ref_count(k(2)) == 0 and m.slot_of(k(2)) == MAX_SLOTS - 1
    assert m.counters().evictable == 2
    with pytest.raises(PinUnderflowError):
        m.complete_load([k(2)], CTX)


def test_a_tier_larger_than_the_slot_ids_allow_is_refused() -> None:
    assert CPUOffloadingManager(MAX_SLOTS).capacity == MAX_SLOTS
    with pytest.raises(ConfigError, match="num_slots"):
        CPUOffloadingManager(MAX_SLOTS + 1)


# -- exploratory sample seed 7101: readiness of pinned keys, completing ready keys ---------------


def test_a_pinned_key_is_ready() -> None:
    m = CPUOffloadingManager(4)
    assert m.prepare_store([k(1)], CTX) is not None
    m.complete_store([k(1)], CTX)
    m.prepare_load([k(1)], CTX)
    assert m.ref_count(k(1)) == 1 and m.is_ready(k(1))


def test_completing_keys_that_are_already_ready_changes_nothing() -> None:
    m = CPUOffloadingManager(4)
    for i in (1, 2):
        assert m.prepare_store([k(i)], CTX) is not None
        m.complete_store([k(i)], CTX)
    before = m.counters()
    m.take_events()
    assert m.complete_write([k(1)], CTX) == []  # a second report of the same store
    assert m.counters() == before and m.take_events() == []
    # k1 stays the least recent idle key: the repeat did not refresh it
    assert m.prepare_store([k(3), k(4), k(5)], CTX) is not None
    assert k(1) not in m and k(2) in m
    m.check_invariants()


# -- exploratory sample seed 7202: the slot bound, key checks of prepare_store, quarantine ids ----


def test_the_slot_bound_is_two_to_the_fortieth() -> None:
    assert CPUOffloadingManager(2**40).capacity == 2**40
    with pytest.raises(ConfigError, match="num_slots"):
        CPUOffloadingManager(2**40 + 1)


@pytest.mark.parametrize(
    "bad", [None, [[b"abcd"]], [b"abc"]], ids=["none", "unhashable-key", "3-byte-key"]
)
def test_prepare_store_refuses_bad_keys_with_a_typed_error(bad: object) -> None:
    m = CPUOffloadingManager(4)
    with pytest.raises(InvalidKeyError) as err:
        m.prepare_store(bad, CTX)  # type: ignore[arg-type]
    assert err.value.call == "prepare_store" and m.counters().keys == 0


def test_check_invariants_catches_a_quarantined_slot_below_zero() -> None:
    m = CPUOffloadingManager(4)
    m._quarantine[-1] = 2
    with pytest.raises(InvariantViolation, match="quarantined slot -1"):
        m.check_invariants()


# -- final sample seed 7309 ----------------------------------------------------------------------


@pytest.mark.parametrize("key", [b"abc", b""], ids=["3-bytes", "empty"])
def test_lookup_refuses_a_bytes_key_shorter_than_four(key: bytes) -> None:
    m = CPUOffloadingManager(4)
    with pytest.raises(InvalidKeyError) as err:
        m.lookup(key, CTX)  # type: ignore[arg-type]
    assert err.value.call == "lookup"
    assert m.lookup(b"abcd", CTX) is LookupResult.MISS  # 4 bytes is the shortest key


def test_quarantine_marks_expire_one_by_one_after_many_schedule_ends() -> None:
    # schedule-end counts above the small-int cache: expiry compares them by value
    m = CPUOffloadingManager(4)
    end = ScheduleEndContext()
    for _ in range(300):
        m.on_schedule_end(end)
    assert m.prepare_store([k(1), k(2)], CTX) is not None
    m.complete_store([k(1)], CTX, success=False)  # slot 0: quarantined until end 302
    m.on_schedule_end(end)
    m.complete_store([k(2)], CTX, success=False)  # slot 1: until end 303
    m.on_schedule_end(end)
    assert not m.is_quarantined(0) and m.is_quarantined(1)
    assert m.counters().quarantined == 1
    m.check_invariants()


# -- a load's pins in one batch: the policy's optional batch form, and who it must not skip ----


class _SingleKeyPinsOnly:
    """A policy written before the optional ``mark_non_evictable_many``: an LRU whose
    single-key pin hook counts its calls."""

    def __init__(self, capacity: int) -> None:
        self.inner = LRUCachePolicy(capacity)
        self.pins = 0
        for name in ("insert", "insert_many", "remove", "mark_evictable", "touch", "clear"):
            setattr(self, name, getattr(self.inner, name))
        self.mark_evictable_many = self.inner.mark_evictable_many
        self.evict = self.inner.evict
        self.evictable_keys = self.inner.evictable_keys

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.pins += 1
        self.inner.mark_non_evictable(key)


class _CountingPinLRU(LRUCachePolicy):
    """Overrides only the single-key pin hook: the inherited batch form must not bypass it."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.pins = 0

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.pins += 1
        super().mark_non_evictable(key)


@pytest.mark.parametrize("policy_cls", [_SingleKeyPinsOnly, _CountingPinLRU])
def test_a_load_pins_through_the_single_key_hook_where_the_policy_has_no_own_batch_form(
    policy_cls: type[_SingleKeyPinsOnly] | type[_CountingPinLRU],
) -> None:
    policy = policy_cls(8)
    m = CPUOffloadingManager(8, policy)  # type: ignore[arg-type]
    keys = [k(i) for i in range(4)]
    m.prepare_store(keys, CTX)
    m.complete_store(keys, CTX)
    m.prepare_load(keys[:3], CTX)  # three idle keys pinned: three single-key calls
    assert policy.pins == 3
    assert policy.evictable_keys() == [k(3)]  # type: ignore[operator]
    m.prepare_load(keys[:2], CTX)  # already pinned: the policy hears nothing
    assert policy.pins == 3
    m.check_invariants()


def test_a_load_of_idle_and_pinned_keys_pins_each_once_and_releases_in_key_order() -> None:
    m = CPUOffloadingManager(8, "lru")
    keys = [k(i) for i in range(5)]
    m.prepare_store(keys, CTX)
    m.complete_store(keys, CTX)
    m.prepare_load([k(1), k(3)], CTX)
    m.prepare_load([k(4), k(3), k(1), k(0)], CTX)  # k1, k3 pinned twice now
    assert [m.ref_count(key) for key in keys] == [1, 2, 0, 2, 1]
    assert m.counters().evictable == 1
    m.complete_load((k(4), k(3), k(1), k(0)), CTX)  # k4 and k0 become idle, in that order
    assert m.policy.evictable_keys() == [k(2), k(4), k(0)]  # type: ignore[attr-defined]
    assert [m.ref_count(key) for key in keys] == [0, 1, 0, 1, 0]
    m.check_invariants()


class _PlainLRU(LRUCachePolicy):
    """An LRU whose instances take attributes (no ``__slots__``)."""


def test_a_single_key_pin_hook_set_on_the_instance_is_called_too() -> None:
    policy = _PlainLRU(8)
    pins: list[OffloadKey] = []

    def pin(key: OffloadKey) -> None:
        pins.append(key)
        LRUCachePolicy.mark_non_evictable(policy, key)

    policy.mark_non_evictable = pin  # type: ignore[method-assign]
    m = CPUOffloadingManager(8, policy)
    keys = [k(i) for i in range(3)]
    m.prepare_store(keys, CTX)
    m.complete_store(keys, CTX)
    m.prepare_load(keys, CTX)
    assert pins == keys
    m.check_invariants()

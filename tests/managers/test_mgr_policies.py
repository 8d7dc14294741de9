"""LRU and ARC policies and their pure kernels."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from statecore.keys import OffloadKey, make_offload_key
from statecore.managers.policies import (
    ARCCachePolicy,
    LRUCachePolicy,
    allocation_plan,
    arc_select_victims,
    arc_target_after_b1_hit,
    arc_target_after_b2_hit,
    lru_select_victims,
    usage_gauges,
)


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ready_arc(capacity: int, *ids: int) -> ARCCachePolicy:
    p = ARCCachePolicy(capacity)
    for i in ids:
        p.insert(k(i))
        p.mark_evictable(k(i))
    return p


def test_arc_b1_hit_raises_target_b2_hit_lowers_it() -> None:
    p = ready_arc(4, 1, 2, 3, 4)
    p.touch([k(3), k(4)])  # ready keys in T1 move to T2
    assert list(p.t1) == [k(1), k(2)] and list(p.t2) == [k(4), k(3)]
    assert p.evict(1, frozenset()) == [k(1)]  # target 0: T1 first
    assert list(p.b1) == [k(1)]
    p.touch([k(1)])  # B1 hit: +max(1, |B2|/|B1|) = +1
    assert p.target_t1_size == 1.0
    p.touch([k(1)])
    assert p.target_t1_size == 2.0
    # T1 (one key) is now below the target, so the victim comes from T2
    assert p.evict(1, frozenset()) == [k(4)]
    assert list(p.b2) == [k(4)]
    p.touch([k(4)])  # B2 hit: -max(1, |B1|/|B2|) = -1
    assert p.target_t1_size == 1.0
    p.touch([k(4)])
    p.touch([k(4)])
    assert p.target_t1_size == 0.0  # floored


def test_arc_target_capped_at_capacity() -> None:
    p = ready_arc(2, 1, 2)
    p.evict(2, frozenset())
    for _ in range(5):
        p.touch([k(1)])
    assert p.target_t1_size == 2.0


def test_arc_pending_key_touch_stays_in_t1() -> None:
    p = ARCCachePolicy(4)
    p.insert(k(1))
    p.insert(k(2))
    p.touch([k(1)])
    assert list(p.t1) == [k(2), k(1)] and not p.t2
    p.mark_evictable(k(1))
    p.touch([k(1)])
    assert list(p.t2) == [k(1)]


def test_arc_evict_is_atomic_and_skips_pinned_and_protected() -> None:
    p = ready_arc(4, 1, 2, 3)
    p.mark_non_evictable(k(1))
    before = (list(p.t1), list(p.t2), list(p.b1), list(p.b2), p.target_t1_size)
    assert p.evict(2, frozenset({k(2)})) is None
    assert (list(p.t1), list(p.t2), list(p.b1), list(p.b2), p.target_t1_size) == before
    assert p.evict(1, frozenset({k(2)})) == [k(3)]


def test_arc_ghost_lists_trimmed_to_capacity() -> None:
    p = ready_arc(2, 1, 2)
    assert p.evict(2, frozenset()) == [k(1), k(2)]
    for i in (3, 4):
        p.insert(k(i))
        p.mark_evictable(k(i))
    p.evict(2, frozenset())
    assert list(p.b1) == [k(3), k(4)]
    p.clear()
    assert not (p.t1 or p.t2 or p.b1 or p.b2) and p.target_t1_size == 0.0


def test_arc_insert_drops_ghost_and_remove_forgets() -> None:
    p = ready_arc(2, 1)
    p.evict(1, frozenset())
    p.insert(k(1))
    assert not p.b1 and list(p.t1) == [k(1)]
    p.remove(k(1))
    assert not p.t1 and p.evictable_keys() == []


def test_lru_evictable_list_semantics() -> None:
    p = LRUCachePolicy(4)
    for i in (1, 2, 3):
        p.insert(k(i))
        p.mark_evictable(k(i))
    p.touch([k(1), k(2)])  # the first key ends up most recent
    assert p.evictable_keys() == [k(3), k(2), k(1)]
    p.mark_non_evictable(k(3))
    p.touch([k(3)])  # not idle: ignored
    assert p.evictable_keys() == [k(2), k(1)]
    p.mark_evictable(k(3))  # released: becomes the most recent
    assert p.evictable_keys() == [k(2), k(1), k(3)]
    assert p.evict(4, frozenset()) is None
    assert p.evict(2, frozenset({k(2)})) == [k(1), k(3)]


def test_kernels() -> None:
    assert lru_select_victims([1, 2, 3, 4], {2}, 2) == [1, 3]
    assert lru_select_victims([1, 2], {2}, 2) is None
    assert lru_select_victims([], set(), 0) == []
    # T1 preferred while its virtual size >= target; falls back to the other list
    assert arc_select_victims([1, 2], [3], 2, 0.0, 3, {1, 2, 3}, set()) == [(1, 1), (2, 1), (3, 2)]
    assert arc_select_victims([1, 2], [3], 2, 2.0, 2, {1, 2, 3}, set()) == [(1, 1), (3, 2)]
    assert arc_select_victims([1], [], 1, 4.0, 1, {1}, set()) == [(1, 1)]
    assert arc_select_victims([1], [2], 1, 0.0, 2, {1}, set()) is None
    assert arc_target_after_b1_hit(0.0, 1, 3, 10) == 3.0
    assert arc_target_after_b2_hit(5.0, 4, 2) == 3.0
    assert allocation_plan(4, 2, 3, 4) == (2, 2)
    assert usage_gauges(4, 3, 1) == (0.75, 0.25, 0.5)


def _policy_state(p: LRUCachePolicy | ARCCachePolicy) -> tuple[object, ...]:
    if isinstance(p, LRUCachePolicy):
        return (list(p.evictable_blocks),)
    return (
        list(p.t1),
        list(p.t2),
        list(p.b1),
        list(p.b2),
        p.target_t1_size,
        set(p._idle),
        set(p._pending),
    )


_ids = st.lists(st.integers(0, 7), max_size=8)


@given(
    policy=st.sampled_from([LRUCachePolicy, ARCCachePolicy]),
    history=st.lists(st.tuples(st.sampled_from(["ins", "ready", "pin", "touch", "evict"]), _ids)),
    batch=_ids,
    form=st.sampled_from(["insert", "ready", "pin"]),
)
def test_batch_hooks_equal_the_single_key_hooks_in_order(
    policy: type[LRUCachePolicy] | type[ARCCachePolicy],
    history: list[tuple[str, list[int]]],
    batch: list[int],
    form: str,
) -> None:
    """insert_many / mark_evictable_many / mark_non_evictable_many leave a policy as the
    single-key calls in order do, whatever came before (ghosts, idle keys, repeated keys)."""
    a, b = policy(4), policy(4)
    for p in (a, b):
        for op, ids in history:
            keys = [k(i) for i in ids]
            if op == "ins":
                for key in keys:
                    p.insert(key)
            elif op == "ready":
                for key in keys:
                    p.mark_evictable(key)
            elif op == "pin":
                for key in keys:
                    p.mark_non_evictable(key)
            elif op == "touch":
                p.touch(keys)
            else:
                p.evict(len(ids) % 3, frozenset())
    keys = [k(i) for i in batch]
    if form == "ready":
        a.mark_evictable_many(keys)
        for key in keys:
            b.mark_evictable(key)
    elif form == "pin":
        a.mark_non_evictable_many(keys)
        for key in keys:
            b.mark_non_evictable(key)
    else:
        a.insert_many(keys)
        for key in keys:
            b.insert(key)
    assert _policy_state(a) == _policy_state(b)


def test_lru_mark_evictable_many_orders_listed_and_repeated_keys_by_last_occurrence() -> None:
    """The batch form's second pass (a key already idle, or listed twice) ends as the
    single-key calls in order: untouched keys first, then the batch by last occurrence."""
    a, b = LRUCachePolicy(8), LRUCachePolicy(8)
    for p in (a, b):
        for i in (1, 2, 3):
            p.mark_evictable(k(i))
    batch = [k(4), k(1), k(5), k(4)]
    a.mark_evictable_many(batch)
    for key in batch:
        b.mark_evictable(key)
    assert a.evictable_keys() == b.evictable_keys() == [k(2), k(3), k(1), k(5), k(4)]
    a.mark_evictable_many([k(6), k(7)])  # all new: one pass, appended in order
    assert a.evictable_keys()[-2:] == [k(6), k(7)]


def test_arc_insert_many_drops_the_ghosts_of_the_keys_it_inserts() -> None:
    p = ready_arc(2, 1, 2)
    p.evict(2, frozenset())  # k1 and k2 become B1 ghosts
    assert list(p.b1) == [k(1), k(2)]
    p.insert_many([k(3), k(1)])
    assert list(p.b1) == [k(2)] and list(p.t1) == [k(3), k(1)]


def test_arc_evicts_exactly_n_of_many_idle_keys() -> None:
    # counts above the small-int cache: the victim loop stops at n by value, not identity
    p = ready_arc(400, *range(400))
    victims = p.evict(300, frozenset())
    assert victims == [k(i) for i in range(300)]
    assert p.evictable_keys() == [k(i) for i in range(300, 400)]

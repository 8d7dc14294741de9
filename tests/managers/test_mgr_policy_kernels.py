"""The CPU tier's pure policy kernels, value by value at their boundaries.

Reference counts at the 0/1 edge, gauges of an empty and a one-slot tier, an allocation
exactly at the high-water mark, a ghost list exactly at capacity, ARC's target steps for
ghost-list ratios above and below one, and LRU's scan over repeated or protected keys.
"""

from __future__ import annotations

import pytest

from statecore.managers.policies import (
    allocation_plan,
    arc_select_victims,
    arc_target_after_b1_hit,
    arc_target_after_b2_hit,
    lru_select_victims,
    pin_counts,
    trim_excess,
    unpin_counts,
    usage_gauges,
)


@pytest.mark.parametrize(
    ("ref", "evictable", "expected"),
    [(0, 3, (1, 2)), (1, 3, (2, 3)), (2, 0, (3, 0)), (0, 1, (1, 0))],
)
def test_pin_counts_leave_the_evictable_set_only_at_the_first_pin(
    ref: int, evictable: int, expected: tuple[int, int]
) -> None:
    assert pin_counts(ref, evictable) == expected


@pytest.mark.parametrize(
    ("ref", "evictable", "expected"),
    [(1, 3, (0, 4)), (2, 3, (1, 3)), (1, 0, (0, 1)), (5, 0, (4, 0))],
)
def test_unpin_counts_rejoin_the_evictable_set_only_at_the_last_unpin(
    ref: int, evictable: int, expected: tuple[int, int]
) -> None:
    assert unpin_counts(ref, evictable) == expected


@pytest.mark.parametrize(
    ("capacity", "busy", "write", "expected"),
    [
        (0, 0, 0, (0.0, 0.0, 0.0)),
        (1, 0, 0, (0.0, 0.0, 0.0)),
        (1, 1, 0, (1.0, 0.0, 1.0)),
        (1, 1, 1, (1.0, 1.0, 0.0)),
        (4, 3, 1, (0.75, 0.25, 0.5)),
        (2, 1, 1, (0.5, 0.5, 0.0)),
    ],
)
def test_usage_gauges_of_empty_one_slot_and_larger_tiers(
    capacity: int, busy: int, write: int, expected: tuple[float, float, float]
) -> None:
    assert usage_gauges(capacity, busy, write) == expected


@pytest.mark.parametrize(
    ("capacity", "high_water", "free_len", "n", "expected"),
    [
        (4, 2, 3, 4, (2, 2)),
        (4, 2, 3, 2, (2, 0)),  # exactly the fresh ids left
        (4, 2, 3, 1, (1, 0)),
        (4, 4, 3, 3, (0, 3)),  # at the high-water mark: recycled only
        (4, 0, 0, 0, (0, 0)),
        (4, 0, 0, 4, (4, 0)),
    ],
)
def test_allocation_plan_takes_fresh_ids_first(
    capacity: int, high_water: int, free_len: int, n: int, expected: tuple[int, int]
) -> None:
    assert allocation_plan(capacity, high_water, free_len, n) == expected


@pytest.mark.parametrize(
    ("length", "capacity", "excess"), [(5, 3, 2), (3, 3, 0), (2, 3, 0), (4, 3, 1), (0, 0, 0)]
)
def test_trim_excess_exactly_at_capacity(length: int, capacity: int, excess: int) -> None:
    assert trim_excess(length, capacity) == excess


@pytest.mark.parametrize(
    ("target", "b1", "b2", "capacity", "expected"),
    [
        (0.0, 1, 3, 10, 3.0),  # grows by |B2|/|B1| when above one
        (0.0, 4, 2, 10, 1.0),  # by one when the ratio is below one
        (2.0, 2, 2, 10, 3.0),  # ratio exactly one
        (9.0, 1, 3, 10, 10.0),  # capped at the capacity
        (10.0, 1, 0, 10, 10.0),
        (1.5, 2, 5, 10, 4.0),
    ],
)
def test_arc_target_after_b1_hit(
    target: float, b1: int, b2: int, capacity: int, expected: float
) -> None:
    assert arc_target_after_b1_hit(target, b1, b2, capacity) == expected


@pytest.mark.parametrize(
    ("target", "b1", "b2", "expected"),
    [
        (5.0, 4, 2, 3.0),  # shrinks by |B1|/|B2| when above one
        (5.0, 1, 4, 4.0),  # by one when the ratio is below one
        (5.0, 3, 3, 4.0),
        (1.0, 6, 2, 0.0),  # floored at zero
        (0.0, 0, 1, 0.0),
        (4.5, 5, 2, 2.0),
    ],
)
def test_arc_target_after_b2_hit(target: float, b1: int, b2: int, expected: float) -> None:
    assert arc_target_after_b2_hit(target, b1, b2) == expected


@pytest.mark.parametrize(
    ("candidates", "protected", "n", "expected"),
    [
        ([1, 2, 3], set(), 3, [1, 2, 3]),  # exactly as many as asked
        ([1, 2, 3], set(), 4, None),
        ([1, 1, 2], set(), 2, [1, 2]),  # a repeated candidate counts once
        ([1, 1], set(), 2, None),
        ([1, 2, 3], {1, 3}, 1, [2]),
        ([1, 2, 3], {1, 2, 3}, 1, None),
        ([], set(), 0, []),
        ([1], {1}, 0, []),
        ([3, 2, 1], set(), 1, [3]),  # the oldest first
    ],
)
def test_lru_select_victims_table(
    candidates: list[int], protected: set[int], n: int, expected: list[int] | None
) -> None:
    assert lru_select_victims(candidates, protected, n) == expected


def test_arc_select_victims_edges() -> None:
    idle = {1, 2, 3, 4}
    # zero victims: nothing is scanned, nothing chosen
    assert arc_select_victims([1], [2], 1, 0.0, 0, set(), set()) == []
    # T1 exactly at the target is preferred; one below it is not
    assert arc_select_victims([1, 2], [3], 2, 2.0, 1, idle, set()) == [(1, 1)]
    assert arc_select_victims([1, 2], [3], 2, 3.0, 1, idle, set()) == [(3, 2)]
    # a fractional target counts by its integer part
    assert arc_select_victims([1, 2], [3], 2, 2.9, 1, idle, set()) == [(1, 1)]
    # the virtual T1 shrinks by one per T1 victim
    assert arc_select_victims([1, 2], [3, 4], 2, 1.0, 3, idle, set()) == [(1, 1), (2, 1), (3, 2)]
    # pinned (not idle) and protected keys are passed over in both lists
    assert arc_select_victims([1, 2], [3, 4], 2, 0.0, 2, {2, 3, 4}, {3}) == [(2, 1), (4, 2)]

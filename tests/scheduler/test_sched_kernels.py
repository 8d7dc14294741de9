"""The scheduler's pure kernels, value by value at every boundary.

Each kernel decides on counts, ids and cursors; the scheduler calls exactly these functions.
The tables below pin their answers at the edges a flipped comparison, a constant off by one,
a swapped ``and``/``or`` or a dropped branch would move: a job id exactly at the stale
threshold or at the next id, a report of exactly the outstanding count, a rank beyond the
worker count, a job exactly at its stall timeout, a second pending chunk, a window that ends
exactly at the left edge.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecore import kernels
from statecore.kernels import ReportKind

H, P, M, R = kernels.HIT, kernels.HIT_PENDING, kernels.MISS, kernels.RETRY


# -- report classification (INV-EPOCH) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("job_id", "threshold", "next_id", "live", "stalled", "kind"),
    [
        (-1, 0, 5, False, False, ReportKind.UNKNOWN),  # never issued: negative
        (0, 0, 1, True, False, ReportKind.LIVE),  # job 0 is a real job
        (0, 0, 1, False, True, ReportKind.STALLED),
        (0, 0, 1, False, False, ReportKind.DUPLICATE),  # job 0 ended
        (2, 3, 5, True, False, ReportKind.LIVE),  # a load carried over a reset
        (2, 3, 5, False, True, ReportKind.STALLED),  # stalled before the reset
        (2, 3, 5, False, False, ReportKind.STALE),
        (0, 3, 5, False, False, ReportKind.STALE),
        (3, 3, 5, False, False, ReportKind.DUPLICATE),  # the first id of the epoch
        (4, 3, 5, False, False, ReportKind.DUPLICATE),  # the last id issued
        (5, 3, 5, False, False, ReportKind.UNKNOWN),  # the next id: not issued yet
        (9, 3, 5, False, False, ReportKind.UNKNOWN),
        (4, 5, 5, False, False, ReportKind.STALE),  # right after a reset
    ],
)
def test_classify_report_at_every_boundary(
    job_id: int, threshold: int, next_id: int, live: bool, stalled: bool, kind: ReportKind
) -> None:
    result = kernels.classify_report(job_id, threshold, next_id, live, stalled)
    assert result is kind
    # the contract's posts: LIVE exactly for a live job, STALLED exactly for a stalled one
    assert (result is ReportKind.LIVE, result is ReportKind.STALLED) == (live, stalled)


# -- quorum arithmetic (INV-QUORUM) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("pending", "ok", "bad", "expected"),
    [
        (3, 1, 1, (1, 1, 1, 0)),
        (2, 2, 0, (0, 2, 0, 0)),  # exactly the outstanding count: no excess
        (2, 3, 0, (0, 2, 0, 1)),
        (1, 2, 1, (0, 0, 1, 2)),  # the failure is accepted first
        (5, 0, 2, (3, 0, 2, 0)),
        (2, 0, 3, (0, 0, 2, 1)),
        (4, 3, 1, (0, 3, 1, 0)),  # the successes fill what the failure left: 4 - 1
        (0, 1, 0, (0, 0, 0, 1)),
        (0, 0, 0, (0, 0, 0, 0)),
    ],
)
def test_apply_report_accepts_failures_first_and_counts_the_excess(
    pending: int, ok: int, bad: int, expected: tuple[int, int, int, int]
) -> None:
    assert kernels.apply_report(pending, ok, bad) == expected


@pytest.mark.parametrize(
    ("pending", "ok", "bad", "over"),
    [
        (2, 1, 1, False),
        (2, 2, 0, False),
        (2, 2, 1, True),
        (2, 0, 3, True),
        (0, 0, 0, False),
        (1, 1, 1, True),  # one success and one failure: two reports
    ],
)
def test_over_report_is_strictly_more_than_outstanding(
    pending: int, ok: int, bad: int, over: bool
) -> None:
    assert kernels.over_report(pending, ok, bad) is over


@pytest.mark.parametrize(
    ("seen", "ok_mask", "bad_mask", "workers", "expected"),
    [
        (0b00, 0b01, 0b10, 2, (0b11, 1, 1, 0, 0)),
        (0b01, 0b111, 0b000, 2, (0b11, 1, 0, 1, 1)),  # rank 2 does not exist; rank 0 repeats
        (0b010, 0b000, 0b110, 3, (0b110, 0, 1, 1, 0)),
        (0b0, 0b1, 0b1, 1, (0b1, 0, 1, 0, 0)),  # success and failure: a failure
        (0b0, 0b1000, 0b0, 4, (0b1000, 1, 0, 0, 0)),  # the highest rank of four
        (0b0, 0b1000, 0b0, 3, (0b0, 0, 0, 0, 1)),  # one rank too high
        (0b11, 0b01, 0b10, 2, (0b11, 0, 0, 2, 0)),  # everything already seen
        (0b0, 0b100, 0b100, 2, (0b0, 0, 0, 0, 1)),  # a missing rank in both masks: one rank
    ],
)
def test_rank_delta_counts_each_rank_once(
    seen: int, ok_mask: int, bad_mask: int, workers: int, expected: tuple[int, ...]
) -> None:
    assert kernels.rank_delta(seen, ok_mask, bad_mask, workers) == expected


# -- reset, stalls, cursor -----------------------------------------------------------------------


def test_reset_plan_flushes_live_and_stalled_and_moves_the_threshold() -> None:
    flush, threshold = kernels.reset_plan(frozenset({3, 4}), frozenset({2}), 7, 1)
    assert (flush, threshold) == (frozenset({2, 3, 4}), 7)
    assert kernels.reset_plan(frozenset(), frozenset(), 0, 0) == (frozenset(), 0)


@pytest.mark.parametrize(
    ("now", "created", "timeout", "due"),
    [
        (10.0, 4.0, 6.0, True),
        (10.0, 4.0, 6.5, False),
        (9.5, 4.0, 6.0, False),
        (11.0, 4.0, 6.0, True),
    ],
)
def test_stall_due_exactly_at_the_timeout(
    now: float, created: float, timeout: float, due: bool
) -> None:
    assert kernels.stall_due(now, created, timeout) is due


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((64, 8, 4, 2, 10), 2),
        ((16, 8, 4, 2, 10), 2),  # every limit binds at once
        ((15, 8, 4, 2, 10), 1),  # one token short of a chunk
        ((16, 8, 3, 2, 10), 1),  # one block short of a chunk
        ((16, 8, 4, 2, 1), 1),
        ((0, 8, 4, 2, 10), 0),
        ((16, 8, 4, 2, 0), 0),
        ((7, 1, 7, 1, 9), 7),
    ],
)
def test_storable_chunks_at_each_bound(args: tuple[int, int, int, int, int], expected: int) -> None:
    assert kernels.storable_chunks(*args) == expected


# -- lookups -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("results", "budget", "expected"),
    [
        ([H, H, H], 0, 3),  # no miss: every chunk
        ([H, M], 0, 1),
        ([M, H], 0, 0),
        ([P, P, H], 3, 0),
        ([P, P, H], 2, None),  # the pending run starts at the FIRST pending chunk
        ([H, P, H, P, H], 4, 1),
        ([H, P, H, P, H], 3, None),
        ([H, P, M], 1, 1),  # a run exactly as long as the budget is recomputed
        ([H, P, M], 0, None),
        ([H, H, P, P, M], 2, 2),
        ([H, R, M], 5, None),
        ([R], 5, None),
        ([H, M, R], 5, 1),  # after the miss nothing counts (the scan stops there)
    ],
)
def test_prefix_hits_table(results: list[int], budget: int, expected: int | None) -> None:
    assert kernels.prefix_hits(results, budget) == expected


def _prefix_hits_by_scan(results: list[int], budget: int) -> int | None:
    """prefix_hits as one scan up to the first miss (its definition, for comparison)."""
    count, first_pending, retry = 0, None, False
    for r in results:
        if r == M:
            break
        if r == R:
            retry = True
        elif r == P and first_pending is None:
            first_pending = count
        count += 1
    if retry:
        return None
    if first_pending is None:
        return count
    return None if count - first_pending > budget else first_pending


@given(st.lists(st.sampled_from([M, H, P, R]), max_size=12), st.integers(0, 6))
def test_prefix_hits_equals_one_scan_to_the_first_miss(results: list[int], budget: int) -> None:
    """Whatever the answers hold (the all-hit case at C speed, anything after a miss)."""
    assert kernels.prefix_hits(results, budget) == _prefix_hits_by_scan(results, budget)
    assert kernels.prefix_hits(tuple(results), budget) == _prefix_hits_by_scan(results, budget)


@pytest.mark.parametrize(
    ("results", "window", "expected"),
    [
        ([H, H, H], 3, 3),  # the window ends at the left edge (index 0)
        ([H, H, H], 1, 3),
        ([H, H, H], 4, 3),  # no full window: the leading run
        ([M, H, H, M], 2, 3),
        ([H, H, M, H, H, M], 2, 5),  # the RIGHTMOST window
        ([H, H, M, H, M], 2, 2),
        ([H, P, M, H, M], 2, None),  # the leftmost window is the only full one: pending
        ([P, H, H], 2, 3),
        ([H, H, P], 2, None),  # the rightmost window is being written: wait for it
        ([P], 1, None),
        ([R, H, H], 2, 3),
        ([H, H, R], 2, None),
        ([M], 1, 0),
        ([M, M], 1, 0),
        ([H, M], 2, 1),  # no full window: the leading run of one hit
        ([M, H], 2, 0),  # no full window and the first chunk misses: nothing
    ],
)
def test_window_hits_table(results: list[int], window: int, expected: int | None) -> None:
    assert kernels.window_hits(results, window) == expected


@given(st.lists(st.sampled_from([M, H, P, R]), max_size=12), st.integers(0, 6), st.integers(1, 4))
def test_a_lookup_kernel_answers_the_same_over_its_own_answers_range(
    results: list[int], budget: int, window: int
) -> None:
    """What lets a single-group lookup stop after one pass: asking again over the chunks the
    first answer chose (the same manager answers, cut there) gives the same answer."""
    for decide in (
        lambda r: kernels.prefix_hits(r, budget),
        lambda r: kernels.window_hits(r, window),
    ):
        hits = decide(results)
        if hits:
            assert decide(results[:hits]) == hits


# -- fence index ---------------------------------------------------------------------------------


def test_fence_remove_goes_on_after_a_missing_pair() -> None:
    index: dict[int, set[int]] = {}
    kernels.fence_add(index, 1, [4, 5])
    kernels.fence_add(index, 2, [5, 6])
    # block 9 never held job 1, block 6 never held it either: both counted, and the blocks
    # listed after them are still released
    assert kernels.fence_remove(index, 1, [9, 4, 6, 5]) == 2
    assert index == {5: {2}, 6: {2}}
    assert kernels.fence_remove(index, 2, [5, 5, 6]) == 1
    assert index == {}

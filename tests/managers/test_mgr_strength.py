"""Manager behaviour that a sampled mutation run found unasserted.

A tiering reset drops its queued promotions for good (their old bytes never land in primary
slots that new keys took after the reset), the pending-promotion count returns to zero so the
engine can go idle, the tiering counters hold exact values, and ARC victim selection matches
a plain reference model (it never discards a candidate it already found).
"""

from __future__ import annotations

import itertools

import pytest

from statecore.errors import ConfigError
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import (
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
)
from statecore.managers import (
    ARCCachePolicy,
    CPUOffloadingManager,
    JobResult,
    MemoryTier,
    TieringOffloadingManager,
)
from statecore.managers.policies import arc_select_victims
from statecore.pool import CPUPool

END = ScheduleEndContext()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


# -- tiering: reset with queued promotions -------------------------------------------------------


def test_reset_drops_queued_promotions_for_good() -> None:
    pool = CPUPool(2, [4])
    tier = MemoryTier(pool)
    primary = CPUOffloadingManager(2)
    m = TieringOffloadingManager(primary, [tier])
    tier.put(k(7), b"OLD7")
    assert m.lookup(k(7), ReqContext("p")) is LookupResult.HIT_PENDING  # queued, not submitted
    m.reset_cache()
    assert m.get_stats()["promotions_dropped"] == 1
    # after the reset new keys take the primary slots (the scheduler's stores reuse at once)
    ctx = ReqContext("new")
    out = m.prepare_store([k(1)], ctx)
    assert out is not None
    (slot1,) = out.store_spec.slots  # type: ignore[attr-defined]
    pool.write_slot(slot1, b"NEW1")
    m.complete_store([k(1)], ctx)
    # a later promotion of another request: only it is submitted
    tier.put(k(8), b"NEW8")
    assert m.lookup(k(8), ReqContext("q")) is LookupResult.HIT_PENDING
    m.on_schedule_end(END)
    assert [j.keys for j in tier.submitted if not j.is_store] == [(k(8),)]
    m.on_schedule_end(END)
    assert pool.read_slot(slot1) == b"NEW1"  # no old promotion landed on k(1)'s slot
    assert m.lookup(k(8), ReqContext("q")) is LookupResult.HIT
    assert m.lookup(k(7), ReqContext("p")) is LookupResult.HIT_PENDING  # promoted afresh
    primary.check_invariants()


def test_pending_promotion_count_returns_to_zero_and_engine_goes_idle() -> None:
    tier = MemoryTier()
    m = TieringOffloadingManager(CPUOffloadingManager(4), [tier])
    tier.put(k(1))
    tier.put(k(2))
    assert not m.has_pending_work()
    assert m.lookup(k(1), ReqContext("a")) is LookupResult.HIT_PENDING
    assert m.lookup(k(2), ReqContext("b")) is LookupResult.HIT_PENDING
    assert m.has_pending_work()
    m.on_schedule_end(END)  # submitted; the tier finishes them on the next poll
    m.on_schedule_end(END)
    assert not m.has_pending_work()
    assert m.lookup(k(1), ReqContext("a")) is LookupResult.HIT
    m.on_schedule_end(END)
    m.on_schedule_end(END)
    assert not m.has_pending_work() and not tier.has_pending_work()
    assert m.get_stats()["promotions_submitted"] == 2


# -- tiering: exact counters ---------------------------------------------------------------------


def test_tiering_counters_have_exact_values() -> None:
    a, b = MemoryTier(name="a"), MemoryTier(name="b")
    m = TieringOffloadingManager(CPUOffloadingManager(8), [a, b])
    ctx = ReqContext("r")
    b.fail_keys.add(k(2))
    for i in (1, 2):
        out = m.prepare_store([k(i)], ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
    a.put(k(5))
    a.put(k(6))
    a.fail_keys.add(k(6))
    assert m.lookup(k(5), ReqContext("p")) is LookupResult.HIT_PENDING
    assert m.lookup(k(6), ReqContext("q")) is LookupResult.HIT_PENDING
    m.on_schedule_end(END)
    m.on_schedule_end(END)
    a.put(k(9))
    assert m.lookup(k(9), ReqContext("s")) is LookupResult.HIT_PENDING
    m.reset_cache()
    stats = m.get_stats()
    assert {
        name: stats[name]
        for name in (
            "cascades_submitted",
            "cascades_failed",
            "promotions_submitted",
            "promotions_failed",
            "promotions_dropped",
            "unknown_job_results",
        )
    } == {
        "cascades_submitted": 4,  # two stores, two tiers each
        "cascades_failed": 1,  # k(2) into tier b
        "promotions_submitted": 2,  # one batch per request
        "promotions_failed": 1,  # k(6)
        "promotions_dropped": 1,  # k(9), queued at the reset
        "unknown_job_results": 0,
    }
    assert m.get_stats()["cascades_submitted"] == 0  # counters are deltas per call


def test_unknown_tier_results_counted_exactly() -> None:
    class Bogus(MemoryTier):
        def get_finished(self):  # type: ignore[no-untyped-def]
            return [JobResult(12345, True), JobResult(12346, False)]

    m = TieringOffloadingManager(CPUOffloadingManager(2), [Bogus()])
    m.on_schedule_end(END)
    assert m.get_stats()["unknown_job_results"] == 2


# -- ARC victim selection ------------------------------------------------------------------------


def _reference_arc(
    t1: list[int],
    t2: list[int],
    target: float,
    n: int,
    idle: set[int],
    protected: set[int],
) -> list[tuple[int, int]] | None:
    """ARC victim choice written plainly: eligible keys of each list, oldest first; take from
    T1 while the shrinking T1 is at least ``int(target)`` long, else T2, else the other."""
    e1 = [x for x in t1 if x in idle and x not in protected]
    e2 = [x for x in t2 if x in idle and x not in protected]
    virtual, out = len(t1), []
    while len(out) < n:
        if e1 and (virtual >= int(target) or not e2):
            out.append((e1.pop(0), 1))
            virtual -= 1
        elif e2:
            out.append((e2.pop(0), 2))
        else:
            return None
    return out


def test_arc_victim_scan_keeps_the_candidates_it_found() -> None:
    # alternating preference: the T2 candidate found while T1 was preferred is used next
    assert arc_select_victims([1, 2], [3, 4], 2, 2.0, 2, {1, 2, 3, 4}, set()) == [(1, 1), (3, 2)]
    # T2 preferred, then exhausted: the T1 candidate found at the start is used
    assert arc_select_victims([1, 2], [3, 4], 2, 3.0, 3, {1, 2, 3, 4}, set()) == [
        (3, 2),
        (4, 2),
        (1, 1),
    ]


def test_arc_victim_selection_matches_reference_model() -> None:
    keys1, keys2 = [1, 2, 3], [4, 5, 6]
    cases = 0
    for l1, l2 in itertools.product(range(4), range(4)):
        t1, t2 = keys1[:l1], keys2[:l2]
        universe = t1 + t2
        for mask in range(1 << len(universe)):
            idle = {x for i, x in enumerate(universe) if mask >> i & 1}
            for protected in (set(), set(universe[:1]), set(universe[-1:])):
                for target in (0.0, 1.0, 1.5, 2.0, 3.0, 4.0):
                    for n in range(len(universe) + 2):
                        want = _reference_arc(t1, t2, target, n, idle, protected)
                        got = arc_select_victims(t1, t2, len(t1), target, n, idle, protected)
                        assert got == want, (t1, t2, target, n, idle, protected)
                        cases += 1
    assert cases > 10_000


@pytest.mark.parametrize("target", [0.0, 2.0, 5.0])
def test_arc_policy_evicts_the_selected_victims_into_ghost_lists(target: float) -> None:
    p = ARCCachePolicy(8)
    for i in range(1, 7):
        p.insert(k(i))
        p.mark_evictable(k(i))
    p.touch([k(4), k(5), k(6)])  # promoted to T2
    p.target_t1_size = target
    want = arc_select_victims(
        list(p.t1), list(p.t2), len(p.t1), target, 3, set(p.evictable_keys()), set()
    )
    assert want is not None
    victims = p.evict(3, set())
    assert victims == [key for key, _ in want]
    for key, src in want:
        assert key not in p.t1 and key not in p.t2
        assert key in (p.b1 if src == 1 else p.b2)
    assert set(p.evictable_keys()) == {k(i) for i in range(1, 7)} - set(victims)


# -- tiering: a tier the request may not load from is skipped, not the end of the search ---------


def test_disallowed_tier_is_skipped_and_the_next_one_promotes() -> None:
    cpu_tier = MemoryTier(medium=Medium.CPU, name="cpu")
    disk_tier = MemoryTier(medium=Medium.STORAGE, name="disk")
    cpu_tier.put(k(1))
    disk_tier.put(k(1))
    disk_tier.put(k(2))
    m = TieringOffloadingManager(CPUOffloadingManager(4), [cpu_tier, disk_tier])
    disk_only = ReqContext("r", load_tier_filter=TierFilter((TierMatcher(Medium.STORAGE),)))
    assert m.lookup(k(1), disk_only) is LookupResult.HIT_PENDING  # the first tier is skipped
    assert m.lookup(k(2), disk_only) is LookupResult.HIT_PENDING
    m.on_schedule_end(END)
    assert not cpu_tier.submitted
    assert [j.keys for j in disk_tier.submitted] == [(k(1), k(2))]


# -- CPU manager configuration: each bound is exact ----------------------------------------------


@pytest.mark.parametrize(
    ("field", "minimum"), [("num_slots", 0), ("store_threshold", 0), ("max_tracker_size", 1)]
)
def test_cpu_manager_config_bounds_are_exact(field: str, minimum: int) -> None:
    base: dict[str, int] = {"num_slots": 4, "store_threshold": 1, "max_tracker_size": 8}
    m = CPUOffloadingManager(**{**base, field: minimum})  # type: ignore[arg-type]
    assert getattr(m, "capacity" if field == "num_slots" else field) == minimum
    with pytest.raises(ConfigError, match=field):
        CPUOffloadingManager(**{**base, field: minimum - 1})  # type: ignore[arg-type]

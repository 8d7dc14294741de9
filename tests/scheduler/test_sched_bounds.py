"""Scheduler behaviour exactly at its time and size boundaries.

A job stalls exactly ``stall_timeout_s`` after its creation, when the stall check runs
exactly ``stall_check_interval_s`` after the last one; a stalled job's ledger entry expires
exactly ``stall_timeout_s`` after the stall; a request stops waiting for another request's
load of its hit chunks exactly ``stall_timeout_s`` after its first deferral. One tick earlier,
nothing happens. Each test pins both sides of its boundary, so a comparison flipped between
strict and non-strict is seen.
"""

from __future__ import annotations

from sched_harness import Harness, config, make_manager, offloaded, prefill

from statecore import GroupConfig, LookupResult, OffloadKey, Request, SchedulerConfig
from statecore.managers import CPUOffloadingManager, MemoryTier, TieringOffloadingManager
from statecore.specs.fakes import RecordingManager


def test_job_stalls_exactly_at_the_timeout_when_the_check_runs_exactly_at_the_interval(
    kind: str,
) -> None:
    h = Harness(make_manager(kind), config(stall_timeout_s=10.0, stall_check_interval_s=5.0))
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")  # created at 0
    h.clock.now = 4.5
    h.report()  # under the interval since construction: no check
    h.clock.now = 5.0
    h.report()  # exactly the interval: the check runs, nothing is due yet
    assert job in h.sched.jobs
    h.clock.now = 9.5
    h.report()  # under the interval since the last check (5.0): no check
    assert job in h.sched.jobs
    h.clock.now = 10.0
    h.report()  # exactly the interval since 5.0, exactly the timeout since 0: stalls
    assert job not in h.sched.jobs and job in h.sched.stalled_jobs
    assert h.sched.counters.jobs_stalled == 1
    assert h.sched.counters.stalled_expired == 0


def test_stalled_job_leaves_the_ledger_exactly_one_timeout_after_the_stall(kind: str) -> None:
    h = Harness(make_manager(kind), config(stall_timeout_s=10.0, stall_check_interval_s=0.5))
    h.add("a", list(range(8)))
    (job,) = prefill(h, "a")
    h.clock.now = 9.5
    h.report()
    assert job in h.sched.jobs
    h.clock.now = 10.0
    h.report()  # stalled at 10.0
    assert job in h.sched.stalled_jobs
    h.clock.now = 19.5
    h.report()
    assert job in h.sched.stalled_jobs
    h.clock.now = 20.0
    h.report()
    assert job not in h.sched.stalled_jobs
    c = h.sched.counters
    assert (c.jobs_stalled, c.stalled_expired, c.stalled_retired, c.jobs_failed) == (1, 1, 0, 0)


def test_young_job_after_a_due_one_is_not_stalled(kind: str) -> None:
    """The stall check walks jobs in creation order and stops at the first young one: an
    older job stalls, a younger one created later stays live."""
    h = Harness(make_manager(kind), config(stall_timeout_s=10.0, stall_check_interval_s=1.0))
    h.add("a", list(range(8)))
    (old,) = prefill(h, "a")
    h.clock.now = 3.0
    h.add("b", list(range(50, 58)))
    (young,) = prefill(h, "b")
    h.clock.now = 10.0
    h.report()
    assert old in h.sched.stalled_jobs and young in h.sched.jobs
    h.clock.now = 13.0
    h.report()
    assert young in h.sched.stalled_jobs and h.sched.counters.jobs_stalled == 2


def test_lookup_stops_waiting_for_other_loaders_exactly_at_the_stall_timeout(kind: str) -> None:
    h = Harness(make_manager(kind), config(stall_timeout_s=10.0, stall_check_interval_s=5.0))
    offloaded(h, "a", list(range(16)))
    h.add("b", list(range(16)) + [7, 7, 7, 7])
    c = h.add("c", list(range(16)) + [8, 8, 8, 8])
    assert h.admit("b") == (16, True)  # b loads the shared chunks (never reported here)
    h.clock.now = 2.0
    assert h.sched.get_num_new_matched_tokens(c, 0) == (None, False)  # deferred since 2.0
    h.clock.now = 11.5
    assert h.sched.get_num_new_matched_tokens(c, 0) == (None, False)  # 9.5 s: still waits
    assert h.sched.counters.loader_waits_expired == 0
    h.clock.now = 12.0
    assert h.sched.get_num_new_matched_tokens(c, 0) == (16, True)  # 10 s: loads its own copy
    cnt = h.sched.counters
    assert (cnt.loader_waits_expired, cnt.lookups_deferred, cnt.lookups) == (1, 2, 5)
    assert h.sched.requests["c"].deferred_since is None  # a hit ends the deferral


def test_lookup_asks_nothing_beyond_the_first_miss() -> None:
    """Chunks after the first miss are never looked up: with a tiering manager a lookup of a
    key found in a secondary tier starts its promotion, which must not happen for chunks
    the request cannot load anyway."""
    tier = MemoryTier()
    manager = TieringOffloadingManager(CPUOffloadingManager(16), [tier])
    h = Harness(manager, config())
    b = h.add("b", list(range(16)))
    assert h.sched.get_num_new_matched_tokens(b, 0) == (0, False)  # computes b's keys
    keys = h.sched.request_keys("b")[0]
    tier.put(keys[2])
    tier.put(keys[3])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (0, False)  # chunk 0 misses
    assert not manager.has_pending_work()  # no promotion queued for chunks 2 and 3
    tier.put(keys[0])
    assert h.sched.get_num_new_matched_tokens(b, 0) == (None, False)  # chunk 0 is promoted
    assert manager.has_pending_work()


KeyList = tuple[OffloadKey, ...]


def _two_windows() -> tuple[RecordingManager, Harness, Request, KeyList, KeyList]:
    """Two sliding-window groups (2 and 4 chunks, the narrow one configured first) and a
    33-token request ``b`` whose keys a first lookup (a miss everywhere) computed."""
    cfg = SchedulerConfig(
        groups=(GroupConfig(4, sliding_window=8), GroupConfig(4, sliding_window=16))
    )
    fake = RecordingManager()
    h = Harness(fake, cfg)
    b = h.add("b", list(range(33)))
    assert h.sched.get_num_new_matched_tokens(b, 0) == (0, False)
    narrow, wide = h.sched.request_keys("b")
    return fake, h, b, narrow, wide


def test_lookup_asks_the_wider_sliding_window_first() -> None:
    """Two sliding-window groups (windows of 2 and 4 chunks, the narrow one configured
    first). The wide one is asked first: its window ends at chunk 6, which caps the narrow
    one's scan below its two chunks still being written, so the lookup answers 24 tokens.
    Asking the narrow one first would see the pending chunks and defer."""
    fake, h, b, narrow, wide = _two_windows()
    for i in range(8):
        fake.lookup_override[narrow[i]] = LookupResult.HIT if i < 6 else LookupResult.HIT_PENDING
    for i in range(6):
        fake.lookup_override[wide[i]] = LookupResult.HIT  # chunks 6 and 7: miss
    assert h.sched.get_num_new_matched_tokens(b, 0) == (24, True)


def test_lookup_runs_until_no_group_lowers_the_hit_any_more() -> None:
    """The wide window (asked first) covers 8 chunks; the narrow one then caps the hit at 6;
    asked again below that cap, the wide one finds no full window (chunk 2 misses) and only a
    leading run of 2 chunks: the lookup answers 8 tokens, not 24."""
    fake, h, b, narrow, wide = _two_windows()
    for i in range(8):
        if i != 2:
            fake.lookup_override[wide[i]] = LookupResult.HIT
        if i < 6:
            fake.lookup_override[narrow[i]] = LookupResult.HIT
    assert h.sched.get_num_new_matched_tokens(b, 0) == (8, True)

"""The scheduler's hooks answer what they did: the load a call created, the keys each store
job writes, the failed loads per request, what a reset did. A caller reads these answers
instead of the scheduler's tables."""

from __future__ import annotations

from typing import Any

from sched_harness import Harness, admit_with_load, config, make_manager, offloaded

from statecore import (
    ConnectorOutputResult,
    CreatedLoad,
    OffloadingScheduler,
    ResetResult,
    ResetStatus,
)
from statecore.errors import ManagerError
from statecore.managers import CPUOffloadingManager


class FlakyManager(CPUOffloadingManager):
    """The CPU manager, whose next ``prepare_load`` or ``reset_cache`` raises when asked."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.fail: set[str] = set()

    def prepare_load(self, keys: Any, ctx: Any) -> Any:
        if "prepare_load" in self.fail:
            self.fail.discard("prepare_load")
            raise ManagerError("prepare_load refused")
        return super().prepare_load(keys, ctx)

    def reset_cache(self) -> None:
        if "reset_cache" in self.fail:
            self.fail.discard("reset_cache")
            raise ManagerError("reset refused")
        super().reset_cache()


def unchecked(manager: CPUOffloadingManager) -> Harness:
    """A harness whose scheduler tolerates typed manager errors (counted, not raised)."""
    h = Harness(manager, config())
    h.sched = OffloadingScheduler(h.config, manager, h.clock, checked=False)
    return h


def test_update_state_after_alloc_returns_the_load_it_created(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    h.add("b", list(range(16)) + [1])
    hits, _ = h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)
    assert hits == 16
    blocks = h.alloc(5)
    load = h.sched.update_state_after_alloc(h.reqs["b"], [blocks], hits)
    assert isinstance(load, CreatedLoad)
    job = h.sched.jobs[load.job_id]
    assert not job.is_store and load.req_id == "b"
    assert load.keys == job.keys and len(load.keys) == 4
    assert load.block_ids == job.blocks == tuple(blocks[:4])
    meta = h.step()
    assert list(meta.load_jobs) == [load.job_id]
    assert meta.load_jobs[load.job_id].dst.block_ids == load.block_ids  # type: ignore[attr-defined]


def test_update_state_after_alloc_without_a_load_returns_none(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    assert h.sched.update_state_after_alloc(h.reqs["a"], [h.alloc(4)], 0) is None
    assert not h.sched.jobs


def test_metadata_carries_the_keys_of_each_store_job(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    h.add("a", list(range(16)))
    h.add("c", list(range(200, 208)))
    h.admit("a")
    h.admit("c")
    meta = h.step([h.schedule("a", 16), h.schedule("c", 8)], new=["a", "c"])
    assert len(meta.store_jobs) == 2
    assert set(meta.store_keys) == set(meta.store_jobs)
    for job_id, keys in meta.store_keys.items():
        assert keys == h.sched.jobs[job_id].keys
    assert sorted(len(k) for k in meta.store_keys.values()) == [2, 4]
    empty = h.step()
    assert not empty.store_jobs and not empty.store_keys and not empty.manager_reset


def test_output_reports_failed_loads_per_request(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    offloaded(h, "e", list(range(100, 116)))
    h.add("b", list(range(16)) + [1])
    h.add("d", list(range(100, 116)) + [2])
    assert h.admit("b") == (16, True) and h.admit("d") == (16, True)
    loads = {h.sched.jobs[j].req.req_id: j for j in h.step().load_jobs}
    result = h.report(completed=[loads["b"]], failed=[loads["d"]])
    assert result.finished_loads == {"b", "d"}
    assert result.failed_loads == {"d": frozenset(h.blocks["d"][0][:4])}
    assert result.invalid_block_ids == result.failed_loads["d"]
    again = h.report()
    assert again == ConnectorOutputResult() and not again.failed_loads


def test_a_load_that_fails_before_it_starts_is_a_failed_load() -> None:
    manager = FlakyManager(64)
    h = unchecked(manager)
    offloaded(h, "a", list(range(16)))
    h.add("b", list(range(16)) + [1])
    hits, _ = h.sched.get_num_new_matched_tokens(h.reqs["b"], 0)
    assert hits == 16
    blocks = h.alloc(5)
    manager.fail.add("prepare_load")
    assert h.sched.update_state_after_alloc(h.reqs["b"], [blocks], hits) is None
    assert h.sched.counters.manager_errors == 1
    result = h.report()
    assert result.finished_loads == {"b"}
    assert result.failed_loads == {"b": frozenset(blocks[:4])}


def test_reset_says_what_it_dropped_and_carried(kind: str) -> None:
    h = Harness(make_manager(kind), config())
    offloaded(h, "a", list(range(16)))
    offloaded(h, "e", list(range(100, 116)))
    carried = admit_with_load(h, "b", list(range(16)) + [1], 16)  # sent to the workers
    h.add("d", list(range(100, 116)) + [2])
    assert h.admit("d") == (16, True)  # created, not sent
    (unsent,) = (j for j in h.sched.jobs if j != carried)
    reset = h.sched.reset()
    assert isinstance(reset, ResetResult) and reset
    assert reset.status is ResetStatus.DONE and reset.reason is None
    assert reset.carried_loads == {carried}
    assert reset.discarded_loads == {"d"}
    assert reset.discarded_jobs == {unsent}
    assert reset.flushed_jobs == {carried, unsent}
    assert h.step().jobs_to_flush >= reset.flushed_jobs
    result = h.report([carried])
    assert result.finished_loads == {"b", "d"} and set(result.failed_loads) == {"d"}


def test_a_deferred_manager_reset_is_answered_and_its_retry_named() -> None:
    manager = FlakyManager(64)
    h = unchecked(manager)
    offloaded(h, "a", list(range(16)))
    manager.fail.add("reset_cache")
    reset = h.sched.reset()
    assert reset.status is ResetStatus.MANAGER_RESET_DEFERRED and not reset
    assert reset.reason is not None and "reset refused" in reset.reason
    meta = h.step()  # the retry takes
    assert meta.manager_reset and not h.sched.manager_reset_pending
    assert not h.step().manager_reset  # said once
    assert h.sched.reset_cache() is True  # the bool form of the same call


def test_reset_cache_answers_false_when_the_manager_reset_raised() -> None:
    manager = FlakyManager(64)
    h = unchecked(manager)
    manager.fail.add("reset_cache")
    assert h.sched.reset_cache() is False
    manager.fail.add("reset_cache")
    assert not h.step().manager_reset  # the retry raised again: still pending
    assert h.sched.manager_reset_pending
    assert h.step().manager_reset

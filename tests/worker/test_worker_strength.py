"""Worker behaviour sampled mutation runs found unasserted: the range check of a
transfer's ids names exactly the offending ids, and the step protocol's edges (flushes, jobs
submitted twice, shutdown with jobs still running, what the memory backend reports)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import pytest
from worker_harness import simple_mapping

from statecore.errors import ConfigError, InvalidMetadataError, SpecError
from statecore.manager import CPULoadStoreSpec
from statecore.pool import CPUPool
from statecore.wire import ConnectorMetadata, TransferJob, WorkerMetadata
from statecore.worker import (
    FaultyBackend,
    GroupSpan,
    MemoryBackend,
    OffloadingWorker,
    TransferResult,
    aggregate,
    job_specs,
    plan_block_copies,
    plan_spans,
    validate_ids,
)


@pytest.mark.parametrize(
    ("blocks", "slots", "message"),
    [
        ([0, 9, 3, 12], [0], r"GPU block ids \[9, 12\] out of range 0\.\.8"),
        ([-1, 2], [0], r"GPU block ids \[-1\] out of range 0\.\.8"),
        ([0], [0, 4, 5, 9], r"CPU slots \[4, 5, 9\] out of range 0\.\.3"),
        ([0], [-2, 1], r"CPU slots \[-2\] out of range 0\.\.3"),
        ([0], [1, 2, 1], r"lists a slot twice"),
    ],
)
def test_validate_ids_names_exactly_the_bad_ids(
    blocks: list[int], slots: list[int], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        validate_ids(blocks, slots, 9, 4)


def test_validate_ids_accepts_the_edges() -> None:
    validate_ids([0, 8], [0, 3], 9, 4)
    validate_ids([], [], 0, 0)


# -- the step protocol's edges (seed 1801 survivors) ---------------------------------------------

PAGE = 64


def _backend(auto: bool = True, cls: type[MemoryBackend] = MemoryBackend) -> MemoryBackend:
    pool = CPUPool(8, [PAGE, 2 * PAGE])
    return cls(
        [PAGE, 2 * PAGE],
        16,
        [pool.region(0), pool.region(1)],
        1,
        group_tensors=[[0], [1]],
        auto_progress=auto,
    )


def _meta(
    loads: dict[int, TransferJob] | None = None,
    stores: dict[int, TransferJob] | None = None,
    flush: frozenset[int] = frozenset(),
) -> ConnectorMetadata:
    return ConnectorMetadata(dict(loads or {}), dict(stores or {}), flush)


def test_a_job_with_a_wrong_side_names_its_direction() -> None:
    job = TransferJob("r", CPULoadStoreSpec((1,)), CPULoadStoreSpec((1,)))
    with pytest.raises(SpecError, match=r"^store of request 'r': GPU side is CPULoadStoreSpec"):
        job_specs(job, True)
    with pytest.raises(SpecError, match=r"^load of request 'r': GPU side is CPULoadStoreSpec"):
        job_specs(job, False)


def test_end_step_queues_the_stores_after_one_a_flush_pulled_forward() -> None:
    w = OffloadingWorker(_backend(auto=False))
    first = simple_mapping([1], [1], 2).store()
    second = simple_mapping([2], [2], 2).store()
    m = _meta(stores={4: first, 5: second}, flush=frozenset({4}))
    w.start_step(m)  # job 4 is pulled forward by the flush
    w.end_step(m)
    assert w.deferred == (5,)


def test_a_job_submitted_twice_is_counted_and_runs_once() -> None:
    be = _backend(auto=False)
    w = OffloadingWorker(be)
    load = simple_mapping([1], [1], 2).load()
    w.start_step(_meta(loads={1: load}))
    w.start_step(_meta(loads={1: load}))
    assert w.ignored_results == 1 and w.in_flight == {1}
    be.progress()
    assert w.build_worker_metadata().completed == {1: 1}


class _StuckBackend(MemoryBackend):
    """A backend whose ``wait`` returns with the jobs still running."""

    def wait(self, job_ids: Collection[int]) -> None:
        return None


def test_shutdown_fails_the_jobs_the_backend_could_not_finish() -> None:
    w = OffloadingWorker(_backend(auto=False, cls=_StuckBackend))
    w.start_step(_meta(loads={1: simple_mapping([1], [1], 2).load()}))
    w.shutdown()
    rep = w.build_worker_metadata()
    assert rep.failed == {1: 1} and rep.completed == {}
    assert w.in_flight == frozenset()


def test_memory_backend_reports_bytes_moved_and_no_transfer_time() -> None:
    # in-memory copies are not timed: a made-up duration would fake a throughput figure
    be = _backend(auto=False)
    be.submit(3, simple_mapping([5], [2], 2).load(), False)
    be.progress()
    assert be.poll() == [TransferResult(3, True, PAGE, 0.0, False)]


def test_range_errors_name_the_last_valid_id_for_even_counts_too() -> None:
    with pytest.raises(SpecError, match=r"GPU block ids \[10\] out of range 0\.\.9$"):
        validate_ids([10], [0], 10, 4)
    with pytest.raises(SpecError, match=r"CPU slots \[6\] out of range 0\.\.5$"):
        validate_ids([0], [6], 10, 6)


def test_a_range_error_names_at_most_eight_bad_ids() -> None:
    with pytest.raises(SpecError, match=r"CPU slots \[10, 11, 12, 13, 14, 15, 16, 17\] out of"):
        validate_ids([0], list(range(10, 20)), 10, 4)


def test_a_plan_of_many_distinct_slots_is_not_a_repeated_slot() -> None:
    """300 slots, each once (counts past CPython's small-int cache): a valid plan."""
    n = 300
    plan = plan_block_copies(tuple(range(n)), (n,), (0,), tuple(range(1000, 1000 + n)), 1)
    assert [(c[1], c[2]) for c in plan] == [(b, 1000 + b) for b in range(n)]


def test_memory_backend_progress_counts_the_jobs_it_ran_and_auto_progress_is_default() -> None:
    be = _backend(auto=False)
    assert be.progress() == 0
    be.submit(1, simple_mapping([5], [2], 2).load(), False)
    be.submit(2, simple_mapping([6], [3], 2).store(), True)
    assert be.progress() == 2 and be.progress() == 0
    pool = CPUPool(8, [PAGE, 2 * PAGE])
    auto = MemoryBackend(
        [PAGE, 2 * PAGE], 16, [pool.region(0), pool.region(1)], 1, group_tensors=[[0], [1]]
    )
    auto.submit(3, simple_mapping([5], [2], 2).load(), False)
    assert [r.job_id for r in auto.poll()] == [3]  # runs at poll without progress()


# -- seed 6007 survivors -----------------------------------------------------------------------


def test_memory_backend_progress_runs_at_most_max_jobs_stores_first() -> None:
    be = _backend(auto=False)
    be.submit(1, simple_mapping([5], [2], 2).load(), False)
    be.submit(2, simple_mapping([6], [3], 2).store(), True)
    be.submit(3, simple_mapping([7], [4], 2).load(), False)
    assert be.progress(max_jobs=0) == 0 and be.poll() == []
    assert be.progress(max_jobs=2) == 2
    assert [(r.job_id, r.is_store) for r in be.poll()] == [(2, True), (1, False)]
    assert be.progress(max_jobs=5) == 1 and [r.job_id for r in be.poll()] == [3]


@pytest.mark.parametrize("missing", ["submit", "poll", "wait", "shutdown"])
def test_worker_refuses_a_backend_without_a_transfer_method(missing: str) -> None:
    class Partial:
        def __init__(self) -> None:
            for name in ("submit", "poll", "wait", "shutdown"):
                if name != missing:
                    setattr(self, name, lambda *args: None)

    with pytest.raises(ConfigError, match=rf"must be a TransferBackend \(no {missing}\(\)\)"):
        OffloadingWorker(Partial())  # type: ignore[arg-type]


def test_an_injected_job_failure_reports_no_bytes_and_no_time() -> None:
    be = FaultyBackend(_backend(auto=False), fail_job=lambda j: j == 7)
    be.submit(7, simple_mapping([5], [2], 2).store(), True)
    assert be.poll() == [TransferResult(7, False, 0, 0.0, True)]


@pytest.mark.parametrize("at", [0, 1])
def test_aggregate_refuses_a_report_with_a_count_that_is_not_an_int(at: int) -> None:
    reports = [WorkerMetadata(completed={1: 1})]
    reports.insert(at, WorkerMetadata(completed={2: "1"}))  # type: ignore[dict-item]
    with pytest.raises(InvalidMetadataError, match=r"aggregate.*meta\.completed\[2\]"):
        aggregate(reports)


# -- exploratory sample seed 7101 ------------------------------------------------------------------


def test_plan_spans_refuses_a_negative_chunk_size_and_takes_many_groups() -> None:
    with pytest.raises(SpecError, match=r"blocks_per_chunk must be > 0, got -1"):
        plan_spans((1,), (0,), 1, 1, -1)
    spans = plan_spans((1,) * 300, (0,) * 300, 300, 300, 1)  # lengths above the small-int cache
    assert len(spans) == 300 and spans[-1] == GroupSpan(299, 299, 1, 299, 0, 1)
    assert len({*spans}) == 300  # frozen spans: hashable values
    with pytest.raises(dataclasses.FrozenInstanceError):
        spans[0].num_blocks = 2  # type: ignore[misc]


def test_range_errors_list_at_most_eight_bad_ids() -> None:
    with pytest.raises(SpecError, match=r"GPU block ids \[10, 11, 12, 13, 14, 15, 16, 17\] out"):
        validate_ids(list(range(10, 20)), [0], 10, 4)


class _EchoingBackend(MemoryBackend):
    """A backend that also reports a job this worker never submitted, first."""

    def poll(self) -> list[TransferResult]:
        return [TransferResult(999, True, 0, 0.0, False), *super().poll()]


def test_a_result_for_an_unknown_job_is_counted_and_the_rest_are_still_taken() -> None:
    w = OffloadingWorker(_backend(cls=_EchoingBackend))
    w.start_step(_meta(loads={1: simple_mapping([1], [1], 2).load()}))
    assert w.build_worker_metadata().completed == {1: 1}
    assert w.ignored_results == 1 and w.in_flight == frozenset()


def test_memory_backend_refuses_fewer_cpu_regions_than_tensors() -> None:
    pool = CPUPool(8, [PAGE])
    with pytest.raises(SpecError, match="2 GPU tensors but 1 CPU regions"):
        MemoryBackend([PAGE, PAGE], 16, [pool.region(0)], 1)

"""The worker's step protocol, reporting and fault handling, over the pure MemoryBackend."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from worker_harness import random_mapping, simple_mapping

from statecore.errors import LifecycleError, SpecError
from statecore.manager import CPULoadStoreSpec
from statecore.pool import CPUPool
from statecore.specs.bad_inputs import IncomparableInt
from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob, WorkerMetadata
from statecore.worker import (
    FaultyBackend,
    MemoryBackend,
    OffloadingWorker,
    aggregate,
    plan_block_copies,
    plan_spans,
    validate_ids,
)

PAGE = 64
NUM_BLOCKS = 32
NUM_SLOTS = 24


def make_backend(bpc: int = 1, auto: bool = True, seed: int = 0) -> tuple[MemoryBackend, CPUPool]:
    pool = CPUPool(NUM_SLOTS, [PAGE * bpc, 2 * PAGE * bpc])
    be = MemoryBackend(
        [PAGE, 2 * PAGE],
        NUM_BLOCKS,
        [pool.region(0), pool.region(1)],
        bpc,
        group_tensors=[[0], [1]],
        auto_progress=auto,
    )
    rng = random.Random(seed)
    for buf in be.gpu:
        buf[:] = rng.randbytes(len(buf))
    return be, pool


def gpu_page(be: MemoryBackend, t: int, block: int) -> bytes:
    p = be.page_bytes[t]
    return bytes(be.gpu[t][block * p : (block + 1) * p])


def cpu_page(be: MemoryBackend, t: int, slot: int, sub: int) -> bytes:
    p = be.page_bytes[t]
    off = (slot * be.bpc + sub) * p
    return bytes(be.cpu[t][off : off + p])


def assert_stored(be: MemoryBackend, job: TransferJob) -> None:
    gpu, cpu = job.src, job.dst
    assert isinstance(gpu, GPULoadStoreSpec) and isinstance(cpu, CPULoadStoreSpec)
    plan = plan_block_copies(gpu.block_ids, gpu.group_sizes, gpu.block_indices, cpu.slots, be.bpc)
    for group, block, slot, sub in plan:
        for t in be.group_tensors[group]:
            assert cpu_page(be, t, slot, sub) == gpu_page(be, t, block)


def meta(loads=None, stores=None, flush=()) -> ConnectorMetadata:
    return ConnectorMetadata(dict(loads or {}), dict(stores or {}), frozenset(flush))


# -- mapping arithmetic ------------------------------------------------------------------------


def test_plan_spans_sub_block_skip() -> None:
    spans = plan_spans((4, 2, 0), (1, 3, 5), 6, 3, 3)
    assert [(s.first_block, s.num_blocks, s.first_chunk, s.skip, s.num_chunks) for s in spans] == [
        (0, 4, 0, 1, 2),
        (4, 2, 2, 0, 1),
        (6, 0, 3, 2, 0),
    ]
    plan = plan_block_copies((10, 11, 12, 13, 20, 21), (4, 2, 0), (1, 3, 5), (7, 8, 9), 3)
    assert plan == [
        (0, 10, 7, 1),
        (0, 11, 7, 2),
        (0, 12, 8, 0),
        (0, 13, 8, 1),
        (1, 20, 9, 0),
        (1, 21, 9, 1),
    ]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((2,), (0, 0), 2, 2, 1), "group sizes but"),
        (((2, 1), (0,), 3, 3, 1), "2 group sizes but 1 block indices"),
        (((2, 1), (0, 0), 2, 3, 1), "sum to 3"),
        (((2,), (1,), 2, 1, 2), "needs 2 CPU chunks"),
        (((2,), (0,), 2, 3, 1), "lists 3 slots"),
        (((-1,), (0,), -1, 0, 1), "negative group size"),
        (((1,), (-1,), 1, 1, 1), "negative block index"),
        (((1,), (0,), 1, 1, 0), "blocks_per_chunk"),
    ],
)
def test_plan_spans_rejects_mismatches(args: tuple, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        plan_spans(*args)


def test_plan_and_ids_validation() -> None:
    with pytest.raises(SpecError, match="slot twice"):
        plan_block_copies((1, 2), (2,), (0,), (3, 3), 1)
    with pytest.raises(SpecError, match="GPU block ids"):
        validate_ids((0, 32), (0,), 32, 4)
    with pytest.raises(SpecError, match="CPU slots"):
        validate_ids((0,), (-1,), 32, 4)
    validate_ids((0, 31), (0, 3), 32, 4)


@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=4),
    data=st.data(),
    bpc=st.integers(1, 4),
)
def test_plan_matches_chunk_positions(sizes: list[int], data: st.DataObject, bpc: int) -> None:
    """Oracle: group g's blocks fill virtual CPU positions skip, skip+1, ... of its chunks."""
    idx = [data.draw(st.integers(0, 50)) for _ in sizes]
    chunks = [-(-(n + i % bpc) // bpc) if n else 0 for n, i in zip(sizes, idx, strict=True)]
    slots = tuple(range(100, 100 + sum(chunks)))
    blocks = tuple(range(sum(sizes)))
    plan = plan_block_copies(blocks, tuple(sizes), tuple(idx), slots, bpc)
    k = 0
    base = 0
    for g, n in enumerate(sizes):
        for j in range(n):
            pos = idx[g] % bpc + j
            assert plan[k] == (g, blocks[k], slots[base + pos // bpc], pos % bpc)
            k += 1
        base += chunks[g]
    assert k == len(plan)


# -- step protocol -------------------------------------------------------------------------------


def test_loads_now_stores_next_step() -> None:
    be, _ = make_backend(auto=False)
    w = OffloadingWorker(be)
    store = simple_mapping([1, 2], [0, 1], 2).store()
    load = simple_mapping([5], [2], 2).load()
    m1 = meta(loads={1: load}, stores={2: store})
    w.start_step(m1)
    assert w.in_flight == {1}
    w.end_step(m1)
    assert w.deferred == (2,) and w.in_flight == {1}
    assert w.build_worker_metadata().is_empty()  # nothing ran yet
    w.start_step(meta())
    assert w.in_flight == {1, 2} and w.deferred == ()
    be.progress()
    rep = w.build_worker_metadata()
    assert rep.completed == {1: 1, 2: 1} and rep.failed == {}
    assert rep.stats.store.bytes == 2 * PAGE and rep.stats.load.bytes == PAGE
    assert_stored(be, store)
    assert w.build_worker_metadata().is_empty()


def test_flush_of_deferred_store_completes_before_start_step_returns() -> None:
    be, _ = make_backend(auto=False)
    w = OffloadingWorker(be)
    store = simple_mapping([3, 4], [5, 6], 2).store()
    other = simple_mapping([7], [9], 2).store()
    m1 = meta(stores={10: store, 11: other})
    w.start_step(m1)
    w.end_step(m1)
    before = cpu_page(be, 0, 5, 0)
    w.start_step(meta(flush={10}))
    # progress() was never called: only the flush's wait can have moved these bytes
    assert cpu_page(be, 0, 5, 0) == gpu_page(be, 0, 3) != before
    assert_stored(be, store)
    rep = w.build_worker_metadata()
    assert rep.completed == {10: 1}  # job 11 was submitted, not run
    assert w.in_flight == {11}


def test_flush_pulls_this_steps_store_forward() -> None:
    be, _ = make_backend(auto=False)
    w = OffloadingWorker(be)
    store = simple_mapping([8, 9], [1, 2], 2).store()
    m = meta(stores={4: store}, flush={4})
    w.start_step(m)
    assert_stored(be, store)
    w.end_step(m)
    assert w.deferred == ()  # not queued a second time
    assert w.build_worker_metadata().completed == {4: 1}
    w.start_step(meta())
    be.progress()
    assert w.build_worker_metadata().is_empty()


def test_flush_ignores_unknown_and_finished_ids() -> None:
    be, _ = make_backend()
    w = OffloadingWorker(be)
    w.start_step(meta(loads={1: simple_mapping([1], [1], 2).load()}))
    w.end_step(meta())
    assert w.build_worker_metadata().completed == {1: 1}
    w.start_step(meta(flush={1, 99}))
    assert w.build_worker_metadata().is_empty()


def test_non_writer_rank_acks_stores_without_copying_but_loads() -> None:
    be, pool = make_backend()
    w = OffloadingWorker(be, rank=1, store_writer=False)
    snapshot = [pool.read_slot(s) for s in range(NUM_SLOTS)]
    store = simple_mapping([1, 2], [0, 1], 2).store()
    flushed = simple_mapping([3], [2], 2).store()
    load = simple_mapping([6], [3], 2).load()
    m = meta(loads={3: load}, stores={1: store, 2: flushed}, flush={2})
    w.start_step(m)
    w.end_step(m)
    assert w.deferred == ()
    rep = w.build_worker_metadata()
    assert rep.completed == {1: 1, 2: 1, 3: 1}
    assert [pool.read_slot(s) for s in range(NUM_SLOTS)] == snapshot
    assert gpu_page(be, 0, 6) == cpu_page(be, 0, 3, 0)


@pytest.mark.parametrize("bpc", [1, 3])
def test_random_stores_then_loads_roundtrip(bpc: int) -> None:
    rng = random.Random(bpc)
    be, _ = make_backend(bpc=bpc, seed=bpc)
    w = OffloadingWorker(be)
    free = list(range(NUM_SLOTS))
    stores = {}
    for j in range(3):
        stores[j] = random_mapping(rng, 2, NUM_BLOCKS, free, bpc, max_blocks=4)
    m = meta(stores={j: mp.store() for j, mp in stores.items()})
    w.start_step(m)
    w.end_step(m)
    w.start_step(meta())
    assert w.build_worker_metadata().completed == {0: 1, 1: 1, 2: 1}
    for mp in stores.values():
        assert_stored(be, mp.store())
    original = [bytes(g) for g in be.gpu]
    for g in be.gpu:
        g[:] = bytes(len(g))
    m = meta(loads={10 + j: mp.load() for j, mp in stores.items()})
    w.start_step(m)
    w.end_step(m)
    assert w.build_worker_metadata().completed == {10: 1, 11: 1, 12: 1}
    for mp in stores.values():
        plan = plan_block_copies(
            mp.gpu.block_ids, mp.gpu.group_sizes, mp.gpu.block_indices, mp.cpu.slots, bpc
        )
        for group, block, _, _ in plan:
            for t in be.group_tensors[group]:
                p = be.page_bytes[t]
                assert gpu_page(be, t, block) == original[t][block * p : (block + 1) * p]


# -- faults ----------------------------------------------------------------------------------------


def test_injected_failures_are_reported_once_and_others_complete() -> None:
    be, _ = make_backend()
    faulty = FaultyBackend(be, fail_job=lambda j: j == 2, fail_submit=lambda j: j == 3)
    w = OffloadingWorker(faulty)
    loads = {j: simple_mapping([j], [j], 2).load() for j in (1, 2, 3, 4)}
    w.start_step(meta(loads=loads))
    rep = w.build_worker_metadata()
    assert rep.completed == {1: 1, 4: 1}
    assert rep.failed == {2: 1, 3: 1}
    assert w.build_worker_metadata().is_empty()


def test_bad_spec_is_a_failed_job_not_an_exception() -> None:
    be, _ = make_backend()
    w = OffloadingWorker(be)
    bad = TransferJob("r", GPULoadStoreSpec((1, 2), (2,), (0,)), CPULoadStoreSpec((1,)))
    out_of_range = simple_mapping([NUM_BLOCKS], [0], 2).store()
    w.start_step(meta(stores={5: bad, 6: out_of_range}, flush={5, 6}))
    assert w.build_worker_metadata().failed == {5: 1, 6: 1}


def test_poll_failure_fails_every_job_in_flight_once() -> None:
    be, _ = make_backend(auto=False)
    broken = {"poll": False}
    w = OffloadingWorker(FaultyBackend(be, fail_poll=lambda: broken["poll"]))
    w.start_step(meta(loads={1: simple_mapping([1], [1], 2).load()}))
    broken["poll"] = True
    rep = w.build_worker_metadata()
    assert rep.failed == {1: 1} and rep.completed == {}
    broken["poll"] = False
    be.progress()
    assert w.build_worker_metadata().is_empty()  # late success of a failed job is ignored
    assert w.ignored_results == 1  # its late result arrived and was dropped


def test_wait_failure_fails_flushed_jobs() -> None:
    be, _ = make_backend(auto=False)
    w = OffloadingWorker(FaultyBackend(be, fail_wait=lambda: True))
    store = simple_mapping([1], [1], 2).store()
    m = meta(stores={7: store})
    w.start_step(m)
    w.end_step(m)
    w.start_step(meta(flush={7}))
    be.progress()
    rep = w.build_worker_metadata()
    assert rep.failed == {7: 1} and rep.completed == {}
    assert w.ignored_results == 1


def test_several_ranks_aggregate() -> None:
    reports = []
    for rank in range(3):
        be, _ = make_backend(seed=rank)
        inner = FaultyBackend(be, fail_job=lambda j, r=rank: r == 2 and j == 1)
        w = OffloadingWorker(inner, rank=rank, store_writer=rank == 0)
        m = meta(
            loads={1: simple_mapping([1], [1], 2).load()},
            stores={2: simple_mapping([2], [2], 2).store()},
        )
        w.start_step(m)
        w.end_step(m)
        w.start_step(meta())
        reports.append(w.build_worker_metadata())
    total = aggregate(reports)
    assert total.completed == {1: 2, 2: 3}
    assert total.failed == {1: 1}
    assert total.stats.store.sizes == [PAGE]  # only the writer copied
    assert aggregate([]) == WorkerMetadata()


def test_shutdown_reports_deferred_as_failed_and_closes() -> None:
    be, _ = make_backend(auto=False)
    w = OffloadingWorker(be)
    m = meta(
        loads={1: simple_mapping([1], [1], 2).load()},
        stores={2: simple_mapping([2], [2], 2).store()},
    )
    w.start_step(m)
    w.end_step(m)
    w.shutdown()
    rep = w.build_worker_metadata()
    assert rep.completed == {1: 1} and rep.failed == {2: 1}
    with pytest.raises(LifecycleError, match="shut down"):
        w.start_step(meta())
    w.shutdown()  # idempotent


@pytest.mark.parametrize("value", [-2, 32, 2**70])
def test_validate_ids_reads_ids_by_value_not_through_their_operators(value: int) -> None:
    """A block id or slot is range-checked as the int it equals: an int subclass whose
    comparisons lie is refused when its value is out of range (else a copy would index
    outside the caches), in both the worker's check and the torch adapter's C-first check."""
    from statecore.adapters.torch import _validate_ids

    for check in (validate_ids, _validate_ids):
        with pytest.raises(SpecError, match="GPU block ids"):
            check((0, IncomparableInt(value)), (0,), 32, 24)
        with pytest.raises(SpecError, match="CPU slots"):
            check((0,), (1, IncomparableInt(value if value != 32 else 24)), 32, 24)
    # in range: the int it equals is fine
    validate_ids((IncomparableInt(3),), (IncomparableInt(4),), 32, 24)

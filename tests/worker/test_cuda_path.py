"""The torch adapter's CUDA path without a GPU: registration faults, the choice of copy
implementation and its warm-up, the staging ring, and the fixtures' finaliser.

A :class:`~cuda_fakes.FakeCudaRuntime` is injected through the backend's ``cuda_runtime``
seam: on CPU tensors the backend then runs its device setup (chunked registration with
rollback, clearing and reporting failed calls, the context check, the choice between Triton
and staging) against the fake, which fails on demand and keeps a pending error the way the
real runtime does. :func:`~cuda_fakes.findings` checks what no backend may leave behind.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from cuda_fakes import (
    ALREADY_REGISTERED,
    ILLEGAL_ADDRESS,
    NOT_REGISTERED,
    OUT_OF_MEMORY,
    Backends,
    FakeCudaRuntime,
    findings,
    pool_ranges,
)
from worker_harness import random_mapping

torch = pytest.importorskip("torch", reason="the torch adapter needs torch")

import statecore.adapters.torch as torch_adapter  # noqa: E402
from statecore.adapters._pinning import HostRegistration  # noqa: E402
from statecore.adapters.torch import TorchTransferBackend  # noqa: E402
from statecore.errors import ConfigError, TransferError  # noqa: E402
from statecore.pool import CPUPool  # noqa: E402
from statecore.worker import plan_block_copies  # noqa: E402

NUM_BLOCKS = 24
NUM_SLOTS = 64
PAGES = [256, 128, 96]  # bytes per GPU page of each canonical tensor
CHUNK = 4096  # registration chunk in these tests: each region is several chunks


def make(
    rt: FakeCudaRuntime | None,
    pool: CPUPool | None = None,
    *,
    bpc: int = 1,
    seed: int = 0,
    **kw: Any,
) -> tuple[list[Any], CPUPool, TorchTransferBackend]:
    """Three tensors in two groups over a pool of ``NUM_SLOTS`` chunks (``bpc`` blocks)."""
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randint(0, 256, (NUM_BLOCKS, p), generator=gen).to(torch.uint8) for p in PAGES]
    if pool is None:
        pool = CPUPool(NUM_SLOTS, [p * bpc for p in PAGES])
        for i in range(pool.num_regions):
            region = pool.region(i)
            region[:] = random.Random(seed * 7 + i).randbytes(len(region))
    kw.setdefault("copy_impl", "staging")
    kw.setdefault("register_chunk_bytes", CHUNK)
    kw.setdefault("staging_chunk_bytes", 2048)  # a small ring: jobs of several pieces
    kw.setdefault("staging_chunks", 2)
    be = TorchTransferBackend(
        caches, pool, bpc, group_tensors=[[0, 1], [2]], threads=1, cuda_runtime=rt, **kw
    )
    return caches, pool, be


def roundtrip(caches: list[Any], pool: CPUPool, be: TorchTransferBackend, seed: int) -> None:
    """Random stores then loads (after wiping the GPU side) through ``be``: byte-exact."""
    rng = random.Random(seed)
    bpc = be.bpc
    free = list(range(NUM_SLOTS))
    maps = [random_mapping(rng, 2, NUM_BLOCKS, free, bpc, max_blocks=6) for _ in range(5)]
    for j, mp in enumerate(maps):
        be.submit(j, mp.store(), True)
    be.wait(range(5))
    assert {r.job_id: r.success for r in be.poll()} == dict.fromkeys(range(5), True)
    want: dict[tuple[int, int], bytes] = {}
    for mp in maps:
        g = mp.gpu
        for group, block, slot, sub in plan_block_copies(
            g.block_ids, g.group_sizes, g.block_indices, mp.cpu.slots, bpc
        ):
            for t in be.group_tensors[group]:
                p = PAGES[t]
                row = bytes(pool.row(t, slot)[sub * p : (sub + 1) * p])
                assert row == caches[t][block].numpy().tobytes()
                want[(t, block)] = row
    for c in caches:
        c.zero_()
    for j, mp in enumerate(maps):
        be.submit(10 + j, mp.load(), False)
    be.wait(range(10, 15))
    assert {r.job_id: r.success for r in be.poll()} == dict.fromkeys(range(10, 15), True)
    for (t, block), data in want.items():
        assert caches[t][block].numpy().tobytes() == data


# -- registration: chunks, rollback, clearing and reporting failed calls -----------------------


def test_pool_registered_in_bounded_page_aligned_chunks(
    backends: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    rt = FakeCudaRuntime()
    with caplog.at_level(logging.INFO, logger="statecore.adapters.torch"):
        caches, pool, be = make(rt)
    backends.add(be)
    assert be.pool_registered and be.impl == "staging"
    ranges = pool_ranges(be)
    chunks = sorted((p, rt.registered[p]) for p in rt.overlapping(ranges))
    assert len(chunks) > len(ranges)  # several chunks per region
    assert all(size <= CHUNK for _, size in chunks)
    assert all(ptr % 4096 == 0 for ptr, _ in chunks)  # the pool's regions are page-aligned
    covered = {ptr: size for ptr, size in chunks}
    for base, size in ranges:  # each region is covered exactly, chunk after chunk
        off = 0
        while off < size:
            off += covered.pop(base + off)
        assert off == size
    assert covered == {}
    assert be.registration is not None and be.registration.bytes == sum(n for _, n in ranges)
    assert any("s per GB" in r.getMessage() for r in caplog.records)
    assert findings(rt, be) == []
    roundtrip(caches, pool, be, 1)
    be.shutdown()
    assert rt.registered == {}
    assert findings(rt, be, after_shutdown=True) == []


@pytest.mark.parametrize(("ptr", "size"), [(0, 1), (4096, 3 * CHUNK), (4100, 2 * CHUNK + 5)])
def test_chunk_pieces_cover_the_range_and_end_on_pages(ptr: int, size: int) -> None:
    pieces = HostRegistration(FakeCudaRuntime(), CHUNK).pieces(ptr, size)
    assert pieces[0][0] == ptr and sum(n for _, n in pieces) == size
    for (p, n), (q, _) in itertools.pairwise(pieces):
        assert p + n == q and q % 4096 == 0 and n <= CHUNK


@pytest.mark.parametrize("fail_at", [1, 2, 5, "last"])
@pytest.mark.parametrize("code", [OUT_OF_MEMORY, ALREADY_REGISTERED])
def test_failed_chunk_rolls_back_clears_and_reports(
    fail_at: int | str, code: int, backends: Backends
) -> None:
    """Any chunk failing leaves nothing registered, no pending error (the next kernel runs),
    the failure reported, and a working staging backend over the pageable pool."""
    reg = HostRegistration(FakeCudaRuntime(), CHUNK)
    total = sum(len(reg.pieces(0, NUM_SLOTS * p)) for p in PAGES)
    at = total if fail_at == "last" else int(fail_at)
    rt = FakeCudaRuntime(fail_register=lambda call, ptr, size: code if call == at else 0)
    caches, pool, be = make(rt, copy_impl="auto")
    backends.add(be)
    assert [c for c in rt.log if c[2]] == [("register", rt.log[at - 1][1], code)]
    assert (be.pool_registered, be.impl) == (False, "staging")
    assert rt.overlapping(pool_ranges(be)) == []  # rolled back
    assert be._staging is not None and be._staging.pinned  # the ring's own registration
    assert rt.pending == 0
    rt.launch()  # the engine's next kernel does not inherit the failure
    (err,) = be.cuda_errors
    assert (err.code, err.cleared) == (code, code) and "cudaHostRegister" in err.call
    assert findings(rt, be) == []
    roundtrip(caches, pool, be, 2)


def test_double_registration_falls_back_and_rebuild_after_shutdown(backends: Backends) -> None:
    """A second backend over a registered pool is refused (cleared, reported) and stages;
    the first keeps its registration; after its shutdown a rebuilt backend registers."""
    rt = FakeCudaRuntime()
    _, pool, first = make(rt)
    backends.add(first)
    caches, _, second = make(rt, pool)
    backends.add(second)
    assert first.pool_registered and not second.pool_registered
    assert [e.code for e in second.cuda_errors] == [ALREADY_REGISTERED]
    assert findings(rt, first, second) == []
    rt.launch()
    roundtrip(caches, pool, second, 3)
    first.shutdown()
    second.shutdown()
    assert findings(rt, first, second, after_shutdown=True) == []
    caches3, _, third = make(rt, pool)
    backends.add(third)
    assert third.pool_registered and third.cuda_errors == []
    roundtrip(caches3, pool, third, 4)


def test_unregister_failure_is_cleared_reported_and_the_rest_released(
    backends: Backends,
) -> None:
    bad: list[int] = []
    rt = FakeCudaRuntime(fail_unregister=lambda ptr: 1 if ptr in bad else 0)
    _, _, be = make(rt)
    bad.append(sorted(rt.registered)[1])
    be.shutdown()  # does not raise
    assert list(rt.registered) == bad  # only the refused chunk stays
    assert rt.pending == 0
    (err,) = be.cuda_errors
    assert err.code == 1 and "cudaHostUnregister" in err.call
    # unregistering something never registered is refused, cleared and reported too
    reg = HostRegistration(rt, CHUNK)
    reg.chunks.append((12345 * 4096, 4096))
    assert not reg.release()
    assert [e.code for e in reg.errors] == [NOT_REGISTERED] and rt.pending == 0


def test_a_stale_pending_error_is_cleared_before_setup(backends: Backends) -> None:
    rt = FakeCudaRuntime()
    rt.pending = OUT_OF_MEMORY  # someone's earlier failed call on this thread
    _, _, be = make(rt)
    backends.add(be)
    assert rt.pending == 0 and [e.code for e in be.cuda_errors] == [OUT_OF_MEMORY]


def test_dead_context_raises_and_releases_the_pool() -> None:
    rt = FakeCudaRuntime(sticky=ILLEGAL_ADDRESS)
    with pytest.raises(TransferError, match=r"context unusable at setup.*cudaErrorIllegalAddress"):
        make(rt, copy_impl="auto")
    assert rt.registered == {} and rt.pending == 0


# -- the choice of copy implementation and the warm-up ----------------------------------------


def _interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the setup consider Triton on the CPU (the tests below replace what would launch
    the kernel; the kernel itself runs in the interpreter check). The kernel module is
    imported first without the interpreter, so this process keeps the compiled-kernel
    decoration."""
    if torch_adapter.triton_copy() is None:
        pytest.skip("Triton is not installed (it is in the test extra on Linux)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_no_host_pointer_capability_means_no_self_test(
    monkeypatch: pytest.MonkeyPatch, backends: Backends
) -> None:
    _interpreted(monkeypatch)
    ran: list[int] = []
    monkeypatch.setattr(TorchTransferBackend, "_triton_warmup", lambda self: ran.append(1))
    rt = FakeCudaRuntime(host_pointer=False)
    _, _, be = make(rt, copy_impl="auto")
    backends.add(be)
    assert be.impl == "staging" and ran == [] and be.pool_registered
    with pytest.raises(ConfigError, match="cudaDevAttrCanUseHostPointerForRegisteredMem"):
        make(FakeCudaRuntime(host_pointer=None), copy_impl="triton")


@pytest.mark.parametrize("how", ["raises", "wrong bytes"])
def test_failed_self_test_falls_back_to_staging(
    how: str, monkeypatch: pytest.MonkeyPatch, backends: Backends
) -> None:
    _interpreted(monkeypatch)

    def broken(self: TorchTransferBackend, addrs: Any, n: int, max_words: int) -> None:
        if how == "raises":
            raise RuntimeError("injected launch failure")

    monkeypatch.setattr(TorchTransferBackend, "_launch_kernel", broken)
    rt = FakeCudaRuntime()
    caches, pool, be = make(rt, copy_impl="auto")
    backends.add(be)
    assert be.impl == "staging" and be.pool_registered
    assert findings(rt, be) == []  # the self-test buffer was unregistered again
    ring = be._staging.host_reg  # type: ignore[union-attr]
    assert len(rt.registered) == len(be.registration.chunks) + len(ring.chunks)  # type: ignore[union-attr]
    roundtrip(caches, pool, be, 5)
    with pytest.raises(ConfigError, match="self-test failed"):
        make(FakeCudaRuntime(), copy_impl="triton")


def test_self_test_that_kills_the_context_is_not_a_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _interpreted(monkeypatch)
    rt = FakeCudaRuntime()

    def faulting(self: TorchTransferBackend, addrs: Any, n: int, max_words: int) -> None:
        rt.sticky = ILLEGAL_ADDRESS
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(TorchTransferBackend, "_launch_kernel", faulting)
    with pytest.raises(TransferError, match="after a failed Triton warm-up"):
        make(rt, copy_impl="auto")
    assert rt.registered == {}


def test_kernel_length_argument_is_not_specialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs of 1, 16 or 17 copies must run the variant the warm-up compiled: the kernel, as
    compiled for a GPU (not the interpreter's wrapper), does not specialise on ``n``."""
    pytest.importorskip("triton", reason="Triton is not installed (it is in the test extra)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = Path(torch_adapter.__file__).with_name("_triton_copy.py")
    spec = importlib.util.spec_from_file_location("_triton_copy_fresh", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module._copy_pages_kernel
    assert [p.name for p in fn.params if p.do_not_specialize] == ["n"]
    assert module.block_words(8, 1) == 1 and module.block_words(8, 1 << 20) == 1024


# -- the staging ring ----------------------------------------------------------------------------


@pytest.mark.parametrize("thread", [False, True])
@pytest.mark.parametrize("bpc", [1, 3])
def test_staging_ring_of_small_chunks_byte_exact(
    thread: bool, bpc: int, backends: Backends
) -> None:
    """Chunks of 2-3 pages and a ring of 2: every job is cut into pieces and the ring wraps
    many times; bytes are exact and the ring's buffers are never reallocated."""
    caches, pool, be = make(
        None, bpc=bpc, seed=bpc, staging_chunk_bytes=600, staging_chunks=2, staging_thread=thread
    )
    backends.add(be)
    ring = be._staging
    assert ring is not None and ring.chunks == 2 and ring.chunk_bytes == 600
    ptrs = [t.data_ptr() for t in ring.gpu + ring.host]
    roundtrip(caches, pool, be, 6 + bpc)
    assert [t.data_ptr() for t in ring.gpu + ring.host] == ptrs
    assert "2 x 0 KiB" in ring.describe()


def test_staging_chunk_is_at_least_one_page(backends: Backends) -> None:
    _, _, be = make(None, staging_chunk_bytes=1)
    backends.add(be)
    assert be._staging is not None and be._staging.chunk_bytes == max(PAGES)


def test_staging_thread_does_the_host_copies(
    monkeypatch: pytest.MonkeyPatch, backends: Backends
) -> None:
    seen: list[str] = []
    real = torch_adapter.run_segments

    def spy(*args: Any) -> None:
        seen.append(threading.current_thread().name)
        real(*args)

    monkeypatch.setattr(torch_adapter, "run_segments", spy)
    caches, pool, be = make(None, staging_thread=True, staging_chunk_bytes=1024)
    backends.add(be)
    roundtrip(caches, pool, be, 9)
    assert seen and set(seen) == {"statecore-staging"}


@pytest.mark.parametrize("thread", [False, True])
def test_a_failed_staged_job_fails_alone(
    thread: bool, monkeypatch: pytest.MonkeyPatch, backends: Backends
) -> None:
    real = torch_adapter._StagingRing._enqueue

    def flaky(self: Any, job: Any, slot: int, parts: Any) -> Any:
        if job.job_id == 2:
            raise RuntimeError("injected CUDA failure")
        return real(self, job, slot, parts)

    monkeypatch.setattr(torch_adapter._StagingRing, "_enqueue", flaky)
    _, _, be = make(None, staging_thread=thread, staging_chunk_bytes=512)
    backends.add(be)
    rng = random.Random(0)
    free = list(range(NUM_SLOTS))
    maps = [random_mapping(rng, 2, NUM_BLOCKS, free, 1, max_blocks=6) for _ in range(4)]
    for j, mp in enumerate(maps):
        be.submit(j, mp.store(), True)
    be.wait(range(4))
    results = be.poll()
    assert [(r.job_id, r.success) for r in results] == [(0, True), (1, True), (2, False), (3, True)]
    assert results[2].nbytes == 0
    assert be.poll() == []


# -- the fixtures' finaliser ----------------------------------------------------------------------


def test_backends_are_shut_down_after_a_failed_assertion() -> None:
    """What the ``backends`` fixture does at teardown: a test body that fails between
    construction and its own ``shutdown`` leaves no registration behind."""
    rt = FakeCudaRuntime()
    made = Backends()
    with pytest.raises(AssertionError):
        try:
            _, _, be = make(rt)
            made.add(be)
            assert be.impl == "triton"  # fails: the pool is registered at this point
        finally:
            made.close_all()
    assert rt.registered == {} and findings(rt, be, after_shutdown=True) == []
    _, _, again = make(rt, be.pool)  # the same memory registers again
    assert again.pool_registered
    again.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_threaded_ring_matches_direct_copies_under_random_interleavings(
    seed: int, backends: Backends
) -> None:
    """Stores and loads submitted back to back, polled and waited on at random points: the
    threaded ring (2 chunks of 2 KiB) ends with the same bytes as the direct CPU copies, and
    reports every job once, in submission order per direction. As the scheduler guarantees,
    a job touching the blocks or slots of a job in flight is submitted only after that one
    is done (in flight on two streams, their order is not defined)."""
    ref_caches, ref_pool, ref = make(None, seed=seed, bpc=2, copy_impl="auto")
    dut_caches, dut_pool, dut = make(None, seed=seed, bpc=2, staging_thread=True)
    backends.add(ref)
    backends.add(dut)
    assert (ref.impl, dut.impl) == ("cpu", "staging")
    rng = random.Random(seed)
    seen: list[tuple[int, bool, bool]] = []
    submitted: list[tuple[int, bool]] = []
    inflight: dict[int, tuple[set[int], set[int]]] = {}  # job -> (GPU blocks, CPU slots)

    def collect() -> None:
        for r in dut.poll():
            seen.append((r.job_id, r.is_store, r.success))
            del inflight[r.job_id]

    for job_id in range(40):
        free = list(range(NUM_SLOTS))
        mp = random_mapping(rng, 2, NUM_BLOCKS, free, 2, max_blocks=8)
        touched = (set(mp.gpu.block_ids), set(mp.cpu.slots))
        if any(touched[0] & b or touched[1] & c for b, c in inflight.values()):
            dut.wait(list(inflight))
            collect()
        is_store = rng.random() < 0.5
        job = mp.store() if is_store else mp.load()
        ref.submit(job_id, job, is_store)
        dut.submit(job_id, job, is_store)
        submitted.append((job_id, is_store))
        inflight[job_id] = touched
        action = rng.random()
        if action < 0.3:
            collect()
        elif action < 0.45:
            dut.wait([rng.randrange(job_id + 1)])
    dut.wait(range(40))
    collect()
    assert inflight == {}
    assert all(ok for _, _, ok in seen)
    for direction in (True, False):
        want = [j for j, s in submitted if s is direction]
        assert [j for j, s, _ in seen if s is direction] == want
    for a, b in zip(ref_caches, dut_caches, strict=True):
        assert torch.equal(a, b)
    for r in range(ref_pool.num_regions):
        assert bytes(ref_pool.region(r)) == bytes(dut_pool.region(r))

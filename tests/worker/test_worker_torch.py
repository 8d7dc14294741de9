"""TorchTransferBackend: real bytes between block-first KV tensors and the CPU pool."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from cuda_fakes import Backends
from native_build import can_build_extensions
from worker_harness import Mapping, random_mapping, simple_mapping

torch = pytest.importorskip("torch", reason="the torch adapter needs torch")

import statecore.adapters.torch as torch_adapter  # noqa: E402
from statecore.adapters.torch import (  # noqa: E402
    TorchTransferBackend,
    host_copy_impl,
    run_segments,
)
from statecore.errors import ConfigError, SpecError  # noqa: E402
from statecore.manager import CPULoadStoreSpec  # noqa: E402
from statecore.pool import CPUPool  # noqa: E402
from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob  # noqa: E402
from statecore.worker import OffloadingWorker, plan_block_copies  # noqa: E402

NUM_BLOCKS = 40
NUM_SLOTS = 30
# CPU copy modes: "auto" copies directly; "staging" runs the CUDA staging path's code on host
# memory (queued jobs, bounce buffer, host scatter at completion)
CPU_IMPLS = ["auto", "staging"]
# The CUDA tests run on a GPU machine (scripts/device_check.sh); elsewhere the same code paths
# run on CPU tensors in the "staging" and interpreted "triton" test modes.
_skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def needs_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test ``cuda`` and skip it (with the reason) where no CUDA device is present."""
    marked: Callable[..., None] = pytest.mark.cuda(_skip_without_cuda(test))
    return marked


needs_native = pytest.mark.skipif(
    host_copy_impl() != "native",
    reason="statecore.adapters._hostcopy was not built (no C compiler at install)",
)
# "native": the C loop's memmove copies; "stream": the C loop streaming every job
# (non-temporal stores, prefetch across runs); "ctypes": the fallback
HOST_IMPLS = [
    pytest.param("native", marks=needs_native),
    pytest.param("stream", marks=needs_native),
    "ctypes",
]


def use_host_impl(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run host copies with ``impl`` and share even small test jobs between the threads."""
    if impl == "ctypes":  # an installation without the extension
        monkeypatch.setattr(torch_adapter, "_native_copy_blocks", None)
        monkeypatch.setattr(torch_adapter, "_native_ids_valid", None)
    monkeypatch.setattr(torch_adapter, "_HOST_PARALLEL_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(torch_adapter, "_NATIVE_PARALLEL_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(torch_adapter, "_STREAM_MIN_BYTES", 0 if impl == "stream" else 1 << 62)
    assert host_copy_impl() == ("native" if impl == "stream" else impl)


def _spy_pieces(monkeypatch: pytest.MonkeyPatch, name: str = "_pieces") -> list[int]:
    """Record the number of pieces of every job that is split for the copy threads
    (``_pieces``: address lists; ``_segment_pieces``: a CPU job's segments)."""
    seen: list[int] = []
    real = getattr(torch_adapter, name)

    def spy(*args: object) -> object:
        out = real(*args)
        seen.append(len(out))
        return out

    monkeypatch.setattr(torch_adapter, name, spy)
    return seen


def _count_copy_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Accumulate ``[pages' bytes, memmove calls]`` over every segment copy."""
    total = [0, 0]
    real = torch_adapter._copy_blocks

    def spy(*args: object) -> tuple[int, int]:
        nbytes, calls = real(*args)  # type: ignore[arg-type]
        total[0] += nbytes
        total[1] += calls
        return nbytes, calls

    monkeypatch.setattr(torch_adapter, "_copy_blocks", spy)
    return total


class Setup:
    """Three canonical tensors of different dtypes and page sizes, two groups."""

    def __init__(self, bpc: int, device: str = "cpu", seed: int = 0, **kw: object) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.bpc = bpc
        self.caches = [
            torch.randint(-100, 100, (NUM_BLOCKS, 2, 4, 8), generator=gen, dtype=torch.int16),
            torch.randn((NUM_BLOCKS, 16, 4), generator=gen).to(torch.bfloat16),
            torch.randint(0, 255, (NUM_BLOCKS, 96), generator=gen, dtype=torch.uint8),
        ]
        self.caches = [c.to(device) for c in self.caches]
        pages = [c[0].numel() * c.element_size() for c in self.caches]
        self.pages = pages
        self.pool = CPUPool(NUM_SLOTS, [p * bpc for p in pages])
        for i in range(self.pool.num_regions):  # known, non-zero background
            region = self.pool.region(i)
            region[:] = random.Random(i).randbytes(len(region))
        self.groups = [[0, 1], [2]]
        self.be = TorchTransferBackend(
            self.caches,
            self.pool,
            bpc,
            group_tensors=self.groups,
            **kw,  # type: ignore[arg-type]
        )

    def gpu_page(self, t: int, block: int) -> bytes:
        row = self.caches[t][block].contiguous().view(torch.uint8).flatten()
        return bytes(row.cpu().numpy().tobytes())

    def cpu_page(self, t: int, slot: int, sub: int) -> bytes:
        p = self.pages[t]
        return bytes(self.pool.row(t, slot)[sub * p : (sub + 1) * p])

    def plan(self, mp: Mapping) -> list[tuple[int, int, int, int]]:
        g = mp.gpu
        return plan_block_copies(
            g.block_ids, g.group_sizes, g.block_indices, mp.cpu.slots, self.bpc
        )

    def snapshot(self) -> list[bytes]:
        return [self.pool.read_slot(s) for s in range(NUM_SLOTS)]

    def drain(self, job_ids: list[int]) -> dict[int, bool]:
        self.be.wait(job_ids)
        return {r.job_id: r.success for r in self.be.poll()}


def check_roundtrip(s: Setup, seed: int) -> None:
    rng = random.Random(seed)
    free = list(range(NUM_SLOTS))
    maps = [random_mapping(rng, 2, NUM_BLOCKS, free, s.bpc, max_blocks=5) for _ in range(4)]
    before = s.snapshot()
    for j, mp in enumerate(maps):
        s.be.submit(j, mp.store(), True)
    assert s.drain(list(range(4))) == dict.fromkeys(range(4), True)
    touched: set[tuple[int, int, int]] = set()
    for mp in maps:
        for group, block, slot, sub in s.plan(mp):
            for t in s.groups[group]:
                assert s.cpu_page(t, slot, sub) == s.gpu_page(t, block)
                touched.add((t, slot, sub))
    for slot in range(NUM_SLOTS):  # every other byte of the pool is untouched
        for t in range(3):
            p = s.pages[t]
            for sub in range(s.bpc):
                if (t, slot, sub) not in touched:
                    old = before[slot][sum(s.pages[:t]) * s.bpc :][sub * p : (sub + 1) * p]
                    assert s.cpu_page(t, slot, sub) == old
    expected = {
        (t, block): s.gpu_page(t, block)
        for mp in maps
        for group, block, _, _ in s.plan(mp)
        for t in s.groups[group]
    }
    for c in s.caches:
        c.zero_()
    for j, mp in enumerate(maps):
        s.be.submit(10 + j, mp.load(), False)
    assert s.drain([10 + j for j in range(4)]) == dict.fromkeys(range(10, 14), True)
    for (t, block), data in expected.items():
        assert s.gpu_page(t, block) == data


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_random_roundtrip_byte_exact(bpc: int, seed: int, impl: str) -> None:
    s = Setup(bpc, seed=seed, copy_impl=impl)
    assert s.be.impl == ("cpu" if impl == "auto" else impl)
    check_roundtrip(s, seed)
    s.be.shutdown()


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_results_report_bytes_and_direction(impl: str) -> None:
    s = Setup(1, copy_impl=impl)
    mp = Mapping(
        GPULoadStoreSpec((3, 4, 5), (2, 1), (0, 0)),
        CPULoadStoreSpec((0, 1, 2)),
    )
    s.be.submit(1, mp.store(), True)
    (res,) = s.be.poll()
    assert (res.job_id, res.success, res.is_store) == (1, True, True)
    assert res.nbytes == 2 * (s.pages[0] + s.pages[1]) + s.pages[2]
    assert s.be.poll() == []


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_padded_block_stride_and_large_parallel_job(impl: str) -> None:
    page = 256 << 10
    backing = torch.randint(0, 255, (48, page + 512), dtype=torch.uint8)
    cache = backing[:, :page]  # block stride > page: packed layout
    pool = CPUPool(48, [page])
    be = TorchTransferBackend([cache], pool, 1, threads=2, copy_impl=impl)  # type: ignore[arg-type]
    rng = random.Random(5)
    blocks = rng.sample(range(48), 40)
    slots = rng.sample(range(48), 40)  # 10 MiB: the threaded path
    be.submit(1, simple_mapping(blocks, slots).store(), True)
    be.wait([1])
    assert [(r.job_id, r.success) for r in be.poll()] == [(1, True)]
    for b, sl in zip(blocks, slots, strict=True):
        assert bytes(pool.row(0, sl)) == cache[b].numpy().tobytes()
    pad = backing[:, page:].clone()
    cache.zero_()
    be.submit(2, simple_mapping(blocks, slots).load(), False)
    be.wait([2])
    for b, sl in zip(blocks, slots, strict=True):
        assert cache[b].numpy().tobytes() == bytes(pool.row(0, sl))
    assert torch.equal(backing[:, page:], pad)  # padding never written
    be.shutdown()


@pytest.mark.parametrize(
    ("job", "match"),
    [
        (
            TransferJob("r", GPULoadStoreSpec((1,), (1,), (0,)), CPULoadStoreSpec((1,))),
            "1 groups, the KV cache has 2",
        ),
        (
            TransferJob("r", GPULoadStoreSpec((1, 2), (2, 0), (0, 0)), CPULoadStoreSpec((1,))),
            "needs 2 CPU chunks",
        ),
        (
            TransferJob("r", GPULoadStoreSpec((1, 2), (1, 1), (0, 0)), CPULoadStoreSpec((1, 1))),
            "slot twice",
        ),
        (
            TransferJob(
                "r", GPULoadStoreSpec((NUM_BLOCKS,), (1, 0), (0, 0)), CPULoadStoreSpec((1,))
            ),
            "out of range",
        ),
        (
            TransferJob(
                "r", GPULoadStoreSpec((1,), (1, 0), (0, 0)), CPULoadStoreSpec((NUM_SLOTS,))
            ),
            "out of range",
        ),
        (TransferJob("r", CPULoadStoreSpec((1,)), CPULoadStoreSpec((1,))), "GPU side"),
    ],
)
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_spec_errors_move_no_bytes(job: TransferJob, match: str, impl: str) -> None:
    s = Setup(1, copy_impl=impl)
    before = s.snapshot()
    with pytest.raises(SpecError, match=match):
        s.be.submit(1, job, True)
    assert s.snapshot() == before
    assert s.be.poll() == []


def test_cpu_triton_mode_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = torch.zeros((4, 16), dtype=torch.uint8)
    with pytest.raises(ConfigError, match="interpreter"):
        TorchTransferBackend([cache], CPUPool(2, [16]), 1, copy_impl="triton")


def test_layout_mismatch_is_a_config_error() -> None:
    cache = torch.zeros((4, 16), dtype=torch.uint8)
    with pytest.raises(ConfigError, match="expected page 16"):
        TorchTransferBackend([cache], CPUPool(2, [32]), 1)
    with pytest.raises(ConfigError, match="regions"):
        TorchTransferBackend([cache, cache], CPUPool(2, [16]), 1)
    with pytest.raises(ConfigError, match="group_tensors"):
        TorchTransferBackend([cache], CPUPool(2, [16]), 1, group_tensors=[[0, 1]])
    with pytest.raises(ConfigError, match="contiguous"):
        TorchTransferBackend([torch.zeros((16, 4), dtype=torch.uint8).t()], CPUPool(2, [16]), 1)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_worker_over_torch_backend_flush_and_ranks(impl: str) -> None:
    reports = []
    for rank in range(2):
        s = Setup(3, seed=rank, copy_impl=impl)
        w = OffloadingWorker(s.be, rank=rank)
        rng = random.Random(9)
        free = list(range(NUM_SLOTS))
        mp = random_mapping(rng, 2, NUM_BLOCKS, free, 3, max_blocks=5)
        m1 = ConnectorMetadata(store_jobs={1: mp.store()})
        w.start_step(m1)
        w.end_step(m1)
        w.start_step(ConnectorMetadata(jobs_to_flush=frozenset({1})))
        for group, block, slot, sub in s.plan(mp):
            for t in s.groups[group]:
                assert s.cpu_page(t, slot, sub) == s.gpu_page(t, block)
        reports.append(w.build_worker_metadata())
        w.shutdown()
    assert reports[0].aggregate(reports[1]).completed == {1: 2}


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_injected_failures_over_torch_backend_ranks(impl: str) -> None:
    """Three ranks over real bytes; rank 2 fails load 1 and rank 1 fails store 3. Failed
    jobs report failure, move nothing on that rank, and the other jobs' bytes are exact."""
    from statecore.worker import FaultyBackend, aggregate

    reports = []
    setups = []
    for rank in range(3):
        s = Setup(3, seed=rank, copy_impl=impl)
        setups.append(s)
        rng = random.Random(4)
        free = list(range(NUM_SLOTS))
        load = random_mapping(rng, 2, NUM_BLOCKS, free, 3, max_blocks=4)
        stores = {j: random_mapping(rng, 2, NUM_BLOCKS, free, 3, max_blocks=4) for j in (2, 3)}
        inner = FaultyBackend(s.be, fail_job=lambda j, r=rank: (r, j) in {(2, 1), (1, 3)})
        w = OffloadingWorker(inner, rank=rank)
        gpu_before = [c.clone() for c in s.caches]
        pool_before = s.snapshot()
        m = ConnectorMetadata(
            load_jobs={1: load.load()}, store_jobs={j: mp.store() for j, mp in stores.items()}
        )
        w.start_step(m)
        w.end_step(m)
        w.start_step(ConnectorMetadata(jobs_to_flush=frozenset({2, 3})))
        reports.append(w.build_worker_metadata())
        w.shutdown()
        for group, block, slot, sub in s.plan(load):  # load: pool rows into GPU blocks
            for t in s.groups[group]:
                want = s.cpu_page(t, slot, sub)
                if rank == 2:  # failed here: the GPU block keeps its old bytes
                    want = gpu_before[t][block].contiguous().view(torch.uint8).numpy().tobytes()
                assert s.gpu_page(t, block) == want
        for j, mp in stores.items():
            for group, block, slot, sub in s.plan(mp):
                for t in s.groups[group]:
                    if (rank, j) == (1, 3):  # failed here: the CPU row is untouched
                        p = s.pages[t]
                        old = pool_before[slot][sum(s.pages[:t]) * 3 :][sub * p : (sub + 1) * p]
                        assert s.cpu_page(t, slot, sub) == old
                    else:
                        assert s.cpu_page(t, slot, sub) == s.gpu_page(t, block)
    total = aggregate(reports)
    assert total.completed == {1: 2, 2: 3, 3: 2}
    assert total.failed == {1: 1, 3: 1}


# -- CUDA (run on the device machine) ----------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("impl", ["auto", "staging"])
@pytest.mark.parametrize("bpc", [1, 3])
def test_cuda_random_roundtrip_byte_exact(impl: str, bpc: int, backends: Backends) -> None:
    s = Setup(bpc, device="cuda", seed=bpc, copy_impl=impl)
    backends.add(s.be)  # shut down (registration released) even if an assertion fails
    check_roundtrip(s, bpc)


@needs_cuda
@pytest.mark.parametrize("impl", ["auto", "staging"])
def test_cuda_store_waits_for_compute_stream_and_fifo(impl: str, backends: Backends) -> None:
    page = 64 << 10
    n = 512
    cache = torch.zeros((n, page // 4), dtype=torch.float32, device="cuda")
    pool = CPUPool(n, [page])
    be = backends.add(TorchTransferBackend([cache], pool, 1, copy_impl=impl))  # type: ignore[arg-type]
    # Long compute on the current stream writes the blocks; the store must see its result.
    big = torch.randn((4096, 4096), device="cuda")
    for _ in range(8):
        big = torch.tanh(big @ big)  # bounded, so big[0, 0] * 0 == 0
    cache.add_(big[0, 0] * 0 + 3.0)
    order = list(range(n))
    random.Random(1).shuffle(order)
    half = n // 2
    be.submit(1, simple_mapping(order[:half], list(range(half))).store(), True)
    be.submit(2, simple_mapping(order[half:], list(range(half, n))).store(), True)
    be.wait([2])
    results = [r.job_id for r in be.poll()]
    assert results == [1, 2]  # FIFO per direction; waiting on 2 implies 1 is done
    host = torch.frombuffer(pool.region(0), dtype=torch.float32)
    assert bool((host == 3.0).all())


@needs_cuda
def test_cuda_triton_selected_when_available(backends: Backends) -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    s = Setup(1, device="cuda")
    backends.add(s.be)
    assert s.be.impl == "triton", "Triton present but the staging fallback was chosen"
    assert s.be.cuda_errors == [], s.be.cuda_errors


# -- factories -----------------------------------------------------------------------------------


def test_canonical_kv_tensors_split_and_alias() -> None:
    from statecore.adapters.torch import canonical_kv_tensors

    nb = 6
    flash = torch.arange(2 * nb * 4 * 2, dtype=torch.int16).view(2, nb, 4, 2)  # (2, nb, ...)
    mla = torch.ones((nb, 3, 8), dtype=torch.bfloat16)
    caches = {"l0": flash, "l1": mla, "l2": mla}  # l2 aliases l1
    tensors, groups = canonical_kv_tensors(caches, [["l0", "l1"], ["l2"]], nb)
    assert len(tensors) == 3
    assert groups == [[0, 1, 2], [2]]
    assert torch.equal(tensors[0], flash[0]) and torch.equal(tensors[1], flash[1])
    with pytest.raises(ConfigError, match="neither"):
        canonical_kv_tensors({"x": torch.zeros((3, nb))}, [["x"]], nb)
    with pytest.raises(ConfigError, match="no KV cache tensor"):
        canonical_kv_tensors({}, [["x"]], nb)


def test_pool_regions_let_two_ranks_share_a_pool() -> None:
    from statecore.adapters.torch import sim_backend

    page = 64
    pool = CPUPool(8, [page] * 4)
    ranks = [
        [torch.randint(-128, 127, (10, page), dtype=torch.int8) for _ in range(2)] for _ in range(2)
    ]
    backends = [sim_backend(ranks[r], pool, range(2 * r, 2 * r + 2), 1) for r in range(2)]
    for r, be in enumerate(backends):
        be.submit(1, simple_mapping([3, 7], [5, 0]).store(), True)
        for t in range(2):
            assert bytes(pool.row(2 * r + t, 5)) == ranks[r][t][3].numpy().tobytes()
            assert bytes(pool.row(2 * r + t, 0)) == ranks[r][t][7].numpy().tobytes()
    with pytest.raises(ConfigError, match="pool_regions"):
        TorchTransferBackend(ranks[0], pool, 1, pool_regions=[0, 4])


@pytest.mark.parametrize("impl", HOST_IMPLS)
@pytest.mark.parametrize("bpc", [1, 3])
def test_consecutive_blocks_merge_and_parallel_pieces_byte_exact(
    bpc: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of consecutive blocks into consecutive sub-rows (merged into fewer copies), a
    padded and an unpadded tensor of different page sizes, copied by both copy threads."""
    use_host_impl(impl, monkeypatch)
    shared = _spy_pieces(monkeypatch, "_segment_pieces")
    copied = _count_copy_calls(monkeypatch)
    pages = [64 << 10, 96 << 10]
    backing = torch.randint(0, 255, (60, pages[1] + 256), dtype=torch.uint8)
    caches = [
        torch.randint(0, 255, (60, pages[0]), dtype=torch.uint8),
        backing[:, : pages[1]],  # padded: its GPU rows never merge
    ]
    groups = [[0], [0, 1]]
    pool = CPUPool(40, [p * bpc for p in pages])
    be = TorchTransferBackend(caches, pool, bpc, group_tensors=groups, threads=2)
    g0 = [*range(3, 21), *range(40, 45)]  # two runs of blocks, into consecutive slots
    g1 = [50, 7, 8, 9, 30, 31, 2]  # group 1 enters its first chunk at sub-block 1 % bpc
    n0 = -(-len(g0) // bpc)
    n1 = -(-(len(g1) + 1 % bpc) // bpc)
    slots = [*range(5, 5 + n0), *random.Random(3).sample(range(5 + n0, 40), n1)]
    gspec = GPULoadStoreSpec((*g0, *g1), (len(g0), len(g1)), (0, 1))
    job = TransferJob("r", gspec, CPULoadStoreSpec(tuple(slots)))
    be.submit(1, job, True)
    nbytes = len(g0) * pages[0] + len(g1) * (pages[0] + pages[1])
    assert copied[0] == nbytes
    assert copied[1] < len(g0) + 2 * len(g1)  # some pages were merged into one memmove
    plan = plan_block_copies(gspec.block_ids, gspec.group_sizes, (0, 1), tuple(slots), bpc)

    def cpu_page(t: int, slot: int, sub: int) -> bytes:
        return bytes(pool.row(t, slot)[sub * pages[t] : (sub + 1) * pages[t]])

    for group, block, slot, sub in plan:
        for t in groups[group]:
            assert cpu_page(t, slot, sub) == caches[t][block].numpy().tobytes()
    want = {(t, b): caches[t][b].clone() for group, b, _, _ in plan for t in groups[group]}
    pad = backing[:, pages[1] :].clone()
    for c in caches:
        c.zero_()
    be.submit(2, TransferJob("r", job.dst, job.src), False)
    for (t, b), data in want.items():
        assert torch.equal(caches[t][b], data)
    assert torch.equal(backing[:, pages[1] :], pad)  # padding never written
    assert {r.job_id: r.nbytes for r in be.poll()} == {1: nbytes, 2: nbytes}
    assert len(shared) == 2 and min(shared) >= 2  # both jobs were shared between threads
    be.shutdown()


@pytest.mark.parametrize("impl", HOST_IMPLS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_run_segments_moves_scattered_pages_byte_exact(
    impl: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments of several page sizes (one with a padded source stride), scattered on both
    sides, cut into pieces claimed by the threads: every destination page gets its source
    bytes and nothing else is written."""
    from concurrent.futures import ThreadPoolExecutor

    use_host_impl(impl, monkeypatch)
    shared = _spy_pieces(monkeypatch, "_segment_pieces")
    rng = random.Random(threads)
    n = 48
    segments, expected, nbytes, pages = [], [], 0, 0
    buffers = []
    for page, pad in ((4096, 0), (65536, 0), (100_000, 8), (7, 1)):
        src = torch.randint(0, 255, (n, page + pad), dtype=torch.uint8)
        dst = torch.zeros((n, page), dtype=torch.uint8)
        buffers += [src, dst]
        # distinct indices; positions 5..9 are a run on both sides (40..44 -> 0..4)
        si = rng.sample(range(40), 25)
        di = rng.sample(range(5, n), 25)
        si[5:5], di[5:5] = range(40, 45), range(0, 5)
        seg = (dst.data_ptr(), page, di, src.data_ptr(), page + pad, si, page)
        segments.append(seg)
        expected.append((src, dst, si, di, page))
        nbytes += 30 * page
        pages += 30
    ex = ThreadPoolExecutor(threads - 1) if threads > 1 else None
    run_segments(segments, nbytes, pages, ex, threads)
    if ex is not None:
        ex.shutdown()
    for src, dst, si, di, page in expected:
        for s_i, d_i in zip(si, di, strict=True):
            assert torch.equal(dst[d_i], src[s_i, :page])
        untouched = sorted(set(range(n)) - set(di))
        assert not dst[untouched].any()
    assert (len(shared) == 1 and shared[0] >= 2) if threads > 1 else not shared


@needs_native
def test_native_copy_blocks_strides_merges_and_errors() -> None:
    from statecore.adapters._hostcopy import copy_blocks

    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    s0, d0 = src.data_ptr(), dst.data_ptr()
    # 4-byte pages, source stride 8 (padded): never merged
    assert copy_blocks(d0, 4, [0, 1, 2], s0, 8, [1, 2, 3], 4) == (12, 3)
    assert dst[:12].tolist() == [*range(8, 12), *range(16, 20), *range(24, 28)]
    dst.zero_()
    # both strides == page: indices 2,3,4 -> 5,6,7 merge; 9 -> 0 stands alone
    assert copy_blocks(d0, 4, [5, 6, 7, 0], s0, 4, [2, 3, 4, 9], 4) == (16, 2)
    assert dst[20:32].tolist() == list(range(8, 20)) and dst[:4].tolist() == list(range(36, 40))
    dst.zero_()
    assert copy_blocks(d0, 4, (5, 6, 7, 0), s0, 4, (2, 3, 4, 9), 4, 1, 3) == (8, 1)
    assert dst[24:32].tolist() == list(range(12, 20)) and int(dst.sum()) == sum(range(12, 20))
    before = dst.clone()
    with pytest.raises(ValueError, match="differ in length"):
        copy_blocks(d0, 4, [0, 1], s0, 4, [0], 4)
    with pytest.raises(ValueError, match=r"range \[1, 3\)"):
        copy_blocks(d0, 4, [0, 1], s0, 4, [0, 1], 4, 1, 3)
    with pytest.raises(ValueError, match=r"src_index\[1\]"):
        copy_blocks(d0, 4, [0, 1], s0, 4, [0, -1], 4)
    with pytest.raises(ValueError, match="nbytes"):
        copy_blocks(d0, 4, [0], s0, 4, [0], -4)
    with pytest.raises(TypeError, match="7 to 10"):
        copy_blocks(d0, 4, [0], s0, 4, [0])  # type: ignore[call-arg]
    assert torch.equal(dst, before)  # a rejected call copies nothing


def _memmove_model(
    buf: bytearray, dst: int, ds: int, di: list[int], src: int, ss: int, si: list[int], n: int
) -> None:
    """What copy_blocks must do, page by page, on offsets into one buffer (memmove
    semantics: each page reads its source before writing its destination)."""
    for d, x in zip(di, si, strict=True):
        buf[dst + d * ds : dst + d * ds + n] = bytes(buf[src + x * ss : src + x * ss + n])


@needs_native
@pytest.mark.parametrize(
    ("page", "src_pad", "dst_off", "di", "si"),
    [
        (4096, 0, 0, [3, 4, 5, 0, 9], [7, 8, 9, 1, 2]),  # aligned pages, a run of three
        (4096 + 24, 0, 5, [1, 2, 0], [0, 1, 3]),  # misaligned dst: head, body, tail
        (100, 12, 3, [0, 1, 2, 7], [5, 6, 7, 0]),  # padded source: nothing merges
        (64, 0, 8, [2], [6]),  # a single page, exactly one 64-byte line
        (7, 0, 1, [0, 1, 2, 3], [4, 5, 6, 7]),  # shorter than one line: one run of 28 bytes
        (4096, 0, 0, [], []),  # empty
    ],
)
def test_native_streaming_copy_is_memmove_on_the_edges(
    page: int, src_pad: int, dst_off: int, di: list[int], si: list[int]
) -> None:
    """The streaming copy (non-temporal stores, prefetch into the next run) writes exactly
    what memmove writes: runs merged or not, misaligned heads, tails, tiny and empty jobs."""
    from statecore.adapters._hostcopy import copy_blocks

    rng = random.Random(page)
    rows, stride = 10, page + src_pad
    src = torch.tensor(list(rng.randbytes(rows * stride)), dtype=torch.uint8)
    outs = [torch.zeros(rows * page + 64, dtype=torch.uint8) for _ in range(2)]
    mergeable = src_pad == 0
    runs = sum(
        1
        for i in range(len(di))
        if not (mergeable and i and di[i] == di[i - 1] + 1 and si[i] == si[i - 1] + 1)
    )
    for out, stream in zip(outs, (False, True), strict=True):
        got = copy_blocks(
            out.data_ptr() + dst_off, page, di, src.data_ptr(), stride, si, page, 0, None, stream
        )
        assert got == (len(di) * page, runs)
    assert torch.equal(outs[0], outs[1])
    want = bytearray(outs[0].numel())
    for d, x in zip(di, si, strict=True):
        at = dst_off + d * page
        want[at : at + page] = bytes(src[x * stride : x * stride + page].tolist())
    assert bytes(outs[1].tolist()) == bytes(want)


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_native_streaming_copy_of_many_blocks_is_memmove(seed: int) -> None:
    """A streamed piece of many blocks (the read-ahead runs several blocks in front of the
    copy and warms each destination page) writes exactly what memmove writes, for pages
    shorter and longer than the read-ahead, unaligned bases, padded strides and sub-ranges
    that start and stop inside the lists."""
    from statecore.adapters._hostcopy import copy_blocks

    rng = random.Random(seed)
    page = rng.choice([40, 64, 100, 4096, 4096 + 24, 20000])
    pad = rng.choice([0, 0, 12])
    rows = max(8, min(120, (1 << 20) // page))
    stride = page + pad
    src = torch.tensor(list(rng.randbytes(rows * stride + 64)), dtype=torch.uint8)
    src_off, dst_off = rng.randrange(64), rng.randrange(64)
    si = rng.sample(range(rows), rows)
    di = rng.sample(range(rows), rows)
    si[2:7], di[2:7] = range(rows - 5, rows), range(5)  # a run on both sides (when unpadded)
    si, di = list(dict.fromkeys(si)), list(dict.fromkeys(di))
    k = min(len(si), len(di))
    si, di = si[:k], di[:k]
    lo, hi = rng.randint(0, 3), k - rng.randint(0, 3)
    out = torch.zeros(rows * page + 64, dtype=torch.uint8)
    got = copy_blocks(
        out.data_ptr() + dst_off,
        page,
        di,
        src.data_ptr() + src_off,
        stride,
        si,
        page,
        lo,
        hi,
        True,
    )
    assert got[0] == (hi - lo) * page
    want = bytearray(out.numel())
    flat = bytes(src.tolist())
    for i in range(lo, hi):
        at, fr = dst_off + di[i] * page, src_off + si[i] * stride
        want[at : at + page] = flat[fr : fr + page]
    assert bytes(out.tolist()) == bytes(want)


@needs_native
@pytest.mark.parametrize("shift", [8, -8, 4096 - 8])
def test_native_streaming_copy_falls_back_to_memmove_when_ranges_overlap(shift: int) -> None:
    """Source and destination ranges that overlap (possible only through the raw function:
    the adapter's sides are distinct buffers) are copied with memmove, never streamed."""
    from statecore.adapters._hostcopy import copy_blocks

    page = 8192
    init = random.Random(shift).randbytes(4 * page)
    buf = torch.tensor(list(init), dtype=torch.uint8)
    base, src_off = buf.data_ptr(), page
    dst_off = src_off + shift
    assert copy_blocks(base + dst_off, page, [0], base + src_off, page, [0], page, 0, 1, True) == (
        page,
        1,
    )
    want = bytearray(init)
    _memmove_model(want, dst_off, page, [0], src_off, page, [0], page)
    assert bytes(buf.tolist()) == bytes(want)


@needs_native
def test_jobs_stream_from_the_threshold_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs of ``_STREAM_MIN_BYTES`` and more reach the C loop with ``stream`` set, smaller
    ones without; both land byte for byte."""
    flags: list[bool] = []
    real = torch_adapter._copy_blocks

    def spy(seg: object, start: int = 0, stop: int | None = None, stream: bool = False) -> object:
        flags.append(stream)
        return real(seg, start, stop, stream)

    monkeypatch.setattr(torch_adapter, "_copy_blocks", spy)
    page = 64 << 10
    n = torch_adapter._STREAM_MIN_BYTES // page
    src = torch.randint(0, 255, (n + 2, page), dtype=torch.uint8)
    for count, streamed in ((n, True), (n - 1, False)):
        dst = torch.zeros_like(src)
        rows = list(range(count))[::-1]  # reversed: no run merges
        seg = (dst.data_ptr(), page, rows, src.data_ptr(), page, list(range(count)), page)
        flags.clear()
        run_segments([seg], count * page, count, None, 1)
        assert flags and set(flags) == {streamed}
        assert torch.equal(dst[:count], src[:count].flip(0)) and not dst[count:].any()


def _python_accepts(blocks: object, slots: object, num_blocks: int, num_slots: int) -> bool:
    from statecore.worker import validate_ids

    try:
        validate_ids(blocks, slots, num_blocks, num_slots)  # type: ignore[arg-type]
    except SpecError:
        return False
    return True


@needs_native
@pytest.mark.parametrize(
    ("blocks", "slots", "num_blocks", "num_slots"),
    [
        ((), (), 4, 4),
        ((0,), (3,), 1, 4),
        ((3, 3, 0), (0, 1, 2), 4, 3),  # a block read twice is allowed
        ((4,), (0,), 4, 4),  # block id == num_gpu_blocks
        ((-1,), (0,), 4, 4),
        ((0,), (4,), 4, 4),  # slot == num_slots
        ((0,), (-1,), 4, 4),
        ((0, 1), (2, 2), 4, 4),  # a slot twice
        ((0, 1, 2), (7, 0, 7), 4, 8),
        ([1, 2], [1, 2], 3, 3),  # lists
        ((0,), (1,), 0, 4),  # no GPU blocks at all
        ((0,), (0,), 4, 0),
        ((True,), (False,), 2, 2),  # bools are ints, as in Python
        ((1 << 70,), (0,), 4, 4),
        ((0,), (0,), 1 << 62, 1 << 30),  # beyond the bitmap: Python rules
    ],
)
def test_native_id_check_accepts_only_what_python_accepts(
    blocks: tuple[int, ...], slots: tuple[int, ...], num_blocks: int, num_slots: int
) -> None:
    """The C check (the adapter's accepting fast path) agrees with
    :func:`statecore.worker.validate_ids` on every edge; where it cannot tell cheaply (a
    bitmap too large) it says no and leaves the verdict to Python."""
    from statecore.adapters._hostcopy import ids_valid

    got = ids_valid(blocks, num_blocks, slots, num_slots)
    python = _python_accepts(blocks, slots, num_blocks, num_slots)
    if num_slots > 1 << 27:
        assert got is False and python is True
    else:
        assert got is python


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_native_id_check_agrees_with_python_on_random_jobs(seed: int) -> None:
    from statecore.adapters._hostcopy import ids_valid

    rng = random.Random(seed)
    for _ in range(200):
        nb, ns = rng.randint(1, 40), rng.randint(1, 40)
        k = rng.randint(0, 12)
        blocks = tuple(rng.randint(-2, nb + 1) for _ in range(k))
        slots = tuple(rng.randint(-2, ns + 1) for _ in range(k))
        assert ids_valid(blocks, nb, slots, ns) is _python_accepts(blocks, slots, nb, ns)


@needs_native
def test_native_id_check_rejects_items_that_are_not_ints() -> None:
    from statecore.adapters._hostcopy import ids_valid

    assert ids_valid((0.0,), 4, (0,), 4) is False
    assert ids_valid((0,), 4, ("0",), 4) is False
    with pytest.raises(TypeError, match="4 positional"):
        ids_valid((0,), 4, (0,))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="list or tuple"):
        ids_valid(0, 4, (0,), 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", HOST_IMPLS)
@pytest.mark.parametrize("fault", ["block", "slot", "twice"])
def test_large_job_with_one_bad_id_moves_no_bytes(
    impl: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of many pages (checked by the C check where built, streamed if it passed) with
    one bad id at its end raises SpecError naming it, and no byte moves."""
    use_host_impl(impl, monkeypatch)
    page, n = 256, 600
    gpu = torch.randint(0, 255, (n + 1, page), dtype=torch.uint8)
    pool = CPUPool(n + 1, [page])
    be = TorchTransferBackend([gpu], pool, 1, threads=2)
    blocks, slots = list(range(n)), list(range(n))[::-1]
    if fault == "block":
        blocks[-1] = n + 1
    elif fault == "slot":
        slots[-1] = n + 1
    else:
        slots[-1] = slots[0]
    job = TransferJob(
        "r", GPULoadStoreSpec(tuple(blocks), (n,), (0,)), CPULoadStoreSpec(tuple(slots))
    )
    before = bytes(pool.region(0))
    match = "slot twice" if fault == "twice" else rf"\[{n + 1}\] out of range"
    with pytest.raises(SpecError, match=match):
        be.submit(1, job, True)
    assert bytes(pool.region(0)) == before and be.poll() == []
    blocks[-1], slots[-1] = n - 1, 0  # the same job made valid is copied
    job = TransferJob(
        "r", GPULoadStoreSpec(tuple(blocks), (n,), (0,)), CPULoadStoreSpec(tuple(slots))
    )
    be.submit(2, job, True)
    assert all(
        bytes(pool.row(0, s)) == bytes(gpu[b].tolist()) for b, s in zip(blocks, slots, strict=True)
    )
    be.shutdown()


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_copy_blocks_fallback_matches_native(seed: int) -> None:
    """The ctypes fallback and the C loop copy the same bytes with the same merged runs."""
    from statecore.adapters._hostcopy import copy_blocks

    rng = random.Random(seed)
    page = rng.choice([4, 12, 64])
    stride = page if seed % 2 == 0 else page + 4
    n = 40
    src = torch.randint(0, 255, (n * stride,), dtype=torch.uint8)
    outs = [torch.zeros(n * page, dtype=torch.uint8) for _ in range(2)]
    si = rng.sample(range(n), 24)
    di = rng.sample(range(n), 24)
    si[3:9] = range(10, 16)  # a run on both sides
    di[3:9] = range(30, 36)
    si = list(dict.fromkeys(si))[:20]  # keep indices distinct
    di = list(dict.fromkeys(di))[: len(si)]
    si = si[: len(di)]
    lo, hi = rng.randint(0, 3), len(si) - rng.randint(0, 3)
    got = [
        fn(out.data_ptr(), page, di, src.data_ptr(), stride, si, page, lo, hi)
        for fn, out in zip((copy_blocks, torch_adapter._ctypes_copy_blocks), outs, strict=True)
    ]
    assert got[0] == got[1]
    assert torch.equal(outs[0], outs[1])
    for i in range(lo, hi):
        a, b = di[i] * page, si[i] * stride
        assert torch.equal(outs[0][a : a + page], src[b : b + page])


@pytest.mark.skipif(
    not can_build_extensions(),
    reason="no C compiler or Python headers: the optional copy loop cannot have been built",
)
def test_installation_with_a_compiler_built_the_native_copy_loop() -> None:
    """Where the extension can be built it must have been: a silent fallback to the ctypes
    loop would hide a broken build (CI has gcc and the headers, so this always runs there)."""
    assert host_copy_impl() == "native"

"""``statecore bench transfer``: throughput of the torch transfer adapter, in GB/s.

For each block size, a GPU KV tensor of ``--total-mib`` MiB is mapped onto the CPU pool by a
random permutation (scattered GPU blocks into scattered final slots, ``blocks_per_chunk`` 1),
split into jobs of about ``--job-mib`` MiB, and copied by :class:`TorchTransferBackend`:
stores (GPU -> CPU), loads (CPU -> GPU) and, on CUDA, both at once (stores and loads on
disjoint halves). The baseline is one contiguous copy of the same bytes (on CUDA: between the
GPU tensor and the pinned pool). Each figure is the median of ``--repeat`` runs after a
warm-up; one block per job is checked byte for byte after the stores. Stores and loads are
timed in interleaved rounds with their contiguous copy, and the ratio printed is the median
of the rounds' ratios (a shared machine's load shifts between separate medians). Every
copy of a round runs warm: the warm-up wrote every page each copy touches, and the bytes
per direction are kept well above the last-level cache, so none of them runs from cache.

On the CPU a second reference is timed in the same rounds: the adapter's own copy loop
(same threads, same pieces, same stores) over the contiguous bytes, one run per piece.
``ratio`` (to torch's contiguous ``copy_``) is the goal's figure; ``loop ratio`` says how
much of it the scattering costs, apart from how the bytes are stored. On the CPU each timed
copy also waits, untimed, until the process uses no CPU (``--no-settle``: back to back, as
before): after a ``copy_``, torch's OpenMP workers spin for milliseconds before they sleep
(about 8 ms of CPU on the 2-core development machine), taking a core from whichever copy is
timed next.

Last, the host-side planning cost per job for a layer-per-tensor layout (what the CPU does
while the copies of earlier jobs run): the CPU path's segments, and the Triton path's address
table, in microseconds per job (median of 200).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    from statecore.cli import command_parser, int_range

    p = command_parser("statecore bench transfer", (__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--device", choices=("cpu", "cuda", "auto"), default="auto", help="where the KV lives"
    )
    p.add_argument(
        "--total-mib",
        metavar="MIB",
        type=int_range(1),
        default=None,
        help="MiB per direction and block size (default: 1024 on CUDA, 128 on CPU)",
    )
    p.add_argument(
        "--repeat",
        metavar="N",
        type=int_range(1),
        default=None,
        help="runs per figure (median; default 3 on CUDA, 9 on CPU)",
    )
    p.add_argument(
        "--block-kib", metavar="KIB,...", type=str, default="4,16,64,256", help="block sizes in KiB"
    )
    p.add_argument(
        "--job-mib", metavar="MIB", type=int_range(1), default=16, help="approximate MiB per job"
    )
    p.add_argument(
        "--no-settle",
        dest="settle",
        action="store_false",
        help="CPU: time the copies of a round back to back, without waiting for the process's "
        "threads (torch's spinning OpenMP workers) to go idle first",
    )
    p.add_argument(
        "--impl",
        choices=("auto", "triton", "staging", "all"),
        default="all",
        help="CUDA copy implementation(s) to measure",
    )
    return p.parse_args(list(argv))


def _median_seconds(fn: Callable[[], None], sync: Callable[[], None], repeat: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _settle(limit: float = 0.25, nap: float = 0.002, busy: float = 0.0002) -> None:
    """Wait (untimed) until this process's threads use less than ``busy`` seconds of CPU
    during a ``nap``, at most ``limit`` seconds: after torch's ``copy_`` its OpenMP workers
    spin before they sleep (libgomp's spin-wait), and a copy timed right after it would share
    the cores with them."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        c0 = time.process_time()
        time.sleep(nap)
        if time.process_time() - c0 < busy:
            return


def _interleaved_seconds(
    fns: Sequence[Callable[[], None]],
    sync: Callable[[], None],
    repeat: int,
    settle: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """``fns[0]`` and its references ``fns[1:]`` timed in ``repeat`` back-to-back rounds (order
    reversed every other round), after a warm-up of each: (median seconds of each, median
    over the rounds of ``ref / fns[0]`` for each reference). On a shared machine the load
    moves between figures taken one after the other; within a round it mostly does not, so
    the median round ratio is the figure to read. ``settle``, when given, runs (untimed)
    before each timed call."""
    for f in fns:
        f()
        sync()
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeat):
        order = range(len(fns)) if i % 2 == 0 else range(len(fns) - 1, -1, -1)
        for which in order:
            sync()
            if settle is not None:
                settle()
            t0 = time.perf_counter()
            fns[which]()
            sync()
            times[which].append(time.perf_counter() - t0)
    ratios = [
        statistics.median(r / t for t, r in zip(times[0], ts, strict=True)) for ts in times[1:]
    ]
    return [statistics.median(ts) for ts in times], ratios


def main(argv: Sequence[str]) -> int:
    """Run the benchmark and print one line per block size, direction and implementation."""
    args = _parse(argv)
    import importlib

    import torch

    backend_cls: Any = importlib.import_module("statecore.adapters.torch").TorchTransferBackend
    from statecore.manager import CPULoadStoreSpec
    from statecore.pool import CPUPool
    from statecore.wire import GPULoadStoreSpec, TransferJob

    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("statecore bench transfer: --device cuda but CUDA is not available")
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    total = (args.total_mib or (1024 if cuda else 128)) << 20
    args.repeat = args.repeat or (3 if cuda else 9)
    sizes = [int(x) << 10 for x in args.block_kib.split(",") if x]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"statecore bench transfer  date={now}  torch={torch.__version__}  device={name}")
    print(f"bytes per direction={total >> 20} MiB  repeat={args.repeat}  job~{args.job_mib} MiB")
    if cuda:
        impls = ["triton", "staging"] if args.impl == "all" else [args.impl]
    else:
        impls = ["cpu"]
        from statecore.adapters.torch import host_copy_impl

        settled = "idle before each timed copy" if args.settle else "back to back (--no-settle)"
        print(
            f"cpu threads={torch.get_num_threads()}  host copy loop={host_copy_impl()}  "
            f"copies timed {settled}"
        )
    loop_head = "" if cuda else f" {'loop ratio':>10}"
    print(
        f"{'block':>7} {'impl':>8} {'direction':>10} {'GB/s':>8} {'contig GB/s':>12} {'ratio':>6}"
        f"{loop_head}"
    )
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for page in sizes:
        n = max(2, total // page)
        # random bytes per block, cheap to make: 64 random bytes repeated along the page
        seed = torch.randint(0, 256, (2 * n, 64), dtype=torch.uint8, generator=gen)
        gpu = seed.to(dev).repeat(1, page // 64)
        pool = CPUPool(2 * n, [page])
        per_job = max(1, (args.job_mib << 20) // page)
        blocks = torch.randperm(2 * n, generator=gen).tolist()
        slots = torch.randperm(2 * n, generator=gen).tolist()

        def jobs(
            lo: int,
            hi: int,
            store: bool,
            per_job: int = per_job,
            blocks: list[int] = blocks,
            slots: list[int] = slots,
        ) -> list[TransferJob]:
            out = []
            for a in range(lo, hi, per_job):
                b = min(hi, a + per_job)
                g = GPULoadStoreSpec(tuple(blocks[a:b]), (b - a,), (0,))
                c = CPULoadStoreSpec(tuple(slots[a:b]))
                out.append(TransferJob("bench", g, c) if store else TransferJob("bench", c, g))
            return out

        stores, loads = jobs(0, n, True), jobs(0, n, False)
        both = jobs(0, n // 2, True) + jobs(n // 2, n, False)
        both_store = [True] * len(jobs(0, n // 2, True)) + [False] * len(jobs(n // 2, n, False))
        for impl in impls:
            kw: dict[str, Any] = {"copy_impl": "auto" if impl == "cpu" else impl}
            try:
                be = backend_cls([gpu], pool, 1, **kw)
            except Exception as exc:
                print(f"{page >> 10:>5}K {impl:>8} unavailable: {exc}")
                continue
            label = be.impl
            reg = getattr(be, "registration", None)
            if cuda and reg is not None and reg.bytes:
                print(
                    f"{page >> 10:>5}K {label:>8} pool registration {reg.bytes / 1e9:.2f} GB in "
                    f"{reg.seconds:.3f} s ({reg.seconds / (reg.bytes / 1e9):.3f} s/GB)"
                )

            def run(js: list[TransferJob], flags: list[bool], be: Any = be) -> None:
                ids = list(range(len(js)))
                for i, (j, s) in enumerate(zip(js, flags, strict=True)):
                    be.submit(i, j, s)
                be.wait(ids)
                be.poll()

            host = torch.frombuffer(pool.region(0), dtype=torch.uint8).view(2 * n, page)
            if cuda and not getattr(be, "pool_registered", False):
                host = torch.empty((2 * n, page), dtype=torch.uint8, pin_memory=True)
            sub_gpu, sub_host = gpu[:n], host[:n]
            contig: dict[str, Callable[[], None]] = {
                "store": functools.partial(_copy, sub_host, sub_gpu),
                "load": functools.partial(_copy, sub_gpu, sub_host),
            }
            # the adapter's loop over the same contiguous bytes (one job per ``per_job`` rows)
            rows = list(range(n))
            loop: dict[str, Callable[[Any], None]] = {
                "store": functools.partial(_loop_copy, sub_host, sub_gpu, rows, per_job),
                "load": functools.partial(_loop_copy, sub_gpu, sub_host, rows, per_job),
            }
            cases: list[tuple[str, list[TransferJob], list[bool]]] = [
                ("store", stores, [True] * len(stores)),
                ("load", loads, [False] * len(loads)),
            ]
            if cuda:
                cases.append(("both", both, both_store))
            for direction, js, flags in cases:
                copy = functools.partial(run, js, flags)
                loop_ratio = ""
                if direction in contig:  # interleaved rounds: the ratio survives a load shift
                    refs = [contig[direction]]
                    if not cuda:
                        refs.append(functools.partial(loop[direction], be))
                    settle = _settle if args.settle and not cuda else None
                    ts, ratios = _interleaved_seconds([copy, *refs], sync, args.repeat, settle)
                    t, tc, ratio = ts[0], ts[1], ratios[0]
                    if not cuda:
                        loop_ratio = f"{ratios[1]:6.2f}"
                else:
                    t = _median_seconds(copy, sync, args.repeat)
                gbs = n * page / t / 1e9
                if direction == "store":  # check one page per job
                    copy()  # (again: the contiguous copy of the pairs wrote the pool's rows)
                    sync()
                    for a in range(0, n, per_job):
                        want = gpu[blocks[a]].cpu()
                        got = torch.frombuffer(pool.row(0, slots[a]), dtype=torch.uint8)
                        if not torch.equal(want, got):
                            failures += 1
                            print(f"MISMATCH block {blocks[a]} slot {slots[a]} ({label})")
                if direction not in contig:
                    tc = _both_contig(torch, sub_gpu, sub_host, gpu[n:], host[n:], args.repeat)
                    ratio = tc / t
                cgbs = n * page / tc / 1e9
                print(
                    f"{page >> 10:>6}K {label:>8} {direction:>10} {gbs:8.1f} {cgbs:12.1f} "
                    f"{ratio:6.2f} {loop_ratio:>10}".rstrip()
                )
            be.shutdown()
    _planning(torch, backend_cls)
    if failures:
        print(f"FAILED: {failures} byte mismatches")
        return 1
    return 0


def _planning(torch: Any, backend_cls: Any) -> None:
    """Print the host planning cost per job for a few layouts (on CPU tensors)."""
    import random

    from statecore.manager import CPULoadStoreSpec
    from statecore.pool import CPUPool
    from statecore.wire import GPULoadStoreSpec, TransferJob

    print("host planning per job (us):")
    print(f"{'tensors':>8} {'blocks':>7} {'pages':>6} {'cpu segments':>13} {'kernel table':>13}")
    num_blocks = 2048
    rng = random.Random(0)
    for tensors, blocks in ((32, 16), (64, 16), (1, 1024)):
        caches = [torch.empty((num_blocks, 64), dtype=torch.uint8) for _ in range(tensors)]
        pool = CPUPool(num_blocks, [64] * tensors)
        be = backend_cls(caches, pool, 1, threads=1)
        g = GPULoadStoreSpec(tuple(rng.sample(range(num_blocks), blocks)), (blocks,), (0,))
        job = TransferJob("plan", g, CPULoadStoreSpec(tuple(rng.sample(range(num_blocks), blocks))))
        cpu_us = _median_us(functools.partial(be._host_plan, 0, job, True))
        table_us = _median_us(functools.partial(be.kernel_args, 0, job, True))
        pages = tensors * blocks
        print(f"{tensors:>8} {blocks:>7} {pages:>6} {cpu_us:>13.0f} {table_us:>13.0f}")
        be.shutdown()


def _median_us(fn: Callable[[], object], n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _copy(dst: Any, src: Any) -> None:
    dst.copy_(src, non_blocking=True)


def _loop_copy(dst: Any, src: Any, rows: list[int], per_job: int, be: Any) -> None:
    """``src`` into ``dst`` (2-D, same shape, contiguous rows) through the CPU backend's copy
    loop and threads, ``per_job`` rows at a time: each job's rows merge into one run per
    piece."""
    from statecore.adapters.torch import run_segments

    page = int(src.shape[1])
    for a in range(0, len(rows), per_job):
        idx = rows[a : a + per_job]
        seg = (dst.data_ptr(), page, idx, src.data_ptr(), page, idx, page)
        run_segments([seg], len(idx) * page, len(idx), be._executor, be.threads)


def _both_contig(torch: Any, g1: Any, h1: Any, g2: Any, h2: Any, repeat: int) -> float:
    """Contiguous D2H and H2D of half the bytes each, on two streams at once."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    half = g1.shape[0] // 2

    def fn() -> None:
        with torch.cuda.stream(s1):
            h1[:half].copy_(g1[:half], non_blocking=True)
        with torch.cuda.stream(s2):
            g2[:half].copy_(h2[:half], non_blocking=True)

    return _median_seconds(fn, torch.cuda.synchronize, repeat)

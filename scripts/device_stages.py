"""The measuring stages of ``scripts/device_check.sh``: the torch adapter's CUDA path on a GPU.

Run one stage per process (a fault in one must not poison the next):

    python scripts/device_stages.py STAGE [--device cuda|cpu] [--dry-run]

``--dry-run`` prints what the stage checks and exits; ``--device cpu`` runs the stage's logic
on CPU tensors where it can (staging copies; Triton only under ``TRITON_INTERPRET=1``), to
try the script without a GPU. Every check prints ``CHECK <name>: ok|FAIL <detail>``; numbers
print as ``MEASURE <name>: <value>``. The exit status is the number of failed checks (capped).

Stages:
  registration  a real failed cudaHostRegister (invalid flags: a real pending error) inside
                the pool's registration, then a torch kernel and a staged job; a second
                backend over a registered pool (double registration), then a kernel; the
                staging path over an unregistered pool; rebuilding a backend on the same
                pool after shutdown; the device's host-pointer attribute
  bytes         store and load byte checks at 64 and 256 KiB pages, Triton and staging
  bigpool       a pool region > 4 GiB: rows at its far end and across registration chunks
                stored and loaded byte-exact; registration seconds per GB
  firstjob      per kernel variant: construction (compile + self-test) time, then latency of
                the first jobs of 1, 16 and 17 copies against the steady state
  vllm          a vLLM-shaped layout: 32 layers, K and V split, two groups, bf16
  contention    a bf16 matmul loop on the compute stream alone and while copies run
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

FAILS: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    """Print one check's result and remember a failure."""
    print(f"CHECK {name}: {'ok' if ok else 'FAIL'}{' ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)
    return ok


def measure(name: str, value: str) -> None:
    """Print one measured number."""
    print(f"MEASURE {name}: {value}", flush=True)


def _imports() -> tuple[Any, Any, Any, Any, Any, Any]:
    import torch

    from statecore.adapters.torch import TorchTransferBackend
    from statecore.manager import CPULoadStoreSpec
    from statecore.pool import CPUPool
    from statecore.wire import GPULoadStoreSpec, TransferJob

    return torch, TorchTransferBackend, CPULoadStoreSpec, CPUPool, GPULoadStoreSpec, TransferJob


class Ctx:
    """The device, the copy implementations to try on it, and job helpers."""

    def __init__(self, device: str) -> None:
        (
            self.torch,
            self.Backend,
            self.CPUSpec,
            self.CPUPool,
            self.GPUSpec,
            self.TransferJob,
        ) = _imports()
        self.device = device
        self.cuda = device == "cuda"
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        self.impls = ["auto", "staging"] if self.cuda or interp else ["staging"]

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def jobs(
        self, blocks: Sequence[int], slots: Sequence[int], sizes: Sequence[int] | None = None
    ) -> tuple[Any, Any]:
        """(store job, load job) of ``blocks`` into ``slots`` (one group unless ``sizes``)."""
        sizes = tuple(sizes) if sizes is not None else (len(blocks),)
        g = self.GPUSpec(tuple(blocks), sizes, (0,) * len(sizes))
        c = self.CPUSpec(tuple(slots))
        return self.TransferJob("dc", g, c), self.TransferJob("dc", c, g)

    def run(self, be: Any, job: Any, is_store: bool, job_id: int) -> bool:
        be.submit(job_id, job, is_store)
        be.wait([job_id])
        res = be.poll()
        return [r.success for r in res if r.job_id == job_id] == [True]

    def random_cache(self, n: int, page: int, dtype: Any = None) -> Any:
        t = self.torch
        seed = t.randint(0, 256, (n, 64), dtype=t.uint8)
        cache = seed.to(self.device).repeat(1, page // 64)
        cache += t.arange(page, dtype=t.int64, device=self.device).to(t.uint8)  # vary per byte
        return cache if dtype is None else cache.view(dtype)

    def roundtrip(self, name: str, be: Any, caches: Sequence[Any], pool: Any, pairs: Any) -> bool:
        """Store ``pairs`` (block, slot) of every tensor, check the pool rows, wipe the GPU
        blocks, load them back, check them."""
        t = self.torch
        blocks, slots = [b for b, _ in pairs], [s for _, s in pairs]
        store, load = self.jobs(blocks, slots)
        ok = self.run(be, store, True, 1)
        bad = 0
        for i, c in enumerate(caches):
            row = t.frombuffer(pool.region(i), dtype=t.uint8).view(pool.num_slots, -1)
            u8 = c.view(t.uint8).view(c.shape[0], -1)
            bad += sum(not t.equal(row[s].view(-1), u8[b].cpu().view(-1)) for b, s in pairs)
        saved = [c[blocks].clone() for c in caches]
        for c in caches:
            c[blocks] = 0
        ok = self.run(be, load, False, 2) and ok
        self.sync()
        bad_load = sum(
            not t.equal(c[blocks].view(t.uint8), s.view(t.uint8))
            for c, s in zip(caches, saved, strict=True)
        )
        return check(
            name,
            ok and bad == 0 and bad_load == 0,
            f"impl={be.impl} pages={len(pairs) * len(caches)} store_bad={bad} "
            f"load_bad_tensors={bad_load} jobs_ok={ok}",
        )


# -- stages ---------------------------------------------------------------------------------


def stage_registration(ctx: Ctx) -> None:
    if not ctx.cuda:
        print("registration: needs the real CUDA runtime (the CPU tests cover it with a fake)")
        return
    t = ctx.torch
    from statecore.adapters._pinning import TorchCudaRuntime, _find_loaded_cudart

    lib = _find_loaded_cudart()
    check("libcudart of torch found in the process", lib is not None, str(lib))
    rt = TorchCudaRuntime()
    measure("canUseHostPointerForRegisteredMem", str(rt.can_use_host_pointer(0)))
    # does a failed registration poison the next torch kernel? (the bug the fix guards)
    import mmap

    buf = mmap.mmap(-1, 1 << 20)
    probe = t.frombuffer(buf, dtype=t.uint8)
    code = rt.host_register(probe.data_ptr(), probe.numel(), 0xFF)  # invalid flags
    try:
        (t.arange(8, device="cuda") * 2).sum().item()
        surfaced = "no"
    except RuntimeError as exc:
        surfaced = f"yes ({str(exc).splitlines()[0]})"
    rt.get_last_error()
    measure("failed register (invalid flags) code", str(code))
    measure("its pending error surfaced in the next torch kernel", surfaced)

    class FailingRuntime(TorchCudaRuntime):
        """The real runtime; the 2nd registration call is made with invalid flags."""

        calls = 0

        def host_register(self, ptr: int, size: int, flags: int) -> int:
            FailingRuntime.calls += 1
            return super().host_register(ptr, size, 0xFF if FailingRuntime.calls == 2 else flags)

    page, n = 64 << 10, 64
    caches = [ctx.random_cache(n, page) for _ in range(2)]
    pool = ctx.CPUPool(2 * n, [page, page])
    pairs = list(zip(random.Random(0).sample(range(n), 32), range(32), strict=True))
    be = ctx.Backend(caches, pool, 1, cuda_runtime=FailingRuntime(), register_chunk_bytes=4 << 20)
    try:
        check(
            "failed chunk: rolled back, staging, error reported",
            not be.pool_registered and be.impl == "staging" and len(be.cuda_errors) == 1,
            f"registered={be.pool_registered} impl={be.impl} errors={be.cuda_errors}",
        )
        try:
            (t.arange(8, device="cuda") * 2).sum().item()
            check("torch kernel after the failed registration", True)
        except RuntimeError as exc:
            check("torch kernel after the failed registration", False, str(exc)[:200])
        ctx.roundtrip("staged jobs after the failed registration", be, caches, pool, pairs)
    finally:
        be.shutdown()
    a = ctx.Backend(caches, pool, 1)
    b = None
    try:
        b = ctx.Backend(caches, pool, 1)
        codes = [e.code for e in b.cuda_errors]
        check(
            "double registration refused, cleared, staging",
            a.pool_registered and not b.pool_registered and b.impl == "staging",
            f"first={a.impl}/{a.pool_registered} second={b.impl}/{b.pool_registered} codes={codes}",
        )
        try:
            (t.arange(8, device="cuda") * 2).sum().item()
            check("torch kernel after the double registration", True)
        except RuntimeError as exc:
            check("torch kernel after the double registration", False, str(exc)[:200])
        ctx.roundtrip("second backend (staging) bytes", b, caches, pool, pairs)
        ctx.roundtrip("first backend bytes", a, caches, pool, pairs)
    finally:
        if b is not None:
            b.shutdown()
        a.shutdown()
    check("shutdown reported no failed unregistration", a.cuda_errors == [], str(a.cuda_errors))
    c = ctx.Backend(caches, pool, 1)
    try:
        check("rebuilt backend on the same pool registers", c.pool_registered, c.impl)
        ctx.roundtrip("rebuilt backend bytes", c, caches, pool, pairs)
    finally:
        c.shutdown()
    d = ctx.Backend(caches, pool, 1, register_pool=False)
    try:
        ctx.roundtrip("staging over an unregistered pool", d, caches, pool, pairs)
    finally:
        d.shutdown()
    if t.cuda.device_count() > 1:
        t.cuda.set_device(0)
        other = [ctx.random_cache(n, page).to("cuda:1") for _ in range(2)]
        e = ctx.Backend(other, ctx.CPUPool(2 * n, [page, page]), 1)
        try:
            check("backend on cuda:1 while cuda:0 is current", e.impl in ("triton", "staging"))
            ctx.roundtrip("cuda:1 bytes", e, other, e.pool, pairs)
        finally:
            e.shutdown()
    else:
        print("device guard on a second GPU: skipped (one GPU)")


def stage_bytes(ctx: Ctx) -> None:
    n, k = (128, 48) if ctx.cuda else (8, 4)
    for page in (64 << 10, 256 << 10):
        for impl in ctx.impls:
            for bpc in (1, 2):
                caches = [ctx.random_cache(n, page), ctx.random_cache(n, page // 2)]
                pool = ctx.CPUPool(n, [page * bpc, page // 2 * bpc])
                be = ctx.Backend(caches, pool, bpc, copy_impl=impl)
                try:
                    rng = random.Random(page + bpc)
                    blocks = rng.sample(range(n), k)
                    slots = rng.sample(range(n), k // bpc)
                    store, load = ctx.jobs(blocks, slots)
                    ok = ctx.run(be, store, True, 1)
                    t = ctx.torch
                    bad = 0
                    for i, c in enumerate(caches):
                        p = c.shape[1]
                        rows = t.frombuffer(pool.region(i), dtype=t.uint8).view(n * bpc, p)
                        for j, b in enumerate(blocks):
                            row = slots[j // bpc] * bpc + j % bpc
                            bad += not t.equal(rows[row], c[b].cpu())
                    saved = [c[blocks].clone() for c in caches]
                    for c in caches:
                        c[blocks] = 0
                    ok = ctx.run(be, load, False, 2) and ok
                    bad_load = sum(
                        not t.equal(c[blocks], s) for c, s in zip(caches, saved, strict=True)
                    )
                    check(
                        f"bytes {page >> 10} KiB bpc {bpc} {be.impl}",
                        ok and bad == 0 and bad_load == 0,
                        f"store_bad_pages={bad} load_bad_tensors={bad_load}",
                    )
                finally:
                    be.shutdown()


def stage_bigpool(ctx: Ctx) -> None:
    page = 96 << 10  # rows of 96 KiB do not divide 1 GiB: some rows straddle two chunks
    gib = float(os.environ.get("BIGPOOL_GIB", "4.5" if ctx.cuda else "0.05"))
    slots = int(gib * (1 << 30)) // page
    n = 64
    caches = [ctx.random_cache(n, page)]
    t0 = time.perf_counter()
    pool = ctx.CPUPool(slots, [page])
    measure("pool region bytes", f"{slots * page} ({slots * page / 2**30:.2f} GiB)")
    for impl in ctx.impls:
        t1 = time.perf_counter()
        be = ctx.Backend(caches, pool, 1, copy_impl=impl)
        built = time.perf_counter() - t1
        try:
            reg = be.registration
            if reg is not None and reg.bytes:
                measure(
                    f"registration {be.impl}",
                    f"{reg.seconds:.3f} s for {reg.bytes / 1e9:.2f} GB = "
                    f"{reg.seconds / (reg.bytes / 1e9):.3f} s/GB in {len(reg.chunks)} chunks "
                    f"(construction {built:.3f} s)",
                )
            far = list(range(slots - 24, slots))
            edges = [(k << 30) // page for k in range(1, int(gib) + 1) if (k << 30) // page < slots]
            above4 = [s for s in (((4 << 30) // page) + 1,) if s < slots]
            pick = sorted(set(far + edges + above4 + [0]))
            pairs = list(zip(random.Random(1).sample(range(n), len(pick)), pick, strict=True))
            ctx.roundtrip(f"far end of a {gib} GiB region ({be.impl})", be, caches, pool, pairs)
        finally:
            be.shutdown()
    measure("bigpool stage seconds", f"{time.perf_counter() - t0:.1f}")


def stage_firstjob(ctx: Ctx) -> None:
    t = ctx.torch
    if ctx.cuda:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    variants = [(4 << 10, "uint8"), (16 << 10, "uint8"), (64 << 10, "bfloat16"), (4100, "uint8")]
    for page, dtype in variants:
        n = 256
        cache = ctx.random_cache(n, page if page % 64 == 0 else 4160)[:, :page]
        if dtype == "bfloat16":
            cache = cache.view(t.bfloat16)
        pool = ctx.CPUPool(n, [page])
        t0 = time.perf_counter()
        be = ctx.Backend([cache], pool, 1)
        built = time.perf_counter() - t0
        try:
            variant = be.kernel_variant() if be.impl == "triton" else None
            lat: dict[int, list[float]] = {}
            job_id = 0
            for _ in range(4):
                for k in (1, 16, 17):
                    rng = random.Random(job_id)
                    store, _ = ctx.jobs(rng.sample(range(n), k), rng.sample(range(n), k))
                    ctx.sync()
                    t1 = time.perf_counter()
                    ok = ctx.run(be, store, True, job_id)
                    lat.setdefault(k, []).append(time.perf_counter() - t1)
                    job_id += 1
                    if not ok:
                        check(f"job {job_id} of page {page}", False)
            firsts = " ".join(
                f"n={k}: first {v[0] * 1e3:.2f} ms, then {statistics.median(v[1:]) * 1e3:.2f} ms"
                for k, v in lat.items()
            )
            measure(
                f"page {page} B {dtype} impl {be.impl} variant {variant}",
                f"construction (warm-up {be.warmup_seconds:.3f} s) {built:.3f} s; {firsts}",
            )
            worst = max(v[0] / max(1e-6, statistics.median(v[1:])) for v in lat.values())
            check(
                f"no compile in the first jobs (page {page})",
                worst < 20 or max(v[0] for v in lat.values()) < 0.05,
                f"worst first/steady ratio {worst:.1f}",
            )
        finally:
            be.shutdown()


def stage_vllm(ctx: Ctx) -> None:
    t = ctx.torch
    from statecore.adapters.torch import canonical_kv_tensors

    layers, num_blocks, block_size, heads, head_dim, bpc = 32, 512, 16, 8, 128, 4
    if not ctx.cuda:
        num_blocks, heads = 32, 1
    gen = t.Generator(device=ctx.device).manual_seed(0)
    kv = {
        f"model.layers.{i}.self_attn": t.randn(
            (2, num_blocks, block_size, heads, head_dim),
            generator=gen,
            device=ctx.device,
            dtype=t.float32,
        ).to(t.bfloat16)
        for i in range(layers)
    }
    names = list(kv)
    groups = [names[0::2], names[1::2]]  # two groups, layers interleaved
    tensors, group_tensors = canonical_kv_tensors(kv, groups, num_blocks)
    check(
        "vllm layout: 64 canonical tensors in two groups of 32",
        len(tensors) == 64 and [len(g) for g in group_tensors] == [32, 32],
    )
    page = tensors[0][0].numel() * tensors[0].element_size()
    measure("vllm page bytes", str(page))
    slots = num_blocks // bpc
    for impl in ctx.impls:
        pool = ctx.CPUPool(slots, [page * bpc] * len(tensors))
        be = ctx.Backend(tensors, pool, bpc, group_tensors=group_tensors, copy_impl=impl)
        try:
            rng = random.Random(5)
            per_group = 8 * bpc if ctx.cuda else 2 * bpc
            blocks = rng.sample(range(num_blocks), 2 * per_group)
            chunk_ids = rng.sample(range(slots), 2 * per_group // bpc)
            store, load = ctx.jobs(blocks, chunk_ids, (per_group, per_group))
            saved = [x[blocks].clone() for x in tensors]
            ctx.sync()
            t0 = time.perf_counter()
            ok = ctx.run(be, store, True, 1)
            dt_store = time.perf_counter() - t0
            for x in tensors:
                x[blocks] = 0
            ctx.sync()
            t0 = time.perf_counter()
            ok = ctx.run(be, load, False, 2) and ok
            dt_load = time.perf_counter() - t0
            bad = 0
            for g, ts in enumerate(group_tensors):
                sel = blocks[g * per_group : (g + 1) * per_group]
                for ti in ts:
                    got = tensors[ti][sel].view(t.uint8)
                    want = saved[ti][g * per_group : (g + 1) * per_group].view(t.uint8)
                    bad += not t.equal(got, want)
            nbytes = 2 * per_group * 32 * page
            check(f"vllm layout roundtrip ({be.impl})", ok and bad == 0, f"bad_tensors={bad}")
            measure(
                f"vllm job {be.impl}",
                f"{nbytes >> 20} MiB: store {nbytes / dt_store / 1e9:.1f} GB/s, "
                f"load {nbytes / dt_load / 1e9:.1f} GB/s (one job, first after warm-up)",
            )
        finally:
            be.shutdown()


def stage_contention(ctx: Ctx) -> None:
    if not ctx.cuda:
        print("contention: needs a GPU (compute stream against copy streams)")
        return
    t = ctx.torch
    a = t.randn((8192, 8192), device="cuda", dtype=t.bfloat16)

    def matmul_ms(iters: int = 40) -> float:
        start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        start.record()
        x = a
        for _ in range(iters):
            x = t.mm(a, a)
        end.record()
        end.synchronize()
        del x
        return float(start.elapsed_time(end))

    matmul_ms(5)
    alone = statistics.median(matmul_ms() for _ in range(3))
    measure("matmul loop alone", f"{alone:.1f} ms")
    page, n = 64 << 10, 4096  # 256 MiB of GPU blocks, pool of as much
    cache = ctx.random_cache(n, page)
    pool = ctx.CPUPool(n, [page])
    for impl in ctx.impls:
        be = ctx.Backend([cache], pool, 1, copy_impl=impl)
        try:
            rng = random.Random(2)
            jobs = []
            for j in range(32):  # 2 GiB of copies: about as long as the matmul loop, or longer
                blocks = rng.sample(range(n), n // 4)
                slots = rng.sample(range(n), n // 4)
                store, load = ctx.jobs(blocks, slots)
                jobs.append((store, True) if j % 2 == 0 else (load, False))
            ctx.sync()
            t0 = time.perf_counter()
            for j, (job, is_store) in enumerate(jobs):
                be.submit(100 + j, job, is_store)
            during = matmul_ms()
            be.wait(range(100, 132))
            copy_s = time.perf_counter() - t0
            ok = all(r.success for r in be.poll())
            moved = 32 * (n // 4) * page
            check(f"copies during the matmul loop ({be.impl})", ok)
            measure(
                f"matmul loop while copying ({be.impl})",
                f"{during:.1f} ms = {during / alone:.2f}x alone; copies {moved >> 20} MiB in "
                f"{copy_s:.2f} s ({moved / copy_s / 1e9:.1f} GB/s)",
            )
        finally:
            be.shutdown()


STAGES: dict[str, Callable[[Ctx], None]] = {
    "registration": stage_registration,
    "bytes": stage_bytes,
    "bigpool": stage_bigpool,
    "firstjob": stage_firstjob,
    "vllm": stage_vllm,
    "contention": stage_contention,
}


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("stage", choices=sorted(STAGES))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(list(argv))
    fn = STAGES[args.stage]
    if args.dry_run:
        print(f"{args.stage}: would run {fn.__name__} on {args.device}")
        return 0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = Ctx(args.device)
    t0 = time.perf_counter()
    try:
        fn(ctx)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        check(f"{args.stage} ran to the end", False, f"{type(exc).__name__}: {exc}")
    print(f"stage {args.stage}: {len(FAILS)} failed checks in {time.perf_counter() - t0:.1f} s")
    return min(len(FAILS), 100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

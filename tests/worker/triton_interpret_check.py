"""Run the Triton copy path's planning and kernel on the CPU, in Triton's interpreter.

Executed by ``test_triton_kernel.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the
variable must be set before Triton compiles anything). Two identical CPU setups receive the
same random jobs: one through the host copy path (itself checked byte for byte elsewhere),
the other through the backend's Triton path (``copy_impl="triton"``: the kernel's address
array from :meth:`TorchTransferBackend.kernel_args`, the kernel on host addresses, queued
completion). Every KV tensor (padding included), every pool byte and every result must end
up equal. Prints ``checked <jobs> jobs, <copies> page copies`` on success.

Then the warm-up: a backend over a fake CUDA runtime (``cuda_fakes``) chooses Triton after
its self-test ran the kernel; every later job, whatever its number of copies (1, 16, 17,
...) and groups, must launch the one variant the warm-up compiled. Prints
``warm-up variant <variant> covers <launches> launches, lengths <lengths>``.
"""

from __future__ import annotations

import os
import random

import torch
from cuda_fakes import FakeCudaRuntime, findings
from worker_harness import random_mapping

from statecore.adapters.torch import TorchTransferBackend, triton_copy
from statecore.manager import CPULoadStoreSpec
from statecore.pool import CPUPool
from statecore.wire import GPULoadStoreSpec, TransferJob

NUM_BLOCKS = 40
NUM_SLOTS = 30


def make(
    bpc: int, seed: int, page4: bool, impl: str
) -> tuple[list[torch.Tensor], CPUPool, TorchTransferBackend]:
    gen = torch.Generator().manual_seed(seed)
    wide = 36 if page4 else 96  # 36-byte pages force 4-byte words
    backing = torch.randint(0, 255, (NUM_BLOCKS, 160), generator=gen, dtype=torch.uint8)
    caches = [
        torch.randint(-100, 100, (NUM_BLOCKS, 2, 4, 8), generator=gen, dtype=torch.int16),
        torch.randn((NUM_BLOCKS, 16, 4), generator=gen).to(torch.bfloat16),
        torch.randint(0, 255, (NUM_BLOCKS, wide), generator=gen, dtype=torch.uint8),
        backing[:, :128],  # padded: block stride 160 B, page 128 B
    ]
    pages = [c[0].numel() * c.element_size() for c in caches]
    pool = CPUPool(NUM_SLOTS, [p * bpc for p in pages])
    for i in range(pool.num_regions):
        region = pool.region(i)
        region[:] = random.Random(seed * 10 + i).randbytes(len(region))
    be = TorchTransferBackend(
        caches,
        pool,
        bpc,
        group_tensors=[[0, 1], [2], [3]],
        threads=1,
        copy_impl=impl,  # type: ignore[arg-type]
    )
    return [backing, *caches[:3]], pool, be


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    assert triton_copy() is not None, "Triton is not importable"
    jobs = copies = 0
    for seed, bpc, page4 in [(1, 1, False), (2, 3, False), (3, 3, True), (4, 1, True)]:
        ref_t, ref_pool, ref = make(bpc, seed, page4, "auto")
        dut_t, dut_pool, dut = make(bpc, seed, page4, "triton")
        assert (ref.impl, dut.impl) == ("cpu", "triton")
        assert dut._word_bytes == (4 if page4 else 8), dut._word_bytes
        rng = random.Random(seed)
        for job_id in range(6):
            free = list(range(NUM_SLOTS))
            mapping = random_mapping(rng, 3, NUM_BLOCKS, free, bpc, max_blocks=8)
            is_store = job_id % 2 == 0
            job = mapping.store() if is_store else mapping.load()
            ref.submit(job_id, job, is_store)
            _, n, _ = dut.kernel_args(job_id, job, is_store)
            dut.submit(job_id, job, is_store)  # plans again, launches the kernel, queues
            dut.wait([job_id])
            want = [(r.job_id, r.success, r.nbytes, r.is_store) for r in ref.poll()]
            got = [(r.job_id, r.success, r.nbytes, r.is_store) for r in dut.poll()]
            assert got == want, (got, want)
            jobs += 1
            copies += n
            for i, (a, b) in enumerate(zip(ref_t, dut_t, strict=True)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (  # bytes: NaNs
                    f"seed {seed} job {job_id}: KV tensor {i} differs"
                )
            for r in range(ref_pool.num_regions):
                assert bytes(ref_pool.region(r)) == bytes(dut_pool.region(r)), (
                    f"seed {seed} job {job_id}: pool region {r} differs"
                )
        ref.shutdown()
        dut.shutdown()
    assert copies > 0
    print(f"checked {jobs} jobs, {copies} page copies")
    check_warmup_variant()


def check_warmup_variant() -> None:
    kernel = triton_copy()
    launches: list[tuple[int, int, int]] = []  # (n, word bytes, block)
    real = kernel.launch_copy_pages

    def spy(addrs: object, n: int, max_words: int, word_bytes: int, block: object = None) -> None:
        launches.append((n, word_bytes, block if block is not None else -1))
        real(addrs, n, max_words, word_bytes, block)

    kernel.launch_copy_pages = spy
    try:
        rt = FakeCudaRuntime()
        gen = torch.Generator().manual_seed(9)
        caches = [
            torch.randint(0, 255, (NUM_BLOCKS, 4096), generator=gen, dtype=torch.uint8),
            torch.randint(0, 255, (NUM_BLOCKS, 512), generator=gen, dtype=torch.uint8),
        ]
        pool = CPUPool(NUM_SLOTS, [4096, 512])
        be = TorchTransferBackend(
            caches, pool, 1, group_tensors=[[0], [1]], threads=1, cuda_runtime=rt
        )
        assert be.impl == "triton" and be.pool_registered, be.impl
        assert len(launches) == 1, launches  # the warm-up
        variant = be.kernel_variant()
        rng = random.Random(3)
        lengths = []
        for job_id, (n0, n1) in enumerate([(1, 0), (0, 1), (8, 8), (16, 0), (9, 8), (0, 17)]):
            blocks = rng.sample(range(NUM_BLOCKS), n0 + n1)
            slots = rng.sample(range(NUM_SLOTS), n0 + n1)
            gpu = GPULoadStoreSpec(tuple(blocks), (n0, n1), (0, 0))
            job = TransferJob("w", gpu, CPULoadStoreSpec(tuple(slots)))
            be.submit(job_id, job, True)
            be.wait([job_id])
            assert [r.success for r in be.poll()] == [True]
            for i, b in enumerate(blocks):
                t = 0 if i < n0 else 1
                page = pool.row_bytes[t]
                assert bytes(pool.row(t, slots[i])) == caches[t][b].numpy().tobytes()[:page]
            lengths.append(n0 + n1)
        be.shutdown()
        assert findings(rt, be, after_shutdown=True) == [], findings(rt, be, after_shutdown=True)
        kinds = {(w, blk) for _, w, blk in launches}
        assert kinds == {variant}, (kinds, variant)
        print(f"warm-up variant {variant} covers {len(launches)} launches, lengths {lengths}")
    finally:
        kernel.launch_copy_pages = real


if __name__ == "__main__":
    main()

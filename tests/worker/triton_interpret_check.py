"""Run the Triton copy path's planning and kernel on the CPU, in Triton's interpreter.

Executed by ``test_triton_kernel.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the
variable must be set before Triton compiles anything). Two identical CPU setups receive the
same random jobs: one through the host copy path (itself checked byte for byte elsewhere),
the other through the backend's Triton path (``copy_impl="triton"``: the kernel's address
array from :meth:`TorchTransferBackend.kernel_args`, the kernel on host addresses, queued
completion). Every KV tensor (padding included), every pool byte and every result must end
up equal. Prints ``checked <jobs> jobs, <copies> page copies`` on success.
"""

from __future__ import annotations

import os
import random

import torch
from statecore.adapters.torch import TorchTransferBackend, triton_copy
from worker_harness import random_mapping

from statecore.pool import CPUPool

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


if __name__ == "__main__":
    main()

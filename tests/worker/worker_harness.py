"""Helpers shared by the worker tests: random block mappings and job builders (no torch)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from statecore.manager import CPULoadStoreSpec
from statecore.wire import GPULoadStoreSpec, TransferJob


@dataclass(frozen=True)
class Mapping:
    """A GPU spec and its CPU spec, as a scheduler would emit them."""

    gpu: GPULoadStoreSpec
    cpu: CPULoadStoreSpec

    def store(self, req_id: str = "r") -> TransferJob:
        return TransferJob(req_id, self.gpu, self.cpu)

    def load(self, req_id: str = "r") -> TransferJob:
        return TransferJob(req_id, self.cpu, self.gpu)


def random_mapping(
    rng: random.Random,
    num_groups: int,
    num_gpu_blocks: int,
    free_slots: list[int],
    bpc: int,
    max_blocks: int = 6,
    gpu_pool: Sequence[int] | None = None,
) -> Mapping:
    """Random group sizes and first-block indices (so random sub-block skips), distinct GPU
    blocks per group and distinct CPU slots, drawn (and removed) from ``free_slots``."""
    sizes: list[int] = []
    indices: list[int] = []
    blocks: list[int] = []
    slots: list[int] = []
    candidates = list(gpu_pool) if gpu_pool is not None else list(range(num_gpu_blocks))
    for _ in range(num_groups):
        n = rng.randint(0, max_blocks)
        idx = rng.randint(0, 20)
        chunks = -(-(n + idx % bpc) // bpc) if n else 0
        if chunks > len(free_slots):
            n, chunks = 0, 0
        sizes.append(n)
        indices.append(idx)
        blocks += rng.sample(candidates, n)
        for _ in range(chunks):
            slots.append(free_slots.pop(rng.randrange(len(free_slots))))
    return Mapping(
        GPULoadStoreSpec(tuple(blocks), tuple(sizes), tuple(indices)),
        CPULoadStoreSpec(tuple(slots)),
    )


def simple_mapping(blocks: Sequence[int], slots: Sequence[int], num_groups: int = 1) -> Mapping:
    """One group (others empty) with bpc 1: block i goes to slot i."""
    sizes = (len(blocks),) + (0,) * (num_groups - 1)
    return Mapping(
        GPULoadStoreSpec(tuple(blocks), sizes, (0,) * num_groups),
        CPULoadStoreSpec(tuple(slots)),
    )

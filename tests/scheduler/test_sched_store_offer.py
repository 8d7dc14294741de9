"""A store job holds exactly the offered chunks whose keys the manager kept.

The scheduler offers a request's storable chunks (null blocks left out) to ``prepare_store``
and builds the job from what the manager kept: the usual offer is a prompt whose shared prefix
is present already, so what is kept is the offer's tail, and the scheduler takes it as such
without filtering every offered key. These tests compare every store job against the plain
definition (each group's offered chunks, filtered by key) over random mixes of present keys
(a prefix, gaps, an evicted first chunk), null blocks, one or two groups, one or two blocks a
chunk, and offers that name a key twice.
"""

from __future__ import annotations

import random

import pytest
from sched_harness import FakeClock

from statecore import (
    GroupConfig,
    OffloadingScheduler,
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import ReqContext
from statecore.managers import CPUOffloadingManager

TPB = 4


def _expected(
    keys: list[list[OffloadKey]],
    blocks: list[list[int]],
    bpc: int,
    n_chunks: list[int],
    present: set[OffloadKey],
) -> tuple[tuple[OffloadKey, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The job by definition: per group the chunks without a null block are offered; the
    manager keeps the offered keys not present (first occurrences, in order); the job holds
    every offered chunk whose key was kept. None when nothing is kept."""
    offered = [
        [c for c in range(n) if 0 not in blocks[g][c * bpc : (c + 1) * bpc]]
        for g, n in enumerate(n_chunks)
    ]
    kept = set(
        dict.fromkeys(
            k for g, cs in enumerate(offered) for c in cs if (k := keys[g][c]) not in present
        )
    )
    if not kept:
        return None
    job_keys: list[OffloadKey] = []
    src: list[int] = []
    sizes: list[int] = []
    starts: list[int] = []
    for g, cs in enumerate(offered):
        acc = [c for c in cs if keys[g][c] in kept]
        job_keys += [keys[g][c] for c in acc]
        group_blocks = [b for c in acc for b in blocks[g][c * bpc : (c + 1) * bpc]]
        src += group_blocks
        sizes.append(len(group_blocks))
        starts.append(acc[0] * bpc if acc else 0)
    return tuple(job_keys), tuple(src), tuple(sizes), tuple(starts)


def _case(rng: random.Random, n_groups: int, bpc: int, duplicates: bool) -> None:
    cfg = SchedulerConfig(
        groups=tuple(GroupConfig(TPB) for _ in range(n_groups)), blocks_per_chunk=bpc
    )
    manager = CPUOffloadingManager(4096)
    sched = OffloadingScheduler(cfg, manager, FakeClock(), checked=not duplicates)
    tpc = TPB * bpc
    n = rng.randint(1, 12)  # chunks
    hashes = [rng.randbytes(8) for _ in range(n * bpc)]
    if duplicates:  # (not a chained hash: a chunk's key repeats another one's)
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randrange(n), rng.randrange(n)
            hashes[(a + 1) * bpc - 1] = hashes[(b + 1) * bpc - 1]
    keys = [
        [make_offload_key(hashes[(c + 1) * bpc - 1], g) for c in range(n)] for g in range(n_groups)
    ]
    shape = rng.choice(["prefix", "random", "none", "all", "evicted first"])
    present: set[OffloadKey] = set()
    for g in range(n_groups):
        for c in range(n):
            cut = rng.randint(0, n)
            if (
                (shape == "prefix" and c < cut)
                or (shape == "random" and rng.random() < 0.5)
                or shape == "all"
                or (shape == "evicted first" and c > 0)
            ):
                present.add(keys[g][c])
    if present:
        ctx = ReqContext("earlier")
        out = manager.prepare_store(sorted(present), ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
    nxt = iter(range(1, 10_000))
    blocks = [[next(nxt) for _ in range(n * bpc)] for _ in range(n_groups)]
    for g in range(n_groups):
        if rng.random() < 0.3:
            blocks[g][rng.randrange(n * bpc)] = 0  # a null block: its chunk is never offered
    req = Request("r", n * tpc, n * tpc, block_hashes=hashes, skip_reading_prefix_cache=True)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks, 0)
    meta = sched.build_connector_meta(
        SchedulerOutput(
            scheduled=[ScheduledRequest("r", tuple(map(tuple, blocks)), n * tpc)],
            new_req_ids=frozenset({"r"}),
        )
    )
    want = _expected(keys, blocks, bpc, [n] * n_groups, present)
    if want is None:
        assert not meta.store_jobs
        return
    ((job_id, store),) = meta.store_jobs.items()
    got = (
        sched.jobs[job_id].keys,
        store.src.block_ids,  # type: ignore[attr-defined]
        store.src.group_sizes,  # type: ignore[attr-defined]
        store.src.block_indices,  # type: ignore[attr-defined]
    )
    assert got == want, (shape, n, bpc, n_groups)
    assert sched.jobs[job_id].blocks == want[1]


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("n_groups", [1, 2])
def test_a_store_job_holds_the_offered_chunks_whose_keys_were_kept(bpc: int, n_groups: int) -> None:
    rng = random.Random(1900 + 10 * bpc + n_groups)
    for _ in range(150):
        _case(rng, n_groups, bpc, duplicates=False)


@pytest.mark.parametrize("bpc", [1, 2])
def test_an_offer_that_names_a_key_twice_is_filtered_by_key(bpc: int) -> None:
    """Hashes that do not identify their prefix (two chunks with one key, the RequestLike
    contract broken): the job is still every offered chunk whose key was kept, the earlier
    of two equal keys included, as filtering by key gives (unchecked mode: a job naming a key
    twice breaks invariants, which is the input's fault)."""
    rng = random.Random(1931 + bpc)
    for _ in range(150):
        _case(rng, 1, bpc, duplicates=True)


class _ReversingManager(CPUOffloadingManager):
    """Answers ``prepare_store`` with the kept keys in reverse order (breaking the contract's
    offered order)."""

    def prepare_store(self, keys, ctx):  # type: ignore[no-untyped-def]
        out = super().prepare_store(keys, ctx)
        if out is None:
            return out
        return type(out)(tuple(reversed(out.keys_to_store)), out.store_spec, out.evicted_keys)


def test_a_job_lists_its_chunks_in_chunk_order_whatever_order_the_manager_answers() -> None:
    sched = OffloadingScheduler(SchedulerConfig(groups=(GroupConfig(TPB),)), _ReversingManager(64))
    hashes = [bytes([i]) * 8 for i in range(1, 5)]
    req = Request("r", 16, 16, block_hashes=hashes, skip_reading_prefix_cache=True)
    sched.on_new_request(req)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [[5, 6, 7, 8]], 0)
    meta = sched.build_connector_meta(
        SchedulerOutput(
            scheduled=[ScheduledRequest("r", ((5, 6, 7, 8),), 16)], new_req_ids=frozenset({"r"})
        )
    )
    ((job_id, store),) = meta.store_jobs.items()
    assert sched.jobs[job_id].keys == sched.request_keys("r")[0]
    assert store.src.block_ids == (5, 6, 7, 8)  # type: ignore[attr-defined]

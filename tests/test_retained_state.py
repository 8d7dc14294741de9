"""Retained state stays bounded by what is live: the soak's memory oracle, in miniature.

A long run (a soak) must keep memory flat: every container statecore holds (dicts, lists,
sets, queues, at any depth of statecore's own objects and of their containers' elements) is
keyed by something live - tracked requests, in-flight jobs, CPU slots, GPU blocks, a tier's
configured limits - never by the history of the run (job ids, per-call records, sizes, events
that nobody drains). Each oracle drives a long run without ever calling ``get_stats`` or
``take_events`` (an engine may never ask), and asserts every container's length is within the
live bound. A container that grows with the number of jobs, steps or requests seen exceeds
the bound long before the run ends, whatever its name.

* the scheduler and the CPU manager: the benchmark's standalone engine;
* the tiering manager with a file-system tier and a Redis tier (a real server), events off:
  the simulator's whole stack;
* the vLLM adapter's per-job transfer sizes (:class:`TransferSizes`, here without vLLM; the
  whole connector inside vLLM's engine is walked by ``tests/vllm``).

The seeded mutants of ``RETAINED_MUTANTS`` (tests/mutants/catalogue.py) re-introduce the class
at each site; every one is caught by its oracle here.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from retained import RETAINED_SCENARIO, containers

from statecore.adapters.vllm_metrics import TransferSizes, stats_payload
from statecore.bench.scheduler import HookTimer, RunResult, run_standalone
from statecore.manager import OffloadingManager
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.filetier import FileTier, InlineExecutor
from statecore.managers.redistier import RedisTier, RedisTierConfig, TierLayout
from statecore.managers.tiering import TieringOffloadingManager
from statecore.services.redisserver import LocalRedis
from statecore.sim.engine import SimConfig, SimEngine
from statecore.sim.faults import SimFaults
from statecore.sim.run import SimStack, attach_store_oracle
from statecore.sim.workload import WorkloadConfig
from tests.managers.redis_fixtures import require_server

sys.path.insert(0, str(Path(__file__).resolve().parent / "mutants"))
from catalogue import RETAINED_MUTANTS

Grown = dict[str, int]
"""Containers beyond the live bound, by attribute path (empty when the oracle holds)."""

# -- the scheduler and the CPU manager --------------------------------------------------------

STEPS = 800

SCENARIO = dataclasses.replace(RETAINED_SCENARIO, bulk=True)


def standalone_grown() -> Grown:
    """The standalone oracle: 800 steps, then every container the scheduler reaches."""
    sizes: dict[str, int] = {}
    live: dict[str, int] = {}

    def probe(step: int, timer: HookTimer, res: RunResult, submitted: int) -> bool:
        timer.steps.clear()  # the benchmark's own records (not under test)
        if step < STEPS:
            return False
        sched = timer.target
        sizes.update(containers(sched, "scheduler"))
        live.update(
            submitted=submitted,
            bound=SCENARIO.num_cpu_chunks()
            + SCENARIO.num_gpu_blocks()
            + SCENARIO.concurrency
            + len(sched.jobs),
        )
        return True

    run_standalone(SCENARIO, probe)
    bound = live["bound"]
    # the run saw many times more jobs than there are live things: history shows up
    assert live["submitted"] > 4 * bound, live
    assert "scheduler.manager._entries" in sizes  # the walk reached the manager
    return {where: n for where, n in sizes.items() if n > bound}


def test_every_container_is_bounded_by_live_state_over_a_long_run() -> None:
    grown = standalone_grown()
    assert grown == {}, f"containers beyond the live bound: {grown}"


# -- the tiering manager and its file-system and Redis tiers ---------------------------------

SIM_STEPS = 3000
TIER_FILES = 48
"""The file tier's size limit, in chunk files."""
KNOWN_KEYS = 256
"""The Redis tier's lookup-answer limit (``max_known_keys``; far fewer answers starve the
lookups: an answer is dropped before the request that asked can use it)."""
FINALIZED = 16
"""The tiering manager's finalised-request memory for the run (``FINALIZED_MEMORY``): the
constant caps are made small so that the run shows they hold."""


class _TieredStack(SimStack):
    """A simulated stack whose tiering manager has a file tier and a Redis tier, with events
    off (an engine that never takes them)."""

    def __init__(self, cfg: SimConfig, tier_dir: Path, redis_url: str) -> None:
        self.tier_dir = tier_dir
        self.redis_url = redis_url
        super().__init__(cfg)

    def _make_manager(self) -> OffloadingManager:
        pool = self.pool
        self.file_tier = FileTier(
            self.tier_dir,
            pool,
            max_bytes=TIER_FILES * (pool.slot_bytes + 64),
            executor=InlineExecutor(),
        )
        layout = TierLayout("retained", "uint8", (self.cfg.num_tensors, self.cfg.page_bytes), 1)
        redis_cfg = RedisTierConfig(
            url=self.redis_url, layout=layout, prefix="retained", max_known_keys=KNOWN_KEYS
        )
        self.redis_tier = RedisTier(redis_cfg, pool, executor=InlineExecutor())
        primary = CPUOffloadingManager(self.cfg.cpu_slots, enable_events=False)
        manager = TieringOffloadingManager(primary, [self.file_tier, self.redis_tier])
        manager.FINALIZED_MEMORY = FINALIZED
        return manager


def tiering_grown(tier_dir: Path) -> Grown:
    """The tiering oracle: 3000 simulated steps (default faults), then every container the
    tiering manager reaches, its primary's and its tiers' included."""
    require_server()
    cfg = SimConfig(
        seed=11,
        steps=10**9,
        manager="tiering",
        cpu_slots=64,
        num_gpu_blocks=96,
        workload=WorkloadConfig(num_requests=10**6),
        faults=SimFaults.preset("default"),
    )
    with LocalRedis() as srv:
        stack = _TieredStack(cfg, tier_dir, srv.url)
        try:
            engine = SimEngine(
                cfg,
                stack.scheduler,
                stack.ranks,
                stack.kv,
                stack.clock,
                in_flight=lambda: len(stack.scheduler.jobs),
            )
            attach_store_oracle(stack, engine)
            for _ in range(SIM_STEPS):
                engine.step()
            sizes = containers(stack.manager, "manager")
            bound = (
                cfg.cpu_slots
                + cfg.num_gpu_blocks * cfg.num_workers
                + cfg.workload.max_open
                + cfg.max_running
                + TIER_FILES
                + KNOWN_KEYS
                + FINALIZED
                + len(stack.scheduler.jobs)
            )
            slot = stack.pool.slot_bytes
            written = (
                stack.file_tier._stats["bytes_written"] // slot
                + stack.redis_tier._stats["bytes_written"] // slot
            )
        finally:
            stack.close()
    # many times more chunks went through the tiers than anything live: history shows up
    assert written > 4 * bound, (written, bound)
    for where in ("manager.primary._entries", "manager.secondaries[]._index"):
        assert where in sizes, where  # the walk reached the primary and the tiers
    return {where: n for where, n in sizes.items() if n > bound}


def test_tiering_manager_and_its_tiers_stay_bounded_by_live_state(tmp_path: Path) -> None:
    """The file and Redis tiers' events, kept until a ``take_events`` that an engine without
    events never makes, were the class here (one list entry per stored chunk batch)."""
    grown = tiering_grown(tmp_path)
    assert grown == {}, f"containers beyond the live bound: {grown}"


# -- the vLLM adapter's per-job transfer sizes ------------------------------------------------

JOBS = 20_000
SIZES = (4096, 8192, 12288, 65536, 1 << 20)
"""The distinct per-job sizes of the run (a job's bytes are its blocks times the block size)."""


def adapter_sizes_grown() -> Grown:
    """The adapter's accumulator fed one size per job, as ``update_connector_output`` feeds
    it, and never asked (``get_kv_connector_stats`` is where vLLM asks, every step)."""
    rng = random.Random(5)
    sizes = TransferSizes()
    for _ in range(JOBS // 10):
        sizes.add([rng.choice(SIZES) for _ in range(10)])
    return {k: n for k, n in containers(sizes, "sizes").items() if n > len(SIZES)}


def test_adapter_transfer_sizes_stay_bounded_by_the_distinct_sizes() -> None:
    grown = adapter_sizes_grown()
    assert grown == {}, f"containers beyond the distinct sizes: {grown}"


def test_adapter_transfer_sizes_give_the_same_stats() -> None:
    """What ``take`` gives is what a per-job list gave: every size once per job (the same
    histogram observations, counts and sum), then nothing until new jobs are added."""
    rng = random.Random(9)
    sizes = TransferSizes()
    fed: list[int] = []
    for _ in range(300):
        batch = [rng.choice(SIZES) for _ in range(rng.randrange(0, 4))]
        sizes.add(batch)
        fed.extend(batch)
    payload = stats_payload({"lookups": 3}, sizes.take(), [])
    assert Counter(payload["load_sizes"]) == Counter(fed)
    assert sum(payload["load_sizes"]) == sum(fed)
    first_seen = list(dict.fromkeys(fed))
    assert list(dict.fromkeys(payload["load_sizes"])) == first_seen  # grouped, first seen
    assert sizes.take() == []
    sizes.add([7, 7, 3])
    assert sizes.take() == [7, 7, 3]


# -- the seeded mutants -----------------------------------------------------------------------

ORACLES: dict[str, Callable[[Path], Grown]] = {
    "standalone": lambda _: standalone_grown(),
    "tiering": tiering_grown,
    "adapter": lambda _: adapter_sizes_grown(),
}
"""The oracle that must catch each mutant (a mutant's name starts with its site)."""

CAUGHT_BY = {
    "cpu_alloc_sizes_per_store": ("standalone", "scheduler.manager._alloc_history"),
    "tier_events_kept_with_events_off": ("tiering", "manager.secondaries[]._events"),
    "adapter_sizes_per_job": ("adapter", "sizes._counts"),
}
"""Mutant -> (its oracle, the container it makes grow)."""


def test_every_retained_mutant_has_an_oracle() -> None:
    assert set(CAUGHT_BY) == set(RETAINED_MUTANTS)


@pytest.mark.parametrize("name", sorted(RETAINED_MUTANTS))
def test_retained_mutant_is_caught(name: str, tmp_path: Path) -> None:
    oracle, where = CAUGHT_BY[name]
    with RETAINED_MUTANTS[name].apply():
        grown = ORACLES[oracle](tmp_path)
    assert where in grown, f"mutant {name!r} survived the {oracle} oracle: {grown}"

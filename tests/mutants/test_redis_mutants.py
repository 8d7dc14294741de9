"""Seeded mutants of the Redis tier: each must fail the tier's verification harness.

The harness (real redis-server on loopback): a value corrupted on the server, a value of
another layout, two requests whose pending lookups outnumber ``max_known_keys`` (each must
stop being answered RETRY), and two simulated instances sharing the tier through an outage
longer than the simulator's liveness bound (INV-LIVE), every instance checked by its byte
oracle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from catalogue import REDIS_MUTANTS

from statecore.keys import make_offload_key
from statecore.manager import CPULoadStoreSpec, LookupResult, ReqContext, ScheduleEndContext
from statecore.managers import CPUOffloadingManager, InlineExecutor, TieringOffloadingManager
from statecore.managers.redistier import RedisTier, RedisTierConfig, TierLayout
from statecore.pool import CPUPool
from statecore.services.redisserver import LocalRedis
from statecore.sim.engine import SimConfig
from statecore.sim.multi import run_instances
from statecore.sim.workload import WorkloadConfig
from tests.managers.redis_fixtures import require_server

ROWS = [64, 64]
CTX = ReqContext("r")
END = ScheduleEndContext()
KEY = make_offload_key(b"\x01" * 8, 0)
DATA = bytes(range(128))


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    require_server()
    with LocalRedis() as srv:
        yield srv


def _manager(
    url: str, prefix: str, dtype: str, known: int = 1 << 18
) -> tuple[TieringOffloadingManager, CPUPool]:
    pool = CPUPool(4, ROWS)
    layout = TierLayout("m", dtype, (8,), 1)
    cfg = RedisTierConfig(url=url, prefix=prefix, layout=layout, max_known_keys=known)
    tier = RedisTier(cfg, pool, executor=InlineExecutor())
    return TieringOffloadingManager(CPUOffloadingManager(4), [tier]), pool


def _fetch(m: TieringOffloadingManager, pool: CPUPool) -> bytes | None:
    for _ in range(4):
        r = m.lookup(KEY, CTX)
        if r is LookupResult.HIT:
            spec = m.prepare_load([KEY], CTX)
            assert isinstance(spec, CPULoadStoreSpec)
            return pool.read_slot(spec.slots[0])
        if r is LookupResult.MISS:
            return None
        m.on_schedule_end(END)
    return None


def _store(m: TieringOffloadingManager, pool: CPUPool) -> None:
    out = m.prepare_store([KEY], CTX)
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
    pool.write_slot(out.store_spec.slots[0], DATA)
    m.complete_store([KEY], CTX)
    m.on_schedule_end(END)
    m.on_schedule_end(END)


def harness_finding(srv: LocalRedis, prefix: str) -> str | None:
    """What the Redis tier's harness reports (None: it passed)."""
    a, pool_a = _manager(srv.url, prefix, "f16")
    _store(a, pool_a)
    # another layout must not see the value
    other, pool_o = _manager(srv.url, prefix, "bf16")
    got = _fetch(other, pool_o)
    if got is not None:
        return f"a tier of another layout loaded {got[:8]!r}..."
    # a value corrupted on the server must never be loaded
    b, pool_b = _manager(srv.url, prefix, "f16")
    tier_b = b.secondaries[0]
    assert isinstance(tier_b, RedisTier)
    client = srv.client()
    raw = client.get(tier_b.redis_key(KEY))
    client.set(tier_b.redis_key(KEY), raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    got = _fetch(b, pool_b)
    if got is not None:
        return f"a corrupted value was loaded ({'wrong' if got != DATA else 'right'} bytes)"
    # two requests sharing a first chunk, one lookup answer kept: neither may wait forever
    small, _ = _manager(srv.url, f"{prefix}known", "f16", known=1)
    prompts = {
        "ra": [make_offload_key(b"\x02" * 8, 0), make_offload_key(b"\x03" * 8, 0)],
        "rb": [make_offload_key(b"\x02" * 8, 0), make_offload_key(b"\x04" * 8, 0)],
    }
    for _ in range(8):
        for rid in list(prompts):
            results = small.lookup_many(prompts[rid], ReqContext(rid), True)
            if LookupResult.RETRY not in results:
                del prompts[rid]
        small.on_schedule_end(END)
    if prompts:
        return f"requests {sorted(prompts)} answered RETRY for 8 steps (max_known_keys=1)"
    # two instances through an outage longer than the liveness bound
    cfg = dataclasses.replace(
        SimConfig(seed=1), workload=dataclasses.replace(WorkloadConfig(), num_requests=120)
    )
    rep = run_instances(
        cfg, srv.url, 2, prefix=f"{prefix}sim", server=srv, restart=True, down_steps=200
    )
    for i, r in enumerate(rep.instances):
        if not r.ok:
            found = r.invariant_violations + r.data_errors + r.hung_requests + r.leaked_state
            return f"instance {i}: {(found or r.engine_errors or ['not ok'])[0]}"
    return None


def test_harness_passes_without_mutants(server: LocalRedis) -> None:
    assert harness_finding(server, "control") is None


@pytest.mark.parametrize("name", sorted(REDIS_MUTANTS))
def test_redis_mutant_is_caught(server: LocalRedis, name: str) -> None:
    with REDIS_MUTANTS[name].apply():
        finding = harness_finding(server, name)
    assert finding is not None, f"mutant {name!r} survived the Redis tier's harness"

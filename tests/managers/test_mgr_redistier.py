"""RedisTier against a real redis-server on loopback: header and namespace, eviction, faults,
corrupt values, concurrent writers, batching, a three-node cluster.

One server serves the module (each test uses its own key prefix); the fault tests that stop
or pause a server start their own. Servers listen on 127.0.0.1, random ports, and are stopped
at the end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from statecore.errors import ConfigError
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import CPULoadStoreSpec, LookupResult, ReqContext, ScheduleEndContext
from statecore.managers import CPUOffloadingManager, InlineExecutor, TieringOffloadingManager
from statecore.managers.redistier import (
    CHECKSUM_CRC32,
    CHECKSUM_XXH3,
    HEADER,
    RedisTier,
    RedisTierConfig,
    TierLayout,
    decode_value,
    delete_keys,
    encode_value,
    glob_escape,
    inspect_value,
    probe_server,
    public_url,
    scan_keys,
    split_key,
)
from statecore.managers.tierconfig import build_tier
from statecore.managers.tiers import FaultLog
from statecore.pool import CPUPool
from statecore.services.redisserver import LocalRedis, LocalRedisCluster
from tests.managers.redis_fixtures import require_server

END = ScheduleEndContext()
CTX = ReqContext("r")
ROWS = [96, 32]
LAYOUT = TierLayout("test-model", "float16", (2, 16, 1, 3), 1)


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def chunk(i: int, salt: int = 0, rows: list[int] = ROWS) -> bytes:
    n = sum(rows)
    return (bytes((i * 31 + j * 7 + salt) % 256 for j in range(256)) * (n // 256 + 1))[:n]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    require_server()
    with LocalRedis() as srv:
        yield srv


_prefixes = iter(range(1 << 30))


def config(srv: LocalRedis | LocalRedisCluster, **kw: Any) -> RedisTierConfig:
    kw.setdefault("prefix", f"t{next(_prefixes)}")
    kw.setdefault("layout", LAYOUT)
    kw.setdefault("timeout_s", 5.0)
    return RedisTierConfig(url=srv.url, **kw)


class Instance:
    """One engine instance's manager stack: CPU primary + RedisTier over its own pool."""

    def __init__(
        self, cfg: RedisTierConfig, slots: int = 8, executor: Any = None, rows: list[int] = ROWS
    ) -> None:
        self.rows = rows
        self.pool = CPUPool(slots, rows)
        self.tier = RedisTier(cfg, self.pool, executor=executor or InlineExecutor())
        self.m = TieringOffloadingManager(CPUOffloadingManager(slots), [self.tier])

    def store(self, *ids: int, salt: int = 0) -> None:
        out = self.m.prepare_store([k(i) for i in ids], CTX)
        assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
        for key, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):
            self.pool.write_slot(slot, chunk(int.from_bytes(key[:8], "big"), salt, self.rows))
        self.m.complete_store(out.keys_to_store, CTX)
        self.step()
        self.tier.drain()
        self.step()  # the cascades are reported, pins released

    def step(self) -> None:
        self.m.on_schedule_end(END)

    def lookup(self, i: int) -> LookupResult:
        return self.m.lookup(k(i), CTX)

    def fetch(self, i: int) -> bytes | None:
        """Look ``k(i)`` up until it settles, promote it, load it: its bytes, or None (MISS)."""
        for _ in range(6):
            r = self.lookup(i)
            if r is LookupResult.HIT:
                spec = self.m.prepare_load([k(i)], CTX)
                assert isinstance(spec, CPULoadStoreSpec)
                data = self.pool.read_slot(spec.slots[0])
                self.m.complete_load([k(i)], CTX)
                return data
            if r is LookupResult.MISS:
                return None
            self.step()
            self.tier.drain()
        raise AssertionError(f"k({i}) never settled (last answer {r!r})")

    def close(self) -> None:
        self.m.shutdown()


# -- header, namespace, bytes ---------------------------------------------------------------------


def test_value_carries_header_and_key_is_namespaced_by_layout(server: LocalRedis) -> None:
    cfg = config(server)
    a = Instance(cfg)
    a.store(1)
    fp = LAYOUT.fingerprint(ROWS)
    rkey = f"{cfg.prefix}:{fp.hex()}:".encode() + k(1)
    raw = server.client().get(rkey)
    assert raw is not None
    magic, version, kind, got_fp, key_len, length, _ = HEADER.unpack_from(raw)
    assert (magic, version, got_fp, key_len, length) == (b"SCRD", 1, fp, len(k(1)), sum(ROWS))
    assert kind in (CHECKSUM_CRC32, CHECKSUM_XXH3)
    assert len(raw) == HEADER.size + len(k(1)) + sum(ROWS)
    payload = decode_value(raw, fp, k(1), sum(ROWS))
    assert not isinstance(payload, str) and bytes(payload) == chunk(1)
    # another layout (dtype) lives in another namespace: it never sees, never reads the value
    other = Instance(
        config(server, prefix=cfg.prefix, layout=TierLayout("test-model", "bf16", (2, 16, 1, 3), 1))
    )
    assert other.fetch(1) is None
    # the pool's row sizes are part of the fingerprint too
    assert LAYOUT.fingerprint([64, 64]) != fp
    a.close()
    other.close()


def test_a_chunk_stored_by_one_instance_is_loaded_by_another(server: LocalRedis) -> None:
    cfg = config(server)
    a, b = Instance(cfg), Instance(cfg)
    a.store(1, 2, 3)
    for i in (1, 2, 3):
        assert b.fetch(i) == chunk(i)
    assert b.fetch(4) is None
    stats = b.m.get_stats()
    assert stats["redis0.bytes_read"] == 3 * sum(ROWS)
    a.close()
    b.close()


def test_checksum_kinds_both_verify(server: LocalRedis) -> None:
    fp = LAYOUT.fingerprint(ROWS)
    rows = [chunk(5)[:96], chunk(5)[96:]]
    value = encode_value(fp, k(5), rows, checksum=CHECKSUM_CRC32)
    payload = decode_value(value, fp, k(5), sum(ROWS))
    assert not isinstance(payload, str) and bytes(payload) == chunk(5)
    with pytest.raises(ConfigError):
        encode_value(fp, k(5), rows, checksum=99)


# -- server eviction and expiry -> MISS -----------------------------------------------------------


def test_evicted_values_are_misses_never_errors() -> None:
    require_server()
    # a server with room for a few dozen chunks and LRU eviction over every key
    with LocalRedis(maxmemory=2 << 20, policy="allkeys-lru") as srv:
        big = [64 << 10, 64 << 10]
        a = Instance(config(srv), slots=16, rows=big)
        n = 64  # 8 MiB of values into 2 MiB
        for start in range(0, n, 16):
            a.store(*range(start, start + 16))
        client = srv.client()
        evicted = {i for i in range(n) if not client.exists(a.tier.redis_key(k(i)))}
        assert evicted, "the server evicted nothing: the test proves nothing"
        assert len(evicted) < n
        for i in range(n):
            a.m.reset_cache()  # the primary forgets: the bytes must come from the server
            got = a.fetch(i)  # a stale "present" answer may meet an evicted value
            if i in evicted:
                assert got is None
            else:
                assert got == chunk(i, rows=big)
        stats = a.tier.get_stats()
        assert stats["missing_reads"] >= 1 and stats["server_errors"] == 0
        a.close()


def test_a_full_server_without_eviction_rejects_stores_as_failed_cascades() -> None:
    require_server()
    with LocalRedis(maxmemory=1 << 20, policy="noeviction") as srv:
        big = [64 << 10, 64 << 10]
        a = Instance(config(srv), slots=16, rows=big)
        for start in range(0, 32, 16):
            a.store(*range(start, start + 16))  # 4 MiB into 1 MiB: the server says OOM
        stats = a.m.get_stats()
        assert stats["redis0.rejected_writes"] >= 1 and stats["cascades_failed"] >= 1
        assert a.m.primary.counters().pinned == 0
        a.m.reset_cache()
        for i in range(32):
            assert a.fetch(i) in (None, chunk(i, rows=big))  # stored ones load, others miss
        a.close()


def test_values_expire_after_ttl_and_then_miss(server: LocalRedis) -> None:
    cfg = config(server, ttl_s=600.0)
    a = Instance(cfg)
    a.store(1)
    client = server.client()
    pttl = client.pttl(a.tier.redis_key(k(1)))
    assert 0 < pttl <= 600_000
    client.pexpire(a.tier.redis_key(k(1)), 1)  # expire it now (the server's own expiry)
    while client.exists(a.tier.redis_key(k(1))):
        pass  # lazy expiry on access: EXISTS removes it once its millisecond has passed
    b = Instance(cfg)
    assert b.fetch(1) is None  # unknown to b: EXISTS says no
    a.m.reset_cache()
    assert a.fetch(1) is None  # known present to a: the promotion finds it gone -> MISS
    assert a.tier.get_stats()["missing_reads"] == 1
    a.close()
    b.close()


# -- corrupt, truncated, foreign values -----------------------------------------------------------


def _tamper(kind: str, raw: bytes, fp: bytes) -> bytes:
    if kind == "flipped":
        return raw[:-1] + bytes([raw[-1] ^ 1])
    if kind == "truncated":
        return raw[:-10]
    if kind == "extended":
        return raw + b"x"
    if kind == "other-layout":
        other = TierLayout("another", "float16", (2, 16, 1, 3), 1).fingerprint(ROWS)
        return encode_value(other, k(1), [chunk(1)])
    if kind == "other-key":  # a valid value of another key under this key's name
        return encode_value(fp, k(2), [chunk(2)])
    if kind == "other-length":  # a valid value of this key and layout, of another length
        return encode_value(fp, k(1), [chunk(1), b"\x00" * 8])
    return b"not a statecore value"


@pytest.mark.parametrize(
    "kind",
    [
        "flipped",
        "truncated",
        "extended",
        "other-layout",
        "other-key",
        "other-length",
        "garbage",
        "wrong-type",
    ],
)
def test_bad_value_fails_promotion_drops_key_never_wrong_bytes(
    server: LocalRedis, kind: str
) -> None:
    cfg = config(server)
    a, b = Instance(cfg), Instance(cfg)
    a.store(1)
    client = server.client()
    rkey = a.tier.redis_key(k(1))
    if kind == "wrong-type":  # not a string under the name (the file tier's directory)
        client.delete(rkey)
        client.rpush(rkey, b"x")
    else:
        client.set(rkey, _tamper(kind, client.get(rkey), a.tier.fingerprint))
    assert b.lookup(1) is LookupResult.RETRY
    b.step()
    assert b.lookup(1) is LookupResult.HIT_PENDING
    slot = b.m.primary.slot_of(k(1))
    assert slot is not None
    before = b.pool.read_slot(slot)
    b.step()
    assert b.lookup(1) is LookupResult.MISS  # failed promotion: slot dropped, recompute
    assert b.pool.read_slot(slot) == before  # the bad payload was never copied in
    assert client.exists(rkey) == 0  # the bad value was deleted
    stats = b.tier.get_stats()
    bad = stats["corrupt_reads"] + stats["foreign_reads"]
    assert bad == 1 and b.m.get_stats()["promotions_failed"] == 1
    a.close()
    b.close()


# -- server down, restarted, slow -----------------------------------------------------------------


def test_server_down_and_restarted_fails_jobs_then_recovers() -> None:
    require_server()
    with LocalRedis() as srv:
        cfg = config(srv, timeout_s=2.0)
        a, b = Instance(cfg), Instance(cfg)
        a.store(1)
        assert b.lookup(1) is LookupResult.RETRY
        b.step()
        assert b.lookup(1) is LookupResult.HIT_PENDING  # promotion queued...
        srv.stop()  # ...and the server goes away before it runs
        b.step()
        assert b.lookup(1) is LookupResult.MISS  # promotion failed -> recompute
        assert b.m.get_stats()["promotions_failed"] == 1
        # an unknown key: the EXISTS batch fails -> MISS, no request waits on a dead server
        assert b.lookup(7) is LookupResult.RETRY
        b.step()
        assert b.lookup(7) is LookupResult.MISS
        # a store while down: the cascade fails, the pins are released
        a.store(2)
        stats = a.m.get_stats()
        assert stats["cascades_failed"] == 1 and stats["redis0.server_errors"] >= 1
        assert a.m.primary.counters().pinned == 0
        srv.start()  # same port, empty (no persistence)
        a.store(3)
        c = Instance(cfg)
        assert c.fetch(3) == chunk(3)
        assert c.fetch(1) is None  # lost with the restart: a miss
        for inst in (a, b, c):
            inst.close()


def test_server_slower_than_timeout_fails_the_job_without_blocking_the_scheduler() -> None:
    require_server()
    with LocalRedis() as srv, ThreadPoolExecutor(2) as pool_exec:
        cfg = config(srv, timeout_s=0.3, lookup_ttl_steps=2)
        a = Instance(cfg)
        a.store(1)
        b = Instance(cfg, executor=pool_exec)
        assert b.lookup(1) is LookupResult.RETRY
        b.step()
        b.tier.drain()
        assert b.lookup(1) is LookupResult.HIT_PENDING
        control = srv.client()
        control.execute_command("CLIENT", "PAUSE", 3000, "ALL")  # the server stops answering
        try:
            b.step()  # submits the promotion: returns at once, the job waits on the server
            assert b.tier.has_pending_work()
            assert b.tier.get_finished() == []  # polling does not wait for the server
            b.tier.drain()  # the job hits its 0.3 s socket timeout
            assert b.lookup(1) is LookupResult.MISS
            assert b.m.get_stats()["promotions_failed"] == 1
        finally:
            # queued behind the pause like every command: returns once the server answers
            control.execute_command("CLIENT", "UNPAUSE")
        b.m.reset_cache()
        for _ in range(3):  # the failure's MISS answer ages out (lookup_ttl_steps=2)
            b.step()
        assert b.fetch(1) == chunk(1)  # the tier recovered: the next job reconnects
        a.close()
        b.close()


# -- concurrent writers ---------------------------------------------------------------------------


def test_two_instances_writing_one_key_leave_one_whole_value(server: LocalRedis) -> None:
    cfg = config(server)
    fp = LAYOUT.fingerprint(ROWS)
    big_rows = [96, 32]
    tiers = []
    pools = []
    for salt in (1, 2):
        pool = CPUPool(1, big_rows)
        pool.write_slot(0, bytes([salt]) * sum(big_rows))
        pools.append(pool)
        tiers.append(RedisTier(cfg, pool, executor=ThreadPoolExecutor(2)))
    reader = server.client()
    rkey = tiers[0].redis_key(k(9))
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            raw = reader.get(rkey)
            if raw is not None:
                payload = decode_value(raw, fp, k(9), sum(big_rows))
                assert not isinstance(payload, str), payload
                seen.add(bytes(payload))

    t = threading.Thread(target=read)
    t.start()
    try:
        for job in range(40):
            for tier in tiers:
                tier.submit_store(job, [k(9)], [0])
            for tier in tiers:
                tier.drain()
                assert [r.success for r in tier.get_finished()] == [True]
    finally:
        stop.set()
        t.join()
    whole = {bytes([1]) * sum(big_rows), bytes([2]) * sum(big_rows)}
    assert seen and seen <= whole  # readers only ever saw one writer's whole value
    final = decode_value(reader.get(rkey), fp, k(9), sum(big_rows))
    assert not isinstance(final, str) and bytes(final) in whole
    for tier in tiers:
        tier.shutdown()


# -- batching and pipelining ----------------------------------------------------------------------


class _CountingClient:
    """The real client, counting pipeline executions and the commands in each."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batches: list[tuple[str, int]] = []

    def pipeline(self, transaction: bool = True) -> Any:
        pipe = self.inner.pipeline(transaction=transaction)
        outer = self
        real_execute = pipe.execute

        def execute(raise_on_error: bool = True) -> Any:
            names = {str(c[0][0]) for c in pipe.command_stack}
            outer.batches.append(("/".join(sorted(names)), len(pipe.command_stack)))
            return real_execute(raise_on_error=raise_on_error)

        pipe.execute = execute
        return pipe


def test_jobs_and_lookups_are_batched_into_pipelines(server: LocalRedis) -> None:
    cfg = config(server, max_batch_bytes=5 * sum(ROWS) - 1)  # 4 chunks per batch
    counting = _CountingClient(cfg.make_client())
    pool = CPUPool(16, ROWS)
    tier = RedisTier(cfg, pool, executor=InlineExecutor(), client=counting)
    tier.submit_store(0, [k(i) for i in range(12)], list(range(12)))
    assert counting.batches == [("SET", 4), ("SET", 4), ("SET", 4)]
    assert [r.success for r in tier.get_finished()] == [True]
    counting.batches.clear()
    for i in range(20, 30):
        assert tier.lookup(k(i), CTX) is LookupResult.RETRY
    tier.on_schedule_end(END)
    assert counting.batches == [("EXISTS", 10)]  # one round trip for the step's lookups
    counting.batches.clear()
    tier.submit_load(1, [k(i) for i in range(4)], list(range(4)))
    assert counting.batches == [("GET", 4)]
    assert [r.success for r in tier.get_finished()] == [True]
    tier.shutdown()


def test_lookup_answers_age_out_and_are_asked_again(server: LocalRedis) -> None:
    a = Instance(config(server, lookup_ttl_steps=3))
    a.store(1)
    a.m.reset_cache()
    assert a.lookup(2) is LookupResult.RETRY
    a.step()
    assert a.lookup(2) is LookupResult.MISS  # answered: absent
    assert a.tier.get_stats()["known_keys"] == 2  # k(1) stored (present), k(2) absent
    for _ in range(4):
        a.step()
    assert a.tier.get_stats()["known_keys"] == 0  # both aged out and were dropped
    assert a.lookup(1) is LookupResult.RETRY  # asked again
    a.step()
    assert a.lookup(1) is LookupResult.HIT_PENDING
    a.close()


def test_an_awaited_answer_is_held_for_its_request_whatever_the_bound(
    server: LocalRedis,
) -> None:
    """Two requests whose pending lookups outnumber ``max_known_keys`` (1) each read the answer
    they wait for: it is held for them (outside the bound and the expiry) until read, then
    released; a request that finishes without reading releases its held answers too."""
    a = Instance(config(server, max_known_keys=1, lookup_ttl_steps=1))
    a.store(1)
    a.m.reset_cache()
    a.tier.forget_answers()
    ra, rb = ReqContext("ra"), ReqContext("rb")
    # both ask k(1) (shared, present) and a key of their own (absent)
    assert a.m.lookup_many([k(1), k(2)], ra, True) == [LookupResult.RETRY] * 2
    assert a.m.lookup_many([k(1), k(3)], rb, True) == [LookupResult.RETRY] * 2
    for _ in range(3):  # the answers arrive; older than the expiry and past the bound
        a.step()
    stats = a.tier.get_stats()
    assert stats["known_keys"] <= 1 and stats["held_answers"] == 3
    assert a.m.lookup_many([k(1), k(2)], ra, True) == [
        LookupResult.HIT_PENDING,  # promoted into the CPU tier: rb finds it there
        LookupResult.MISS,
    ]
    assert a.tier.get_stats()["held_answers"] == 2  # k(2) read by ra; k(1) still awaited by rb
    a.m.on_request_finished(rb)  # rb never reads its answers: they are released
    assert a.tier.get_stats()["held_answers"] == 0
    a.m.on_request_finished(ra)
    assert a.tier._awaited == {} and a.tier._awaits == {}
    a.close()


def test_config_is_validated_and_selectable(server: LocalRedis, tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        RedisTierConfig(timeout_s=0)
    pool = CPUPool(4, ROWS)
    tier = build_tier(
        {"kind": "redis", "url": server.url, "prefix": "sel", "timeout_s": 1.5}, pool, LAYOUT
    )
    assert isinstance(tier, RedisTier) and tier.config.timeout_s == 1.5
    tier.shutdown()
    ftier = build_tier({"kind": "file", "directory": str(tmp_path)}, pool, LAYOUT)
    assert type(ftier).__name__ == "FileTier"
    ftier.shutdown()
    with pytest.raises(ConfigError, match="kind"):
        build_tier({"kind": "s3"}, pool, LAYOUT)
    with pytest.raises(ConfigError, match="unknown"):
        build_tier({"kind": "redis", "url": server.url, "bogus": 1}, pool, LAYOUT)
    m = TieringOffloadingManager.from_config(
        CPUOffloadingManager(4), pool, [{"kind": "redis", "url": server.url}], LAYOUT
    )
    assert [type(t).__name__ for t in m.secondaries] == ["RedisTier"]
    m.shutdown()


# -- cluster --------------------------------------------------------------------------------------


def test_three_node_cluster_spreads_keys_and_serves_another_instance() -> None:
    require_server()
    with LocalRedisCluster(3) as cl:
        cfg = config(cl, cluster=True)
        a, b = Instance(cfg, slots=48), Instance(cfg, slots=48)
        ids = list(range(100, 140))
        a.store(*ids)
        per_node = [node.client().dbsize() for node in cl.nodes]
        assert sum(per_node) == len(ids) and all(n > 0 for n in per_node), per_node
        for i in ids[:12]:
            assert b.fetch(i) == chunk(i)
        # one node goes down: jobs touching it fail, nothing raises into the scheduler
        cl.nodes[1].stop()
        b.m.reset_cache()
        got = [b.fetch(i) for i in ids[12:24]]
        assert all(g is None or g == chunk(i) for g, i in zip(got, ids[12:24], strict=True))
        # a store job over every node: the live nodes' keys are written, the dead node's not
        new = list(range(200, 224))
        live = [node for node in cl.nodes if node.running]
        before = sum(node.client().dbsize() for node in live)
        a.m.get_stats()
        a.store(*new)
        stats = a.m.get_stats()
        assert stats["cascades_failed"] == 1 and stats["redis0.server_errors"] == 1
        written = sum(node.client().dbsize() for node in live) - before
        assert 0 < written < len(new)
        a.close()
        b.close()


# -- what an operator sees: faults by kind, logged as they happen; namespaces ---------------------


def test_faults_are_logged_by_kind_as_they_happen_and_recovery_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_server()
    caplog.set_level(logging.INFO, logger="statecore.managers.redistier")
    with LocalRedis() as srv:
        cfg = config(srv, timeout_s=2.0)
        a, b = Instance(cfg), Instance(cfg)
        a.store(1)
        assert b.lookup(1) is LookupResult.RETRY
        b.step()
        assert b.lookup(1) is LookupResult.HIT_PENDING
        srv.stop()
        b.step()  # the promotion meets the stopped server
        assert b.lookup(1) is LookupResult.MISS  # its result is collected: recompute
        faults = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert faults and "unreachable: a promotion of 1 chunk failed for 1 key" in (
            faults[0].getMessage()
        )
        assert not [r for r in caplog.records if "recovered" in r.getMessage()]
        stats = b.tier.get_stats()
        assert stats["failed_jobs_unreachable"] == 1 and stats["unreachable_keys"] == 1
        srv.start()
        b.store(5)  # the server answers again: one line says so
        recovered = [r for r in caplog.records if "recovered" in r.getMessage()]
        assert len(recovered) == 1 and recovered[0].levelno == logging.WARNING
        assert b.tier.get_stats()["failed_jobs_unreachable"] == 0  # counters since last call
        a.close()
        b.close()


def test_fault_log_is_rate_limited_per_kind() -> None:
    now = [0.0]
    log = logging.getLogger("statecore.test.faultlog")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        faults = FaultLog(log, "tier", interval_s=10.0, clock=lambda: now[0])
        for _ in range(5):
            faults.fault("unreachable", 2, "a store of 2 chunks")
        faults.fault("missing", 1, "a promotion of 1 chunks")
        assert len(lines) == 2  # the first of each kind at once, the rest counted
        now[0] = 11.0
        faults.fault("unreachable", 2, "a store of 2 chunks")
        assert "4 more such failures since the last line" in lines[-1]
        assert faults.down
        now[0] = 12.5
        faults.success()
        assert "recovered" in lines[-1] and "after 12.5 s (6 failures meanwhile" in lines[-1]
        assert not faults.down
        faults.success()  # no outage: nothing more
        assert len(lines) == 4
        now[0] = 13.0  # a flapping server: a short outage, within the interval of both lines
        faults.fault("unreachable", 1, "a store of 1 chunk")
        faults.success()
        assert len(lines) == 4  # counted, not logged
        now[0] = 30.0
        faults.fault("unreachable", 1, "a store of 1 chunk")
        faults.success()
        assert "1 more such failures" in lines[-2] and "[unreachable:" not in lines[-2]
        assert "1 more outages ended since the last such line" in lines[-1]
    finally:
        log.removeHandler(handler)


def test_a_full_server_counts_out_of_memory_failures_by_kind() -> None:
    require_server()
    with LocalRedis(maxmemory=1 << 20, policy="noeviction") as srv:
        big = [64 << 10, 64 << 10]
        a = Instance(config(srv), slots=16, rows=big)
        for start in range(0, 32, 16):
            a.store(*range(start, start + 16))
        stats = a.m.get_stats()
        assert stats["redis0.out_of_memory_writes"] >= 1
        assert stats["redis0.failed_jobs_out_of_memory"] >= 1
        assert stats["redis0.failed_jobs_unreachable"] == 0
        a.close()


def test_values_are_inspected_and_namespaces_listed_and_cleared(server: LocalRedis) -> None:
    cfg = config(server, prefix="ops-a")
    a = Instance(cfg)
    a.store(1, 2, 3)
    client = server.client()
    rkey = a.tier.redis_key(k(1))
    parts = split_key(rkey)
    assert parts == (b"ops-a", a.tier.fingerprint.hex().encode(), k(1))
    good = inspect_value(client.get(rkey), k(1))
    assert good.verdict == "ok" and good.key == k(1) and good.payload_length == sum(ROWS)
    assert good.fingerprint == a.tier.fingerprint
    raw = client.get(rkey)
    assert inspect_value(raw[:-1] + bytes([raw[-1] ^ 1]), k(1)).verdict == "corrupt"
    assert inspect_value(raw, k(2)).verdict == "foreign"
    assert inspect_value(b"short", None).verdict == "corrupt"
    Instance(config(server, prefix="ops-b")).store(1)
    client.set(b"ops-a-not-a-tier-key", b"x")
    assert sorted(scan_keys(client, b"ops-a:")) == sorted(a.tier.redis_key(k(i)) for i in (1, 2, 3))
    assert delete_keys(client, b"ops-a") == 4
    assert list(scan_keys(client, b"ops-a")) == [] and len(list(scan_keys(client, b"ops-b"))) == 1
    with pytest.raises(ConfigError):
        delete_keys(client, b"")
    assert glob_escape(b"a*b?[c]\\") == b"a\\*b\\?\\[c\\]\\\\"
    a.close()


def test_probe_server_fails_fast_with_one_line(server: LocalRedis) -> None:
    assert probe_server(server.url)
    with pytest.raises(ConfigError, match="does not answer") as down:
        probe_server("redis://127.0.0.1:1/0", timeout_s=1.0)
    with pytest.raises(ConfigError, match="cannot use Redis URL") as bad:
        probe_server("http://nope")
    for exc in (down.value, bad.value):
        assert "\n" not in str(exc)
    assert public_url("redis://user:secret@host:1/0") == "redis://user:***@host:1/0"
    assert public_url("redis://:secret@host:1/0") == "redis://***@host:1/0"


def test_tier_command_lists_inspects_and_clears_a_namespace(
    server: LocalRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    from statecore import cli

    a = Instance(config(server, prefix="cmd-run"))
    a.store(1, 2)
    client = server.client()
    rkey = a.tier.redis_key(k(2))
    raw = client.get(rkey)
    client.set(rkey, raw[:-1] + bytes([raw[-1] ^ 1]))  # one flipped byte
    url = ["--redis-url", server.url]
    assert cli.main(["tier", *url, "list", "--prefix", "cmd-run"]) == 0
    out = capsys.readouterr().out
    fp = a.tier.fingerprint.hex()
    assert "cmd-run" in out and fp in out and "1 namespaces; 0 keys" in out
    assert cli.main(["tier", *url, "inspect", "cmd-run:"]) == 0
    out = capsys.readouterr().out
    assert f"key      cmd-run:{fp}:{k(1).hex()}" in out and "verdict ok" in out
    assert "verdict corrupt" in out and "2 keys inspected: corrupt 1, ok 1" in out
    assert b"\x00" in k(1) and "\x00" not in out  # raw key bytes never reach the terminal
    assert cli.main(["tier", *url, "clear", "cmd-run"]) == 0
    assert "deleted 2 keys" in capsys.readouterr().out
    assert cli.main(["tier", *url, "clear", ""]) == 2
    a.close()

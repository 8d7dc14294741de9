"""FileTier: atomic checksummed chunk files, restart, corruption, size limit."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from statecore.errors import ConfigError
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import CPULoadStoreSpec, LookupResult, Medium, ReqContext, ScheduleEndContext
from statecore.managers import (
    CPUOffloadingManager,
    FileTier,
    InlineExecutor,
    TieringOffloadingManager,
)
from statecore.managers.filetier import LOCK_NAME
from statecore.pool import CPUPool

END = ScheduleEndContext()
CTX = ReqContext("r")
ROWS = [16, 8]


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 1)


def chunk(i: int) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(sum(ROWS)))


def build(
    directory: Path, slots: int = 4, **kw: object
) -> tuple[TieringOffloadingManager, CPUPool, FileTier]:
    pool = CPUPool(slots, ROWS)
    tier = FileTier(directory, pool, executor=InlineExecutor(), **kw)  # type: ignore[arg-type]
    return TieringOffloadingManager(CPUOffloadingManager(slots), [tier]), pool, tier


def store_bytes(m: TieringOffloadingManager, pool: CPUPool, *ids: int) -> None:
    out = m.prepare_store([k(i) for i in ids], CTX)
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
    for key, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):
        pool.write_slot(slot, chunk(int.from_bytes(key[:8], "big")))
    m.complete_store(out.keys_to_store, CTX)
    m.on_schedule_end(END)
    m.on_schedule_end(END)  # next step polls: the cascades are reported, pins released


def promote_and_load(m: TieringOffloadingManager, pool: CPUPool, i: int) -> bytes | None:
    """Look ``k(i)`` up (starting a promotion), run a step, and load it if it became a HIT."""
    first = m.lookup(k(i), CTX)
    if first is LookupResult.MISS:
        return None
    assert first is LookupResult.HIT_PENDING
    m.on_schedule_end(END)
    if m.lookup(k(i), CTX) is not LookupResult.HIT:
        return None
    spec = m.prepare_load([k(i)], CTX)
    assert isinstance(spec, CPULoadStoreSpec)
    data = pool.read_slot(spec.slots[0])
    m.complete_load([k(i)], CTX)
    return data


def test_restart_loads_the_same_bytes(tmp_path: Path) -> None:
    m, pool, tier = build(tmp_path)
    store_bytes(m, pool, 1, 2, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [LOCK_NAME, *(k(i).hex() + ".chunk" for i in (1, 2, 3))]
    )
    assert tier.get_stats()["files"] == 3
    m.shutdown()
    pool.close()
    m2, pool2, tier2 = build(tmp_path)  # a new process on the same directory
    assert set(tier2.indexed_keys()) == {k(1), k(2), k(3)}
    for i in (3, 1, 2):
        assert promote_and_load(m2, pool2, i) == chunk(i)
    stats = m2.get_stats()
    assert stats["file0.bytes_read"] == 3 * sum(ROWS)
    assert stats["promotions_failed"] == 0


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "delete", "extra"])
def test_damaged_file_fails_promotion_without_wrong_bytes(tmp_path: Path, damage: str) -> None:
    m, pool, _tier = build(tmp_path)
    store_bytes(m, pool, 1, 2)
    m.shutdown()
    path = tmp_path / (k(1).hex() + ".chunk")
    raw = bytearray(path.read_bytes())
    if damage == "flip-payload":
        raw[-3] ^= 0x40
        path.write_bytes(raw)
    elif damage == "flip-header":
        raw[0] ^= 0x01
        path.write_bytes(raw)
    elif damage == "truncate":
        path.write_bytes(raw[:-5])
    elif damage == "extra":
        path.write_bytes(raw + b"x")
    else:
        path.unlink()
    m2, pool2, _tier2 = build(tmp_path)
    if damage == "delete":
        assert m2.lookup(k(1), CTX) is LookupResult.MISS  # not indexed at all
    else:
        assert promote_and_load(m2, pool2, 1) is None  # the promotion failed: no crash
        assert m2.primary.ref_count(k(1)) is None  # the write-pending slot was dropped
        assert m2.lookup(k(1), CTX) is LookupResult.MISS  # recompute, not retry forever
        assert not path.exists()
        stats = m2.get_stats()
        assert stats["promotions_failed"] == 1 and stats["file0.corrupt_reads"] == 1
    assert promote_and_load(m2, pool2, 2) == chunk(2)  # the other chunk is intact
    m2.primary.check_invariants()


MISFILED = ["other-key", "other-layout", "other-tag", "other-length", "directory"]
"""Valid-looking things under a key's name that are not that key's chunk of this layout."""


def misfile(tmp_path: Path, kind: str) -> tuple[Path, dict[str, object]]:
    """Put ``kind`` under ``k(1)``'s name in ``tmp_path`` (where this layout's tier stored
    ``k(1)`` and ``k(2)``); returns the path and the tier options of the reader."""
    path = tmp_path / (k(1).hex() + ".chunk")
    if kind == "other-key":  # a copy, a rename or a restore into the wrong place
        path.write_bytes((tmp_path / (k(2).hex() + ".chunk")).read_bytes())
        return path, {}
    if kind == "directory":
        path.unlink()
        path.mkdir()
        return path, {}
    rows = {"other-layout": [8, 16], "other-tag": ROWS, "other-length": [16, 16]}[kind]
    tag = "bf16" if kind == "other-tag" else ""
    other = tmp_path / "other"
    pool = CPUPool(1, rows)
    tier = FileTier(other, pool, executor=InlineExecutor(), layout=tag)
    pool.write_slot(0, chunk(2)[: sum(rows)].ljust(sum(rows), b"\x07"))
    tier.submit_store(1, [k(1)], [0])  # a valid file of k(1), of another layout or length
    assert tier.get_finished()[0].success
    tier.shutdown()
    os.replace(other / path.name, path)
    return path, {}


def misfiled_findings(tmp_path: Path, kind: str) -> list[str]:
    """What goes wrong when ``kind`` lies under a key's name, found by a tier already
    running (indexed before) and by one that starts on the directory (empty: refused)."""
    found: list[str] = []
    for restart in (False, True):
        d = tmp_path / f"{kind}-{restart}"
        m, pool, _tier = build(d)
        store_bytes(m, pool, 1, 2)
        if restart:
            m.shutdown()
            pool.close()
        else:
            m.reset_cache()  # the primary forgets; the file tier keeps both (indexed)
        path, _ = misfile(d, kind)
        if restart:
            m, pool, _tier = build(d)
        data = promote_and_load(m, pool, 1)
        where = "after a restart" if restart else "while running"
        if data is not None:
            found.append(
                f"{kind} {where}: served {'its own' if data == chunk(1) else 'wrong'} bytes"
            )
        if m.lookup(k(1), CTX) is not LookupResult.MISS:
            found.append(f"{kind} {where}: the key still answers a hit")
        stats = m.get_stats()
        refused = stats["file0.corrupt_reads"] + stats["file0.missing_reads"]
        indexed = not (restart and kind == "directory")  # a directory is never indexed
        if indexed and refused != 1:
            found.append(f"{kind} {where}: {refused} refused reads counted, not 1")
        if kind != "directory" and path.exists():
            found.append(f"{kind} {where}: the misfiled file was kept")
        if promote_and_load(m, pool, 2) != chunk(2):
            found.append(f"{kind} {where}: the other chunk was lost")
        m.shutdown()
    return found


@pytest.mark.parametrize("kind", MISFILED)
def test_misfiled_value_is_refused_never_served(tmp_path: Path, kind: str) -> None:
    """A valid chunk file of another key, of another layout (same payload length), of another
    layout tag, of another length, or a directory under a key's name: a counted refused read,
    the key a miss afterwards, never a byte served."""
    assert misfiled_findings(tmp_path, kind) == []


def test_file_missing_after_indexing_fails_job(tmp_path: Path) -> None:
    m, pool, tier = build(tmp_path)
    store_bytes(m, pool, 1, 2)
    m.reset_cache()  # the primary forgets; the file tier keeps both
    (tmp_path / (k(1).hex() + ".chunk")).unlink()
    assert m.lookup(k(1), CTX) is LookupResult.HIT_PENDING
    assert m.lookup(k(2), CTX) is LookupResult.HIT_PENDING
    m.on_schedule_end(END)  # one job with both keys: partial success
    assert m.lookup(k(2), CTX) is LookupResult.HIT
    assert m.primary.ref_count(k(1)) is None
    assert m.get_stats()["file0.missing_reads"] == 1
    assert k(1) not in tier


def test_size_limit_evicts_least_recent_files(tmp_path: Path) -> None:
    one = FileTier(tmp_path / "probe", CPUPool(1, ROWS), executor=InlineExecutor())
    assert one.bytes_used == 0
    file_size = 20 + 12 + sum(ROWS)  # header + key + payload
    m, pool, tier = build(tmp_path / "d", max_bytes=2 * file_size)
    store_bytes(m, pool, 1, 2)
    tier.touch([k(1)], CTX)  # k2 is now the least recent
    m.primary.reset_cache()
    store_bytes(m, pool, 3)
    assert set(tier.indexed_keys()) == {k(1), k(3)} and tier.bytes_used == 2 * file_size
    assert not (tmp_path / "d" / (k(2).hex() + ".chunk")).exists()
    removed = [e for e in tier.take_events() if e.removed]
    assert [e.keys for e in removed] == [(k(2),)] and removed[0].medium is Medium.STORAGE
    assert tier.get_stats()["evictions"] == 1


def test_restart_cleans_temp_files_ignores_strangers_and_applies_limit(tmp_path: Path) -> None:
    m, pool, _ = build(tmp_path)
    store_bytes(m, pool, 1, 2)
    (tmp_path / ".abc.123.tmp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_bytes(b"x")
    (tmp_path / "zz.chunk").write_bytes(b"x")  # not hex: ignored
    os.utime(tmp_path / (k(2).hex() + ".chunk"), ns=(1, 1))  # k2 is the oldest file
    m.shutdown()
    _, _, tier = build(tmp_path, max_bytes=1)
    assert not (tmp_path / ".abc.123.tmp").exists()
    assert (tmp_path / "notes.txt").exists()
    assert tier.indexed_keys() == []  # the limit (1 byte) evicted both, oldest first
    assert [e.keys for e in tier.take_events()] == [(k(2),), (k(1),)]


def test_store_dedupes_present_keys(tmp_path: Path) -> None:
    m, pool, tier = build(tmp_path)
    store_bytes(m, pool, 1)
    tier.submit_store(100, [k(1)], [0])
    assert tier.get_finished()[0].success
    assert tier.get_stats()["bytes_written"] == 20 + 12 + sum(ROWS)  # written once only


def test_thread_pool_executor(tmp_path: Path) -> None:
    pool = CPUPool(4, ROWS)
    tier = FileTier(tmp_path, pool, workers=2)
    for slot in range(4):
        pool.write_slot(slot, chunk(slot))
    tier.submit_store(1, [k(0), k(1)], [0, 1])
    tier.submit_store(2, [k(2), k(3)], [2, 3])
    tier.drain()
    results = tier.get_finished()
    assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True)]
    for slot in range(4):
        pool.write_slot(slot, bytes(sum(ROWS)))
    tier.submit_load(3, [k(3), k(0)], [0, 1])
    assert tier.has_pending_work()
    tier.drain()
    assert [r.success for r in tier.get_finished()] == [True]
    assert pool.read_slot(0) == chunk(3) and pool.read_slot(1) == chunk(0)
    assert not tier.has_pending_work()
    tier.shutdown()


def test_write_error_is_a_failed_job(tmp_path: Path) -> None:
    pool = CPUPool(1, ROWS)
    tier = FileTier(tmp_path / "d", pool, executor=InlineExecutor())
    (tmp_path / "d" / LOCK_NAME).unlink()
    (tmp_path / "d").rmdir()  # the directory vanished: the write fails
    tier.submit_store(1, [k(1)], [0])
    assert tier.get_finished()[0].success is False
    assert tier.get_stats()["write_errors"] == 1 and k(1) not in tier


def test_one_tier_owns_a_directory(tmp_path: Path) -> None:
    """A second tier on a directory in use is refused, naming the holder, in this process and
    in another; the directory is free again after shutdown or when the tier is collected."""
    import gc
    import subprocess
    import sys

    pool = CPUPool(1, ROWS)
    tier = FileTier(tmp_path, pool, executor=InlineExecutor())
    with pytest.raises(ConfigError, match=rf"in use by another FileTier \(process {os.getpid()}\)"):
        FileTier(tmp_path, pool, executor=InlineExecutor())
    probe = (
        "import sys\n"
        "from statecore.errors import ConfigError\n"
        "from statecore.managers import FileTier\n"
        "from statecore.pool import CPUPool\n"
        "try:\n"
        "    FileTier(sys.argv[1], CPUPool(1, [8]))\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert other.returncode == 3, other.stdout + other.stderr
    assert f"process {os.getpid()}" in other.stdout
    tier.shutdown()
    again = FileTier(tmp_path, pool, executor=InlineExecutor())  # released by shutdown
    del again
    gc.collect()
    FileTier(tmp_path, pool, executor=InlineExecutor()).shutdown()  # released with the object


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_orders_file_rename_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    """With ``fsync=True`` a stored chunk is durable before its job reports success: the
    temporary file is fsynced, renamed into place, then the directory is fsynced (a rename is
    only durable once its directory is). Without it, nothing is fsynced."""
    import stat

    from statecore.managers import filetier

    ops: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync_spy(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            assert os.path.samestat(st, os.stat(tmp_path)), "fsynced a foreign directory"
            ops.append("fsync dir")
        else:
            ops.append("fsync file")
        real_fsync(fd)

    def replace_spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        ops.append("rename " + ("chunk" if str(dst).endswith(".chunk") else str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(filetier.os, "fsync", fsync_spy)
    monkeypatch.setattr(filetier.os, "replace", replace_spy)
    m, pool, tier = build(tmp_path, fsync=fsync)
    store_bytes(m, pool, 1, 2)
    assert k(1) in tier and k(2) in tier
    if fsync:
        assert ops == ["fsync file", "rename chunk", "fsync dir"] * 2
    else:
        assert ops == ["rename chunk"] * 2
    tier.shutdown()
    again = FileTier(tmp_path, CPUPool(4, ROWS), executor=InlineExecutor())
    assert k(1) in again and k(2) in again  # the renamed files are found after a restart
    again.shutdown()


def test_faults_are_counted_and_logged_by_kind_then_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="statecore.managers.filetier")
    pool = CPUPool(2, ROWS)
    tier = FileTier(tmp_path / "d", pool, executor=InlineExecutor())
    (tmp_path / "d" / LOCK_NAME).unlink()
    (tmp_path / "d").rmdir()  # the directory vanished: writes fail
    tier.submit_store(1, [k(1)], [0])
    tier.submit_store(2, [k(2)], [1])
    assert [r.success for r in tier.get_finished()] == [False, False]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "io-error: a store of 1 chunk failed for 1 key" in lines[0]
    assert tier.get_stats()["failed_jobs_io_error"] == 2
    (tmp_path / "d").mkdir()  # the storage is back
    tier.submit_store(3, [k(1)], [0])
    assert tier.get_finished()[0].success
    assert "recovered: the storage reads and writes again" in caplog.records[-1].getMessage()
    (tmp_path / "d" / (k(1).hex() + ".chunk")).unlink()
    tier.submit_load(4, [k(1)], [0])
    assert tier.get_finished()[0].success is False
    assert tier.get_stats()["failed_jobs_missing"] == 1
    assert "missing: a load of 1 chunk failed for 1 key" in caplog.records[-1].getMessage()
    tier.shutdown()


def test_a_tier_built_for_another_engine_layout_refuses_its_files(tmp_path: Path) -> None:
    """``build_tier`` seeds the file tier's checksums with the engine layout's fingerprint: an
    engine of another dtype over the same pool geometry finds the file (a hit) but its load
    fails (a counted corrupt read); one of the same layout loads the bytes."""
    from statecore.managers.redistier import TierLayout
    from statecore.managers.tierconfig import build_tier

    spec = {"kind": "file", "directory": str(tmp_path)}
    f16, bf16 = TierLayout("m", "float16", (2, 4), 1), TierLayout("m", "bfloat16", (2, 4), 1)
    pool = CPUPool(2, ROWS)
    writer = build_tier(spec, pool, f16)
    pool.write_slot(0, chunk(1))
    writer.submit_store(1, [k(1)], [0])
    writer.drain()
    assert writer.get_finished()[0].success
    writer.shutdown()
    for layout, loads in ((bf16, False), (f16, True)):
        pool.write_slot(1, bytes(sum(ROWS)))
        reader = build_tier(spec, pool, layout)
        assert k(1) in reader  # indexed by name; verified when loaded
        reader.submit_load(2, [k(1)], [1])
        reader.drain()
        assert reader.get_finished()[0].success is loads
        if loads:  # (a refused load's slot is dropped by the tiering manager, never served)
            assert pool.read_slot(1) == chunk(1)
        reader.shutdown()
        if not loads:  # refused: counted, deleted; store it again for the next reader
            assert reader.get_stats()["corrupt_reads"] == 1 and k(1) not in reader
            writer = build_tier(spec, pool, f16)
            writer.submit_store(3, [k(1)], [0])
            writer.drain()
            assert writer.get_finished()[0].success
            writer.shutdown()

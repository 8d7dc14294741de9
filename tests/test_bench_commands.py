"""The benchmark commands run and print their tables (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import re

import pytest

from statecore.cli import main


def test_bench_transfer_cpu_prints_every_size_direction_and_planning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch", reason="the transfer benchmark needs torch")
    argv = ["bench", "transfer", "--device", "cpu", "--total-mib", "1", "--repeat", "1"]
    assert main([*argv, "--block-kib", "4,64", "--job-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host copy loop=(native|ctypes)", out)
    num = r"\s+[\d.]+"
    # GB/s, contiguous GB/s, ratio to it, ratio to the adapter's loop over contiguous bytes
    rows = re.findall(rf"^\s+(\d+)K\s+cpu\s+(store|load){num * 4}$", out, re.M)
    assert sorted(rows) == [("4", "load"), ("4", "store"), ("64", "load"), ("64", "store")]
    assert "MISMATCH" not in out
    planning = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+\d+$", out, re.M)
    assert [(int(t), int(b)) for t, b, _ in planning] == [(32, 16), (64, 16), (1, 1024)]


def test_bench_dispatch_prints_table_and_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dispatch", "--events", "200", "--machine-events", "20"]) == 0
    out = capsys.readouterr().out.lower()
    assert "table" in out and "machine" in out


def test_bench_without_a_known_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "transfer" in err


def test_bench_tier_prints_store_and_load_for_every_chunk_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.managers.redis_fixtures import require_server

    require_server()
    argv = ["bench", "tier", "--chunk-kib", "64,256", "--total-mib", "1", "--repeat", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = r"^\s+(\d+)K\s+(store|load)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$"
    rows = re.findall(row, out, re.M)
    assert sorted(rows) == [("256", "load"), ("256", "store"), ("64", "load"), ("64", "store")]
    assert "MISMATCH" not in out


def test_bench_scheduler_change_proportional_mode_prints_the_reference_and_each_n(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--engine", "standalone", "--clock", "thread"]
    assert main([*argv, "--active", "4", "--concurrency", "16", "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "at most 4 requests scheduled per step" in out
    assert re.search(r"^N=4 \(reference, no cap\)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+1\.00$", out, re.M)
    assert re.search(r"^N=16, 4 active\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M)


def test_bench_scheduler_soak_prints_a_memory_curve_and_stops_at_the_job_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--soak", "--concurrency", "8", "--clock", "thread"]
    assert main([*argv, "--soak-jobs", "30", "--soak-seconds", "60", "--soak-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "soak: N=8, until 30 jobs or 60 s" in out
    rows = re.findall(r"^\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+0\.0(?:\s+[\d.]+){4}$", out, re.M)
    assert rows, out
    jobs = [int(r[2]) for r in rows]
    assert jobs == sorted(jobs) and jobs[-1] >= 30  # stopped at the target, not the clock
    assert all(float(r[3]) > 0 for r in rows)  # RSS read

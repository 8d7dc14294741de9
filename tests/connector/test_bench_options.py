"""``statecore bench scheduler``'s reset, cache-size and clock options (standalone engine)."""

from __future__ import annotations

import pytest

from statecore.bench.scheduler import Scenario, main, run_standalone


def test_reset_with_a_load_in_flight_and_a_small_cache_drain_cleanly() -> None:
    sc = Scenario(
        concurrency=8,
        steps=80,
        num_prefixes=16,  # more prefixes than the GPU prefix cache holds: loads
        output_len=(4, 16),
        gpu_cache_factor=0.8,
        reset_at=20,
        reset_with_loads=True,
        clock="thread",
    )
    res = run_standalone(sc)
    assert res.counters.get("resets") == 1
    assert res.summary["sum of 4 hooks"]["steps"] > 0


def test_options_reach_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", "standalone", "--concurrency", "8", "--steps", "40", "--reset-at", "10"]
    argv += ["--reset-with-loads", "--gpu-cache-factor", "0.8", "--clock", "thread"]
    assert main(argv) == 0
    assert "N=8" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--engine", "standalone", "--gpu-cache-factor", "0"])

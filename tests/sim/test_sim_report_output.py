"""What the simulator's report and plot say: units, warnings, settings, series on one axis."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from statecore.sim.engine import SimConfig
from statecore.sim.faults import FAULT_KINDS, parse_faults
from statecore.sim.report import FAULTS_EXPLAINED, SimReport
from statecore.sim.run import simulate
from statecore.sim.workload import WorkloadConfig


def _config(requests: int, steps: int, checked: bool = False) -> SimConfig:
    return dataclasses.replace(
        SimConfig(),
        seed=3,
        steps=steps,
        workload=WorkloadConfig(num_requests=requests),
        faults=parse_faults("heavy"),
        checked=checked,
    )


@pytest.fixture(scope="module")
def short_run() -> tuple[SimConfig, SimReport]:
    """A run whose steps end long before its requests have all arrived."""
    cfg = _config(requests=400, steps=60)
    return cfg, simulate(cfg)


def test_requests_that_never_arrived_are_a_warning(short_run: tuple[SimConfig, SimReport]) -> None:
    _, report = short_run
    arrived = report.requests["arrived"]
    assert 0 < arrived < 400
    text = report.format_text()
    header = text.splitlines()[0]
    assert header.startswith("statecore simulate: PASS with 1 warning")
    assert f"WARNING       only {arrived} of 400 requests arrived within 60 steps" in text
    data = json.loads(report.to_json())
    assert data["warnings"] and "give the run more steps" in data["warnings"][0]
    assert "--" not in data["warnings"][0]  # no command-line flag: the report serves Python too


def test_json_has_settings_seed_and_wall_time(short_run: tuple[SimConfig, SimReport]) -> None:
    cfg, report = short_run
    data = json.loads(report.to_json())
    assert data["seed"] == 3 and data["requests_wanted"] == 400 and data["checked"] is False
    assert data["settings"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert data["wall_s"] > 0
    # the wall time is not part of what replays from the seed
    again = simulate(cfg)
    assert again.fingerprint() == report.fingerprint()


def test_every_figure_has_its_unit_and_faults_are_explained(
    short_run: tuple[SimConfig, SimReport],
) -> None:
    _, report = short_run
    text = report.format_text()
    lines = {line.split()[0]: line for line in text.splitlines() if line and line[0] != " "}
    assert "% of admitted prompt tokens" in lines["hit"]
    assert re.search(r"from the GPU prefix cache \d+ tokens", lines["hit"])
    assert lines["tokens"].endswith("(tokens)")
    assert lines["jobs"].endswith("(jobs)")
    assert lines["absorbed"].endswith("(worker reports)")
    assert re.search(r"GPU->CPU [\d.]+ (B|KiB|MiB|GiB)", lines["bytes"])
    assert re.search(r"wall time +[\d.]+ s \(\d+ steps/s\)", text)
    flat = " ".join(text.split())
    assert FAULTS_EXPLAINED in flat


def test_header_names_checked_mode() -> None:
    report = simulate(_config(requests=10, steps=40, checked=True))
    assert "checked mode on" in report.format_text().splitlines()[0]


def test_series_share_one_step_axis(short_run: tuple[SimConfig, SimReport]) -> None:
    _, report = short_run
    series = report.series
    steps = report.steps + report.drain_steps
    names = [
        "hit_rate",
        "in_flight_jobs",
        "loads_in_flight",
        "stores_in_flight",
        "cpu_occupancy",
        *(f"faults_{k}" for k in FAULT_KINDS),
    ]
    for name in names:
        assert len(series[name]) == steps, name
    for loads, stores, total in zip(
        series["loads_in_flight"], series["stores_in_flight"], series["in_flight_jobs"], strict=True
    ):
        assert loads + stores == total
    assert all(0 <= x <= 100 for x in series["cpu_occupancy"])
    for kind in FAULT_KINDS:
        injected = report.faults[kind].injected
        assert sum(series[f"faults_{kind}"]) == injected, kind


def test_plot_is_written(short_run: tuple[SimConfig, SimReport], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the sim extra)")
    from statecore.sim.plot import moving_average, write_plot

    _, report = short_run
    path = tmp_path / "run.png"
    write_plot(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert moving_average([2.0, 4.0, 6.0, 8.0], 2) == [2.0, 3.0, 5.0, 7.0]

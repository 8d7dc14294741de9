"""The ``statecore`` command line: help, version, usage errors, exit statuses, quiet endings."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import statecore
from statecore import cli

COMMANDS = [name for name, _, _ in cli.commands()]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_prints_the_single_source_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--version")
    assert code == 0
    assert out.strip() == f"statecore {statecore.__version__}"


@pytest.mark.parametrize("argv", [[], ["bench"], *([*name.split(), "--help"] for name in COMMANDS)])
def test_help_exits_0_at_every_level(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    argv = argv if argv and argv[-1] == "--help" else [*argv, "--help"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    prog = " ".join(["statecore", *argv[:-1]])
    assert out.startswith(f"usage: {prog}"), out[:200]
    assert "`" not in out and ":class:" not in out and ":func:" not in out, out


def test_top_level_help_lists_every_command_and_the_exit_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out, _ = _run(capsys, "--help")
    for name in [*cli._COMMANDS, "bench"]:
        assert f"    {name}" in out
    for code in cli.EXIT_CODES:
        assert f"  {code} " in out


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, "simulate", "--help")
    assert "(default: 800)" in out and "(default: 0)" in out and "(default: auto)" in out
    assert "(default: False)" not in out and "(default: None)" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["nope"], "argument COMMAND: invalid choice: 'nope'"),
        (["bench"], "the following arguments are required: BENCH"),
        (["simulate", "--requests", "-5"], "argument --requests: must be an integer >= 0, got -5"),
        (["simulate", "--workers", "0"], "argument --workers: must be an integer from 1 to 64"),
        (["simulate", "--steps", "x"], "argument --steps: expected an integer, got 'x'"),
        (["simulate", "--stall-timeout", "0"], "argument --stall-timeout: must be a number > 0"),
        (["simulate", "--faults", "bogus"], "argument --faults: faults: unknown preset 'bogus'"),
        (["fuzz", "--seconds", "0"], "argument --seconds: must be a number > 0, got 0"),
        (["bench", "dispatch", "--events", "0"], "argument --events: must be an integer >= 1"),
    ],
)
def test_usage_errors_name_the_flag_and_what_it_accepts(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


@pytest.fixture
def no_simulation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import statecore.sim.run

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the simulation started before the arguments were checked")

    monkeypatch.setattr(statecore.sim.run, "simulate", refuse)
    yield


@pytest.mark.usefixtures("no_simulation")
def test_output_path_is_checked_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "missing" / "x.png"
    code, _, err = _run(capsys, "simulate", "--plot", str(missing))
    assert code == 2
    assert f"argument --plot: folder {missing.parent} does not exist" in err
    code, _, err = _run(capsys, "simulate", "--plot", str(tmp_path))
    assert code == 2 and "is a folder" in err


def test_ctrl_c_ends_quietly_with_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(module: str, argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_call", interrupted)
    code, _, err = _run(capsys, "diagrams", "--print")
    assert code == 130
    assert err.strip() == "statecore: interrupted"


def test_closed_pipe_ends_quietly_with_141(tmp_path: Path) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte, as `| head` is after its lines
    try:
        result = subprocess.run(
            [sys.executable, "-m", "statecore", "docs", "--print", "invariants.md"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    assert result.returncode == 141
    assert result.stderr == ""


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: object) -> str:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return name


def test_registry_runs_both_module_shapes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[object] = []

    def old_main(argv: list[str]) -> int:
        seen.append(list(argv))
        return 1

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--level", type=cli.int_range(1, 3), default=2, help="how much")

    def run(args: argparse.Namespace) -> int:
        seen.append(args.level)
        return 0

    old = _fake_module(monkeypatch, "_statecore_test_old", main=old_main)
    new = _fake_module(monkeypatch, "_statecore_test_new", add_arguments=add_arguments, run=run)
    monkeypatch.setitem(cli._COMMANDS, "old", (old, "an old-shape command"))
    monkeypatch.setitem(cli._BENCHES, "new", (new, "a new-shape benchmark"))

    assert cli.main(["old", "--anything", "x"]) == 1
    assert cli.main(["bench", "new", "--level", "3"]) == 0
    assert seen == [["--anything", "x"], 3]
    code, out, _ = _run(capsys, "bench", "new", "--help")
    assert code == 0 and "how much (default: 2)" in out
    code, _, err = _run(capsys, "bench", "new", "--level", "4")
    assert code == 2 and "argument --level: must be an integer from 1 to 3, got 4" in err
    parser = cli.parser_for("bench new")
    assert parser is not None and parser.prog == "statecore bench new"


def test_generated_cli_page_documents_exit_codes() -> None:
    from statecore.docsgen import render_cli_page

    page = render_cli_page()
    for code, meaning in cli.EXIT_CODES.items():
        assert f"| {code} | {meaning} |" in page
    assert "argparse" in page


@pytest.mark.usefixtures("no_simulation")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["simulate", "--redis-url", "redis://127.0.0.1:1/0"],
            "--redis-url is used only with --instances 2 or more",
        ),
        (["simulate", "--keep-keys"], "--keep-keys is used only with --instances 2 or more"),
        (["simulate", "--instances", "2", "--tiering"], "--tiering does nothing with --instances"),
        (
            ["simulate", "--instances", "2", "--redis-url", "http://nope"],
            "cannot use Redis URL 'http://nope': ValueError: Redis URL must specify one of",
        ),
        (
            ["simulate", "--instances", "2", "--redis-url", "redis://127.0.0.1:1/0"],
            "the Redis server at redis://127.0.0.1:1/0 does not answer: ConnectionError",
        ),
        (["tier", "--redis-url", "redis://127.0.0.1:1/0", "list"], "does not answer"),
        (["--log-level", "loud", "simulate"], "--log-level: expected one of debug, info"),
    ],
)
def test_unusable_configuration_fails_fast_with_one_line_and_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    pytest.importorskip("redis", reason="the redis package is not installed (statecore[test])")
    code, out, err = _run(capsys, *argv)
    assert code == 2, err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


def test_log_level_is_taken_anywhere_and_logs_go_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import logging

    assert cli._log_level(["simulate", "--log-level", "debug", "--seed", "1"]) == (
        "debug",
        ["simulate", "--seed", "1"],
    )
    assert cli._log_level(["--log-level=error", "check"]) == ("error", ["check"])
    assert cli._log_level(["fuzz", "--", "--log-level", "x"]) == (
        "warning",
        ["fuzz", "--", "--log-level", "x"],
    )
    cli.configure_logging("info")
    logging.getLogger("statecore.test.cli").info("a line")
    logging.getLogger("statecore.test.cli").debug("not this one")
    out, err = capsys.readouterr()
    assert out == "" and "INFO statecore.test.cli: a line" in err and "not this" not in err
    logger = logging.getLogger("statecore")
    cli.configure_logging("warning")
    assert len(logger.handlers) == 1
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    assert cli.main(["--log-level", "debug", "--version"]) == 0
    assert logger.level == logging.NOTSET and not logger.handlers  # main leaves it as it was


def test_progress_heartbeat_lines_off_a_terminal_and_a_redrawn_line_on_one() -> None:
    import io

    from statecore.progress import Progress

    now = [0.0]
    log = io.StringIO()
    bar = Progress("work", total=10, unit="steps", stream=log, interval_s=5.0, clock=lambda: now[0])
    for step in range(10):
        now[0] = step * 2.0
        bar.update(step, "note")
    bar.close()
    assert log.getvalue().splitlines() == [
        "work: 3/10 steps, 6 s, note",  # one line every 5 s, none before the first 5 s
        "work: 6/10 steps, 12 s, note",
        "work: 9/10 steps, 18 s, note",
    ]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    bar = Progress("work", unit="steps", stream=term, clock=lambda: now[0])
    bar.update(1)
    now[0] += 1.0
    bar.update(2)
    bar.close()
    text = term.getvalue()
    assert "\n" not in text and text.count("\r") == 4 and "work: 2 steps, 1 s" in text
    quiet = io.StringIO()
    Progress("work", stream=quiet, enabled=False, interval_s=0.0).update(1)
    assert quiet.getvalue() == ""

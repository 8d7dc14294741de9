"""A short whole-stack fuzz campaign and the stateful machine, as the suite's budget allows."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from statecore.specs import fuzz
from statecore.specs.stack import StackHarness, StackMachine


def test_short_fuzz_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    rc = fuzz.main(["--seconds", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "steps/s" in out


@pytest.mark.parametrize(("manager", "groups"), [("arc", "mixed"), ("tiering", "full")])
def test_short_campaign_rotates_managers_and_groups(
    manager: str, groups: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = fuzz.main(["--seconds", "3", "--manager", manager, "--groups", groups, "--seed", "5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"manager {manager}, groups {groups}" in out


def test_bad_manager_or_groups_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert fuzz.main(["--seconds", "1", "--manager", "nope"]) == 2
    assert fuzz.main(["--seconds", "1", "--groups", "nope"]) == 2
    assert "unknown manager" in capsys.readouterr().err


def test_decode_and_reproduction_format() -> None:
    program = bytes([0, 0, 5, 0, 3, 9])  # padding, then two operations
    ops = fuzz.decode(program)
    assert len(ops) == 2
    text = fuzz.format_program(program)
    assert text.startswith("h = StackHarness()") and text.endswith("h.drain_and_check()")


def test_program_runs_and_drains_clean() -> None:
    # new requests, steps, every report delivered: a full happy path with real bytes
    h = StackHarness()
    for i in range(3):
        h.new_request(i, 3, 2, False, True)
    for _ in range(12):
        for rep in h.step():
            h.deliver(rep)
        h.check()
    assert h.engine.stats.tokens_computed > 0
    h.drain_and_check()


def test_campaign_reports_a_planted_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_check(self: StackHarness) -> None:
        from statecore.errors import InvariantViolation

        if self.engine.step_no >= 2:
            raise InvariantViolation("INV-TEST", "planted")

    monkeypatch.setattr(StackHarness, "check", broken_check)
    failure = fuzz.campaign(20.0)[3]
    assert failure is not None and "INV-TEST" in failure
    assert "h.step()" in failure  # the shrunk reproduction is printed as harness calls


TestStackMachine = StackMachine.TestCase
TestStackMachine.settings = settings(
    max_examples=12,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

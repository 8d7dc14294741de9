"""``statecore bench scheduler --validation-share``: the lockstep A/B runs, both copies take
the same decisions, and the bench-only switch is undone afterwards (no timing is asserted)."""

from __future__ import annotations

import re
from typing import Any

import pytest

import statecore.bench.scheduler as bench
import statecore.scheduler.planning as planning
import statecore.validate as validate
import statecore.wire as wire
from statecore.bench.validation_share import stubbed_validation
from statecore.cli import main
from statecore.errors import InvalidMetadataError
from statecore.views import ScheduledColumns, ScheduledRequest, SchedulerOutput


def _patched_names() -> list[object]:
    return [
        validate.request_id,
        validate.request_view,
        validate.scheduler_output,
        validate.worker_metadata,
        validate.offload_keys,
        planning.admitted_lists,
        ScheduledRequest.__post_init__,
        ScheduledColumns.__post_init__,
        SchedulerOutput.__post_init__,
        vars(bench)["SchedulerOutput"],
        bench.HookTimer.end_step,
        wire.check_worker_metadata,
    ]


def test_validation_share_pools_two_pairs_in_both_tables_with_identical_decisions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = _patched_names()
    argv = ["bench", "scheduler", "--validation-share", "2", "--engine", "standalone"]
    assert main([*argv, "--clock", "thread", "--concurrency", "8", "--steps", "40"]) == 0
    out = capsys.readouterr().out
    row = r"^N=8\s+(\d+)(?:\s+-?[\d.]+%?){8}\s+(yes|NO)(?:\s+-?[\d.]+){2}$"  # 2 pairs
    rows = re.findall(row, out, re.M)
    assert len(rows) == 2, out  # hooks only, hooks + views
    assert all(int(steps) > 0 and same == "yes" for steps, same in rows)
    assert "the four hooks + building the step's views" in out
    assert all(a is b for a, b in zip(before, _patched_names(), strict=True))


def test_the_switch_turns_checks_off_inside_only() -> None:
    with stubbed_validation():
        ScheduledRequest("r", None, 1)  # type: ignore[arg-type]  # unchecked in copy B
    with pytest.raises(InvalidMetadataError, match="new_block_ids"):
        ScheduledRequest("r", None, 1)  # type: ignore[arg-type]


def test_the_switch_also_stubs_the_native_view_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The views' C checks (``statecore._viewcheck``) run inside the stubbed ``__post_init__``:
    copy B does not run them either, so A - B keeps counting them."""
    import statecore.views as views

    calls: list[str] = []
    for name in ("_native_request", "_native_columns", "_native_output"):
        monkeypatch.setattr(views, name, lambda *a, _n=name: bool(calls.append(_n)))

    def build() -> None:
        SchedulerOutput(
            scheduled=[ScheduledRequest("r", ((1,),), 1)],
            columns=ScheduledColumns(["c"], [None], [1]),
        )

    with stubbed_validation():
        build()
    assert calls == []
    build()
    assert calls == ["_native_request", "_native_columns", "_native_output"]


def test_control_run_stubs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """``--validation-control``: B's turns switch in the original checks (an A/A run), so a
    malformed view built during B's turn is still refused, and the switch is undone after."""
    import statecore.bench.validation_share as vs

    before = _patched_names()
    seen: list[object] = []
    real_end = vs._Copy.step_ends

    def probe(self: Any, timer: Any) -> None:
        if self.stubbed and not seen:
            seen.append(ScheduledRequest.__post_init__)
            with pytest.raises(InvalidMetadataError):
                ScheduledRequest("r", None, 1)  # type: ignore[arg-type]
        real_end(self, timer)

    vs._Copy.step_ends = probe  # type: ignore[method-assign]
    try:
        argv = ["bench", "scheduler", "--validation-share", "1", "--validation-control"]
        assert main([*argv, "--clock", "thread", "--concurrency", "8", "--steps", "30"]) == 0
    finally:
        vs._Copy.step_ends = real_end  # type: ignore[method-assign]
    assert "A/A CONTROL" in capsys.readouterr().out
    assert seen == [before[6]]  # B ran with the original ScheduledRequest check
    assert all(a is b for a, b in zip(before, _patched_names(), strict=True))

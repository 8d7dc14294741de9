"""The bad-input table: every malformed call gets its typed error or its counted tolerance.

The table lives in :mod:`statecore.specs.bad_inputs` (the "bad inputs" docs page is generated
from it). Each case runs on a fresh small stack; a rejected call must leave every observable
state unchanged (scheduler records and counters, manager entries, tiers, worker).
"""

from __future__ import annotations

import pytest

from statecore.specs.bad_inputs import CASES, Case, run_case


@pytest.mark.parametrize("case", CASES, ids=[f"{c.entry}: {c.given}" for c in CASES])
@pytest.mark.usefixtures("view_checks")  # with and without the views' C checks
def test_bad_input_outcome(case: Case) -> None:
    out = run_case(case)
    assert out.escaped is None, f"untyped exception escaped: {out.escaped}"
    if case.error is not None:
        assert out.error_class is not None, f"accepted (counters moved: {out.counters})"
        assert issubclass(out.error_class, case.error), out.error
        assert out.unchanged, f"{out.error} raised but the state changed: {out.message}"
        assert case.entry.split(".")[-1] in out.message or out.error in (
            "ConfigError",
            "LifecycleError",
            "UnknownKeyError",
            "KeyNotReadyError",
            "PinUnderflowError",
            "ManagerStateError",
            "UnknownRequestError",
        ), f"the message does not name the call: {out.message}"
    else:
        assert out.error is None, f"{out.error}: {out.message}"
        assert case.counter in out.counters, f"counter {case.counter} did not move: {out}"


def test_the_table_covers_every_boundary() -> None:
    assert {c.area for c in CASES} == {
        "scheduler",
        "manager",
        "tier",
        "worker",
        "wire",
        "config",
        "keys",
    }
    assert len(CASES) >= 100

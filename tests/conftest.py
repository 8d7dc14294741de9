"""Test-suite configuration: Hypothesis profiles.

Profiles registered here, beside Hypothesis's own ``ci`` profile (which Hypothesis loads by
itself when the ``CI`` environment variable is set, and which is never redefined here):

* ``dev``: fewer examples, for quick local runs (the default outside CI);
* ``fuzz``: many examples and long stateful runs, for bug hunting.

Select one with ``STATECORE_HYPOTHESIS_PROFILE=dev|fuzz|ci`` (or pytest's own
``--hypothesis-profile``, which wins). Without either, Hypothesis's choice stands under CI,
and ``dev`` is loaded otherwise. No profile has a deadline: timing is never a test outcome.
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


def pytest_report_header(config: pytest.Config) -> str:
    """Show the Hypothesis profile in effect at the top of the run."""
    return (
        f"hypothesis profile: {settings.get_current_profile_name()} "
        f"(select with {PROFILE_ENV}=dev|fuzz|ci)"
    )

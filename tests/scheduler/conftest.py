"""Scheduler tests run with the lifecycles in checked mode, against a fake and a real manager."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from statecore.lifecycle import checked_mode


@pytest.fixture(autouse=True)
def _checked_lifecycles() -> Iterator[None]:
    """Every event also runs through the real python-statemachine machine."""
    with checked_mode():
        yield


@pytest.fixture(params=["fake", "cpu"])
def kind(request: pytest.FixtureRequest) -> str:
    """The manager behind the scheduler: the recording fake or the real CPU manager."""
    return str(request.param)

"""Fixtures of the worker tests: backends that are shut down whatever a test's outcome."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cuda_fakes import Backends


@pytest.fixture
def backends() -> Iterator[Backends]:
    """Backends shut down at teardown, after a failed assertion too (the finaliser)."""
    made = Backends()
    try:
        yield made
    finally:
        made.close_all()

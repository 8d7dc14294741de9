"""The record of the name shims a test of vLLM's goes through (scripts/vllm-upstream-tests.sh):
where a vLLM test reads or calls a vLLM-internal name, the plugin gives it statecore's
equivalent under that name and records it here; the plugin writes the record into the test's
JUnit entry (``statecore_shims``), and the table classes a test that passes on statecore
through a shim as passing with that shim.
"""

from __future__ import annotations

import os
import sys

SHIMS_USED: set[str] = set()
"""The name shims the running test went through (the plugin records them per test, and the
table classes a test that passes through any of them as passing with those shims)."""


_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
_HARNESS = os.path.join("offloading_connector", "utils.py")


def used(name: str) -> None:
    """Record that the running test read or called vLLM-internal ``name`` through a shim.

    A read by vLLM's test harness (the ``request_runner`` fixture, ``utils.py``: its job-table
    and group-configuration reads, made in every scenario) is recorded as ``harness:NAME``."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PLUGIN_DIR):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None and frame.f_code.co_filename.endswith(_HARNESS):
        name = f"harness:{name}"
    SHIMS_USED.add(name)


__all__ = ["SHIMS_USED", "used"]

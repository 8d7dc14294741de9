"""Real Redis servers for the tests: one per module (and one cluster), stopped at the end.

A server test needs ``redis-server`` (or ``valkey-server``); ``scripts/test.sh`` installs
Debian's ``redis-server`` when it is missing. Without one, the tests skip with that reason,
except under ``CI=true``, where a missing server fails them: CI must run them.
"""

from __future__ import annotations

import os

import pytest

from statecore.services.redisserver import find_server


def require_server() -> None:
    """Skip (fail under CI) when no server binary or no redis package is available."""
    try:
        import redis  # noqa: F401
    except ImportError:
        reason = "the redis package is not installed (pip install 'statecore[test]')"
    else:
        if find_server() is not None:
            return
        reason = "no redis-server/valkey-server on PATH (scripts/test.sh installs redis-server)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the Redis tier tests: {reason}")
    pytest.skip(reason)

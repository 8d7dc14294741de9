"""The validation layer's primitives: raising a typed argument error, and the numbers check.

Below :mod:`statecore.validate` and :mod:`statecore.wire` (it imports only
:mod:`statecore.errors`), so that the wire types can check their own shape
(:func:`statecore.wire.check_worker_metadata`) and the validation layer can check the wire
types, without either importing the other at call time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NoReturn

from statecore.errors import InvalidArgumentError, InvalidMetadataError

__all__ = ["fail", "finite", "nowhere"]


def nowhere(req_id: object) -> tuple[str | None, str | None]:
    """No entity or state to name (the default ``where`` of :func:`fail`)."""
    return None, None


def fail(
    call: str,
    argument: str,
    value: object,
    expected: str,
    where: Callable[[object], tuple[str | None, str | None]] = nowhere,
    req_id: object = None,
    error: type[InvalidArgumentError] = InvalidMetadataError,
) -> NoReturn:
    """Raise ``error`` naming the call, the argument, the bad value and what was expected,
    and, when ``where`` knows ``req_id``, the entity and its state."""
    entity, state = where(req_id) if req_id is not None else (None, None)
    raise error(call, argument, value, expected, entity, state)


def finite(value: object) -> bool:
    """Whether ``value`` is a finite ``int`` or ``float`` (not a bool)."""
    return (type(value) is int or type(value) is float) and math.isfinite(value)

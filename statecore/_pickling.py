"""Pickling of the small frozen records that cross process boundaries every engine step.

vLLM's multiprocess executor pickles each step's scheduler output, the connector metadata in
it, to every worker, and the workers' reports back. A slotted dataclass pickles through the
state functions ``dataclasses`` generates, which walk ``fields()`` on every object: a step's
metadata with 64 store jobs holds about 190 such objects and took about half a millisecond to
pickle and unpickle. :func:`pickled_by_fields` gives a class a ``__reduce__`` that rebuilds it
with one constructor call from its init fields (read with one attribute getter).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["pickled_by_fields"]

T = TypeVar("T")


def pickled_by_fields(cls: type[T]) -> type[T]:
    """Give the dataclass ``cls`` a ``__reduce__`` that pickles it as its constructor and the
    values of its init fields (``__match_args__``), in order; apply it above ``@dataclass``."""
    names: tuple[str, ...] = cls.__match_args__  # type: ignore[attr-defined]
    get = operator.attrgetter(*names)
    reduce: Callable[[Any], tuple[Any, tuple[Any, ...]]]
    if len(names) == 1:

        def reduce(self: Any) -> tuple[Any, tuple[Any, ...]]:
            return cls, (get(self),)

    else:

        def reduce(self: Any) -> tuple[Any, tuple[Any, ...]]:
            return cls, get(self)

    reduce.__qualname__ = f"{cls.__qualname__}.__reduce__"
    reduce.__doc__ = "Pickle as the constructor and the init fields' values (one call)."
    cls.__reduce__ = reduce  # type: ignore[method-assign]
    return cls

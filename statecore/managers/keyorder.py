"""An insertion-ordered set of offload keys, the CPU tier's LRU list: :class:`KeyOrder`.

The LRU policy keeps its idle keys oldest first and needs five things of that list, each in
O(1) per key: append a key as the newest (moving it there when present), remove a key, move
present keys to the newest end, test membership and iterate from the oldest. An
``OrderedDict`` does all five, but it grows by rebuilding: its dict's table in one call, then
its node index by looking every key up again. For a tier that fills, that is a one-step stall
proportional to the keys held, and a full tier pays it again whenever churn compacts the
table (on the development machine, 1.5 ms at 11,000 keys and 200 ms at 1.4 million). The
collector also traverses an ``OrderedDict`` key by key in every full collection.

:class:`KeyOrder` is, where the optional C extension ``statecore._keyorder`` is built (the
editable install builds it), a set whose memory for ``capacity`` keys is allocated once:
no rebuild while it holds at most ``capacity`` keys, and no work for the collector (it holds
only bytes). It holds more when asked to, doubling its arrays then. Keys are exact ``bytes``
(offload keys); anything else is a ``TypeError`` and changes nothing. Where the extension is
not built, :class:`KeyOrder` is :class:`PyKeyOrder`, the same interface over an
``OrderedDict``: the same order, the same answers and errors (tests/managers/test_keyorder.py
holds the two to it). :func:`keyorder_impl` says which one is in use.
"""

from __future__ import annotations

from abc import ABC
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

from statecore.keys import OffloadKey

__all__ = ["DistinctKeys", "KeyOrder", "PyKeyOrder", "keyorder_impl"]


class DistinctKeys(ABC):  # noqa: B024 (a marker: no abstract methods)
    """Iterables whose items are distinct by their type: a virtual base class, registered for
    :class:`KeyOrder` and :class:`PyKeyOrder` (they are sets), that lets
    :func:`~statecore.managers.policies.lru_select_victims` scan them at C speed, as it does
    sets and mappings."""


def _check(keys: Sequence[Any]) -> Sequence[Any]:
    """``keys`` as a sequence of exact bytes, or the TypeError the C type raises."""
    if not isinstance(keys, list | tuple):
        try:
            keys = list(keys)
        except TypeError:
            raise TypeError("KeyOrder: keys must be a sequence") from None
    if set(map(type, keys)) - {bytes}:
        bad = next(k for k in keys if type(k) is not bytes)
        raise TypeError(f"KeyOrder keys are bytes, got {type(bad).__name__}")
    return keys


class PyKeyOrder:
    """:class:`KeyOrder` over an ``OrderedDict`` (the fallback, and the tests' reference).

    Args:
        capacity: the keys it is sized for (kept for the interface; an ``OrderedDict`` is
            not presized).
        keys: initial keys, oldest first.
    """

    __slots__ = ("_od", "capacity")

    def __init__(self, capacity: int, keys: Iterable[OffloadKey] | None = None) -> None:
        if type(capacity) is not int and not isinstance(capacity, int):
            raise TypeError(f"KeyOrder capacity must be an int, got {type(capacity).__name__}")
        if capacity < 0:
            raise ValueError("KeyOrder capacity must be >= 0")
        self.capacity = int(capacity)
        self._od: OrderedDict[OffloadKey, None] = OrderedDict()
        if keys is not None:
            self.append_many(list(keys))

    def append(self, key: OffloadKey) -> None:
        """Make ``key`` the newest (appended when absent, moved when present)."""
        _check((key,))
        od = self._od
        od[key] = None
        od.move_to_end(key)

    def append_many(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`append` of each key, in order (the last one newest)."""
        keys = _check(keys)
        od = self._od
        before = len(od)
        od.update(zip(keys, repeat(None)))
        if len(od) - before != len(keys):  # some key was present or listed twice: move all
            move = od.move_to_end
            for key in keys:
                move(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Move the present ``keys`` to the newest end, last to first (the first key ends
        newest); absent keys are ignored."""
        keys = _check(keys)
        od = self._od
        for key in reversed(keys):
            if key in od:
                od.move_to_end(key)

    def discard(self, key: OffloadKey) -> bool:
        """Remove ``key`` if present; whether it was."""
        _check((key,))
        return self._od.pop(key, _ABSENT) is not _ABSENT

    def discard_many(self, keys: Sequence[OffloadKey]) -> int:
        """:meth:`discard` of each key; how many were present."""
        keys = _check(keys)
        od = self._od
        before = len(od)
        deque(map(od.pop, keys, repeat(None)), 0)
        return before - len(od)

    def clear(self) -> None:
        """Remove every key."""
        self._od.clear()

    def oldest(self) -> OffloadKey | None:
        """The oldest key, or ``None`` when empty."""
        return next(iter(self._od), None)

    def __contains__(self, key: object) -> bool:
        return type(key) is bytes and key in self._od

    def __len__(self) -> int:
        return len(self._od)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._od)

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + self._od.__sizeof__()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.capacity, list(self._od)))

    def __repr__(self) -> str:
        return f"KeyOrder(capacity={self.capacity}, len={len(self._od)})"


_ABSENT: Any = object()

if TYPE_CHECKING:  # (the C type has PyKeyOrder's interface: statecore/_keyorder.pyi)
    KeyOrder = PyKeyOrder
else:
    try:
        from statecore._keyorder import KeyOrder
    except ImportError:  # pragma: no cover - the extension is optional (no C compiler)
        KeyOrder = PyKeyOrder

DistinctKeys.register(PyKeyOrder)
DistinctKeys.register(KeyOrder)


def keyorder_impl() -> str:
    """``"native"`` when :class:`KeyOrder` is the C type, ``"python"`` otherwise."""
    return "python" if KeyOrder is PyKeyOrder else "native"

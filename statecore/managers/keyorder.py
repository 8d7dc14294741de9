"""The CPU tier's ordered key containers, sized once: :class:`KeyOrder` (the LRU list) and
:class:`KeyTable` (the key table).

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

:class:`KeyTable` is the same structure with an int value per key: the CPU tier's key table
(key -> its reference count and slot), with a dict's semantics for the operations the tier
uses (``get``, ``in``, item get/set/delete, ``pop``, ``update`` from pairs, ``clear``,
iteration oldest first; ``keys``, ``values`` and ``items`` are iterators). A dict grows by
rebuilding its table in one call, which was the largest one-step stall left at the tail of
the connector's per-step cost (0.4 ms at 11,000 keys, 0.8 ms at 22,000, 99 ms at 1.4
million). Keys are exact ``bytes`` and values exact ``int`` (``TypeError`` otherwise,
before any change); a lookup of anything else answers "absent". Where the extension is not
built it is :class:`PyKeyTable`, a dict with the same checks (tests/managers/test_keytable.py
holds the two to a dict).
"""

from __future__ import annotations

from abc import ABC
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from statecore.keys import OffloadKey

__all__ = ["DistinctKeys", "KeyOrder", "KeyTable", "PyKeyOrder", "PyKeyTable", "keyorder_impl"]


class DistinctKeys(ABC):  # noqa: B024 (a marker: no abstract methods)
    """Iterables whose items are distinct by their type: a virtual base class, registered for
    :class:`KeyOrder` and :class:`PyKeyOrder` (they are sets), that lets
    :func:`~statecore.managers.policies.lru_select_victims` scan them at C speed, as it does
    sets and mappings."""


def _capacity(capacity: object, name: str) -> int:
    """``capacity`` as an int >= 0, or the TypeError / ValueError the C types raise."""
    if not isinstance(capacity, int):
        raise TypeError(f"{name} capacity must be an int, got {type(capacity).__name__}")
    if capacity < 0:
        raise ValueError(f"{name} capacity must be >= 0")
    return int(capacity)


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
        self.capacity = _capacity(capacity, "KeyOrder")
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


_NOT_A_PAIR = "KeyTable.update: element #{} is not a (key, value) pair"
_TUPLE, _TWO, _BYTES, _INT = {tuple}, {2}, {bytes}, {int}
_first, _second = itemgetter(0), itemgetter(1)


def _check_item(key: object, value: object) -> None:
    """The TypeError the C :class:`KeyTable` raises for a key that is not exact bytes or a
    value that is not an exact int."""
    if type(key) is not bytes:
        raise TypeError(f"KeyTable keys are bytes, got {type(key).__name__}")
    if type(value) is not int:
        raise TypeError(f"KeyTable values are ints, got {type(value).__name__}")


class PyKeyTable(dict[OffloadKey, int]):
    """:class:`KeyTable` over a ``dict`` (the fallback, and the tests' reference).

    A dict with the C type's construction and checks: keys are exact bytes and values exact
    ints (``TypeError`` otherwise, before any change). Lookups of anything else answer
    "absent" (after hashing it, so an unhashable key is a ``TypeError``, as with a dict).

    Args:
        capacity: the keys it is sized for (kept for the interface; a dict is not presized).
        items: initial ``(key, value)`` pairs, oldest first.
    """

    __slots__ = ("capacity",)

    def __init__(
        self, capacity: int, items: Iterable[tuple[OffloadKey, int]] | None = None
    ) -> None:
        super().__init__()
        self.capacity = _capacity(capacity, "KeyTable")
        if items is not None:
            self.update(items)

    def __setitem__(self, key: OffloadKey, value: int) -> None:
        _check_item(key, value)
        super().__setitem__(key, value)

    def update(self, items: Any = (), /) -> None:
        """Set each ``(key, value)`` pair in order (pairs before a bad one are kept, as
        ``dict.update`` does)."""
        pairs = list(items.items() if hasattr(items, "items") else items)
        if (
            set(map(type, pairs)) <= _TUPLE
            and set(map(len, pairs)) <= _TWO
            and set(map(type, map(_first, pairs))) <= _BYTES
            and set(map(type, map(_second, pairs))) <= _INT
        ):  # the usual case, checked at C speed
            dict.update(self, pairs)
            return
        for n, pair in enumerate(pairs):
            try:
                items_of = list(pair)
            except TypeError:
                raise TypeError(_NOT_A_PAIR.format(n)) from None
            if len(items_of) != 2:
                raise ValueError(_NOT_A_PAIR.format(n))
            self[items_of[0]] = items_of[1]

    def __contains__(self, key: object) -> bool:
        hash(key)
        return type(key) is bytes and super().__contains__(key)

    def get(self, key: OffloadKey, default: Any = None, /) -> Any:
        hash(key)
        return super().get(key, default) if type(key) is bytes else default

    def __getitem__(self, key: OffloadKey) -> int:
        hash(key)
        if type(key) is not bytes:
            raise KeyError(key)
        return super().__getitem__(key)

    def __delitem__(self, key: OffloadKey) -> None:
        hash(key)
        if type(key) is not bytes:
            raise KeyError(key)
        super().__delitem__(key)

    def pop(self, key: OffloadKey, *default: Any) -> Any:
        """Remove ``key`` and return its value; ``default`` (or KeyError) when absent."""
        hash(key)
        if type(key) is not bytes:
            if default:
                return default[0]
            raise KeyError(key)
        return super().pop(key, *default)

    def __sizeof__(self) -> int:
        return dict.__sizeof__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.capacity, list(self.items())))

    def __repr__(self) -> str:
        return f"KeyTable(capacity={self.capacity}, len={len(self)})"


if TYPE_CHECKING:  # (the C types have the Python ones' interfaces: statecore/_keyorder.pyi)
    KeyOrder = PyKeyOrder
    KeyTable = PyKeyTable
else:
    try:
        from statecore._keyorder import KeyOrder, KeyTable
    except ImportError:  # pragma: no cover - the extension is optional (no C compiler)
        KeyOrder, KeyTable = PyKeyOrder, PyKeyTable

DistinctKeys.register(PyKeyOrder)
DistinctKeys.register(KeyOrder)
MutableMapping.register(KeyTable)


def keyorder_impl() -> str:
    """``"native"`` when :class:`KeyOrder` and :class:`KeyTable` are the C types (they are
    imported together), ``"python"`` otherwise."""
    return "python" if KeyOrder is PyKeyOrder else "native"

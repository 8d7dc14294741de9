"""An insertion-ordered set of bytes keys, sized once: the CPU tier's LRU list
(:mod:`statecore.managers.keyorder`, whose ``PyKeyOrder`` has the same interface)."""

from collections.abc import Iterable, Iterator, Sequence

class KeyOrder:
    """``KeyOrder(capacity, keys=None)``: oldest first, memory for ``capacity`` keys."""

    def __init__(self, capacity: int, keys: Iterable[bytes] | None = None) -> None: ...
    @property
    def capacity(self) -> int:
        """The capacity it was built for."""
    def append(self, key: bytes) -> None:
        """Make ``key`` the newest (appended when absent, moved when present)."""
    def append_many(self, keys: Sequence[bytes]) -> None:
        """``append`` of each key in order (the last one newest)."""
    def touch(self, keys: Sequence[bytes]) -> None:
        """Move the present keys to the newest end, last to first."""
    def discard(self, key: bytes) -> bool:
        """Remove ``key`` if present; whether it was."""
    def discard_many(self, keys: Sequence[bytes]) -> int:
        """``discard`` of each key; how many were present."""
    def clear(self) -> None:
        """Remove every key."""
    def oldest(self) -> bytes | None:
        """The oldest key, or ``None`` when empty."""
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...

class KeyTable:
    """``KeyTable(capacity, items=None)``: an insertion-ordered map of bytes keys to ints,
    oldest first, memory for ``capacity`` keys."""

    def __init__(self, capacity: int, items: Iterable[tuple[bytes, int]] | None = None) -> None: ...
    @property
    def capacity(self) -> int:
        """The capacity it was built for."""
    def get(self, key: object, default: object = None, /) -> int | None:
        """``key``'s value, or ``default`` when absent."""
    def pop(self, key: object, default: object = ..., /) -> int:
        """Remove ``key`` and return its value; ``default`` (or KeyError) when absent."""
    def update(self, items: Iterable[tuple[bytes, int]], /) -> None:
        """Set each ``(key, value)`` pair, in order."""
    def keys(self) -> Iterator[bytes]:
        """The keys, oldest first."""
    def values(self) -> Iterator[int]:
        """The values, oldest key first."""
    def items(self) -> Iterator[tuple[bytes, int]]:
        """``(key, value)`` pairs, oldest first."""
    def clear(self) -> None:
        """Remove every key."""
    def __getitem__(self, key: bytes) -> int: ...
    def __setitem__(self, key: bytes, value: int) -> None: ...
    def __delitem__(self, key: bytes) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...

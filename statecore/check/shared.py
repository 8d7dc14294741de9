"""The shared secondary tier of the checker's world: the real ``RedisTier`` over a server double.

A scope with ``redis=True`` puts a real
:class:`~statecore.managers.tiering.TieringOffloadingManager` over the CPU tier, with one real
:class:`~statecore.managers.redistier.RedisTier` below it: the production code encodes and
decodes every value (header, fingerprint, key, checksum), names the key namespace from the
layout, batches lookups and answers ``RETRY``/``HIT``/``MISS``.
Only two things are replaced, both through the tier's own injection points:

* the executor is :class:`~statecore.managers.filetier.InlineExecutor`: a job runs when it is
  submitted, its result is collected at the tiering manager's next poll (deterministic);
* the client is a :class:`ServerDouble`: a dict of values and a ``down`` flag. While down,
  every pipeline's ``execute`` raises the redis-py ``ConnectionError`` (the builtin one when
  redis-py is not installed), as a refused connection does. The double is plain data, so it
  snapshots with the world.

The byte model. The RedisTier copies real pool rows, so the world's CPU tier (rank 0) is a
:class:`LabelPool`: a :class:`~statecore.pool.CPUPool` whose slot rows *encode* the byte
model's label (a length byte, the label, zero padding). The world reads and writes labels
through it as a sequence, and the tier reads and writes the same rows as bytes, so a promotion
delivers exactly the label that the value on the server encodes. A row that is not a valid
encoding (a corrupted value loaded unchecked) reads as :data:`~statecore.check.model.GARBAGE`;
a value stored by an engine of another layout carries the label ``foreign:`` + key; either
one, once loaded, is a data error (INV-DATA), never a silent success.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from statecore.pool import CPUPool

__all__ = ["FOREIGN", "LabelPool", "ServerDouble", "ServerDown"]

FOREIGN = b"foreign:"
"""The label prefix of chunks stored by an engine of another layout."""

_GARBAGE = b"garbage"  # = statecore.check.model.GARBAGE (that module imports this one)

ServerDown: type[Exception]
try:
    from redis.exceptions import ConnectionError as ServerDown
except ImportError:  # pragma: no cover - redis-py is optional
    ServerDown = ConnectionError


class _Pipeline:
    """The commands RedisTier sends through ``client.pipeline(transaction=False)``."""

    __slots__ = ("_cmds", "_server")

    def __init__(self, server: ServerDouble) -> None:
        self._server = server
        self._cmds: list[tuple[Any, ...]] = []

    def set(self, key: bytes, value: bytes, px: int | None = None) -> None:
        """Queue a ``SET`` (``px`` is accepted and ignored: nothing expires by itself)."""
        self._cmds.append(("set", key, bytes(value)))

    def get(self, key: bytes) -> None:
        """Queue a ``GET``."""
        self._cmds.append(("get", key))

    def exists(self, key: bytes) -> None:
        """Queue an ``EXISTS``."""
        self._cmds.append(("exists", key))

    def delete(self, key: bytes) -> None:
        """Queue a ``DEL``."""
        self._cmds.append(("delete", key))

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Run the queued commands in order; a server that is down refuses the connection."""
        server = self._server
        if server.down:
            raise ServerDown("Error 111 connecting to the server double: Connection refused.")
        data = server.data
        out: list[Any] = []
        for cmd in self._cmds:
            op, key = cmd[0], cmd[1]
            if op == "set":
                data[key] = cmd[2]
                out.append(True)
            elif op == "get":
                out.append(data.get(key))
            elif op == "exists":
                out.append(int(key in data))
            else:
                out.append(int(data.pop(key, None) is not None))
        self._cmds = []
        return out


class ServerDouble:
    """A Redis server in one process: ``data`` (key -> value) and whether it is ``down``.

    It has no ``connection_pool``, so RedisTier sends stores through a plain pipeline.
    """

    __slots__ = ("data", "down")

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.down = False

    def pipeline(self, transaction: bool = False) -> _Pipeline:
        """A new pipeline."""
        return _Pipeline(self)

    def corrupt(self, key: bytes) -> None:
        """Flip every bit of the value's last byte (a torn write, a bad disk, a bad actor)."""
        value = self.data[key]
        self.data[key] = value[:-1] + bytes([value[-1] ^ 0xFF])


def _label_pool(num_slots: int, width: int, data: bytes) -> LabelPool:
    pool = LabelPool(num_slots, width)
    pool._buf[:] = data
    return pool


class LabelPool(CPUPool):
    """A CPU pool of one region whose rows encode byte-model labels (module docstring).

    As a sequence of labels (``pool[slot]``, ``pool[slot] = label``, iteration) it is the
    world's CPU tier of rank 0; as a pool it is what the RedisTier copies.

    Args:
        num_slots: the CPU tier's slots.
        width: bytes of a row: one length byte plus the longest label.
    """

    __slots__ = ("_buf", "width")

    def __init__(self, num_slots: int, width: int) -> None:  # no mmap: plain, picklable bytes
        self.num_slots = num_slots
        self.row_bytes = (width,)
        self.width = width
        self._buf = bytearray(num_slots * width)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_label_pool, (self.num_slots, self.width, bytes(self._buf)))

    # -- the pool interface RedisTier uses ------------------------------------------------------

    def region(self, idx: int) -> memoryview:
        """The whole region (there is one)."""
        return memoryview(self._buf)

    def row(self, region: int, slot: int) -> memoryview:
        """The row of ``slot``."""
        w = self.width
        return memoryview(self._buf)[slot * w : (slot + 1) * w]

    def read_slot(self, slot: int) -> bytes:
        """A copy of the slot's row."""
        w = self.width
        return bytes(self._buf[slot * w : (slot + 1) * w])

    def write_slot(self, slot: int, data: bytes | memoryview) -> None:
        """Overwrite the slot's row."""
        w = self.width
        self._buf[slot * w : (slot + 1) * w] = data

    def close(self) -> None:
        """Nothing to release."""

    # -- the label sequence the world uses ------------------------------------------------------

    def __len__(self) -> int:
        return self.num_slots

    def __getitem__(self, slot: int) -> bytes:
        w = self.width
        row = self._buf[slot * w : (slot + 1) * w]
        n = row[0]
        if n >= w or any(row[1 + n :]):
            return _GARBAGE  # not an encoding of any label: the bytes are wrong
        return bytes(row[1 : 1 + n])

    def __setitem__(self, slot: int, label: bytes) -> None:
        w = self.width
        if len(label) >= w:
            raise ValueError(f"label of {len(label)} bytes does not fit a row of {w}")
        self._buf[slot * w : (slot + 1) * w] = bytes([len(label)]) + label.ljust(w - 1, b"\0")

    def __iter__(self) -> Iterator[bytes]:
        return (self[s] for s in range(self.num_slots))

    def labels(self) -> Sequence[bytes]:
        """Every slot's label."""
        return tuple(self)

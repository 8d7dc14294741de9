"""The shared CPU pool: the memory behind the primary tier's slots.

One pool serves both sides without copies: the transfer adapter views each region as a tensor
of shape ``(num_slots, row_bytes)`` (``torch.frombuffer``), the file tier reads and writes the
same rows through :class:`memoryview`. A slot holds one chunk: for each region (one per
canonical KV tensor) one row of ``page_bytes * blocks_per_chunk`` bytes.

The pool is plain anonymous memory (``mmap``), page-aligned, so that a CUDA adapter can pin it
in place (``cudaHostRegister``) instead of allocating a second, pinned copy.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

from statecore import validate
from statecore.errors import ConfigError, describe

__all__ = ["CPUPool"]


class CPUPool:
    """``num_slots`` chunk slots over one region per canonical KV tensor.

    Args:
        num_slots: number of chunk slots (the primary tier's capacity).
        row_bytes: bytes of one slot row in each region (``page_bytes * blocks_per_chunk``).
    """

    __slots__ = ("_maps", "_views", "num_slots", "row_bytes")

    def __init__(self, num_slots: int, row_bytes: Sequence[int]) -> None:
        validate.config_int("CPUPool", "num_slots", num_slots, 0)
        if (
            isinstance(row_bytes, str | bytes)
            or not isinstance(row_bytes, Sequence)
            or not row_bytes
            or any(type(r) is not int or r <= 0 for r in row_bytes)
        ):
            raise ConfigError(
                f"CPUPool.row_bytes must be a non-empty sequence of ints > 0, got "
                f"{describe(row_bytes)}",
                "CPUPool.row_bytes",
                row_bytes,
            )
        self.num_slots = num_slots
        self.row_bytes = tuple(int(r) for r in row_bytes)
        self._maps = [mmap.mmap(-1, max(1, num_slots * r)) for r in self.row_bytes]
        self._views = [memoryview(m) for m in self._maps]

    @property
    def num_regions(self) -> int:
        """Number of regions (canonical KV tensors)."""
        return len(self.row_bytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one whole chunk (all regions)."""
        return sum(self.row_bytes)

    def region(self, idx: int) -> memoryview:
        """The whole region ``idx`` as a writable memoryview (``num_slots * row_bytes``)."""
        return self._views[idx][: self.num_slots * self.row_bytes[idx]]

    def row(self, region: int, slot: int) -> memoryview:
        """Slot ``slot``'s row in region ``region`` (a writable view, no copy)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        r = self.row_bytes[region]
        return self._views[region][slot * r : (slot + 1) * r]

    def read_slot(self, slot: int) -> bytes:
        """A copy of the whole chunk in ``slot`` (all regions concatenated)."""
        return b"".join(bytes(self.row(i, slot)) for i in range(self.num_regions))

    def write_slot(self, slot: int, data: bytes | memoryview) -> None:
        """Overwrite the whole chunk in ``slot`` with ``data`` (``slot_bytes`` long)."""
        if len(data) != self.slot_bytes:
            raise ValueError(f"slot data must be {self.slot_bytes} bytes, got {len(data)}")
        off = 0
        for i, r in enumerate(self.row_bytes):
            self.row(i, slot)[:] = data[off : off + r]
            off += r

    def close(self) -> None:
        """Release the memory. Views handed out before must not be used afterwards."""
        for v in self._views:
            v.release()
        for m in self._maps:
            m.close()
        self._views = []
        self._maps = []

"""The shared CPU pool: the memory behind the primary tier's slots.

One pool serves both sides without copies: the transfer adapter views each region as a tensor
of shape ``(num_slots, row_bytes)`` (``torch.frombuffer``), the file tier reads and writes the
same rows through :class:`memoryview`. A slot holds one chunk: for each region (one per
canonical KV tensor) one row of ``page_bytes * blocks_per_chunk`` bytes.

The pool is plain anonymous memory (``mmap``), page-aligned, so that a CUDA adapter can pin it
in place (``cudaHostRegister``) instead of allocating a second, pinned copy.

Anonymous memory is mapped lazily: the first write to each page faults and the kernel zeroes
it, which roughly doubles the cost of the first store into a slot (64 MiB into fresh pages
took 33 ms, into touched ones 15 ms, on the 2-core development machine). A serving engine
passes ``prefault=True`` so that cost is paid once at start-up (Linux ``MAP_POPULATE``), as
upstream pays it when it allocates pinned memory; the pool's memory is then resident from
the start.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Sequence

from statecore import validate
from statecore.errors import ConfigError, describe

__all__ = ["CPUPool"]

log = logging.getLogger(__name__)

_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)


class CPUPool:
    """``num_slots`` chunk slots over one region per canonical KV tensor.

    Args:
        num_slots: number of chunk slots (the primary tier's capacity).
        row_bytes: bytes of one slot row in each region (``page_bytes * blocks_per_chunk``).
        prefault: map every page at construction (Linux ``MAP_POPULATE``; elsewhere pages
            stay lazy), so no store pays a page fault.
    """

    __slots__ = ("_maps", "_views", "num_slots", "row_bytes")

    def __init__(self, num_slots: int, row_bytes: Sequence[int], *, prefault: bool = False) -> None:
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
        flags = mmap.MAP_SHARED | (_POPULATE if prefault else 0)
        t0 = time.perf_counter()
        self._maps = [mmap.mmap(-1, max(1, num_slots * r), flags=flags) for r in self.row_bytes]
        if prefault:
            log.info(
                "CPU pool: %d slots x %d bytes mapped%s in %.2f s",
                num_slots,
                sum(self.row_bytes),
                " and prefaulted" if _POPULATE else " (no MAP_POPULATE here: pages stay lazy)",
                time.perf_counter() - t0,
            )
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

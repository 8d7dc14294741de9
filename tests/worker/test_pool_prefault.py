"""The CPU pool's memory: lazy by default, resident from the start when prefaulted."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

from statecore.pool import CPUPool

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_POPULATE"),
    reason="prefaulting is Linux MAP_POPULATE; page residency is read with Linux mincore",
)

PAGES = 64


def _resident_pages(pool: CPUPool, region: int) -> int:
    """How many of the region's pages are resident (``mincore``)."""
    view = pool.region(region)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    n = len(view) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(view)), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec)


def test_prefaulted_pool_is_resident_before_any_write() -> None:
    pool = CPUPool(PAGES, [mmap.PAGESIZE, 2 * mmap.PAGESIZE], prefault=True)
    assert _resident_pages(pool, 0) == PAGES
    assert _resident_pages(pool, 1) == 2 * PAGES
    pool.write_slot(3, bytes(range(256)) * (3 * mmap.PAGESIZE // 256))
    assert pool.read_slot(3)[:256] == bytes(range(256))


def test_default_pool_maps_pages_on_first_write() -> None:
    pool = CPUPool(PAGES, [mmap.PAGESIZE])
    assert _resident_pages(pool, 0) == 0
    pool.write_slot(5, b"\x01" * mmap.PAGESIZE)
    assert _resident_pages(pool, 0) == 1

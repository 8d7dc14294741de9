"""Batched host memory copies that release the GIL (the torch adapter's CPU path)."""

from collections.abc import Sequence

def copy_pages(
    dst: Sequence[int],
    src: Sequence[int],
    size: Sequence[int],
    start: int = 0,
    stop: int | None = None,
    /,
) -> int:
    """Copy ``size[i]`` bytes from address ``src[i]`` to ``dst[i]`` for ``i`` in ``[start, stop)``.

    The GIL is released while the bytes move; returns the bytes copied. The addresses are
    trusted: the caller must have validated every range.
    """

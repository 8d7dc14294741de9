"""Batched host memory copies that release the GIL (the torch adapter's CPU path)."""

from collections.abc import Sequence

def copy_blocks(
    dst_base: int,
    dst_stride: int,
    dst_index: Sequence[int],
    src_base: int,
    src_stride: int,
    src_index: Sequence[int],
    nbytes: int,
    start: int = 0,
    stop: int | None = None,
    stream: bool = False,
    /,
) -> tuple[int, int]:
    """Copy ``nbytes`` from ``src_base + src_index[i] * src_stride`` to
    ``dst_base + dst_index[i] * dst_stride`` for ``i`` in ``[start, stop)``.

    Where both strides equal ``nbytes``, pages whose indices go up by one on both sides are
    merged into one run. The GIL is released while the bytes move; returns
    ``(bytes copied, runs copied)``. The caller must have validated every index.

    ``stream``: copy with non-temporal stores while prefetching the source ahead, across
    runs (for jobs far larger than the caches). Runs whose ranges overlap, and every run on
    a machine without SSE2, are copied with ``memmove``.
    """

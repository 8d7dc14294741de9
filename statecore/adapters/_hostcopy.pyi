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

def ids_valid(
    block_ids: Sequence[int], num_gpu_blocks: int, slots: Sequence[int], num_slots: int, /
) -> bool:
    """``True`` when every block id is in ``[0, num_gpu_blocks)``, every slot in
    ``[0, num_slots)`` and no slot repeats; ``False`` otherwise and whenever it cannot tell
    cheaply (a non-int item, more than 2**27 slots): the caller then checks in Python."""

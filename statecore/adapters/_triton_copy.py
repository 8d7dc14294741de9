"""The Triton page-copy kernel of the torch adapter.

Imported lazily by :mod:`statecore.adapters.torch` (only where Triton is installed). One
launch copies every page of a job: program ``(row, part)`` copies words
``[part * BLOCK, (part + 1) * BLOCK)`` of copy ``row``, masked at that copy's length. Source
and destination are raw addresses, so the same kernel writes GPU blocks into mapped pinned
host rows and back. Under ``TRITON_INTERPRET=1`` it runs on the CPU with host addresses, which
is how CI checks it without a GPU.

Variants. Triton compiles the kernel once per combination of its constants (``WORD``,
``BLOCK``) and of the properties it specialises its other arguments on. The number of copies
``n`` is excluded from specialisation (``do_not_specialize``): otherwise ``n == 1`` and ``n``
divisible by 16 would each compile a variant of their own, on the engine thread, the first
time a job of that length arrives. A backend passes one fixed ``block`` for all its jobs, so
it launches exactly one variant, which its warm-up compiles (:func:`variant_key`).
"""

from __future__ import annotations

import triton  # type: ignore[import-not-found,import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,import-untyped,unused-ignore]

__all__ = ["block_words", "launch_copy_pages", "variant_key"]


@triton.jit(do_not_specialize=["n"])  # type: ignore[misc,untyped-decorator,unused-ignore]
def _copy_pages_kernel(  # type: ignore[no-untyped-def,unused-ignore]
    addrs,  # int64[3, n]: source address, destination address, words to copy
    n,
    WORD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    src = tl.load(addrs + row).to(tl.pointer_type(WORD))
    dst = tl.load(addrs + n + row).to(tl.pointer_type(WORD))
    words = tl.load(addrs + 2 * n + row)
    offs = part.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def block_words(word_bytes: int, max_words: int) -> int:
    """Words one program copies: 8 KiB (16 KiB of 4-byte words), fewer for small pages."""
    cap = 1024 if word_bytes == 8 else 2048
    return min(cap, int(triton.next_power_of_2(max(1, max_words))))


def variant_key(word_bytes: int, block: int) -> tuple[int, int]:
    """The compiled variant a launch with these arguments uses: ``(word_bytes, block)``."""
    return word_bytes, block


def launch_copy_pages(
    addrs: object, n: int, max_words: int, word_bytes: int, block: int | None = None
) -> None:
    """Launch the kernel on the current stream of ``addrs``'s device.

    Args:
        addrs: int64 tensor ``[3, n]`` (source addresses, destination addresses, words per
            copy), on the device the kernel runs on.
        n: number of copies.
        max_words: the largest ``addrs[2]`` entry (sets the grid's second dimension).
        word_bytes: 8 or 4; every address and length must be a multiple of it.
        block: words per program (a power of two); default :func:`block_words` of
            ``max_words``. A caller that passes one value for all its launches runs a single
            compiled variant.
    """
    if n == 0:
        return
    if word_bytes not in (4, 8):
        raise ValueError(f"word_bytes must be 4 or 8, got {word_bytes}")
    if block is None:
        block = block_words(word_bytes, max_words)
    word = tl.int64 if word_bytes == 8 else tl.int32
    grid = (n, int(triton.cdiv(max_words, block)))
    _copy_pages_kernel[grid](addrs, n, WORD=word, BLOCK=block, num_warps=4)

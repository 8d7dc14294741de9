"""Token ids to block hashes, and block hashes to KV bytes.

Block hashes are chained: the hash of block ``i`` covers every token of blocks ``0..i``, so two
sequences share the hash of block ``i`` exactly when they share their first ``(i+1) * n`` tokens.
The KV content the simulator writes into a GPU block is a pure function of that hash (plus the
rank and the canonical tensor index), so the oracle always knows what any block must hold.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = [
    "ROOT_HASH",
    "block_content",
    "chain_hash",
    "extend_block_hashes",
    "partial_content",
]

ROOT_HASH = b"\x00" * 16
"""Parent hash of the first block of every sequence."""

_DIGEST = 16


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of one block of ``tokens`` whose predecessor's hash is ``parent``."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def extend_block_hashes(hashes: list[bytes], tokens: Sequence[int], tokens_per_hash: int) -> None:
    """Append the hashes of every complete block of ``tokens`` not yet in ``hashes``."""
    n_full = len(tokens) // tokens_per_hash
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), n_full):
        parent = chain_hash(parent, tokens[i * tokens_per_hash : (i + 1) * tokens_per_hash])
        hashes.append(parent)


def _expand(seed: bytes, nbytes: int) -> bytes:
    digest = hashlib.blake2b(seed, digest_size=64).digest()
    reps = -(-nbytes // 64)
    return (digest * reps)[:nbytes]


def block_content(block_hash: bytes, rank: int, tensor: int, nbytes: int) -> bytes:
    """The bytes a full block with ``block_hash`` holds in ``tensor`` of worker ``rank``."""
    return _expand(block_hash + struct.pack("<HH", rank, tensor), nbytes)


def partial_content(
    parent: bytes, tokens: Sequence[int], rank: int, tensor: int, nbytes: int
) -> bytes:
    """The bytes of a block that holds only ``tokens`` (fewer than a full block)."""
    seed = chain_hash(parent, tokens) + b"partial" + struct.pack("<HH", rank, tensor)
    return _expand(seed, nbytes)

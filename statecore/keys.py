"""Offload keys: the identity of one offloaded chunk of one KV-cache group.

An :data:`OffloadKey` is the block hash of the chunk's *last* hash block followed by the group
index as 4 big-endian bytes. Two requests that share a token prefix share the keys of the
chunks that prefix covers, per group.
"""

from __future__ import annotations

from typing import NewType

from statecore.errors import InvalidArgumentError

__all__ = ["OffloadKey", "key_group", "key_hash", "make_offload_key"]

OffloadKey = NewType("OffloadKey", bytes)
"""Bytes: chunk block hash + 4-byte big-endian group index."""

_GROUP_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Build the key of the chunk ending with ``block_hash`` in group ``group_idx``.

    Raises :class:`~statecore.errors.InvalidArgumentError` (a ``ValueError`` and a
    ``TypeError``) unless ``block_hash`` is bytes and ``group_idx`` an int (not a bool) in
    ``0 .. 2**32 - 1``.
    """
    if type(group_idx) is not int or not 0 <= group_idx < 2**32:
        raise InvalidArgumentError(
            "make_offload_key", "group_idx", group_idx, "an int in 0..2**32-1 (4 bytes)"
        )
    if type(block_hash) is not bytes:
        if not isinstance(block_hash, bytes | bytearray | memoryview):
            raise InvalidArgumentError("make_offload_key", "block_hash", block_hash, "bytes")
        block_hash = bytes(block_hash)
    return OffloadKey(block_hash + group_idx.to_bytes(_GROUP_BYTES, "big"))


def key_hash(key: OffloadKey) -> bytes:
    """The block hash part of ``key``."""
    return key[:-_GROUP_BYTES]


def key_group(key: OffloadKey) -> int:
    """The group index part of ``key``."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big")

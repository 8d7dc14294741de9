"""The simulated GPU KV cache (CPU tensors) and its shadow: the data oracle.

Every rank owns ``num_tensors`` canonical KV tensors of shape ``(num_blocks, page_bytes)``
(int8, block first, as upstream registers them), split evenly among the KV-cache groups (group
``g`` owns tensors ``g * per_group .. (g + 1) * per_group - 1``; block ids are shared by the
groups, as in an engine whose groups allocate from one block pool). Whenever the engine
computes tokens into a block of a group it writes the block's deterministic content (a function
of the token prefix and the tensor) into that group's tensors and into a shadow copy, and marks
the block *valid* in those tensors. Blocks being loaded into, or handed to a new owner, are
marked *don't care* until their content is known again.

Two checks:

* :meth:`KVCache.verify_loaded`: right after a load is released, every loaded block must hold
  exactly the bytes of its key (INV-DATA); a mismatch names the block, rank and tensor.
* :meth:`KVCache.verify_all`: after every step, every valid block still holds its shadow
  bytes, so a transfer that lands late, or into a block that changed owner, is caught too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from statecore.sim.hashing import block_content, partial_content

__all__ = ["DataError", "KVCache"]


@dataclass(frozen=True, slots=True)
class DataError:
    """One block whose bytes are not what the oracle expects."""

    step: int
    block: int
    rank: int
    tensor: int
    what: str

    def __str__(self) -> str:
        return (
            f"step {self.step}: GPU block {self.block} (rank {self.rank}, tensor {self.tensor}): "
            f"{self.what}"
        )


class KVCache:
    """Per-rank GPU KV tensors with a shadow of what every valid block must hold."""

    def __init__(
        self, num_ranks: int, num_blocks: int, num_tensors: int, page_bytes: int, groups: int = 1
    ) -> None:
        if groups < 1 or num_tensors % groups:
            raise ValueError(f"{num_tensors} tensors cannot be split among {groups} groups")
        per = num_tensors // groups
        self.group_tensors: list[range] = [range(g * per, (g + 1) * per) for g in range(groups)]
        """Per KV-cache group, the indices of its canonical tensors."""
        self.num_ranks = num_ranks
        self.num_blocks = num_blocks
        self.num_tensors = num_tensors
        self.page_bytes = page_bytes
        # one allocation for all ranks and tensors, so that a check is one vectorised compare
        self._all = torch.zeros((num_ranks, num_tensors, num_blocks, page_bytes), dtype=torch.int8)
        self.tensors: list[list[torch.Tensor]] = [
            [self._all[r, t] for t in range(num_tensors)] for r in range(num_ranks)
        ]
        self._all_np = self._all.numpy()
        self._shadow_np = np.zeros_like(self._all_np)
        self._np = [[self._all_np[r, t] for t in range(num_tensors)] for r in range(num_ranks)]
        self._shadow = [
            [self._shadow_np[r, t] for t in range(num_tensors)] for r in range(num_ranks)
        ]
        words = page_bytes // 8 if page_bytes % 8 == 0 else 0
        self._cmp = (
            (self._all_np.view(np.int64), self._shadow_np.view(np.int64))
            if words
            else (self._all_np, self._shadow_np)
        )
        self.valid = np.zeros((num_tensors, num_blocks), dtype=bool)
        """Per canonical tensor and block: whether the block's bytes are known."""
        self.dirty = True
        """Set whenever GPU bytes may have changed (the engine sets it on every step)."""
        self.expected_hash: list[bytes | None] = [None] * num_blocks
        self.blocks_written = 0

    def _write(self, block: int, contents: Sequence[Sequence[bytes]], group: int) -> None:
        tensors = self.group_tensors[group]
        for r in range(self.num_ranks):
            for i, t in enumerate(tensors):
                row = np.frombuffer(contents[r][i], dtype=np.int8)
                self._np[r][t][block] = row
                self._shadow[r][t][block] = row
        self.valid[tensors.start : tensors.stop, block] = True
        self.blocks_written += 1

    def _contents_full(self, block_hash: bytes, group: int) -> list[list[bytes]]:
        pb = self.page_bytes
        return [
            [block_content(block_hash, r, t, pb) for t in self.group_tensors[group]]
            for r in range(self.num_ranks)
        ]

    def write_full(self, block: int, block_hash: bytes, group: int = 0) -> None:
        """Compute: ``block`` of ``group`` now holds the full block ``block_hash``."""
        self._write(block, self._contents_full(block_hash, group), group)
        self.expected_hash[block] = block_hash

    def write_partial(
        self, block: int, parent: bytes, tokens: Sequence[int], group: int = 0
    ) -> None:
        """Compute: ``block`` of ``group`` holds only ``tokens`` (a partial block)."""
        pb = self.page_bytes
        contents = [
            [partial_content(parent, tokens, r, t, pb) for t in self.group_tensors[group]]
            for r in range(self.num_ranks)
        ]
        self._write(block, contents, group)
        self.expected_hash[block] = None

    def dont_care(self, block: int) -> None:
        """``block``'s content is about to be replaced (load target, new owner)."""
        self.valid[:, block] = False
        self.expected_hash[block] = None

    def verify_loaded(
        self, step: int, block: int, block_hash: bytes, group: int = 0
    ) -> list[DataError]:
        """INV-DATA: a load delivered ``block`` of ``group``; it must hold the content of
        ``block_hash``.

        On success the block becomes valid with that content.
        """
        contents = self._contents_full(block_hash, group)
        tensors = self.group_tensors[group]
        errors: list[DataError] = []
        for r in range(self.num_ranks):
            for i, t in enumerate(tensors):
                want = np.frombuffer(contents[r][i], dtype=np.int8)
                got = self._np[r][t][block]
                if not np.array_equal(got, want):
                    errors.append(
                        DataError(step, block, r, t, self._describe(got, block_hash, r, t))
                    )
                self._shadow[r][t][block] = want
        # After a wrong load the engine would compute on garbage; the oracle reports it and
        # repairs the block so that one corruption is reported once.
        if errors:
            for r in range(self.num_ranks):
                for t in tensors:
                    self._np[r][t][block] = self._shadow[r][t][block]
        self.valid[tensors.start : tensors.stop, block] = True
        self.expected_hash[block] = block_hash
        return errors

    def _describe(self, got: np.ndarray, want_hash: bytes, rank: int, tensor: int) -> str:
        if not got.any():
            return f"loaded zeros, expected key {want_hash.hex()[:12]}"
        return f"loaded wrong bytes for key {want_hash.hex()[:12]}"

    def verify_all(self, step: int) -> list[DataError]:
        """Every valid block still holds its shadow bytes (on every rank and tensor)."""
        if not self.dirty:
            return []
        self.dirty = False
        got, want = self._cmp
        differs = (got != want).any(axis=3)  # (rank, tensor, block)
        differs &= self.valid[None]
        if not differs.any():
            return []
        errors: list[DataError] = []
        for r, t, b in zip(*np.nonzero(differs), strict=True):
            r, t, b = int(r), int(t), int(b)
            errors.append(DataError(step, b, r, t, "bytes changed under a valid block"))
            self._np[r][t][b] = self._shadow[r][t][b]
        return errors

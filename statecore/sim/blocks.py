"""A GPU block allocator with prefix caching, as an engine's KV-cache manager keeps it.

Block 0 is the null block and is never handed out. Freed blocks go to the tail of an LRU free
list and keep their hash: a later request whose prefix hashes match can take them back (a
prefix-cache hit). Allocation pops from the head, evicting the block's cached hash. That reuse of
freed blocks is what exercises fencing: a block freed by a finished request while its store is
still reading it can be handed to a new owner in the very next step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["BlockPool", "BlockPoolError"]


class BlockPoolError(RuntimeError):
    """The simulator's own allocator was misused (a harness bug, never a library bug)."""


class BlockPool:
    """``num_blocks`` GPU blocks (ids ``1..num_blocks-1`` usable) with a prefix cache.

    Args:
        num_blocks: total blocks including the null block 0.
        on_evict: called with a block id when its cached content is dropped for reuse.
        reuse_freed_first: a freed block goes to the head of the free list (the next
            allocation takes it: immediate reuse) instead of the tail.
        uncached_first: vLLM 0.33's prefix cache: a freed block that holds no cached hash
            goes to the head of the free list (the blocks of one release in the order they
            are released, so the first is handed out first), a cached one to the tail; and
            every full block keeps its hash, also when another block already holds the same
            one (a hit takes the block cached first; when it is evicted, the next).
    """

    def __init__(
        self,
        num_blocks: int,
        on_evict: Callable[[int], None] | None = None,
        reuse_freed_first: bool = False,
        uncached_first: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise BlockPoolError(f"need at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._on_evict = on_evict
        self._reuse_first = reuse_freed_first
        self._uncached_first = uncached_first
        self._same: dict[bytes, dict[int, None]] = {}
        """With ``uncached_first``: every block that holds each hash, in caching order."""
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self.free)

    def computed_blocks(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The longest cached prefix of ``hashes`` (at most ``max_blocks`` blocks). No effect."""
        out: list[int] = []
        for h in hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free list."""
        for b in blocks:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks from the head of the free list, or None (nothing changes)."""
        if n > len(self.free):
            return None
        out: list[int] = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                if self._uncached_first:
                    same = self._same[h]
                    del same[b]
                    if self.cached.get(h) == b:
                        if same:
                            self.cached[h] = next(iter(same))
                        else:
                            del self.cached[h]
                    if not same:
                        del self._same[h]
                elif self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            if self._on_evict is not None:
                self._on_evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first (so prefix blocks are evicted last)."""
        first: list[int] = []
        for b in reversed(blocks):
            if b == 0:
                continue
            if self.ref[b] <= 0:
                raise BlockPoolError(f"block {b} released with ref count {self.ref[b]}")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self._reuse_first:
                    self.free.move_to_end(b, last=False)
                elif self._uncached_first and self.hash_of[b] is None:
                    first.append(b)
        for b in reversed(first):
            self.free.move_to_end(b, last=False)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record that ``block`` holds the full block ``block_hash`` (first one wins)."""
        if self.hash_of[block] is not None:
            return
        if self._uncached_first:
            self.hash_of[block] = block_hash
            self._same.setdefault(block_hash, {})[block] = None
            self.cached.setdefault(block_hash, block)
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.hash_of[block] = block_hash

    def check(self) -> None:
        """Raise :class:`BlockPoolError` if the allocator's own bookkeeping is inconsistent."""
        if self.ref[0] != 0 or 0 in self.free:
            raise BlockPoolError("null block 0 was handed out")
        for b in range(1, self.num_blocks):
            if self.ref[b] < 0 or (self.ref[b] == 0) != (b in self.free):
                raise BlockPoolError(f"block {b}: ref {self.ref[b]}, free={b in self.free}")

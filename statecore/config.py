"""Scheduler configuration, validated on construction with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

from statecore.errors import ConfigError

__all__ = ["GroupConfig", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """One KV-cache group.

    Attributes:
        tokens_per_block: GPU block size of the group, in tokens.
        sliding_window: attention window in tokens for a sliding-window group; None for full
            attention.
    """

    tokens_per_block: int
    sliding_window: int | None = None

    @property
    def is_sliding(self) -> bool:
        """Whether the group uses sliding-window attention."""
        return self.sliding_window is not None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything the scheduler needs to know about the engine and its own policy.

    Attributes:
        groups: the KV-cache groups, indexed by group index.
        blocks_per_chunk: GPU blocks per offloaded chunk (one CPU slot per chunk and group).
        tokens_per_hash: tokens covered by one block hash; defaults to the smallest group
            block size. Every group's chunk size must be a multiple of it.
        num_workers: workers (ranks) that execute and report every job.
        offload_prompt_only: store only prompt tokens, never generated ones.
        max_recompute_pending_tokens: a pending (not yet readable) run of at most this many
            tokens is recomputed instead of waited for.
        enable_prefix_caching: the engine's GPU prefix cache is on (enables deferring a request
            whose hit chunks another request is loading).
        stall_timeout_s: a job without a full quorum after this long is stalled.
        stall_check_interval_s: the stall check runs at most this often.
    """

    groups: tuple[GroupConfig, ...] = (GroupConfig(16),)
    blocks_per_chunk: int = 1
    tokens_per_hash: int | None = None
    num_workers: int = 1
    offload_prompt_only: bool = False
    max_recompute_pending_tokens: int = 0
    enable_prefix_caching: bool = True
    stall_timeout_s: float = 300.0
    stall_check_interval_s: float = 10.0
    _tph: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("SchedulerConfig.groups: at least one KV-cache group is needed")
        for g, grp in enumerate(self.groups):
            if grp.tokens_per_block <= 0:
                raise ConfigError(
                    f"SchedulerConfig.groups[{g}].tokens_per_block must be > 0, "
                    f"got {grp.tokens_per_block}"
                )
            if grp.sliding_window is not None and grp.sliding_window <= 0:
                raise ConfigError(
                    f"SchedulerConfig.groups[{g}].sliding_window must be > 0 or None, "
                    f"got {grp.sliding_window}"
                )
        if self.blocks_per_chunk <= 0:
            raise ConfigError(f"blocks_per_chunk must be > 0, got {self.blocks_per_chunk}")
        tph = self.tokens_per_hash
        if tph is None:
            tph = min(g.tokens_per_block for g in self.groups)
        if tph <= 0:
            raise ConfigError(f"tokens_per_hash must be > 0, got {tph}")
        for g, grp in enumerate(self.groups):
            tpc = grp.tokens_per_block * self.blocks_per_chunk
            if tpc % tph:
                raise ConfigError(
                    f"group {g}: tokens per chunk {tpc} (tokens_per_block "
                    f"{grp.tokens_per_block} x blocks_per_chunk {self.blocks_per_chunk}) is not "
                    f"a multiple of tokens_per_hash {tph}"
                )
        if self.num_workers <= 0:
            raise ConfigError(f"num_workers must be > 0, got {self.num_workers}")
        if self.max_recompute_pending_tokens < 0:
            raise ConfigError(
                "max_recompute_pending_tokens must be >= 0, "
                f"got {self.max_recompute_pending_tokens}"
            )
        if not self.stall_timeout_s > 0:
            raise ConfigError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if not 0 < self.stall_check_interval_s <= self.stall_timeout_s:
            raise ConfigError(
                "stall_check_interval_s must be > 0 and <= stall_timeout_s, "
                f"got {self.stall_check_interval_s}"
            )
        object.__setattr__(self, "_tph", tph)

    @property
    def hash_tokens(self) -> int:
        """The effective ``tokens_per_hash``."""
        return self._tph

    def tokens_per_chunk(self, group: int) -> int:
        """Tokens covered by one chunk of ``group``."""
        return self.groups[group].tokens_per_block * self.blocks_per_chunk

    def hashes_per_chunk(self, group: int) -> int:
        """Block hashes per chunk of ``group``."""
        return self.tokens_per_chunk(group) // self._tph

    def window_chunks(self, group: int) -> int | None:
        """Sliding window of ``group`` in chunks (rounded up), or None for full attention."""
        w = self.groups[group].sliding_window
        if w is None:
            return None
        tpc = self.tokens_per_chunk(group)
        return -(-w // tpc)

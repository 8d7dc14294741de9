"""Scheduler configuration, validated on construction with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

from statecore import validate
from statecore.errors import ConfigError, describe

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

    def __post_init__(self) -> None:
        validate.config_int("GroupConfig", "tokens_per_block", self.tokens_per_block, 1)
        if self.sliding_window is not None:
            validate.config_int("GroupConfig", "sliding_window", self.sliding_window, 1)

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
        owner = "SchedulerConfig"
        groups: object = self.groups
        if isinstance(groups, list):
            groups = tuple(groups)
            object.__setattr__(self, "groups", groups)
        if type(groups) is not tuple:
            raise ConfigError(
                f"{owner}.groups must be a tuple of GroupConfig, got {describe(groups)}",
                f"{owner}.groups",
                groups,
            )
        if not groups:
            raise ConfigError(f"{owner}.groups: at least one KV-cache group is needed")
        for g, grp in enumerate(groups):
            if type(grp) is not GroupConfig:
                raise ConfigError(
                    f"{owner}.groups[{g}] must be a GroupConfig, got {describe(grp)}",
                    f"{owner}.groups[{g}]",
                    grp,
                )
        validate.config_int(owner, "blocks_per_chunk", self.blocks_per_chunk, 1)
        if self.tokens_per_hash is not None:
            validate.config_int(owner, "tokens_per_hash", self.tokens_per_hash, 1)
        validate.config_int(owner, "num_workers", self.num_workers, 1)
        validate.config_int(
            owner, "max_recompute_pending_tokens", self.max_recompute_pending_tokens, 0
        )
        validate.config_bool(owner, "offload_prompt_only", self.offload_prompt_only)
        validate.config_bool(owner, "enable_prefix_caching", self.enable_prefix_caching)
        validate.config_float(owner, "stall_timeout_s", self.stall_timeout_s)
        validate.config_float(owner, "stall_check_interval_s", self.stall_check_interval_s)
        tph = self.tokens_per_hash
        if tph is None:
            tph = min(g.tokens_per_block for g in groups)
        for g, grp in enumerate(groups):
            tpc = grp.tokens_per_block * self.blocks_per_chunk
            if tpc % tph:
                raise ConfigError(
                    f"group {g}: tokens per chunk {tpc} (tokens_per_block "
                    f"{grp.tokens_per_block} x blocks_per_chunk {self.blocks_per_chunk}) is not "
                    f"a multiple of tokens_per_hash {tph}",
                    f"{owner}.tokens_per_hash",
                    tph,
                )
        if self.stall_check_interval_s > self.stall_timeout_s:
            raise ConfigError(
                f"{owner}.stall_check_interval_s must be <= stall_timeout_s "
                f"({self.stall_timeout_s}), got {describe(self.stall_check_interval_s)}",
                f"{owner}.stall_check_interval_s",
                self.stall_check_interval_s,
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

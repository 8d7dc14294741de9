"""The small typed views the scheduler reads: requests and per-step scheduler output.

An engine adapts its own objects to these with a thin layer. :class:`RequestLike` is a
protocol read live (the scheduler keeps the object and reads its attributes when it needs them),
so an engine's mutable request object can be passed as is when its attribute names match, or
wrapped in a small proxy. :class:`Request`, :class:`ScheduledRequest` and
:class:`SchedulerOutput` are plain dataclasses for tests, the simulator and adapters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Request", "RequestLike", "ScheduledRequest", "SchedulerOutput"]


@runtime_checkable
class RequestLike(Protocol):
    """What the scheduler reads of a request.

    Attributes:
        request_id: unique id of the request.
        num_tokens: prompt plus output tokens so far.
        num_prompt_tokens: prompt tokens.
        num_computed_tokens: tokens whose KV the engine has computed (or loaded).
        block_hashes: ``block_hashes[i]`` identifies tokens ``[0, (i+1) * tokens_per_hash)``.
        kv_transfer_params: per-request connector parameters (``max_load_tokens``,
            ``max_offload_tokens``), or None.
        skip_reading_prefix_cache: never load for this request (lookups answer 0).
        is_aborted: the request was aborted (only its computed tokens may be stored).
    """

    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...
    @property
    def skip_reading_prefix_cache(self) -> bool: ...
    @property
    def is_aborted(self) -> bool: ...


@dataclass(slots=True)
class Request:
    """A concrete, mutable :class:`RequestLike`."""

    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv_transfer_params: Mapping[str, Any] | None = None
    skip_reading_prefix_cache: bool = False
    is_aborted: bool = False


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request scheduled in a step.

    Attributes:
        req_id: the request id.
        new_block_ids: per KV-cache group, the GPU block ids newly given to the request in
            this step (appended to what it held; the full list when resumed).
        num_scheduled_tokens: tokens computed for it in this step.
        resumed_from_preemption: it was preempted earlier and starts from a fresh allocation;
            ``new_block_ids`` then holds its complete block lists.
    """

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...]
    num_scheduled_tokens: int
    resumed_from_preemption: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What the engine scheduled in one step.

    Attributes:
        scheduled: the requests that compute in this step, new ones first.
        new_req_ids: which of them are scheduled for the first time.
        finished_req_ids: requests that finished (or were aborted) since the last step.
        preempted_req_ids: requests preempted in this step (their blocks were freed).
        extra_allocated_block_ids: other blocks handed out this step (copy destinations).
    """

    scheduled: Sequence[ScheduledRequest] = ()
    new_req_ids: frozenset[str] = frozenset()
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    extra_allocated_block_ids: frozenset[int] = frozenset()

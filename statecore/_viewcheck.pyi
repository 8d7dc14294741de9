"""The accepting half of the step views' checks at C speed (:mod:`statecore.views`), and of
the block lists of :meth:`~statecore.OffloadingScheduler.update_state_after_alloc`.

Each view function returns ``True`` after storing the normalised fields on ``self`` exactly as the
Python check would, or ``False``, storing nothing, for any input it does not accept (the
caller's Python check then rules on it and names the fault); ``block_lists`` returns the
normalised lists, or ``None`` likewise."""

from typing import Any

def request(
    self: Any,
    req_id: object,
    new_block_ids: object,
    num_scheduled_tokens: object,
    resumed_from_preemption: object,
    /,
) -> bool:
    """:class:`~statecore.views.ScheduledRequest`'s check."""

def columns(
    self: Any,
    req_ids: object,
    new_block_ids: object,
    num_scheduled_tokens: object,
    resumed_req_ids: object,
    /,
) -> bool:
    """:class:`~statecore.views.ScheduledColumns`' check."""

def output(
    self: Any,
    scheduled: object,
    new_req_ids: object,
    finished_req_ids: object,
    preempted_req_ids: object,
    extra_allocated_block_ids: object,
    columns: object,
    entry_type: type,
    columns_type: type,
    /,
) -> bool:
    """:class:`~statecore.views.SchedulerOutput`'s check."""

def block_lists(block_ids: object, n_groups: object, /) -> tuple[tuple[int, ...], ...] | None:
    """:meth:`~statecore.OffloadingScheduler.update_state_after_alloc`'s block lists as a
    tuple of tuples, or ``None`` for anything not accepted here."""

"""The step views' diagnosis: which field of a malformed view is bad, and why.

A view (:mod:`statecore.views`) accepts a well-formed step on its fast path; whatever that
declines it hands to the functions here, which raise the typed error naming the field (or
normalise the fields, when they turn out acceptable). They sit below both the views and the
validation layer (they import only :mod:`statecore._argerrors` and the errors), so that the
views can call them without importing :mod:`statecore.validate` at call time;
:mod:`statecore.validate` re-exports them with its own sequence and id checks, which live
here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from statecore import _argerrors

__all__ = [
    "id_set",
    "int_list",
    "is_seq",
    "scheduled_columns",
    "scheduled_request",
    "scheduler_output_fields",
]

Where = Callable[[object], tuple[str | None, str | None]]
"""Given a request id, the (entity, state) an error should name (computed on error only)."""

_fail = _argerrors.fail
_nowhere = _argerrors.nowhere

SEQ = (list, tuple)
SETS = (set, frozenset)
INT_VALUE: Any = int.__index__
"""An id as the exact int it equals: raises TypeError for anything that is not an int (or
an int subclass such as bool), and ignores a subclass's own comparison operators."""


def is_seq(value: object) -> bool:
    return type(value) in SEQ or (
        isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)
    )


def int_list(ids: Any, call: str, argument: str, where: Where, req_id: object, what: str) -> None:
    """A sequence of ints >= 0 (GPU block ids, slots)."""
    if not is_seq(ids):
        _fail(call, argument, ids, f"a sequence of {what} (ints >= 0)", where, req_id)
    seq: Sequence[Any] = ids
    if not seq:
        return
    try:  # fast path, C speed: a float makes the sum a float; None/str raise
        if min(map(INT_VALUE, seq)) >= 0:
            return
    except TypeError:
        pass
    for i, b in enumerate(seq):
        if type(b) is not int or b < 0:
            _fail(call, f"{argument}[{i}]", b, f"a {what} (int >= 0)", where, req_id)


def id_set(value: Any, call: str, argument: str, kind: type, what: str) -> None:
    if type(value) not in SETS and not isinstance(value, AbstractSet):
        _fail(call, argument, value, f"a set of {what}")
    for v in value:
        ok = isinstance(v, int) and INT_VALUE(v) >= 0 if kind is int else isinstance(v, str)
        if not ok:
            _fail(call, f"{argument} item", v, what)


def scheduled_request(s: Any, call: str) -> None:
    """Diagnose a :class:`~statecore.views.ScheduledRequest` built with a malformed field
    (raises naming it); when every field is acceptable, store the block lists as tuples."""
    rid = s.req_id
    if not isinstance(rid, str):
        _fail(call, "req_id", rid, "a str")
    ids = s.new_block_ids
    if not is_seq(ids):
        _fail(call, "new_block_ids", ids, "a sequence of block-id sequences, one per group")
    for g, group in enumerate(ids):
        int_list(group, call, f"new_block_ids[{g}]", _nowhere, rid, "GPU block id")
    n = s.num_scheduled_tokens
    if type(n) is not int or n < 0:
        _fail(call, "num_scheduled_tokens", n, "an int >= 0")
    if type(s.resumed_from_preemption) is not bool:
        _fail(call, "resumed_from_preemption", s.resumed_from_preemption, "a bool")
    object.__setattr__(s, "new_block_ids", tuple(tuple(group) for group in ids))


def scheduled_columns(c: Any, call: str) -> None:
    """Diagnose a :class:`~statecore.views.ScheduledColumns` built with a malformed field
    (raises naming it and the entry); when every field is acceptable, normalise it as its
    fast path does."""
    rids = c.req_ids
    blocks = c.new_block_ids
    counts = c.num_scheduled_tokens
    columns = (("req_ids", rids), ("new_block_ids", blocks), ("num_scheduled_tokens", counts))
    for name, col in columns:
        if not is_seq(col):
            _fail(call, name, col, "a sequence, one item per scheduled request")
    if not len(rids) == len(blocks) == len(counts):
        _fail(
            call,
            "columns",
            (len(rids), len(blocks), len(counts)),
            "req_ids, new_block_ids and num_scheduled_tokens of one length",
        )
    for i, rid in enumerate(rids):
        if not isinstance(rid, str):
            _fail(call, f"req_ids[{i}]", rid, "a str")
    for i, n in enumerate(counts):
        if type(n) is not int or n < 0:
            _fail(call, f"num_scheduled_tokens[{i}]", n, "an int >= 0", _nowhere, rids[i])
    out: list[Any] = []
    group_counts: set[int] = set()
    for i, ids in enumerate(blocks):
        if ids is None:
            out.append(None)
            continue
        if not is_seq(ids):
            _fail(
                call,
                f"new_block_ids[{i}]",
                ids,
                "None or a sequence of block-id sequences, one per group",
                _nowhere,
                rids[i],
            )
        for g, group in enumerate(ids):
            int_list(group, call, f"new_block_ids[{i}][{g}]", _nowhere, rids[i], "GPU block id")
        group_counts.add(len(ids))
        out.append(tuple(tuple(group) for group in ids))
    id_set(c.resumed_req_ids, call, "resumed_req_ids", str, "request ids (str)")
    object.__setattr__(c, "req_ids", tuple(rids))
    object.__setattr__(c, "new_block_ids", tuple(out))
    object.__setattr__(c, "num_scheduled_tokens", tuple(counts))
    object.__setattr__(c, "resumed_req_ids", frozenset(c.resumed_req_ids))
    object.__setattr__(c, "group_counts", frozenset(group_counts))


def scheduler_output_fields(output: Any, entry_type: type[Any], columns_type: type[Any]) -> None:
    """Diagnose a :class:`~statecore.views.SchedulerOutput` built with a malformed field
    (raises naming it); when every field is acceptable, normalise it (tuple of entries, the
    per-entry group counts). ``entry_type`` and ``columns_type`` are the views'
    :class:`~statecore.views.ScheduledRequest` and :class:`~statecore.views.ScheduledColumns`
    (passed in: this module sits below the views)."""
    call = "SchedulerOutput"
    scheduled = output.scheduled
    if not is_seq(scheduled):
        _fail(call, "scheduled", scheduled, "a sequence of ScheduledRequest")
    for i, s in enumerate(scheduled):
        if type(s) is not entry_type:
            _fail(call, f"scheduled[{i}]", s, "a ScheduledRequest")
    for name in ("new_req_ids", "finished_req_ids", "preempted_req_ids"):
        id_set(getattr(output, name), call, name, str, "request ids (str)")
    id_set(
        output.extra_allocated_block_ids,
        call,
        "extra_allocated_block_ids",
        int,
        "GPU block ids (ints >= 0)",
    )
    columns = output.columns
    if columns is not None and type(columns) is not columns_type:
        _fail(call, "columns", columns, "None or a ScheduledColumns")
    object.__setattr__(output, "scheduled", tuple(scheduled))
    counts = {len(s.new_block_ids) for s in output.scheduled}
    if columns is not None:
        counts.update(columns.group_counts)
    object.__setattr__(output, "group_counts", frozenset(counts))

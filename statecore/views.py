"""The small typed views the scheduler reads: requests and per-step scheduler output.

An engine adapts its own objects to these with a thin layer. :class:`RequestLike` is a
protocol read live (the scheduler keeps the object and reads its attributes when it needs them),
so an engine's mutable request object can be passed as is when its attribute names match, or
wrapped in a small proxy; each hook checks the fields it reads. After ``request_finished``
the scheduler keeps a copy of the fields instead (unless a load of the request is in flight),
so the engine's object is freed when the engine drops it. :class:`Request` is a plain
dataclass for tests, the simulator and adapters.

:class:`ScheduledRequest` and :class:`SchedulerOutput` are frozen and validated when they are
built (the boundary where an engine's step enters statecore): a malformed field raises
:class:`~statecore.errors.InvalidMetadataError` naming it, and the per-group block lists are
stored as tuples, so a built output cannot be changed afterwards. ``build_connector_meta``
then only checks what depends on the scheduler's configuration (the number of KV-cache
groups), before applying any entry.

Where the optional C extension ``statecore._viewcheck`` is built (the editable install and
the wheel build it; :func:`view_checks_impl` says whether it is), a view's check first asks
it: it accepts the plain forms an engine adapter hands over (exact lists, tuples, sets, str
and int, ints >= 0, None for an absent block entry) and stores the normalised fields exactly
as the Python check would; anything else it leaves to the Python check, which accepts what it
accepts and names the fault of what it refuses. The same inputs are accepted and refused, with
the same errors, with or without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, filterfalse
from typing import Any, Protocol, runtime_checkable

from statecore import _viewerrors

__all__ = [
    "Request",
    "RequestLike",
    "ScheduledColumns",
    "ScheduledRequest",
    "SchedulerOutput",
    "view_checks_impl",
]


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


_native_request: Callable[[ScheduledRequest, Any, Any, Any, Any], bool] | None
_native_columns: Callable[[ScheduledColumns, Any, Any, Any, Any], bool] | None
_native_output: Callable[..., bool] | None
try:  # the accepting half of the checks below, at C speed (optional: built by the install)
    from statecore._viewcheck import columns as _native_columns
    from statecore._viewcheck import output as _native_output
    from statecore._viewcheck import request as _native_request
except ImportError:  # pragma: no cover - the extension is optional (no compiler at install)
    _native_request = _native_columns = _native_output = None


def view_checks_impl() -> str:
    """``"native"`` when the views' checks accept well-formed steps in C (the optional
    ``statecore._viewcheck`` extension is built), ``"python"`` otherwise. Either way the same
    inputs are accepted, normalised the same way and refused with the same errors: the C
    check only accepts, and whatever it does not accept the Python check rules on."""
    if _native_request is None or _native_columns is None or _native_output is None:
        return "python"
    return "native"


_SEQ = (list, tuple)
_NO_NEW_BLOCK = ((),)
_SETS = (frozenset, set)
_STR = {str}
_INT = {int}
_NONE_ID = {id(None)}
_INT_VALUE: Any = int.__index__
"""An id as the exact int it equals: raises TypeError for anything that is not an int (or
an int subclass such as bool), and ignores a subclass's own comparison operators."""


def _ids_ok(ids: Any) -> bool:
    """A list/tuple of ints >= 0 (C-speed check: a float turns the sum into a float)."""
    if type(ids) not in _SEQ:
        return False
    if not ids:
        return True
    try:
        return bool(min(map(_INT_VALUE, ids)) >= 0)
    except TypeError:
        return False


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request scheduled in a step.

    Attributes:
        req_id: the request id.
        new_block_ids: per KV-cache group, the GPU block ids given to the request since it was
            last scheduled, appended to what it held. The first scheduling after an allocation
            (:meth:`~statecore.OffloadingScheduler.update_state_after_alloc`) may instead repeat
            the complete lists, as vLLM does for new and resumed requests: both forms work.
            Stored as a tuple of tuples.
        num_scheduled_tokens: tokens computed for it in this step.
        resumed_from_preemption: it was preempted earlier and starts from a fresh allocation;
            ``new_block_ids`` then holds its complete block lists.

    Raises :class:`~statecore.errors.InvalidMetadataError` when built with a malformed field.
    """

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...]
    num_scheduled_tokens: int
    resumed_from_preemption: bool = False

    def __post_init__(self) -> None:
        # Happy path, no call per group: a tuple of tuples of ints >= 0 (the sum of ints is an
        # int: a float, None or a str makes it something else or raises, diagnosed below).
        ids: Any = self.new_block_ids
        n = self.num_scheduled_tokens
        native = _native_request
        if native is not None and native(self, self.req_id, ids, n, self.resumed_from_preemption):
            return
        if (
            type(self.req_id) is str
            and type(n) is int
            and n >= 0
            and type(self.resumed_from_preemption) is bool
        ):
            if type(ids) is tuple:
                if ids == _NO_NEW_BLOCK:  # most entries: a decode step, one group, no block
                    return
                try:
                    for group in ids:
                        if type(group) is not tuple or (group and min(map(_INT_VALUE, group)) < 0):
                            break
                    else:
                        return
                except TypeError:
                    pass
            if type(ids) in _SEQ:  # lists (vLLM's form): check, then store as tuples
                if len(ids) == 1:  # one group: no per-group call
                    g = ids[0]
                    if type(g) is list:
                        g = tuple(g)
                    try:
                        if type(g) is tuple and (not g or min(map(_INT_VALUE, g)) >= 0):
                            object.__setattr__(self, "new_block_ids", (g,))
                            return
                    except TypeError:
                        pass
                else:
                    groups = tuple(g if type(g) is tuple else tuple(g) for g in ids if _ids_ok(g))
                    if len(groups) == len(ids):
                        object.__setattr__(self, "new_block_ids", groups)
                        return
        _viewerrors.scheduled_request(self, "ScheduledRequest")


@dataclass(frozen=True, slots=True)
class ScheduledColumns:
    """Requests scheduled in a step, in columnar form: the bulk counterpart of a tuple of
    :class:`ScheduledRequest`, for the running requests of a large decode batch.

    Entry ``i`` means ``ScheduledRequest(req_ids[i], new_block_ids[i], num_scheduled_tokens[i],
    req_ids[i] in resumed_req_ids)``, where a ``new_block_ids[i]`` of None means no new blocks
    in any group. An engine adapter builds it from the engine's own columnar step output
    (vLLM's ``CachedRequestData``), so that an entry that carries nothing (a decode token) is
    not an object of its own. It is validated in bulk when built, as strictly as the
    per-entry form (the columns' types at C speed; only entries with new blocks are looked
    at one by one); the lists with new blocks are stored as tuples of tuples.

    Attributes:
        req_ids: the request ids.
        new_block_ids: per entry, None or per KV-cache group the GPU block ids given since the
            request was last scheduled (its complete lists when it resumed or was just
            allocated, as for :class:`ScheduledRequest`).
        num_scheduled_tokens: per entry, the tokens computed for it in this step.
        resumed_req_ids: the entries that resumed from preemption.

    Raises :class:`~statecore.errors.InvalidMetadataError` when built with a malformed field
    (columns of different lengths, an id that is not a str, a count that is not an int >= 0,
    a block list that is not a sequence of ints >= 0).
    """

    req_ids: Sequence[str]
    new_block_ids: Sequence[Sequence[Sequence[int]] | None]
    num_scheduled_tokens: Sequence[int]
    resumed_req_ids: frozenset[str] = frozenset()
    group_counts: frozenset[int] = field(default=frozenset(), init=False, compare=False)
    """How many block lists the entries with new blocks carry; computed."""

    def __post_init__(self) -> None:
        rids: Any = self.req_ids
        blocks: Any = self.new_block_ids
        counts: Any = self.num_scheduled_tokens
        resumed: Any = self.resumed_req_ids
        native = _native_columns
        if native is not None and native(self, rids, blocks, counts, resumed):
            return
        if (
            type(rids) in _SEQ
            and type(blocks) in _SEQ
            and type(counts) in _SEQ
            and len(blocks) == len(rids) == len(counts)
            and type(resumed) in _SETS
            and (not counts or (set(map(type, counts)) == _INT and min(counts) >= 0))
        ):
            try:  # ids: str or str subclasses (as the diagnosis accepts), at C speed
                "".join(rids)
                "".join(resumed)
            except TypeError:
                norm = None
            else:
                norm = _columns_blocks(blocks)
            if norm is not None:
                out, group_counts = norm
                setattr_ = object.__setattr__
                setattr_(self, "req_ids", tuple(rids))
                setattr_(self, "new_block_ids", out)
                setattr_(self, "num_scheduled_tokens", tuple(counts))
                setattr_(self, "resumed_req_ids", frozenset(resumed))  # (no copy if frozen)
                setattr_(self, "group_counts", group_counts)
                return
        _viewerrors.scheduled_columns(self, "ScheduledColumns")


def _columns_blocks(
    blocks: Sequence[Any],
) -> tuple[tuple[tuple[tuple[int, ...], ...] | None, ...], frozenset[int]] | None:
    """The block column with every present entry as a tuple of tuples and every absent one as
    None, and its group counts; None when an entry is malformed (the caller diagnoses).

    No call per absent entry (most entries of a decode batch): the present entries are the
    truthy ones (``compress``) and every other one must be None itself (the set of the false
    ones' ids is ``{id(None)}``); when it is not (an empty or false entry) or a test raises,
    every entry is looked at, and anything but None and a sequence of groups is refused. A
    one-group entry costs no call per group."""
    n = len(blocks)
    try:
        present = list(compress(range(n), blocks))
        # every false entry is None itself (by identity: an object equal to None and hashed
        # as None is not None); else an empty or falsy entry
        bulk = set(map(id, filterfalse(None, blocks))) <= _NONE_ID
    except Exception:  # an entry whose truth test or hash raises (an array, a list)
        bulk = False
    if not bulk:  # the entry-by-entry path
        present = [i for i in range(n) if blocks[i] is not None]
    out: list[Any] = [None] * n
    counts: set[int] = set()
    try:
        for i in present:
            ids = blocks[i]
            if type(ids) not in _SEQ:
                return None
            if len(ids) == 1:
                g = ids[0]
                if type(g) is list:
                    g = tuple(g)
                if type(g) is not tuple or (g and min(map(_INT_VALUE, g)) < 0):
                    return None
                out[i] = (g,)
                counts.add(1)
                continue
            for group in ids:
                if not _ids_ok(group):
                    return None
            counts.add(len(ids))
            out[i] = tuple(g if type(g) is tuple else tuple(g) for g in ids)
    except TypeError:  # a block id that is not a number (None, a str)
        return None
    return tuple(out), frozenset(counts)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What the engine scheduled in one step.

    Attributes:
        scheduled: the requests that compute in this step, new ones first (stored as a tuple).
        new_req_ids: which of them are scheduled for the first time.
        finished_req_ids: requests that finished (or were aborted) since the last step.
        preempted_req_ids: requests preempted in this step (their blocks were freed).
        extra_allocated_block_ids: other blocks handed out this step (copy destinations).
        columns: more scheduled requests in columnar form (:class:`ScheduledColumns`),
            applied after ``scheduled``; None when every entry is in ``scheduled``.

    Raises :class:`~statecore.errors.InvalidMetadataError` when built with a malformed field
    (an entry that is not a :class:`ScheduledRequest`, an id set that is not a set of str, a
    block id that is not an int >= 0).
    """

    scheduled: Sequence[ScheduledRequest] = ()
    new_req_ids: frozenset[str] = frozenset()
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    extra_allocated_block_ids: frozenset[int] = frozenset()
    columns: ScheduledColumns | None = None
    group_counts: frozenset[int] = field(default=frozenset(), init=False, compare=False)
    """How many block lists the entries carry (one value when they agree); computed."""

    def __post_init__(self) -> None:
        # Happy path, in this frame: the sets' types, their items at C speed (``join`` raises
        # on an id that is not a str; a sum of ints is an int), then the entries' group counts
        # (each entry checked its own fields when it was built)
        scheduled: Any = self.scheduled
        native = _native_output
        if native is not None and native(
            self,
            scheduled,
            self.new_req_ids,
            self.finished_req_ids,
            self.preempted_req_ids,
            self.extra_allocated_block_ids,
            self.columns,
            ScheduledRequest,
            ScheduledColumns,
        ):
            return
        if type(scheduled) is list:
            scheduled = tuple(scheduled)
            object.__setattr__(self, "scheduled", scheduled)
        new: Any = self.new_req_ids
        finished: Any = self.finished_req_ids
        preempted: Any = self.preempted_req_ids
        extra: Any = self.extra_allocated_block_ids
        columns = self.columns
        if (
            type(scheduled) is tuple
            and type(new) in _SETS
            and type(finished) in _SETS
            and type(preempted) in _SETS
            and type(extra) in _SETS
            and (columns is None or type(columns) is ScheduledColumns)
        ):
            try:
                "".join(chain(new, finished, preempted))
                ok = not extra or min(map(_INT_VALUE, extra)) >= 0
            except TypeError:
                ok = False
            if ok:
                entry = ScheduledRequest  # -1: an entry that is not a ScheduledRequest
                counts = {len(s.new_block_ids) if type(s) is entry else -1 for s in scheduled}
                if -1 not in counts:
                    if columns is not None:
                        counts.update(columns.group_counts)
                    object.__setattr__(self, "group_counts", frozenset(counts))
                    return
        _viewerrors.scheduler_output_fields(self, ScheduledRequest, ScheduledColumns)

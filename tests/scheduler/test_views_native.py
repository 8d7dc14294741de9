"""The views' C accepting checks (``statecore._viewcheck``) against the pure-Python path.

The design rule: the C functions only ever *accept*, and only what the Python path accepts,
storing the very fields it would store; whatever they do not accept (they return False and
store nothing) the Python path rules on. These tests hold them to it:

* a differential test builds each view from generated fields, adversarial ones included
  (subclasses of int/str/tuple/list, bools, floats and NaN, huge and negative ints, NumPy
  integers, objects posing as None, values whose truth test, comparison or hash raises),
  once as installed and once by the Python path alone: the same outcome (the same typed error
  and message, or identical fields: same types, same items);
* the C functions called directly: when one accepts, the Python path accepts the same fields
  and stores the same normalised values; when it declines, it has stored nothing; on plain,
  well-formed fields (the forms engine adapters hand over) it accepts, so it is the path
  actually taken;
* references: no input object's reference count moves over repeated accepted and declined
  calls (no leak, no early release);
* a list changed by a finalizer while the check allocates: what is accepted is what was
  checked.

The garbage fuzzer, the bad-inputs table and the columns tests run with both paths through
the ``view_checks`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_build import can_build_extensions

import statecore.scheduler.planning as planning
import statecore.views as views
from statecore import InvalidMetadataError
from statecore.views import ScheduledColumns, ScheduledRequest, SchedulerOutput

needs_native = pytest.mark.skipif(
    views.view_checks_impl() != "native",
    reason="statecore._viewcheck is not built (no C compiler at install)",
)

if views.view_checks_impl() == "native":
    from statecore import _viewcheck as native
else:  # pragma: no cover - the tests that call it are skipped
    native = None

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a test dependency
    np = None


def _examples() -> int:
    return 3000 if settings.get_current_profile_name() == "fuzz" else 300


SETTINGS = settings(
    max_examples=_examples(),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- adversarial values ----------------------------------------------------------------------


class IntSub(int):
    """An int subclass (the Python path's sum accepts it as a block id, not as a count)."""


class NegPoser(int):
    """An int subclass that is negative but compares as if it were not."""

    def __ge__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return False


class StrSub(str):
    """A str subclass: an id for the Python path (``join`` and isinstance accept it)."""


class TupleSub(tuple):  # type: ignore[type-arg]
    """A tuple subclass."""


class ListSub(list):  # type: ignore[type-arg]
    """A list subclass."""


class NonePoser:
    """False, equal to None and hashed as None: an absent entry in disguise."""

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return other is None

    def __hash__(self) -> int:
        return hash(None)


class Raising:
    """Its truth test, comparisons and length raise (as an array's do); hashable."""

    def __bool__(self) -> bool:
        raise ValueError("truth")

    def __eq__(self, other: object) -> bool:
        raise ValueError("eq")

    def __lt__(self, other: object) -> bool:
        raise ValueError("lt")

    def __len__(self) -> int:
        raise ValueError("len")

    __hash__ = object.__hash__


class RaisingHash:
    """Its hash raises (it cannot be put in a set)."""

    def __hash__(self) -> int:
        raise ValueError("hash")


class Adder:
    """Not a number, but sums to one and compares as one (posing as a block id)."""

    def __radd__(self, other: object) -> int:
        return 1

    def __ge__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return False


NONE_POSER = NonePoser()
RAISING = Raising()

_odd_ints: list[Any] = [
    True,
    False,
    IntSub(3),
    NegPoser(-2),
    -1,
    -(2**70),
    2**64,
    2**70,
    1.0,
    math.nan,
    math.inf,
    None,
    NONE_POSER,
    "3",
    StrSub("3"),
    b"3",
    RAISING,
    Adder(),
]
if np is not None:
    _odd_ints += [np.int64(3), np.uint8(1), np.int32(-1)]


def pick(values: list[Any]) -> st.SearchStrategy[Any]:
    """One of ``values``, drawn by index (Hypothesis never compares or hashes the values:
    some of them raise when it does)."""
    return st.integers(0, len(values) - 1).map(values.__getitem__)


GOOD_INT = st.one_of(st.integers(0, 300), st.integers(0, 2**80))
ODD_INT = pick(_odd_ints)
INT = st.one_of(GOOD_INT, GOOD_INT, GOOD_INT, ODD_INT)

GOOD_ID = st.text("abcxyz0123", min_size=1, max_size=4)
ODD_ID = st.one_of(
    GOOD_ID.map(StrSub),
    pick([None, 5, True, b"id", 1.5, NONE_POSER, RAISING, ("a",)]),
)
ID = st.one_of(GOOD_ID, GOOD_ID, GOOD_ID, ODD_ID)
HASHABLE_ID = ID.filter(lambda x: not isinstance(x, RaisingHash))


def _seq(elems: st.SearchStrategy[Any], max_size: int = 4, odd: bool = True) -> Any:
    """A list or a tuple of ``elems`` (sometimes a subclass of either, or a range)."""
    lists = st.lists(elems, max_size=max_size)
    kinds: list[Callable[[list[Any]], Any]] = [list, tuple, list, tuple]
    if odd:
        kinds += [TupleSub, ListSub]
    return st.tuples(lists, st.sampled_from(kinds)).map(lambda p: p[1](p[0]))


GROUP = st.one_of(_seq(INT), _seq(GOOD_INT), _seq(GOOD_INT, odd=False), pick([range(3), None, 7]))
ENTRY = st.one_of(
    _seq(GROUP, max_size=3),
    _seq(_seq(GOOD_INT, odd=False), max_size=3, odd=False),
    pick([None, None, None, NONE_POSER, RAISING, (), [], 0, "", b"", RaisingHash()]),
)
SET_KINDS = st.sampled_from([frozenset, set, frozenset, list, tuple])


def _a_set(elems: st.SearchStrategy[Any]) -> Any:
    return st.tuples(st.lists(elems, max_size=3), SET_KINDS).map(lambda p: p[1](p[0]))


# -- comparing results -----------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Identical normalised values: the same container types all the way down, the same
    items (the very same objects, or equal exact ints)."""
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) in (frozenset, set):
        return {id(x) for x in a} == {id(y) for y in b} or (
            all(type(x) is int for x in a) and a == b
        )
    return a is b or (type(a) is int and a == b)


_FIELDS = {
    ScheduledRequest: (
        "req_id",
        "new_block_ids",
        "num_scheduled_tokens",
        "resumed_from_preemption",
    ),
    ScheduledColumns: (
        "req_ids",
        "new_block_ids",
        "num_scheduled_tokens",
        "resumed_req_ids",
        "group_counts",
    ),
    SchedulerOutput: (
        "scheduled",
        "new_req_ids",
        "finished_req_ids",
        "preempted_req_ids",
        "extra_allocated_block_ids",
        "columns",
        "group_counts",
    ),
}


@contextmanager
def python_only() -> Iterator[None]:
    """The views checked by the pure-Python path alone."""
    names = ("_native_request", "_native_columns", "_native_output")
    saved = [getattr(views, n) for n in names]
    saved_lists = planning._native_block_lists
    for n in names:
        setattr(views, n, None)
    planning._native_block_lists = None
    try:
        yield
    finally:
        for n, v in zip(names, saved, strict=True):
            setattr(views, n, v)
        planning._native_block_lists = saved_lists


def outcome(build: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", fields)`` or ``("raised", (type, message))``."""
    try:
        obj = build()
    except Exception as exc:  # compared between the two paths, whatever it is
        return "raised", (type(exc), str(exc))
    return "ok", tuple(getattr(obj, f) for f in _FIELDS[type(obj)])


def assert_same_outcome(build: Callable[[], Any]) -> tuple[str, Any]:
    with python_only():
        want = outcome(build)
    got = outcome(build)
    assert got[0] == want[0], (got, want)
    if got[0] == "raised":
        assert got[1] == want[1]
    else:
        assert all(same(x, y) for x, y in zip(got[1], want[1], strict=True)), (got, want)
    return got


def bare(cls: type, **fields: Any) -> Any:
    """An instance with its fields set as given and no check run (for the C calls)."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def direct(cls: type, call: Callable[..., bool], args: tuple[Any, ...], **fields: Any) -> None:
    """Call the C check on a bare instance: if it accepts, the Python path accepts the same
    fields and stores the same values; if it declines, nothing was stored."""
    obj = bare(cls, **fields)
    accepted = call(obj, *args)
    if not accepted:
        for name, value in fields.items():
            assert getattr(obj, name) is value, name
        if cls is ScheduledColumns:
            with pytest.raises(AttributeError):
                _ = obj.group_counts
        return
    with python_only():
        ref = cls(**fields)
    for name in _FIELDS[cls]:
        assert same(getattr(obj, name), getattr(ref, name)), name


# -- the differential tests ------------------------------------------------------------------


@needs_native
@SETTINGS
@given(rid=ID, ids=st.one_of(ENTRY, _seq(GROUP)), n=INT, resumed=pick([False, True, 1, None]))
def test_scheduled_request_both_paths_agree(rid: Any, ids: Any, n: Any, resumed: Any) -> None:
    assert_same_outcome(lambda: ScheduledRequest(rid, ids, n, resumed))
    direct(
        ScheduledRequest,
        native.request,
        (rid, ids, n, resumed),
        req_id=rid,
        new_block_ids=ids,
        num_scheduled_tokens=n,
        resumed_from_preemption=resumed,
    )


@st.composite
def columns_fields(draw: st.DrawFn) -> tuple[Any, Any, Any, Any]:
    n = draw(st.integers(0, 6))
    rids = draw(st.lists(ID, min_size=n, max_size=n))
    blocks = draw(st.lists(st.one_of(st.none(), ENTRY), min_size=n, max_size=n))
    counts = draw(st.lists(INT, min_size=n, max_size=n))
    if draw(st.integers(0, 9)) == 0:  # a column of another length
        draw(pick([rids, blocks, counts])).append(None)
    kinds = st.sampled_from([list, tuple, list, tuple, ListSub, TupleSub])
    rids, blocks, counts = (draw(kinds)(c) for c in (rids, blocks, counts))
    if draw(st.integers(0, 19)) == 0:
        blocks = draw(pick([None, "ab", range(n), {None}]))
    hashable = [r for r in rids if not isinstance(r, RaisingHash)]
    resumed_ids = draw(st.lists(pick(hashable), max_size=2)) if hashable else []
    if draw(st.booleans()):
        resumed_ids += draw(st.lists(HASHABLE_ID, max_size=1))
    resumed = draw(SET_KINDS)(resumed_ids)
    return rids, blocks, counts, resumed


@needs_native
@SETTINGS
@given(fields=columns_fields())
def test_scheduled_columns_both_paths_agree(fields: tuple[Any, Any, Any, Any]) -> None:
    rids, blocks, counts, resumed = fields
    assert_same_outcome(lambda: ScheduledColumns(rids, blocks, counts, resumed))
    direct(
        ScheduledColumns,
        native.columns,
        fields,
        req_ids=rids,
        new_block_ids=blocks,
        num_scheduled_tokens=counts,
        resumed_req_ids=resumed,
    )


class EntrySub(ScheduledRequest):
    """A subclass of the entry type (not a ScheduledRequest for the output's check)."""

    __slots__ = ()


class ColumnsSub(ScheduledColumns):
    """A subclass of the columns type (refused as the output's columns)."""

    __slots__ = ()


@st.composite
def output_fields(draw: st.DrawFn) -> dict[str, Any]:
    entries: list[Any] = []
    for _ in range(draw(st.integers(0, 4))):
        groups = draw(st.lists(st.lists(GOOD_INT, max_size=3), max_size=3))
        rid = draw(GOOD_ID)
        kind = draw(st.integers(0, 9))
        if kind == 0:
            entries.append(EntrySub(rid, groups, 1))
        elif kind == 1:
            entries.append(draw(pick([None, "e", (rid, groups, 1), RAISING])))
        elif kind == 2:  # fields changed after the check (a list, not a tuple, of groups)
            e = ScheduledRequest(rid, groups, 1)
            object.__setattr__(e, "new_block_ids", draw(pick([list(groups), 5])))
            entries.append(e)
        else:
            entries.append(ScheduledRequest(rid, groups, 1))
    scheduled = draw(st.sampled_from([list, tuple, list, TupleSub, ListSub]))(entries)
    columns: Any = None
    kind = draw(st.integers(0, 9))
    if kind < 4:
        columns = ScheduledColumns(["c"], [draw(pick([None, ([1],), ([1], [2])]))], [1])
    elif kind == 4:
        columns = draw(pick([ColumnsSub(["c"], [None], [1]), "c", [("c", None, 1)]]))
    elif kind == 5:
        columns = ScheduledColumns(["c"], [None], [1])
        object.__setattr__(columns, "group_counts", draw(pick([{1}, [2], 2**70])))
    extra = draw(_a_set(st.one_of(GOOD_INT, GOOD_INT, ODD_INT.filter(_hashable))))
    return {
        "scheduled": scheduled,
        "new_req_ids": draw(_a_set(HASHABLE_ID)),
        "finished_req_ids": draw(_a_set(HASHABLE_ID)),
        "preempted_req_ids": draw(_a_set(HASHABLE_ID)),
        "extra_allocated_block_ids": extra,
        "columns": columns,
    }


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except Exception:
        return False
    return True


@needs_native
@SETTINGS
@given(fields=output_fields())
def test_scheduler_output_both_paths_agree(fields: dict[str, Any]) -> None:
    assert_same_outcome(lambda: SchedulerOutput(**fields))
    direct(
        SchedulerOutput,
        native.output,
        (
            fields["scheduled"],
            fields["new_req_ids"],
            fields["finished_req_ids"],
            fields["preempted_req_ids"],
            fields["extra_allocated_block_ids"],
            fields["columns"],
            ScheduledRequest,
            ScheduledColumns,
        ),
        **fields,
    )


# -- the C path is the one taken for well-formed steps ---------------------------------------


@needs_native
@SETTINGS
@given(
    ids=st.one_of(ENTRY, _seq(GROUP), _seq(_seq(GOOD_INT, odd=False), odd=False)),
    n_groups=st.one_of(st.integers(0, 3), pick([True, -1, 2**70])),  # the scheduler: an int
    external=INT,
)
def test_admitted_block_lists_both_paths_agree(ids: Any, n_groups: Any, external: Any) -> None:
    """``update_state_after_alloc``'s block lists: the C check and the Python one accept the
    same lists and return the same tuples; what C declines it declines without a trace."""
    with python_only():
        want = planning.admitted_lists(ids, n_groups, external)
    got = planning.admitted_lists(ids, n_groups, external)
    assert (got is None) == (want is None), (got, want)
    if got is not None:
        assert same(got, want), (got, want)
    fast = native.block_lists(ids, n_groups)
    if fast is not None:
        assert want is not None or not (type(external) is int and external >= 0)
        with python_only():
            ref = planning.admitted_lists(ids, n_groups, 0)
        assert ref is not None and same(fast, ref)


@needs_native
def test_admitted_block_lists_edges() -> None:
    """The plain forms are taken in C; int subclasses, negatives and wrong counts are not."""
    groups = ([1, 2], (3,))
    out = native.block_lists(groups, 2)
    assert out == ((1, 2), (3,)) and out[1] is groups[1]
    assert native.block_lists((), 0) == ()
    normalised = ((1, 2), (3,))
    assert native.block_lists(normalised, 2) is normalised  # nothing to copy
    for bad, n in [
        ([[True]], 1),
        ([[IntSub(1)]], 1),
        ([[-1]], 1),
        ([[1]], 2),
        ([[1]], True),
        ([[1]], -1),
        ([[1]], 2**70),
        (TupleSub(([1],)), 1),
        ([ListSub([1])], 1),
        ([None], 1),
        ("ab", 2),
    ]:
        assert native.block_lists(bad, n) is None, (bad, n)
    # the Python path takes the int subclasses (as the ints they equal), not the negative
    assert planning.admitted_lists([[True, IntSub(2)]], 1, 0) == ((True, 2),)
    assert planning.admitted_lists([[1, NegPoser(-2)]], 1, 0) is None
    with pytest.raises(TypeError, match="2 positional"):
        native.block_lists([[1]])


PLAIN_GROUP = st.tuples(st.lists(GOOD_INT, max_size=4), st.sampled_from([list, tuple])).map(
    lambda p: p[1](p[0])
)
PLAIN_ENTRY = st.tuples(st.lists(PLAIN_GROUP, max_size=3), st.sampled_from([list, tuple])).map(
    lambda p: p[1](p[0])
)


@needs_native
@SETTINGS
@given(
    rids=st.lists(GOOD_ID, max_size=6),
    data=st.data(),
    seq=st.sampled_from([list, tuple]),
    resumed_kind=st.sampled_from([frozenset, set]),
)
def test_plain_well_formed_fields_are_accepted_in_c(
    rids: list[str], data: st.DataObject, seq: Any, resumed_kind: Any
) -> None:
    n = len(rids)
    blocks = data.draw(st.lists(st.one_of(st.none(), PLAIN_ENTRY), min_size=n, max_size=n))
    counts = data.draw(st.lists(GOOD_INT, min_size=n, max_size=n))
    resumed = resumed_kind(rids[:1])
    c = bare(ScheduledColumns)
    assert native.columns(c, seq(rids), seq(blocks), seq(counts), resumed) is True
    entries = []
    for rid, ids in zip(rids, blocks, strict=True):
        ids = () if ids is None else ids
        e = bare(ScheduledRequest, req_id=rid, new_block_ids=ids)
        assert native.request(e, rid, ids, 1, False) is True
        object.__setattr__(e, "num_scheduled_tokens", 1)
        object.__setattr__(e, "resumed_from_preemption", False)
        assert type(e.new_block_ids) is tuple
        assert all(type(g) is tuple for g in e.new_block_ids)
        entries.append(e)
    scheduled = seq(entries)
    out = bare(SchedulerOutput, scheduled=scheduled)
    sets = (frozenset(rids), set(), frozenset(), frozenset(counts))
    assert native.output(out, scheduled, *sets, c, ScheduledRequest, ScheduledColumns)
    assert type(out.scheduled) is tuple and list(out.scheduled) == entries
    assert out.group_counts == {len(e.new_block_ids) for e in entries} | c.group_counts


@needs_native
def test_known_edges_of_the_rule() -> None:
    """What C leaves to Python, and the Python path's verdict on it (both paths agree)."""
    # accepted by Python, declined by C: bools and int subclasses as block ids
    odd = ((True, IntSub(2)),)
    assert assert_same_outcome(lambda: ScheduledRequest("a", odd, 1))[0] == "ok"
    e = bare(ScheduledRequest)
    assert native.request(e, "a", ((True,),), 1, False) is False
    # a str subclass as an id: accepted by both (join and isinstance accept it)
    c = bare(ScheduledColumns)
    assert native.columns(c, [StrSub("a")], [None], [1], frozenset()) is True
    # huge ints are ints >= 0; negative ones of any size are not
    assert native.columns(bare(ScheduledColumns), ["a"], [([2**90],)], [2**70], set()) is True
    assert native.columns(bare(ScheduledColumns), ["a"], [([-(2**90)],)], [1], set()) is False
    with pytest.raises(InvalidMetadataError, match=r"new_block_ids\[0\]\[0\]"):
        ScheduledColumns(["a"], [([-(2**90)],)], [1])
    # an object posing as None goes to the Python path (which refuses it)
    assert native.columns(bare(ScheduledColumns), ["a"], [NONE_POSER], [1], set()) is False
    # a count that is a bool is not an int (both paths refuse it)
    assert native.columns(bare(ScheduledColumns), ["a"], [None], [True], set()) is False
    with pytest.raises(InvalidMetadataError, match=r"num_scheduled_tokens\[0\]"):
        ScheduledColumns(["a"], [None], [True])
    # the group counts beyond 63 groups (the C bit mask's end) are counted too
    wide = ScheduledColumns(["a", "b"], [((1,),) * 70, ((2,),)], [1, 1])
    assert wide.group_counts == frozenset({70, 1})
    assert SchedulerOutput(columns=wide).group_counts == frozenset({70, 1})
    with pytest.raises(TypeError, match="5 positional"):
        native.request(e, "a")
    with pytest.raises(TypeError, match="must be types"):
        native.output(bare(SchedulerOutput), (), set(), set(), set(), set(), None, 1, 2)


# -- references and mutation -----------------------------------------------------------------


@needs_native
def test_no_reference_is_leaked_or_lost() -> None:
    group_l = [1, 2, 3]
    group_t = (4, 5)
    entry = (group_l, group_t)
    rids = ["a", "b"]
    blocks = [entry, None]
    counts = [1, 2]
    resumed = {"a"}
    bad_blocks = [entry, NONE_POSER]
    watched = [group_l, group_t, entry, rids, blocks, counts, resumed, bad_blocks, NONE_POSER]
    sched = [ScheduledRequest("x", ((1,),), 1)]
    watched += [sched, sched[0]]
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(200):
        c = bare(ScheduledColumns)
        assert native.columns(c, rids, blocks, counts, resumed)
        assert not native.columns(bare(ScheduledColumns), rids, bad_blocks, counts, resumed)
        assert not native.columns(bare(ScheduledColumns), rids, blocks, [1, -1], resumed)
        r = bare(ScheduledRequest)
        assert native.request(r, "a", entry, 1, False)
        assert not native.request(bare(ScheduledRequest), "a", (group_l, [-1]), 1, False)
        o = bare(SchedulerOutput)
        assert native.output(
            o, sched, set(), set(), set(), set(), c, ScheduledRequest, ScheduledColumns
        )
        assert not native.output(
            bare(SchedulerOutput),
            sched,
            {1},
            set(),
            set(),
            set(),
            c,
            ScheduledRequest,
            ScheduledColumns,
        )
        assert native.block_lists(entry, 2) is not None
        assert native.block_lists(list(entry), 2) is not None
        assert native.block_lists((group_l, [-1]), 2) is None
        assert native.block_lists(entry, 3) is None
        del c, r, o
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before


def _columns_check(victim: list[int]) -> Callable[[], Any]:
    c = bare(ScheduledColumns)
    args = (c, ["a"], [(victim,)], [1], frozenset())
    return lambda: c.new_block_ids[0] if native.columns(*args) else None


def _block_lists_check(victim: list[int]) -> Callable[[], Any]:
    args = ([victim], 1)
    return lambda: native.block_lists(*args)


class _Counted:
    """An object the collector counts when it is allocated (no free list)."""

    __slots__ = ()


@needs_native
@pytest.mark.parametrize("prepare", [_columns_check, _block_lists_check])
def test_a_list_changed_during_the_check_is_not_accepted_unchecked(
    prepare: Callable[[list[int]], Callable[[], Any]],
) -> None:
    """A finalizer run by the collector during the check's allocations makes the groups'
    block ids negative: whatever is accepted was checked after the change (the columns'
    check, and the block lists of ``update_state_after_alloc``).

    With the threshold at 1, a collection starts at the second counted allocation after the
    last one: each check starts one short of it, so its own first counted allocation (the
    25-id list copied into a tuple, too long for CPython's tuple free list) starts one."""
    victims = [list(range(1, 26)) for _ in range(8)]
    kept: list[Any] = []
    armed = [False]
    ran = [0]

    def poison(phase: str, info: dict[str, int]) -> None:
        if armed[0]:
            ran[0] += 1
            for v in victims:
                v[:] = [-1] * len(v)

    threshold = gc.get_threshold()
    gc.callbacks.append(poison)
    try:
        for v in victims:
            check = prepare(v)
            gc.collect()
            gc.set_threshold(1)
            kept.append(_Counted())
            armed[0] = True
            groups = check()
            armed[0] = False
            gc.set_threshold(*threshold)
            kept.append(groups)
            if groups is not None:
                assert all(b >= 0 for g in groups for b in g)
    finally:
        armed[0] = False
        gc.set_threshold(*threshold)
        gc.callbacks.remove(poison)
    assert ran[0] > 0
    assert all(v == [-1] * 25 for v in victims)


@pytest.mark.skipif(
    not can_build_extensions(),
    reason="no C compiler or Python headers: the optional extension cannot have been built",
)
def test_installation_with_a_compiler_built_the_native_view_checks() -> None:
    """Where the extension can be built it must have been: a silent fallback to the Python
    checks would hide a broken build (CI has gcc and the headers, so this always runs there)."""
    assert views.view_checks_impl() == "native"
    assert planning._native_block_lists is not None

"""The CPU tier's key table, :class:`~statecore.managers.keyorder.KeyTable`: the C type
(``statecore._keyorder.KeyTable``) and the dict fallback (``PyKeyTable``) against a plain
``dict`` model.

* a differential test runs generated operation sequences (sets, overwrites of present keys,
  deletes, pops with and without a default, lookups of bytes, of other types and of
  unhashable objects, updates from ``zip``, from a dict and with a bad element, clears,
  pickling, filling well past a small capacity) on each implementation and on a dict: the
  same answers, the same exception types and the same ``items()`` order after every step;
* a key that is not exact bytes or a value that is not an exact int is a TypeError that
  changes nothing; an absent key is a KeyError for ``del``, ``[]`` and ``pop``; lookups
  of anything but exact bytes answer "absent" (after hashing: an unhashable key is a
  TypeError); a change of size during iteration is a RuntimeError, a value replaced is not;
* pickling keeps the order and the capacity; both are ``MutableMapping`` instances;
* no key's or value's reference count moves once it is gone (on both: the dict fallback
  checks the test); the C type's memory: not tracked by the cyclic collector, sized once
  (its size does not move while it fills to its capacity), ints of any size kept exactly;
* the CPU manager keeps its entries in a :class:`KeyTable`.
"""

from __future__ import annotations

import gc
import pickle
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.keyorder import KeyTable, PyKeyTable

NativeKeyTable: Any
try:
    from statecore._keyorder import KeyTable as NativeKeyTable
except ImportError:  # the extension is not built, or was built before it had KeyTable
    NativeKeyTable = None

native = pytest.mark.skipif(
    NativeKeyTable is None,
    reason="statecore._keyorder.KeyTable is not built (no C compiler at install, or a stale build)",
)

IMPLS: list[Any] = [
    pytest.param(PyKeyTable, id="python"),
    pytest.param(NativeKeyTable, marks=native, id="native"),
]


def key(i: int) -> bytes:
    return b"key-%04d" % i


class Bytes(bytes):
    """Equal to (and hashing as) its bytes, but not exact bytes: never a key."""


class Int(int):
    """Equal to its int, but not an exact int: never a value."""


# ---------------------------------------------------------------------------------------
# The differential test
# ---------------------------------------------------------------------------------------

BIG = [(5 << 40) + 7, -((5 << 40) + 7), 1 << 63, -(1 << 63) - 1, 1 << 100, -(1 << 100)]
VALUES = st.one_of(st.integers(-3, 300), st.integers(), st.sampled_from(BIG))
# hashable objects that are not exact bytes and equal no bytes: absent for every operation
ODD_KEYS: st.SearchStrategy[Any] = st.sampled_from(["key-0001", 7, None, (1, 2), 1.5, frozenset()])
# hashing them fails: a TypeError for `in`, `get`
UNHASHABLE = st.sampled_from(["list", "bytearray", "dict"])
BAD_KEYS = st.sampled_from(["key-0001", 7, None, 1.5, "bytearray", "bytes-subclass"])
BAD_VALUES = st.sampled_from([1.5, "1", None, True, "int-subclass", b"1"])


def _unhashable(kind: str, k: bytes) -> Any:
    return {"list": [k], "bytearray": bytearray(k), "dict": {k: 1}}[kind]


def _bad_key(kind: Any, k: bytes) -> Any:
    if kind == "bytearray":
        return bytearray(k)
    if kind == "bytes-subclass":
        return Bytes(k)
    return kind


def _bad_value(kind: Any, v: int) -> Any:
    return Int(v) if kind == "int-subclass" else kind


def _ops(pool: list[bytes]) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    keys = st.sampled_from(pool)
    pairs = st.lists(st.tuples(keys, VALUES), max_size=10)
    return st.lists(
        st.one_of(
            st.tuples(st.just("set"), keys, VALUES),
            st.tuples(st.just("overwrite"), st.integers(0, 30), VALUES),
            st.tuples(st.just("set_bad_key"), BAD_KEYS, keys, VALUES),
            st.tuples(st.just("set_bad_value"), keys, BAD_VALUES, VALUES),
            st.tuples(st.just("getitem"), keys),
            st.tuples(st.just("getitem_odd"), ODD_KEYS),
            st.tuples(st.just("get"), keys, st.sampled_from([None, -1, "default"])),
            st.tuples(st.just("get_odd"), ODD_KEYS),
            st.tuples(st.just("get_view"), keys),
            st.tuples(st.just("get_unhashable"), UNHASHABLE, keys),
            st.tuples(st.just("contains"), keys),
            st.tuples(st.just("contains_odd"), ODD_KEYS),
            st.tuples(st.just("contains_view"), keys),
            st.tuples(st.just("contains_unhashable"), UNHASHABLE, keys),
            st.tuples(st.just("del"), keys),
            st.tuples(st.just("del_odd"), ODD_KEYS),
            st.tuples(st.just("pop"), keys),
            st.tuples(st.just("pop_default"), keys, st.sampled_from([None, -1, "default"])),
            st.tuples(st.just("pop_odd"), ODD_KEYS),
            st.tuples(st.just("update_zip"), pairs),
            st.tuples(st.just("update_mapping"), pairs),
            st.tuples(
                st.just("update_bad"),
                pairs,
                st.sampled_from(["key", "value", "scalar", "triple", "single"]),
                pairs,
            ),
            st.tuples(st.just("fill"), VALUES),
            st.tuples(st.just("clear")),
            st.tuples(st.just("pickle"), st.integers(0, pickle.HIGHEST_PROTOCOL)),
            st.tuples(st.just("len")),
            st.tuples(st.just("iter")),
            st.tuples(st.just("getsizeof")),
        ),
        max_size=60,
    )


SCENARIOS = st.lists(
    st.binary(min_size=4, max_size=8), min_size=1, max_size=24, unique=True
).flatmap(lambda pool: st.tuples(st.just(pool), _ops(pool)))

Outcome = tuple[str, Any]  # ("ok", answer) or ("raise", exception types accepted/raised)


def _call(fn: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", fn())
    except Exception as e:
        return ("raise", type(e))


def _model_contains(model: dict[bytes, int], k: object) -> bool:
    hash(k)
    return type(k) is bytes and k in model


def _step(
    t: Any, model: dict[bytes, int], op: tuple[Any, ...], pool: list[bytes]
) -> tuple[Any, Outcome, Outcome]:
    """Apply ``op`` to the table and to the model; the table (replaced when pickled) and the
    two outcomes. A model outcome ``("raise", (E1, E2))`` accepts either type."""
    name = op[0]
    if name == "set":
        k, v = op[1], op[2]
        model[k] = v
        return t, _call(lambda: t.__setitem__(k, v)), ("ok", None)
    if name == "overwrite":  # a present key's value replaced: its place in the order kept
        if not model:
            return t, ("ok", None), ("ok", None)
        k = list(model)[op[1] % len(model)]
        v = op[2]
        model[k] = v
        return t, _call(lambda: t.__setitem__(k, v)), ("ok", None)
    if name == "set_bad_key":
        bad = _bad_key(op[1], op[2])
        return t, _call(lambda: t.__setitem__(bad, op[3])), ("raise", (TypeError,))
    if name == "set_bad_value":
        bad = _bad_value(op[2], op[3])
        return t, _call(lambda: t.__setitem__(op[1], bad)), ("raise", (TypeError,))
    if name == "getitem":
        k = op[1]
        want: Outcome = ("ok", model[k]) if k in model else ("raise", (KeyError,))
        return t, _call(lambda: t[k]), want
    if name == "getitem_odd":
        return t, _call(lambda: t[op[1]]), ("raise", (KeyError,))
    if name == "get":
        k, default = op[1], op[2]
        return t, _call(lambda: t.get(k, default)), ("ok", model.get(k, default))
    if name == "get_odd":
        return t, _call(lambda: (t.get(op[1]), t.get(op[1], -5))), ("ok", (None, -5))
    if name == "get_view":  # equal and hashing as bytes, yet not bytes: absent
        view = memoryview(op[1])
        sub = Bytes(op[1])
        return t, _call(lambda: (t.get(view), t.get(sub, -5))), ("ok", (None, -5))
    if name == "get_unhashable":
        bad = _unhashable(op[1], op[2])
        return t, _call(lambda: t.get(bad)), ("raise", (TypeError,))
    if name == "contains":
        return t, _call(lambda: op[1] in t), ("ok", _model_contains(model, op[1]))
    if name == "contains_odd":
        return t, _call(lambda: op[1] in t), ("ok", False)
    if name == "contains_view":
        view = memoryview(op[1])
        sub = Bytes(op[1])
        return t, _call(lambda: (view in t, sub in t)), ("ok", (False, False))
    if name == "contains_unhashable":
        bad = _unhashable(op[1], op[2])
        return t, _call(lambda: bad in t), ("raise", (TypeError,))
    if name == "del":
        k = op[1]
        want = ("ok", None) if model.pop(k, None) is not None else ("raise", (KeyError,))
        return t, _call(lambda: t.__delitem__(k)), want
    if name == "del_odd":
        return t, _call(lambda: t.__delitem__(op[1])), ("raise", (KeyError,))
    if name == "pop":
        k = op[1]
        want = ("ok", model.pop(k)) if k in model else ("raise", (KeyError,))
        return t, _call(lambda: t.pop(k)), want
    if name == "pop_default":
        k, default = op[1], op[2]
        return t, _call(lambda: t.pop(k, default)), ("ok", model.pop(k, default))
    if name == "pop_odd":
        return t, _call(lambda: (t.pop(op[1], -5), t.pop(op[1]))), ("raise", (KeyError,))
    if name == "update_zip":
        ks = [k for k, _ in op[1]]
        vs = [v for _, v in op[1]]
        model.update(zip(ks, vs, strict=True))
        return t, _call(lambda: t.update(zip(ks, vs, strict=True))), ("ok", None)
    if name == "update_mapping":
        mapping = dict(op[1])
        model.update(mapping)
        return t, _call(lambda: t.update(mapping)), ("ok", None)
    if name == "update_bad":  # the pairs before the bad element are applied (dict.update)
        before, kind, after = op[1], op[2], op[3]
        k0 = pool[0]
        element: Any = {
            "key": ("key-0001", 1),
            "value": (k0, 1.5),
            "scalar": 3,
            "triple": (k0, 1, 2),
            "single": (k0,),
        }[kind]
        want_types = (TypeError,) if kind in ("key", "value") else (ValueError, TypeError)
        model.update(before)
        elements = [*before, element, *after]
        return t, _call(lambda: t.update(iter(elements))), ("raise", want_types)
    if name == "fill":  # every key of the pool: well past a small capacity
        pairs = [(k, op[1] + i) for i, k in enumerate(pool)]
        model.update(pairs)
        return t, _call(lambda: t.update(pairs)), ("ok", None)
    if name == "clear":
        model.clear()
        return t, _call(t.clear), ("ok", None)
    if name == "pickle":
        again = pickle.loads(pickle.dumps(t, protocol=op[1]))
        assert type(again) is type(t) and again.capacity == t.capacity
        return again, ("ok", None), ("ok", None)
    if name == "len":
        return t, _call(lambda: len(t)), ("ok", len(model))
    if name == "iter":
        got = _call(lambda: (list(iter(t)), list(t.keys()), list(t.values()), list(t.items())))
        return (
            t,
            got,
            ("ok", (list(model), list(model.keys()), list(model.values()), list(model.items()))),
        )
    if name == "getsizeof":
        return t, _call(lambda: sys.getsizeof(t) > 0), ("ok", True)
    raise AssertionError(f"unknown operation {name!r}")


def _same(got: Outcome, want: Outcome) -> bool:
    if want[0] == "raise":
        return got[0] == "raise" and got[1] in want[1]
    return got[0] == "ok" and got[1] == want[1] and type(got[1]) is type(want[1])


def _agrees(
    t: Any, model: dict[bytes, int], pool: list[bytes], capacity: int, done: list[Any]
) -> None:
    """The table holds what the model does, in its order, by every way of reading it
    (a pickled copy included)."""
    items = list(model.items())
    assert list(t.items()) == items, f"after {done}"
    assert list(t) == list(t.keys()) == list(model), f"after {done}"
    assert list(t.values()) == list(model.values()), f"after {done}"
    assert len(t) == len(model) and t.capacity == capacity, f"after {done}"
    assert [k in t for k in pool] == [k in model for k in pool], f"after {done}"
    assert [t.get(k, -7) for k in pool] == [model.get(k, -7) for k in pool], f"after {done}"
    again = pickle.loads(pickle.dumps(t))
    assert type(again) is type(t) and again.capacity == capacity, f"after {done}"
    assert list(again.items()) == items, f"after {done}"


@pytest.mark.parametrize("cls", IMPLS)
@given(capacity=st.sampled_from([0, 1, 4, 8]), scenario=SCENARIOS, initial=st.integers(0, 3))
def test_each_implementation_follows_the_dict_model(
    cls: Any, capacity: int, scenario: tuple[list[bytes], list[tuple[Any, ...]]], initial: int
) -> None:
    pool, ops = scenario
    start = [(k, i) for i, k in enumerate(pool[:initial])]
    t = cls(capacity, start) if start else cls(capacity)
    model: dict[bytes, int] = dict(start)
    done: list[tuple[Any, ...]] = []
    for op in ops:
        done.append(op)
        t, got, want = _step(t, model, op, pool)
        assert _same(got, want), f"after {done}: got {got}, want {want}"
        _agrees(t, model, pool, capacity, done)


# ---------------------------------------------------------------------------------------
# Focused tests
# ---------------------------------------------------------------------------------------

START = [(key(0), 0), (key(1), (5 << 40) + 7), (key(2), -2)]


@pytest.mark.parametrize("cls", IMPLS)
def test_construction_capacity_and_interface(cls: Any) -> None:
    t = cls(4, START)
    assert t.capacity == 4 and len(t) == 3
    assert list(t) == [key(0), key(1), key(2)]
    assert list(t.keys()) == [key(0), key(1), key(2)]
    assert list(t.values()) == [0, (5 << 40) + 7, -2]
    assert tuple(t.items()) == tuple(START)
    assert [k for k in t] == [key(0), key(1), key(2)]
    assert cls(0).capacity == 0 and len(cls(0)) == 0 and list(cls(7, None)) == []
    assert cls(2, iter(START)).capacity == 2 and list(cls(2, iter(START)).items()) == START
    assert isinstance(t, MutableMapping) and isinstance(cls(0), MutableMapping)
    assert sys.getsizeof(t) > 0


@pytest.mark.parametrize("cls", IMPLS)
def test_bad_capacities_are_refused(cls: Any) -> None:
    with pytest.raises(ValueError):
        cls(-1)
    for bad in ("8", 8.0, None, [8]):
        with pytest.raises(TypeError):
            cls(bad)


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.__setitem__(7, 1),
        lambda t: t.__setitem__("key-0003", 1),
        lambda t: t.__setitem__(bytearray(key(3)), 1),
        lambda t: t.__setitem__(Bytes(key(3)), 1),
        lambda t: t.__setitem__(memoryview(key(3)), 1),
        lambda t: t.__setitem__(key(3), 1.5),
        lambda t: t.__setitem__(key(3), "1"),
        lambda t: t.__setitem__(key(3), None),
        lambda t: t.__setitem__(key(3), True),
        lambda t: t.__setitem__(key(3), Int(1)),
        lambda t: t.__setitem__(key(1), 2.5),  # a present key: its value stays
        lambda t: t.__setitem__(Bytes(key(1)), 9),
        lambda t: t.update([("key-0003", 3)]),
        lambda t: t.update([(key(3), 3.0)]),
        lambda t: t.update({key(3): "3"}),
        lambda t: t.update({Bytes(key(3)): 3}),
    ],
)
def test_a_bad_key_or_value_is_a_type_error_that_changes_nothing(
    cls: Any, call: Callable[[Any], Any]
) -> None:
    t = cls(4, START)
    with pytest.raises(TypeError):
        call(t)
    assert list(t.items()) == START
    assert key(3) not in t and len(t) == 3


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize(
    ("bad", "errors"),
    [
        (("key-0009", 9), (TypeError,)),
        ((key(9), 9.5), (TypeError,)),
        (3, (TypeError, ValueError)),
        ((key(9), 1, 2), (TypeError, ValueError)),
        ((key(9),), (TypeError, ValueError)),
    ],
)
def test_an_update_keeps_the_pairs_before_a_bad_element(
    cls: Any, bad: Any, errors: tuple[type[Exception], ...]
) -> None:
    t = cls(4, START)
    with pytest.raises(errors):
        t.update([(key(5), 5), (key(0), 10), bad, (key(6), 6)])
    assert list(t.items()) == [(key(0), 10), START[1], START[2], (key(5), 5)]
    with pytest.raises((TypeError, ValueError)):
        cls(4, [(key(5), 5), bad])


@pytest.mark.parametrize("cls", IMPLS)
def test_updates_from_zip_and_from_a_mapping(cls: Any) -> None:
    t = cls(2, START)
    t.update(zip([key(2), key(7), key(8)], [20, 7, 8], strict=True))
    t.update({key(0): -1, key(9): 9})
    t.update(cls(1, [(key(10), 10)]))  # a table is a mapping too
    t.update([])
    assert list(t.items()) == [
        (key(0), -1),
        START[1],
        (key(2), 20),
        (key(7), 7),
        (key(8), 8),
        (key(9), 9),
        (key(10), 10),
    ]


def _assert_absent(t: Any, absent: object) -> None:
    """Reading, deleting or popping ``absent`` is a KeyError; a pop with a default is not."""
    with pytest.raises(KeyError):
        t[absent]
    with pytest.raises(KeyError):
        del t[absent]
    with pytest.raises(KeyError):
        t.pop(absent)
    assert t.pop(absent, "d") == "d"


@pytest.mark.parametrize("cls", IMPLS)
def test_an_absent_key_is_a_key_error(cls: Any) -> None:
    t = cls(4, START)
    for absent in (key(9), b"", "key-0001", 7, None, (1,)):
        _assert_absent(t, absent)
        assert t.pop(absent, None) is None
    assert list(t.items()) == START
    del t[key(1)]
    with pytest.raises(KeyError):
        t[key(1)]
    with pytest.raises(KeyError):
        del t[key(1)]
    assert t.pop(key(2)) == -2
    with pytest.raises(KeyError):
        t.pop(key(2))
    assert list(t.items()) == [START[0]]


@pytest.mark.parametrize("cls", IMPLS)
def test_lookups_of_anything_but_exact_bytes_answer_absent(cls: Any) -> None:
    t = cls(4, START)
    for other in (memoryview(key(1)), Bytes(key(1)), "key-0001", 1, None, (key(1),), 1.5):
        assert other not in t
        assert t.get(other) is None and t.get(other, "d") == "d"
        _assert_absent(t, other)
    assert key(1) in t and bytes(Bytes(key(1))) in t and t.get(key(1)) == (5 << 40) + 7
    assert t.get(key(9)) is None and t.get(key(9), -1) == -1
    assert list(t.items()) == START


@pytest.mark.parametrize("cls", IMPLS)
def test_an_unhashable_lookup_is_a_type_error(cls: Any) -> None:
    t = cls(4, START)
    for bad in ([key(1)], bytearray(key(1)), {key(1): 1}, {key(1)}):
        with pytest.raises(TypeError):
            bad in t  # noqa: B015 (the lookup raises)
        with pytest.raises(TypeError):
            t.get(bad)
        with pytest.raises(TypeError):
            t.get(bad, 0)
    assert list(t.items()) == START


@pytest.mark.parametrize("cls", IMPLS)
def test_setting_a_present_key_keeps_its_place(cls: Any) -> None:
    t = cls(4, START)
    t[key(0)] = 100
    t[key(1)] = -(1 << 100)
    assert list(t.items()) == [(key(0), 100), (key(1), -(1 << 100)), START[2]]
    del t[key(0)]
    t[key(0)] = 5  # removed, then set again: it is the newest
    assert list(t) == [key(1), key(2), key(0)]


@pytest.mark.parametrize("cls", IMPLS)
def test_it_grows_past_its_capacity_keeping_the_order(cls: Any) -> None:
    t = cls(4)
    t.update((key(i), i * i) for i in range(200))
    for i in range(0, 200, 3):
        del t[key(i)]
    t.update((b"more-%04d" % i, -i) for i in range(50))
    want = [(key(i), i * i) for i in range(200) if i % 3] + [
        (b"more-%04d" % i, -i) for i in range(50)
    ]
    assert list(t.items()) == want and len(t) == len(want) and t.capacity == 4
    t.clear()
    assert len(t) == 0 and list(t) == []
    t[key(1)] = 1
    assert list(t.items()) == [(key(1), 1)]


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_keeps_the_order_and_the_capacity(cls: Any, protocol: int) -> None:
    t = cls(8)
    t.update([(key(5), 5), (key(1), (5 << 40) + 7), (key(3), -(1 << 70)), (key(0), 0)])
    del t[key(1)]
    t[key(1)] = 11
    again = pickle.loads(pickle.dumps(t, protocol=protocol))
    assert type(again) is type(t) and again.capacity == 8
    assert list(again.items()) == [(key(5), 5), (key(3), -(1 << 70)), (key(0), 0), (key(1), 11)]
    again[key(5)] = 6  # a copy, not a view
    assert t[key(5)] == 5
    empty = pickle.loads(pickle.dumps(cls(0), protocol=protocol))
    assert empty.capacity == 0 and len(empty) == 0


# Both implementations: a dict's iterators do the same (the C type is held to it).
@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.__setitem__(key(9), 9),
        lambda t: t.__delitem__(key(2)),
        lambda t: t.pop(key(2)),
        lambda t: t.pop(key(2), None),
        lambda t: t.update([(key(9), 9)]),
        lambda t: t.clear(),
    ],
)
@pytest.mark.parametrize("view", ["iter", "keys", "values", "items"])
def test_a_change_of_size_during_iteration_is_a_runtime_error(
    cls: Any, change: Callable[[Any], Any], view: str
) -> None:
    t = cls(4, START)
    it = iter(t) if view == "iter" else iter(getattr(t, view)())
    next(it)
    change(t)
    with pytest.raises(RuntimeError):
        next(it)


@pytest.mark.parametrize("cls", IMPLS)
def test_replacing_values_during_iteration_is_allowed(cls: Any) -> None:
    t = cls(4, START)
    for k in t:
        t[k] = t[k] + 1
    for k, v in t.items():
        t[k] = v * 2
    t.pop(key(9), None)  # nothing removed: the size does not change
    assert list(t.items()) == [(k, (v + 1) * 2) for k, v in START]


@native
def test_the_native_table_is_invisible_to_the_collector() -> None:
    t = NativeKeyTable(16)
    assert not gc.is_tracked(t)
    t.update((key(i), i) for i in range(40))
    t[key(0)] = (5 << 40) + 7
    assert not gc.is_tracked(t) and len(t) == 40


@native
def test_the_native_table_is_sized_once_and_grows_past_its_capacity() -> None:
    t = NativeKeyTable(1000)
    size = sys.getsizeof(t)
    for i in range(1000):
        t[key(i)] = i
        assert sys.getsizeof(t) == size, i  # no rebuild while it fills to its capacity
    t[key(5)] = 1 << 80  # replacing a value: no new entry
    assert sys.getsizeof(t) == size and len(t) == 1000
    t.update((b"past-%04d" % i, i) for i in range(100))
    assert sys.getsizeof(t) > size and len(t) == 1100  # past the capacity: it grows
    assert list(t)[:3] == [key(0), key(1), key(2)]
    assert list(t)[-100:] == [b"past-%04d" % i for i in range(100)]
    assert t[key(5)] == 1 << 80 and t[key(999)] == 999


def _fresh_keys(n: int) -> list[bytes]:
    return [bytes(bytearray(b"held-%04d" % i)) for i in range(n)]


def _fresh_values(n: int) -> list[int]:
    return [int(str((5 << 40) + 7 + i)) * (-1) ** i for i in range(n)]


def _churn(t: Any, keys: list[bytes], values: list[int], others: list[int]) -> None:
    """Every way in and out of the table, the errors included (in a function of its own, so
    that no loop variable or traceback outlives it and holds a key or a value)."""
    t.update(zip(keys, values, strict=True))  # past a small capacity: the arrays grow
    assert [t[k] for k in keys] == values
    t.update(zip(keys, values, strict=True))  # present keys: no second reference
    for k, v in zip(keys, others, strict=True):
        t[k] = v  # a replaced value is released
    assert [t[k] for k in keys] == others and [t.get(k) for k in keys] == others
    for k in keys[:5]:
        del t[k]
    for k in keys[5:10]:
        t.pop(k)
    for k in keys[10:15]:
        t.pop(k, None)
    failing: list[Callable[[], Any]] = [
        lambda: t.__setitem__(keys[0], 1.5),
        lambda: t.__setitem__(keys[20], "1"),  # a present key
        lambda: t.update([(keys[0], values[0]), (keys[1], "bad"), (keys[2], values[2])]),
        lambda: t.update([(keys[3], values[3], values[4])]),
        lambda: t.pop(keys[4]),
        lambda: t[keys[5]],
        lambda: t.__delitem__(keys[6]),
    ]
    for call in failing:
        try:
            call()
        except (TypeError, ValueError, KeyError):
            pass
        else:
            raise AssertionError("expected an error")
    assert t.pop(keys[7], values[7]) is values[7] and t.get(keys[8], values[8]) is values[8]
    assert keys[0] in t and keys[9] not in t
    _ = list(t.items()), list(t.keys()), list(t.values()), list(t)
    again = pickle.loads(pickle.dumps(t))
    assert list(again.items()) == list(t.items())


# Both implementations: a dict releases what it held too (which checks the test itself).
@pytest.mark.parametrize("cls", IMPLS)
def test_keys_and_values_are_released(cls: Any) -> None:
    keys = _fresh_keys(40)
    values = _fresh_values(40)
    others = _fresh_values(40)

    def counts() -> list[int]:
        return [sys.getrefcount(x) for x in (*keys, *values, *others)]

    before = counts()
    t = cls(16)
    _churn(t, keys, values, others)
    t.clear()
    assert counts() == before
    _churn(t, keys, values, others)
    del t
    assert counts() == before
    t = cls(4, zip(keys, values, strict=True))
    t.update(zip(keys[10:], others[10:], strict=True))
    t = cls(0)
    assert counts() == before


@native
def test_the_native_table_keeps_large_and_negative_ints() -> None:
    t = NativeKeyTable(4)
    vals = [
        0,
        -1,
        (5 << 40) + 7,
        -((5 << 40) + 7),
        2**63 - 1,
        -(2**63),
        2**63,
        -(2**63) - 1,
        1 << 200,
    ]
    t.update((key(i), v) for i, v in enumerate(vals))
    assert list(t.values()) == vals
    assert all(type(v) is int for v in t.values())
    assert [t.get(key(i)) for i in range(len(vals))] == vals
    assert [t.pop(key(i)) for i in range(len(vals))] == vals


def test_the_cpu_manager_keeps_its_entries_in_a_key_table() -> None:
    m = CPUOffloadingManager(6)
    assert isinstance(m._entries, KeyTable)
    assert m._entries.capacity >= 6  # sized for every slot's key from the start

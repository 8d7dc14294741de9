"""The LRU list, :class:`~statecore.managers.keyorder.KeyOrder`: the C type against the
``OrderedDict`` fallback and a plain-list model.

* a differential test runs generated operation sequences (appends, batches with repeats,
  touches, discards, clears, iteration, pickling) on the C type, on ``PyKeyOrder`` and on a
  list model, capacities from 0 (so the C type's arrays grow past what they were sized for):
  the same order, answers and errors after every operation;
* a key that is not exact bytes is a TypeError that changes nothing, wherever it sits in a
  batch; a change during iteration is a RuntimeError (as for dicts);
* the C type's memory: sized once (its size does not move while it fills to its capacity),
  not tracked by the cyclic collector, and no key's reference count moves once it is gone;
* the LRU and ARC policies, in the CPU manager, evict the same keys on either implementation.
"""

from __future__ import annotations

import gc
import pickle
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from native_build import can_build_extensions

import statecore.managers.policies as policies
from statecore.check import snapshot
from statecore.manager import ReqContext
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.keyorder import KeyOrder, KeyTable, PyKeyOrder, PyKeyTable, keyorder_impl

native = pytest.mark.skipif(
    keyorder_impl() != "native",
    reason="statecore._keyorder is not built (no C compiler at install)",
)

IMPLS: list[Any] = [
    PyKeyOrder,
    pytest.param(KeyOrder, marks=native, id="native"),
]


def key(i: int) -> bytes:
    return b"key-%04d" % i


class Model:
    """The reference: a list, oldest first."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def append(self, k: bytes) -> None:
        if k in self.keys:
            self.keys.remove(k)
        self.keys.append(k)

    def touch(self, ks: list[bytes]) -> None:
        for k in reversed(ks):
            if k in self.keys:
                self.keys.remove(k)
                self.keys.append(k)

    def discard(self, k: bytes) -> bool:
        if k in self.keys:
            self.keys.remove(k)
            return True
        return False


KEYS = st.integers(0, 23).map(key)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), KEYS),
        st.tuples(st.just("append_many"), st.lists(KEYS, max_size=8)),
        st.tuples(st.just("touch"), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("discard"), KEYS),
        st.tuples(st.just("discard_many"), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("clear"), st.none()),
        st.tuples(st.just("pickle"), st.none()),
    ),
    max_size=60,
)


def _apply(model: Model, op: str, arg: Any) -> Any:
    if op == "append":
        model.append(arg)
        return None
    if op == "append_many":
        for k in arg:
            model.append(k)
        return None
    if op == "touch":
        model.touch(arg)
        return None
    if op == "discard":
        return model.discard(arg)
    if op == "discard_many":
        return sum(model.discard(k) for k in arg)
    if op == "clear":
        model.keys.clear()
    return None


@given(capacity=st.integers(0, 12), ops=OPS, as_tuple=st.booleans())
def test_both_implementations_follow_the_list_model(
    capacity: int, ops: list[tuple[str, Any]], as_tuple: bool
) -> None:
    impls = [PyKeyOrder(capacity)]
    if keyorder_impl() == "native":
        impls.append(KeyOrder(capacity))
    model = Model()
    for op, arg in ops:
        want = _apply(model, op, arg)
        if isinstance(arg, list) and as_tuple:
            arg = tuple(arg)
        for i, impl in enumerate(impls):
            if op == "pickle":
                impls[i] = impl = pickle.loads(pickle.dumps(impl))
                assert type(impl) is type(impls[i]) and impl.capacity == capacity
                continue
            got = getattr(impl, op)(arg) if arg is not None else getattr(impl, op)()
            assert got == want, (op, arg)
        for impl in impls:
            assert list(impl) == model.keys
            assert len(impl) == len(model.keys)
            assert impl.oldest() == (model.keys[0] if model.keys else None)
            assert all((key(i) in impl) == (key(i) in model.keys) for i in range(24))


@pytest.mark.parametrize("cls", IMPLS)
@pytest.mark.parametrize(
    "call",
    [
        lambda k: k.append(7),
        lambda k: k.append("key-0001"),
        lambda k: k.append(bytearray(b"key-0001")),
        lambda k: k.append_many([key(5), key(6), 3]),
        lambda k: k.append_many(5),
        lambda k: k.touch([key(1), None]),
        lambda k: k.discard(memoryview(b"key-0001")),
        lambda k: k.discard_many([key(1), 1.5]),
    ],
)
def test_a_key_that_is_not_bytes_is_a_type_error_that_changes_nothing(
    cls: Any, call: Callable[[Any], Any]
) -> None:
    k = cls(4, [key(0), key(1), key(2)])
    with pytest.raises(TypeError):
        call(k)
    assert list(k) == [key(0), key(1), key(2)]
    assert 7 not in k and "key-0001" not in k and bytearray(b"key-0001") not in k


@pytest.mark.parametrize("cls", IMPLS)
def test_a_change_during_iteration_is_a_runtime_error(cls: Any) -> None:
    k = cls(4, [key(0), key(1)])
    it = iter(k)
    assert next(it) == key(0)
    k.append(key(2))
    with pytest.raises(RuntimeError):
        next(it)
    assert list(k) == [key(0), key(1), key(2)]


@pytest.mark.parametrize("cls", IMPLS)
def test_bad_capacities_are_refused(cls: Any) -> None:
    with pytest.raises(ValueError):
        cls(-1)
    with pytest.raises(TypeError):
        cls("8")


@pytest.mark.parametrize("cls", IMPLS)
def test_the_model_checkers_snapshot_keeps_the_order(cls: Any) -> None:
    k = cls(8, [key(3), key(1), key(2)])
    again = snapshot.loads(snapshot.dumps(k))
    assert list(again) == [key(3), key(1), key(2)] and again.capacity == 8
    again.append(key(3))
    assert list(k) == [key(3), key(1), key(2)]  # a copy, not a view


@native
def test_the_native_list_is_sized_once_and_grows_past_its_capacity() -> None:
    k = KeyOrder(1000)
    size = sys.getsizeof(k)
    assert size >= 1000 * 24  # the node array for every key, from the start
    k.append_many([key(i) for i in range(1000)])
    assert sys.getsizeof(k) == size  # no rebuild while it fills to its capacity
    k.discard_many([key(i) for i in range(0, 1000, 2)])
    k.append_many([b"more-%04d" % i for i in range(500)])  # churn: free nodes are reused
    assert sys.getsizeof(k) == size and len(k) == 1000
    k.append_many([b"past-%04d" % i for i in range(100)])
    assert sys.getsizeof(k) > size and len(k) == 1100  # past the capacity: it grows
    assert list(k)[-100:] == [b"past-%04d" % i for i in range(100)]
    assert list(k)[:500] == [key(i) for i in range(1, 1000, 2)]


@native
def test_the_native_list_is_invisible_to_the_collector_and_releases_its_keys() -> None:
    k = KeyOrder(16)
    assert not gc.is_tracked(k)
    held = [bytes(b"held-%04d" % i) for i in range(40)]
    before = [sys.getrefcount(h) for h in held]
    k.append_many(held)
    assert [sys.getrefcount(h) for h in held] == [n + 1 for n in before]
    k.append_many(held)  # present keys move: no second reference
    k.touch(held)
    assert [sys.getrefcount(h) for h in held] == [n + 1 for n in before]
    assert k.discard_many(held[:10]) == 10
    k.clear()
    k.append_many(held[10:20])
    del k
    assert [sys.getrefcount(h) for h in held] == before


@pytest.mark.skipif(
    not can_build_extensions(),
    reason="no C compiler or Python headers: the optional extension cannot have been built",
)
def test_installation_with_a_compiler_built_the_native_key_order() -> None:
    """Where the extension can be built it must have been (a silent fallback would bring back
    the rebuild stalls; CI has gcc and the headers, so this always runs there)."""
    assert keyorder_impl() == "native"
    assert type(policies.LRUCachePolicy(4).evictable_blocks) is KeyOrder
    # (the key table comes from the same extension: a build without it is a stale one)
    assert type(CPUOffloadingManager(4)._entries) is KeyTable is not PyKeyTable


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("cls", IMPLS)
def test_the_cpu_tier_evicts_the_same_keys_on_either_list(
    cls: Any, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same traffic through the CPU manager with the lists' two implementations: the
    same victims in the same order (the reference is the OrderedDict fallback)."""

    def run() -> list[tuple[bytes, ...]]:
        m = CPUOffloadingManager(6, policy=policy)
        ctx = ReqContext("r")
        victims: list[tuple[bytes, ...]] = []
        for step in range(12):
            keys = [key(step * 3 + j) for j in range(3)]
            out = m.prepare_store(keys, ctx)
            assert out is not None
            victims.append(tuple(out.evicted_keys))
            m.complete_store(list(out.keys_to_store), ctx)
            if step % 3 == 0:  # a load pins, then releases, an older key: it becomes newest
                old = [key(step * 3 - 2)] if step else [key(0)]
                if m.is_ready(old[0]):
                    m.prepare_load(old, ctx)
                    m.complete_load(old, ctx)
            m.touch([key(step * 3)], ctx)
        return victims

    monkeypatch.setattr(policies, "KeyOrder", PyKeyOrder)
    reference = run()
    monkeypatch.setattr(policies, "KeyOrder", cls)
    assert run() == reference
    assert any(reference)

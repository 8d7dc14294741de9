"""Request-aware policies (vLLM 0.33's semantics) and the reuse filter that counts offers,
through the CPU manager (no vLLM needed; tests/vllm compares them with vLLM's classes)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.errors import ConfigError
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import ReqContext
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.policies import (
    LRUCachePolicy,
    RequestARCCachePolicy,
    RequestCachePolicy,
    RequestLRUCachePolicy,
    order_request_keys,
    request_rank,
)


def k(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), group)


def ctx(rid: str, keys: Sequence[OffloadKey], tokens: int = 16) -> ReqContext:
    """A request whose keys are chunks 1, 2, ... of ``tokens`` tokens each, in order."""
    c = ReqContext(rid)
    c.key_positions = {key: (i + 1) * tokens for i, key in enumerate(keys)}
    return c


def store(m: CPUOffloadingManager, c: ReqContext, keys: Sequence[OffloadKey]) -> list[int]:
    out = m.prepare_store(keys, c)
    assert out is not None
    m.complete_store(out.keys_to_store, c)
    return [int.from_bytes(v[:8], "big") for v in out.evicted_keys]


def ids(keys: Sequence[OffloadKey]) -> list[int]:
    return [int.from_bytes(v[:8], "big") for v in keys]


def scenario_prefix_tail(policy: str) -> list[int]:
    """4 chunks stored in order by a request without positions (still running); a request
    loads [2, 3] and finishes; a third offers [6, 7, 8]: the victims."""
    m = CPUOffloadingManager(4, policy=policy)
    a = ReqContext("a")
    m.on_new_request(a)
    store(m, a, [k(2), k(3), k(4), k(5)])
    b = ctx("b", [k(2), k(3)])
    m.on_new_request(b)
    m.prepare_load([k(2), k(3)], b)
    m.complete_load([k(2), k(3)], b)
    m.on_request_finished(b)
    c = ctx("c", [k(6), k(7), k(8)])
    m.on_new_request(c)
    evicted = store(m, c, [k(6), k(7), k(8)])
    m.check_invariants()
    return evicted


def test_request_lru_evicts_a_prefix_tail_before_its_head() -> None:
    assert scenario_prefix_tail("request-lru") == [4, 5, 3]
    # statecore's access-recency LRU keeps chunk 3 and evicts 2: no prefix can reach 3
    assert scenario_prefix_tail("lru") == [4, 5, 2]


def test_request_lru_finished_prefix_ranks_its_head_most_recent() -> None:
    m = CPUOffloadingManager(4, policy="request-lru")
    a = ctx("a", [k(2), k(3), k(4), k(5)])
    store(m, a, [k(2), k(3), k(4), k(5)])
    m.on_request_finished(a)
    c = ctx("c", [k(6), k(7), k(8)])
    assert store(m, c, [k(6), k(7), k(8)]) == [5, 4, 3]


def test_request_lru_ranks_an_unfinished_requests_store_tail_first() -> None:
    m = CPUOffloadingManager(4, policy="request-lru")
    a = ctx("a", [k(1), k(2), k(3), k(4)])
    store(m, a, [k(1), k(2)])
    store(m, a, [k(3), k(4)])  # a later step of the same request: one rank, by position
    b = ctx("b", [k(9)])
    assert store(m, b, [k(9)]) == [4]  # the tail of the unfinished prefix goes first


def test_request_lru_protects_an_unfinished_requests_prefix() -> None:
    m = CPUOffloadingManager(3, policy="request-lru")
    old = ctx("old", [k(7)])
    store(m, old, [k(7)])
    m.on_request_finished(old)
    a = ctx("a", [k(1), k(2)])
    store(m, a, [k(1), k(2)])  # unfinished: ranked with its request, above k(7)'s request
    n = ctx("n", [k(8)])
    assert store(m, n, [k(8)]) == [7]


def test_request_lru_touch_and_fresh_inserts_without_positions() -> None:
    p = RequestLRUCachePolicy(4)
    for i in (1, 2, 3):
        p.insert(k(i))
        p.mark_evictable(k(i))
    p.touch([k(1), k(2)])  # the first key ends most recent
    assert p.eviction_order() == [k(3), k(2), k(1)]
    assert p.evict(2, frozenset({k(3)})) == [k(2), k(1)]
    assert p.evict(2, frozenset()) is None  # one idle key left: nothing changes
    assert p.evictable_keys() == [k(3)]


def test_request_arc_counts_reuse_once_per_request() -> None:
    m = CPUOffloadingManager(4, policy="request-arc")
    a = ctx("a", [k(1), k(2)])
    store(m, a, [k(1), k(2)])
    m.on_request_finished(a)
    b = ctx("b", [k(1)])
    for _ in range(3):  # three loads by one request: one reuse
        m.prepare_load([k(1)], b)
        m.complete_load([k(1)], b)
    policy = m.policy
    assert isinstance(policy, RequestARCCachePolicy)
    # a's finish left its head most recent; nothing moves before b finishes
    assert list(policy.t1) == [k(2), k(1)] and list(policy.t2) == []
    m.on_request_finished(b)
    assert list(policy.t1) == [k(2)] and list(policy.t2) == [k(1)]
    m.on_request_finished(b)  # a second finish notice changes nothing
    assert list(policy.t2) == [k(1)]


def test_request_arc_adapts_its_target_once_per_request_on_a_ghost_offer() -> None:
    m = CPUOffloadingManager(2, policy="request-arc")
    a = ctx("a", [k(1), k(2), k(3)])
    store(m, a, [k(1), k(2)])
    assert store(m, a, [k(3)]) == [1]  # k(1) becomes a B1 ghost
    policy = m.policy
    assert isinstance(policy, RequestARCCachePolicy)
    b = ctx("b", [k(1)])
    # no room can be made (k(2), k(3) pinned): the offer still counts its ghost, once
    m.prepare_load([k(2), k(3)], a)
    assert m.prepare_store([k(1)], b) is None
    assert m.prepare_store([k(1)], b) is None
    assert policy.target_t1_size == 1.0


def test_reuse_filter_counting_offers_stores_on_the_second_offer() -> None:
    m = CPUOffloadingManager(8, store_threshold=2, reuse_counts="offers")
    c = ReqContext("r")
    keys = [k(1), k(2), k(3), k(4)]
    out = m.prepare_store(keys, c)
    assert out is not None and out.keys_to_store == ()
    out = m.prepare_store(keys, c)
    assert out is not None and ids(out.keys_to_store) == [1, 2, 3, 4]
    # counting lookups (statecore's former meaning): offers alone never admit a key
    old = CPUOffloadingManager(8, store_threshold=2, reuse_counts="lookups")
    for _ in range(4):
        out = old.prepare_store(keys, c)
        assert out is not None and out.keys_to_store == ()
    with pytest.raises(ConfigError):
        CPUOffloadingManager(8, reuse_counts="stores")


def test_offer_tracker_keeps_the_keys_an_offer_names() -> None:
    m = CPUOffloadingManager(8, store_threshold=2, max_tracker_size=2, reuse_counts="offers")
    c = ReqContext("r")
    m.prepare_store([k(1), k(2)], c)
    m.prepare_store([k(1), k(2), k(3)], c)  # the tracker is full of named keys: k(3) waits
    out = m.prepare_store([k(1), k(2)], c)
    assert out is not None and ids(out.keys_to_store) == []  # stored by the second offer
    assert m.ref_count(k(1)) == -1 and m.ref_count(k(3)) is None  # (write-pending)


def test_request_policies_are_request_aware_and_ask_for_positions() -> None:
    assert isinstance(RequestLRUCachePolicy(1), RequestCachePolicy)
    assert isinstance(RequestARCCachePolicy(1), RequestCachePolicy)
    assert not isinstance(LRUCachePolicy(1), RequestCachePolicy)
    assert CPUOffloadingManager(1, policy="request-lru").wants_key_positions
    assert not CPUOffloadingManager(1, policy="lru").wants_key_positions


def test_order_request_keys_sorts_by_position_only_when_all_known() -> None:
    groups = [[k(2), k(1)], [k(3, 1)]]
    pos = {k(1): 16, k(2): 32, k(3, 1): 24}
    assert order_request_keys(groups, pos) == [k(1), k(3, 1), k(2)]
    assert order_request_keys(groups, {k(1): 16}) == [k(2), k(1), k(3, 1)]
    assert order_request_keys(groups, None) == [k(2), k(1), k(3, 1)]


@given(st.integers(0, 2**20), st.integers(0, 2**20), st.integers(0, 2**41), st.integers(0, 2**41))
def test_request_rank_orders_as_vllms_pairs(r1: int, r2: int, p1: int, p2: int) -> None:
    cap = (1 << 40) - 1
    assert (request_rank(r1, p1) < request_rank(r2, p2)) == (
        (r1, -min(p1, cap)) < (r2, -min(p2, cap))
    )
    assert request_rank(r1, None) >= request_rank(r1, p1)  # (position 0 ranks as none)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9)), max_size=60))
def test_request_policies_keep_the_managers_invariants(ops: list[tuple[int, int]]) -> None:
    for policy in ("request-lru", "request-arc"):
        m = CPUOffloadingManager(4, policy=policy)
        reqs = [ctx(f"r{i}", [k(j) for j in range(10)]) for i in range(3)]
        pinned: list[tuple[list[OffloadKey], ReqContext]] = []
        for op, arg in ops:
            c = reqs[arg % 3]
            if op <= 1:
                out = m.prepare_store([k(arg), k((arg + 1) % 10)], c)
                if out is not None and out.keys_to_store:
                    m.complete_store(out.keys_to_store, c, success=op == 0)
            elif op == 2 and m.is_ready(k(arg)):
                m.prepare_load([k(arg)], c)
                pinned.append(([k(arg)], c))
            elif op == 3 and pinned:
                keys, pc = pinned.pop(0)
                m.complete_load(keys, pc)
            elif op == 4:
                m.on_request_finished(c)
                reqs[arg % 3] = ctx(f"r{arg}-{len(ops)}", [k(j) for j in range(10)])
            elif op == 5 and arg == 0:
                m.reset_cache()
                pinned.clear()
            m.check_invariants()

"""The CPU tier's request-aware policies against vLLM 0.33's own CPUOffloadingManager.

The same random sequence of requests (shared prefixes, stores, loads, failed stores,
finishes, resets) drives vLLM's manager and statecore's; every answer must be the same: each
offer's keys to store and victims (in order), each lookup. Run with
scripts/vllm-integration.sh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VManager

from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import LookupResult, ReqContext
from statecore.managers.cpu import CPUOffloadingManager

TOKENS = 16


def key(family: int, i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(family.to_bytes(4, "big") + i.to_bytes(4, "big"), group)


@dataclass
class Req:
    keys: list[OffloadKey]
    ours: ReqContext
    theirs: VReqContext
    finished: bool = False
    jobs: list[tuple[str, tuple[OffloadKey, ...]]] = field(default_factory=list)


class Pair:
    """vLLM's manager and statecore's, driven alike; every answer compared."""

    def __init__(self, capacity: int, policy: str, threshold: int, positions: bool) -> None:
        self.theirs = VManager(capacity, cache_policy=policy, store_threshold=threshold)
        self.ours = CPUOffloadingManager(
            capacity, policy=f"request-{policy}", store_threshold=threshold, reuse_counts="offers"
        )
        self.positions = positions
        self.reqs: list[Req] = []
        self.log: list[str] = []

    def new(self, family: int, length: int, groups: int) -> None:
        keys = [key(family, i, g) for i in range(length) for g in range(groups)]
        ours = ReqContext(f"r{len(self.reqs)}")
        theirs = VReqContext(ours.req_id)
        if self.positions:
            ours.key_positions = {}
            for k in keys:
                pos = (int.from_bytes(k[4:8], "big") + 1) * TOKENS
                ours.key_positions[k] = pos
                theirs.set_offload_key_position(k, pos)
        self.ours.on_new_request(ours)
        self.theirs.on_new_request(theirs)
        self.reqs.append(Req(keys, ours, theirs))
        self.log.append(f"new {ours.req_id} family {family} x{length} groups {groups}")

    def live(self, i: int) -> Req | None:
        if not self.reqs:
            return None
        r = self.reqs[i % len(self.reqs)]
        return None if r.finished else r

    def store(self, i: int, a: int, b: int) -> None:
        r = self.live(i)
        if r is None:
            return
        start = a % len(r.keys)
        offer = r.keys[start : start + 1 + b % 4]  # (a step's new chunks)
        self.log.append(f"store {r.ours.req_id} {len(offer)} keys")
        theirs = self.theirs.prepare_store(list(offer), r.theirs)
        ours = self.ours.prepare_store(offer, r.ours)
        if theirs is None or ours is None:
            assert theirs is None and ours is None, self.log
            return
        assert list(ours.keys_to_store) == list(theirs.keys_to_store), self.log
        assert list(ours.evicted_keys) == list(theirs.evicted_keys), self.log
        if ours.keys_to_store:
            r.jobs.append(("store", tuple(ours.keys_to_store)))

    def load(self, i: int, a: int, b: int) -> None:
        r = self.live(i)
        if r is None:
            return
        start = a % 3  # (a prefix, or its part past the GPU's hits)
        want = r.keys[start : start + 1 + b % len(r.keys)]
        got = [self.ours.lookup(k, r.ours) for k in want]
        assert [g.name for g in got] == [self.theirs.lookup(k, r.theirs).name for k in want], (
            self.log
        )
        hits = list(
            dict.fromkeys(k for k, g in zip(want, got, strict=True) if g == LookupResult.HIT)
        )
        if not hits:
            return
        self.log.append(f"load {r.ours.req_id} {len(hits)} keys")
        self.theirs.prepare_load(hits, r.theirs)
        self.ours.prepare_load(hits, r.ours)
        r.jobs.append(("load", tuple(hits)))

    def complete(self, i: int, success: bool) -> None:
        pending = [r for r in self.reqs if r.jobs]
        if not pending:
            return
        r = pending[i % len(pending)]
        kind, keys = r.jobs.pop(0)
        self.log.append(f"complete {kind} {r.ours.req_id} {success}")
        if kind == "store":
            self.theirs.complete_store(list(keys), r.theirs, success)
            self.ours.complete_store(keys, r.ours, success)
        else:
            self.theirs.complete_load(list(keys), r.theirs)
            self.ours.complete_load(keys, r.ours)

    def finish(self, i: int) -> None:
        r = self.live(i)
        if r is None:
            return
        self.log.append(f"finish {r.ours.req_id}")
        r.finished = True
        self.theirs.on_request_finished(r.theirs)
        self.ours.on_request_finished(r.ours)

    def reset(self) -> None:
        self.log.append("reset")
        self.theirs.reset_cache()
        self.ours.reset_cache()
        for r in self.reqs:
            r.jobs.clear()  # (jobs discarded by a reset get no completion)


OPS = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)),
    max_size=80,
)


def drive(pair: Pair, ops: Sequence[tuple[int, int, int, int]], groups: int) -> None:
    for op, x, y, z in ops:
        if op <= 1:
            pair.new(x % 3, 2 + y % 7, groups)
        elif op <= 4:
            pair.store(x, y, z)
        elif op <= 6:
            pair.load(x, y, z)
        elif op <= 9:
            pair.complete(x, success=y % 5 != 0)
        elif op <= 11:
            pair.finish(x)
        elif x == 0:
            pair.reset()
        pair.ours.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("positions", [True, False])
@settings(max_examples=150, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 10), groups=st.integers(1, 2))
def test_request_policies_answer_as_vllms(
    policy: str, positions: bool, ops: Any, capacity: int, groups: int
) -> None:
    drive(Pair(capacity, policy, 1, positions), ops, groups)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=100, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 10), threshold=st.integers(2, 3))
def test_store_threshold_counts_offers_as_vllms(
    policy: str, ops: Any, capacity: int, threshold: int
) -> None:
    drive(Pair(capacity, policy, threshold, True), ops, 1)


def scenario(manager: Any, context: Any, positions: bool) -> list[int]:
    """Four chunks stored by a running request without positions; another request loads
    [2, 3] and finishes; a third offers [6, 7, 8]: the victims' indices."""

    def req(rid: str, ids: Sequence[int]) -> Any:
        c = context(rid)
        if positions:
            if isinstance(c, ReqContext):
                c.key_positions = {key(0, i): (i + 1) * TOKENS for i in ids}
            else:
                for i in ids:
                    c.set_offload_key_position(key(0, i), (i + 1) * TOKENS)
        manager.on_new_request(c)
        return c

    a = req("a", [])
    out = manager.prepare_store([key(0, i) for i in (2, 3, 4, 5)], a)
    manager.complete_store(list(out.keys_to_store), a)
    b = req("b", [2, 3])
    manager.prepare_load([key(0, 2), key(0, 3)], b)
    manager.complete_load([key(0, 2), key(0, 3)], b)
    manager.on_request_finished(b)
    c = req("c", [6, 7, 8])
    out = manager.prepare_store([key(0, i) for i in (6, 7, 8)], c)
    return [int.from_bytes(k[4:8], "big") for k in out.evicted_keys]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_prefix_tail_example_evicts_as_vllm(policy: str) -> None:
    """statecore's request-aware policy evicts what vLLM's does (LRU: [4, 5, 3]); the
    access-ordered policies evict otherwise (LRU: [4, 5, 2], a chunk no prefix reaches kept)."""
    theirs = scenario(VManager(4, cache_policy=policy), VReqContext, True)
    ours = scenario(CPUOffloadingManager(4, policy=f"request-{policy}"), ReqContext, True)
    assert ours == theirs
    if policy == "lru":
        assert theirs == [4, 5, 3]
        old = scenario(CPUOffloadingManager(4, policy="lru"), ReqContext, True)
        assert old == [4, 5, 2]
    else:  # the reused chunks moved to T2 once: T1's 4 and 5 go first, then T2's oldest
        old = scenario(CPUOffloadingManager(4, policy="arc"), ReqContext, True)
        assert old != theirs

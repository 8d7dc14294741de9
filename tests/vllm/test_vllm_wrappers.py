"""The two wrappers of a vLLM 0.33 manager: the conformance kit's
(:class:`~statecore.adapters.vllm_manager.VllmManagerAdapter`) and the out-of-tree spec's behind
statecore's scheduler (:class:`~statecore.adapters.vllm_spec.VllmSpecManager`), one conversion
layer with the scheduler's rules on top (run with the peer venv, scripts/vllm-integration.sh)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

from vllm.v1.kv_offload import base as vb
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPUManager

from statecore.adapters import vllm_manager
from statecore.adapters.vllm_spec import VllmSpecManager
from statecore.errors import ManagerError
from statecore.keys import OffloadKey, make_offload_key
from statecore.manager import (
    CPULoadStoreSpec,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
)

K1, K2, K3 = (make_offload_key(bytes([i]) * 8, 0) for i in (1, 2, 3))
END = ScheduleEndContext()


class _OtherSpec(vb.LoadStoreSpec):
    """A load/store spec that is not vLLM's CPU spec (a disk tier's, say)."""


class _OtherSpecManager(VllmCPUManager):  # type: ignore[misc]
    """vLLM's CPU manager answering its loads and stores with a spec of another type."""

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        super().prepare_load(keys, req_context)
        return _OtherSpec()

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        out = super().prepare_store(keys, req_context)
        if out is None:
            return None
        return vb.PrepareStoreOutput(out.keys_to_store, _OtherSpec(), out.evicted_keys)


def _store(m: Any, keys: list[OffloadKey], ctx: ReqContext) -> None:
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(list(out.keys_to_store), ctx)


def test_both_wrappers_ask_for_vllms_step_order_and_key_positions() -> None:
    """The wrapped manager follows vLLM's contract whichever wrapper holds it: on_schedule_end
    last in a step, and each key's position in the request (vLLM's scheduler records both)."""
    kit = vllm_manager.cpu_lru(2)
    spec = VllmSpecManager(VllmCPUManager(2, "lru"))
    for m in (kit, spec):
        assert m.schedule_end_last is True
        assert m.wants_key_positions is True


def test_the_vllm_context_shares_the_requests_key_positions() -> None:
    seen: list[int | None] = []

    class Recording(VllmCPUManager):  # type: ignore[misc]
        def lookup(self, key: Any, req_context: Any) -> Any:
            seen.append(req_context.get_offload_key_position(key))
            return super().lookup(key, req_context)

    m = VllmSpecManager(Recording(2, "lru"))
    ctx = ReqContext("r", {"a": 1}, key_positions={})
    assert m.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    ctx.key_positions[K1] = 16  # type: ignore[index]  # recorded after the first call
    m.lookup(K1, ctx)
    assert seen == [16]


def test_the_spec_wrapper_holds_the_lock_the_kit_wrapper_leaves_it_to_the_caller() -> None:
    entered: list[str] = []

    class Lock:
        def __enter__(self) -> None:
            entered.append("enter")

        def __exit__(self, *exc: object) -> None:
            entered.append("exit")

    class Locked(VllmCPUManager):  # type: ignore[misc]
        lock = Lock()

    spec = VllmSpecManager(Locked(2, "lru"))
    ctx = ReqContext("r")
    spec.on_new_request(ctx)
    spec.lookup(K1, ctx)
    assert entered == ["enter", "exit"] * 2
    entered.clear()
    kit = vllm_manager.VllmManagerAdapter(Locked(2, "lru"))
    kit.on_new_request(ctx)
    kit.lookup(K1, ctx)
    assert entered == []


def test_the_kit_wrapper_carries_another_spec_type_as_is() -> None:
    m = vllm_manager.VllmManagerAdapter(_OtherSpecManager(2, "lru"))
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store([K1], ctx)
    assert out is not None and isinstance(out.store_spec, vllm_manager.VllmLoadStoreSpec)
    assert isinstance(out.store_spec.spec, _OtherSpec)


def test_a_refused_store_spec_gives_the_room_back() -> None:
    """The spec wrapper refuses a store spec that is not CPU slots with a ManagerError, which
    the scheduler takes as no room (and, unchecked, goes on). The vLLM manager had allocated
    the keys by then: they stayed write-pending for good (lookups answered HIT_PENDING, the
    room was never freed), against the contract that a typed error changes nothing."""
    m = VllmSpecManager(_OtherSpecManager(1, "lru"))
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    with pytest.raises(ManagerError, match="prepare_store returned a _OtherSpec"):
        m.prepare_store([K1], ctx)
    assert m.lookup(K1, ctx) is LookupResult.MISS
    assert m.manager.prepare_store([K2], m._ctx(ctx)) is not None  # the one chunk is free


def _other_spec_manager_holding_k1(capacity: int) -> tuple[VllmSpecManager, ReqContext, Any]:
    """The spec wrapper over :class:`_OtherSpecManager` of ``capacity`` chunks, K1 stored by
    vLLM's own path; the request's context and its vLLM context."""
    raw = _OtherSpecManager(capacity, "lru")
    m = VllmSpecManager(raw)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    vctx = m._ctx(ctx)
    out = VllmCPUManager.prepare_store(raw, [K1], vctx)
    raw.complete_store(out.keys_to_store, vctx)
    return m, ctx, vctx


def test_a_refused_load_spec_releases_its_pins() -> None:
    m, ctx, vctx = _other_spec_manager_holding_k1(1)
    with pytest.raises(ManagerError, match="prepare_load returned a _OtherSpec"):
        m.prepare_load([K1], ctx)
    # K1 unpinned: the one chunk can be evicted for K2
    assert VllmCPUManager.prepare_store(m.manager, [K2], vctx) is not None


def test_an_empty_store_needs_no_cpu_spec() -> None:
    m, ctx, _ = _other_spec_manager_holding_k1(2)
    got = m.prepare_store([K1], ctx)  # nothing to write
    assert got is not None and got.keys_to_store == () and got.store_spec == CPULoadStoreSpec(())


def test_the_spec_wrapper_takes_the_managers_stats() -> None:
    """vLLM's managers collect their metrics until ``get_stats`` takes them (vLLM's CPU manager
    keeps one allocation size per store). Behind statecore's scheduler they are not
    statecore's metrics, and the wrapper never asked for them: they grew for good."""
    raw = VllmCPUManager(4, "lru")
    m = VllmSpecManager(raw)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    for i in range(3):
        _store(m, [make_offload_key(bytes([10 + i]) * 8, 0)], ctx)
    assert m.get_stats() == {}
    left = vllm_manager._stats(raw.get_stats())
    assert not left.get("vllm:kv_offload_cpu_allocation_size"), left


def test_the_kit_wrapper_reports_the_managers_stats() -> None:
    m = vllm_manager.cpu_lru(4)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    _store(m, [K1, K2], ctx)
    assert m.get_stats()["vllm:kv_offload_cpu_allocation_size"] == [2]
    m.shutdown()


def _tiering_with_every_key_in_its_tier() -> tuple[VllmSpecManager, ReqContext]:
    """vLLM's tiering manager over a primary of 2 chunks and the example tier, behind the spec
    wrapper: K1..K3 stored (each cascaded to the tier), the request finished, then a reset
    (the tier keeps its chunks, the primary is empty)."""
    m = VllmSpecManager(vllm_manager.tiering_example(2).vllm)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    for key in (K1, K2, K3):
        _store(m, [key], ctx)
        m.on_schedule_end(END)
    m.on_request_finished(ctx)
    m.on_schedule_end(END)
    m.reset_cache()
    later = ReqContext("later")
    m.on_new_request(later)
    return m, later


def test_the_reset_flush_reaches_a_vllm_manager_behind_statecores_scheduler() -> None:
    """vLLM's tiering manager holds promotions from a reset until ``on_reset_flushed`` (a job in
    flight at the reset may still write a freed chunk). statecore's scheduler has no such call:
    the workers have run the reset's flush by the second ``on_schedule_end`` after it. Nothing
    told the manager, so it never promoted again (every later lookup of a chunk only its tier
    held answered MISS)."""
    m, ctx = _tiering_with_every_key_in_its_tier()
    try:
        m.on_schedule_end(END)  # the step that sends the flush
        assert m.lookup(K1, ctx) is LookupResult.MISS  # held: the flush may not have run yet
        m.on_schedule_end(END)  # the next one: the workers ran it
        assert m.lookup(K1, ctx) is LookupResult.HIT_PENDING  # promoted
    finally:
        m.shutdown()


def test_the_reset_flush_comes_before_the_schedule_end_it_rides() -> None:
    """on_schedule_end stays the step's last manager call (vLLM 0.33's contract)."""
    calls: list[str] = []

    class Recording(VllmCPUManager):  # type: ignore[misc]
        def on_reset_flushed(self) -> None:
            calls.append("on_reset_flushed")

        def on_schedule_end(self, context: Any) -> None:
            calls.append("on_schedule_end")

    m = VllmSpecManager(Recording(2, "lru"))
    m.reset_cache()
    for _ in range(3):
        m.on_schedule_end(END)
    assert calls == ["on_schedule_end", "on_reset_flushed", "on_schedule_end", "on_schedule_end"]

"""statecore's connector inside vLLM 0.33's real engine Scheduler, against vLLM's own
OffloadingConnector on the same seeded workload (run with scripts/vllm-integration.sh)."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

# "vllm.config", not "vllm": without vLLM, this very folder (tests/vllm, on sys.path through
# pytest's rootdir insertion) would import as an empty namespace package named vllm.
pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

from kv_event_oracle import BLOCK_SIZE, payload_findings

from statecore import ConfigError
from statecore.bench.scheduler import RunResult, Scenario, run_vllm

BASE = Scenario(
    concurrency=16, steps=200, num_prefixes=32, gpu_cache_factor=0.8, max_prompt_len=1536
)
SCENARIOS = {
    # GPU cache smaller than the working set: CPU hits, async loads, flushes
    "steady": BASE,
    # the same with reset_connector_cache() in the middle (reset fence, stale reports)
    "reset": dataclasses.replace(BASE, reset_at=100),
    # a reset while a load is in flight, under vLLM's default kv_load_failure_policy ("fail")
    "reset_loads": dataclasses.replace(BASE, reset_at=100, reset_with_loads=True),
    # a small GPU cache: frequent preemption (with loads and stores in flight)
    "preemption": Scenario(
        concurrency=32,
        steps=200,
        num_prefixes=16,
        prefix_len=256,
        suffix_len=(32, 256),
        output_len=(64, 192),
        max_prompt_len=512,
        gpu_cache_factor=0.35,
    ),
    # two simulated tensor-parallel ranks
    "tp2": Scenario(
        concurrency=12,
        steps=150,
        num_prefixes=24,
        gpu_cache_factor=0.8,
        max_prompt_len=1024,
        num_workers=2,
    ),
    # KV events on (self-describing payloads), compared stream to stream
    "events": dataclasses.replace(BASE, kv_events=True),
    # the same with a CPU tier of half the GPU cache: evictions, so removal events. Which
    # chunk of a store job vLLM evicts first follows a set's iteration order (its complete_store
    # gets a set of keys), so the work differs from there on
    "events_evict": dataclasses.replace(BASE, kv_events=True, cpu_cache_factor=0.5),
    # statecore's rank 0 fails every third load (vLLM's worker cannot fail: it asserts);
    # vLLM's engine recomputes the invalid blocks (kv_load_failure_policy "recompute")
    "failures": dataclasses.replace(BASE, load_fail_every=3, failure_policy="recompute"),
    # TieringOffloadingSpec with a file-system tier below a CPU tier that holds half the GPU
    # cache; no follow-up turns, so the request stream does not depend on finishing order
    "tiering": dataclasses.replace(BASE, tiering=True, cpu_cache_factor=0.5, followup_prob=0.0),
}
SAME_WORK = ("steady", "reset", "reset_loads", "preemption", "tp2", "events")
"""Scenarios where both connectors do identical work, job by job."""


@functools.cache
def run(name: str, connector: str) -> RunResult:
    return run_vllm(SCENARIOS[name], connector)


@pytest.fixture(params=sorted(SCENARIOS))
def pair(request: pytest.FixtureRequest) -> tuple[str, RunResult, RunResult]:
    name = request.param
    return name, run(name, "vllm"), run(name, "statecore")


def test_every_request_finishes_with_the_same_outputs(
    pair: tuple[str, RunResult, RunResult],
) -> None:
    name, upstream, ours = pair
    assert not upstream.errors and not ours.errors  # no request failed
    for res in (upstream, ours):
        assert len(res.outputs) == res.counters["requests"]
    if name == "tiering":  # secondary-tier I/O runs on threads in both: timing-dependent
        common = upstream.outputs.keys() & ours.outputs.keys()
        assert len(common) >= 0.9 * len(upstream.outputs)
        assert {r: ours.outputs[r] for r in common} == {r: upstream.outputs[r] for r in common}
        return
    assert ours.counters["requests"] == upstream.counters["requests"]
    assert ours.outputs == upstream.outputs


def test_loads_hit_the_same_chunks(pair: tuple[str, RunResult, RunResult]) -> None:
    name, upstream, ours = pair
    if name not in SAME_WORK:
        pytest.skip(f"{name}: the connectors do different work by design (see docs/upstream.md)")
    assert upstream.counters.get("load_jobs", 0) > 0, "scenario produced no CPU hits"
    # per request: the hit tokens of every lookup that found something, in order
    assert ours.hits == upstream.hits
    # per request: the number of CPU chunks of every load job, in order
    assert ours.loads == upstream.loads
    for key in ("load_jobs", "store_jobs", "flushed", "lookups_deferred", "preempted"):
        assert ours.counters.get(key, 0) == upstream.counters.get(key, 0), key


def test_nothing_is_left_behind(pair: tuple[str, RunResult, RunResult]) -> None:
    _, upstream, ours = pair
    assert all(v == 0 for v in upstream.leftovers.values()), upstream.leftovers
    assert all(v == 0 for v in ours.leftovers.values()), ours.leftovers
    for key in ("requests", "jobs", "stalled", "fences", "pinned", "write_pending"):
        assert key in ours.leftovers


def test_reset_with_a_load_in_flight_fails_no_request() -> None:
    upstream, ours = run("reset_loads", "vllm"), run("reset_loads", "statecore")
    for res in (upstream, ours):
        assert res.counters["loads_in_flight_at_reset"] > 0
        assert res.errors == []  # kv_load_failure_policy "fail" would abort a failed load's request
    assert ours.counters.get("loads_carried", 0) > 0


def test_a_failed_manager_reset_reaches_vllm_and_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from statecore.errors import ManagerError
    from statecore.managers.cpu import CPUOffloadingManager

    real = CPUOffloadingManager.reset_cache
    calls: list[int] = []

    def refused_once(self: CPUOffloadingManager) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ManagerError("injected: the CPU tier refused its reset")
        real(self)

    from statecore.adapters.vllm import EventPayloads

    payload_resets: list[int] = []
    real_payload_reset = EventPayloads.reset

    def counted(self: EventPayloads) -> None:
        payload_resets.append(len(calls))
        real_payload_reset(self)

    monkeypatch.setattr(CPUOffloadingManager, "reset_cache", refused_once)
    monkeypatch.setattr(EventPayloads, "reset", counted)
    sc = dataclasses.replace(SCENARIOS["reset_loads"], kv_events=True)
    ours = run_vllm(sc, "statecore")
    assert ours.counters["resets_failed"] == 1  # vLLM's reset_connector_cache said False
    assert len(calls) == 2  # the next build_connector_meta retried it, and it took
    # the KV-event payloads went stale with the reset that took, not the one that failed
    assert payload_resets == [2]
    assert ours.errors == [] and ours.events
    assert payload_findings(ours.events, block_size=BLOCK_SIZE) == []
    assert all(v == 0 for v in ours.leftovers.values()), ours.leftovers


def test_preemption_is_frequent() -> None:
    assert run("preemption", "statecore").counters.get("preempted", 0) >= 10


def test_injected_load_failures_are_recomputed() -> None:
    ours = run("failures", "statecore")
    assert ours.counters.get("jobs_failed", 0) > 0
    assert ours.errors == []


def test_injected_load_failures_fail_requests_under_the_fail_policy() -> None:
    ours = run_vllm(dataclasses.replace(SCENARIOS["failures"], failure_policy="fail"), "statecore")
    failed = ours.counters.get("jobs_failed", 0)
    assert failed > 0 and 0 < len(ours.errors) <= failed  # vLLM aborts those requests
    assert all(v == 0 for v in ours.leftovers.values()), ours.leftovers


def test_tiering_cascades_to_the_file_tier_and_promotes_back() -> None:
    ours = run("tiering", "statecore")
    assert ours.counters.get("cascades_submitted", 0) > 0
    assert ours.counters.get("promotions_submitted", 0) > 0
    assert ours.counters.get("cascades_failed", 0) == 0
    assert ours.counters.get("promotions_failed", 0) == 0
    assert ours.counters.get("load_jobs", 0) > 0


def _by_step(events: list[tuple[Any, ...]]) -> dict[int, Counter[tuple[Any, ...]]]:
    steps: dict[int, Counter[tuple[Any, ...]]] = defaultdict(Counter)
    for step, *ev in events:
        steps[step][tuple(ev)] += 1
    return steps


def test_event_streams_match_upstream() -> None:
    upstream, ours = run("events", "vllm"), run("events", "statecore")
    assert len(upstream.events) > 100
    # vLLM publishes one batch per engine step; inside a batch its order follows a set of
    # keys (PYTHONHASHSEED-dependent), so batches are compared as multisets
    assert _by_step(ours.events) == _by_step(upstream.events)
    stored = [e for e in ours.events if e[1] == "stored"]
    assert all(len(e[4]) == 16 and e[5] == 16 and e[6] == "CPU" for e in stored)
    # parent hashes chain chunks, also across batches (a parent announced in an earlier step)
    first_step = {e[2][0]: e[0] for e in stored}
    assert any(e[3] is not None and first_step.get(e[3], e[0]) < e[0] for e in stored)
    # every payload describes its chunk (its token ids hash to its block hashes), in both
    for res in (upstream, ours):
        assert payload_findings(res.events, block_size=BLOCK_SIZE) == [], res.connector


def test_removal_events_name_announced_chunks() -> None:
    for connector in ("vllm", "statecore"):
        events = run("events_evict", connector).events
        announced: set[Any] = set()
        removed = 0
        for _, kind, hashes, *_rest in events:
            if kind == "stored":
                announced.update(hashes)
            else:
                assert set(hashes) <= announced, connector
                removed += len(hashes)
        assert removed > 0, connector
    # a chunk evicted and stored again in one step keeps its payload for the new store's
    # event (vLLM's connector announces such chunks with the placeholder payload)
    assert payload_findings(run("events_evict", "statecore").events, block_size=BLOCK_SIZE) == []


def test_prometheus_metrics_from_a_run() -> None:
    import prometheus_client as pc

    from statecore.adapters.vllm import StatecoreOffloadingConnector

    ours = run("steady", "statecore")
    reg = pc.CollectorRegistry()
    types = {
        kind: functools.partial(cls, registry=reg)
        for kind, cls in (
            (pc.Counter, pc.Counter),
            (pc.Gauge, pc.Gauge),
            (pc.Histogram, pc.Histogram),
        )
    }
    cfg = type("Cfg", (), {"kv_transfer_config": None})()
    prom = StatecoreOffloadingConnector.build_prom_metrics(cfg, types, ["engine"], {0: ["0"]})
    prom.observe(ours.stats, 0)
    loads = reg.get_sample_value("vllm:kv_offload_load_size_count", {"engine": "0"})
    assert loads == ours.counters["load_jobs"]
    lookups = reg.get_sample_value("statecore:kv_offload_lookups_total", {"engine": "0"})
    assert lookups is not None and lookups > 0


def test_layout_answer_matches_upstream() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    from statecore.adapters.vllm import StatecoreOffloadingConnector

    cfg = type("Cfg", (), {"attention_config": type("A", (), {"hisparse_config": None})()})()
    assert StatecoreOffloadingConnector.get_required_kvcache_layout(cfg) == (
        OffloadingConnector.get_required_kvcache_layout(cfg)
    )


def test_unmodelled_group_kinds_are_refused_at_start_up() -> None:
    import torch
    from vllm.v1 import kv_cache_interface as iface

    from statecore.adapters.vllm import _group_config

    attn: dict[str, Any] = {"block_size": 16, "num_kv_heads": 1, "head_size": 1}
    mamba = iface.MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,))
    local = iface.ChunkedLocalAttentionSpec(**attn, dtype=torch.float32, attention_chunk_size=64)
    for spec, what in ((mamba, "Mamba"), (local, "chunked local attention")):
        group = iface.KVCacheGroupSpec(["layer"], spec)
        with pytest.raises(ConfigError, match=f"group 3 is a {what}"):
            _group_config(3, group)
    full = iface.FullAttentionSpec(**attn, dtype=torch.float32)
    assert _group_config(0, iface.KVCacheGroupSpec(["layer"], full)).sliding_window is None


def test_every_extra_config_key_vllm_reads_is_in_the_table() -> None:
    import vllm

    from statecore.adapters.vllm_keys import EXTRA_KEYS

    root = Path(vllm.__file__).parent
    files = [
        *root.glob("distributed/kv_transfer/kv_connector/v1/offloading*.py"),
        *root.glob("distributed/kv_transfer/kv_connector/v1/offloading/*.py"),
        *root.glob("v1/kv_offload/*.py"),
        *root.glob("v1/kv_offload/cpu/*.py"),
        root / "v1/kv_offload/tiering/spec.py",
    ]
    keys: set[str] = set()
    for f in files:
        keys |= set(re.findall(r"extra_config\.get\(\s*\"([a-z_]+)\"", f.read_text()))
    assert len(keys) >= 12, keys
    assert keys <= set(EXTRA_KEYS), keys - set(EXTRA_KEYS)


def test_loaded_through_kv_connector_module_path() -> None:
    code = (
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "ktc = KVTransferConfig(kv_connector='StatecoreOffloadingConnector',"
        " kv_connector_module_path='statecore.adapters.vllm', kv_role='kv_both')\n"
        "print(KVConnectorFactory.get_connector_class(ktc).__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "statecore.adapters.vllm"


def test_connector_state_stays_bounded_when_stats_are_never_asked() -> None:
    """The retained-state oracle inside vLLM's engine: an embedding that never asks for the
    connector's stats (vLLM's engine asks every step; here the call answers nothing and drains
    nothing), 800 steps of short requests, then every container the scheduler-role connector
    reaches (its scheduler, manager, per-job transfer sizes) is within the live bound (as
    tests/test_retained_state.py's standalone oracle)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from retained import RETAINED_SCENARIO, containers

    sc = RETAINED_SCENARIO
    found: dict[str, Any] = {}

    def probe(step: int, timer: Any, res: RunResult, submitted: int) -> bool:
        conn = timer.target
        if step == 0:
            conn.get_kv_connector_stats = lambda: None  # never asked
        timer.steps.clear()  # the benchmark's own records (not under test)
        if step < 800:
            return False
        found["sizes"] = containers(conn, "connector")
        found["submitted"] = submitted
        found["bound"] = (
            sc.num_cpu_chunks() + sc.num_gpu_blocks() + sc.concurrency + len(conn.scheduler.jobs)
        )
        return True

    run_vllm(sc, "statecore", probe)
    bound = found["bound"]
    assert found["submitted"] > 4 * bound, found["submitted"]
    sizes = found["sizes"]
    assert "connector.scheduler.manager._entries" in sizes  # the walk reached the manager
    grown = {where: n for where, n in sizes.items() if n > bound}
    assert grown == {}, f"containers beyond the live bound {bound}: {grown}"


def test_the_engine_without_a_connector_is_the_engine_step_baseline() -> None:
    """The no-connector run: the same request stream, finished with the same outputs as both
    connectors where those outputs are the engine's alone (no CPU hit changes a token), and
    an engine-step summary for each run, hooks included."""
    sc = dataclasses.replace(BASE, gc_stats=True)
    none, ours = run_vllm(sc, "none"), run_vllm(sc, "statecore")
    assert not none.errors and len(none.outputs) == none.counters["requests"]
    assert none.outputs == ours.outputs  # sampled tokens do not depend on where KV came from
    assert none.summary["sum of 4 hooks"]["median_us"] == 0  # no hook ran
    for res in (none, ours):
        e = res.engine_step
        assert e["steps"] > 0 and e["median_us"] > 0 and "collections" in e
    assert ours.engine_step["median_us"] > ours.summary["sum of 4 hooks"]["median_us"]


OUT_OF_TREE = dataclasses.replace(
    BASE,
    extra=(("spec_name", "OutOfTreeCPUSpec"), ("spec_module_path", "vllm_oot_spec")),
)
"""``steady`` with an out-of-tree spec (tests/vllm/vllm_oot_spec.py: vLLM's CPU spec under
another name): statecore's scheduler runs vLLM's own CPU manager through
statecore.adapters.vllm_spec."""


def test_an_out_of_tree_specs_manager_runs_behind_statecores_scheduler() -> None:
    upstream = run_vllm(OUT_OF_TREE, "vllm")
    ours = run_vllm(OUT_OF_TREE, "statecore")
    assert not upstream.errors and not ours.errors
    assert ours.outputs == upstream.outputs
    assert upstream.counters.get("load_jobs", 0) > 0, "scenario produced no CPU hits"
    assert ours.hits == upstream.hits
    assert ours.loads == upstream.loads
    for key in ("load_jobs", "store_jobs", "flushed", "lookups_deferred", "preempted"):
        assert ours.counters.get(key, 0) == upstream.counters.get(key, 0), key
    assert all(v == 0 for v in ours.leftovers.values()), ours.leftovers


def _vllm_config(extra: dict[str, Any]) -> Any:
    """A vLLM configuration of the tiny model with statecore's connector and ``extra``."""
    from vllm import config as vcfg

    from statecore.bench.scheduler import _model_dir

    model = _model_dir()
    return vcfg.VllmConfig(
        model_config=vcfg.ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True),
        cache_config=vcfg.CacheConfig(block_size=4, enable_prefix_caching=True),
        kv_transfer_config=vcfg.KVTransferConfig(
            kv_connector="StatecoreOffloadingConnector",
            kv_connector_module_path="statecore.adapters.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=vcfg.DeviceConfig("cpu"),
    )


def _kv_cache_config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer{i}"], sp) for i, sp in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_an_out_of_tree_spec_needs_no_cpu_capacity_on_the_scheduler_side() -> None:
    """The scheduler side of an out-of-tree spec asks the spec's manager, which owns its
    capacity: a configuration without ``num_cpu_chunks`` or ``cpu_bytes_to_use`` builds, as
    vLLM's connector builds it (vLLM's own test fixture selects such a spec)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from statecore.adapters.vllm import build_scheduler
    from statecore.adapters.vllm_spec import VllmSpecManager

    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    extra = {"spec_name": "FixedCapacitySpec", "spec_module_path": "vllm_oot_spec"}
    sched = build_scheduler(_vllm_config(extra), _kv_cache_config(spec))
    assert isinstance(sched.manager, VllmSpecManager)


@pytest.mark.parametrize("window,extra_retained", [(8, 0), (8, 1), (8, 3), (13, 2), (16, 9)])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_sliding_window_counts_the_tokens_its_group_retains_beyond_it(
    window: int, extra_retained: int, blocks_per_chunk: int
) -> None:
    """A sliding-window group that retains tokens beyond its window (vLLM's
    ``extra_retained_tokens``, for MTP) needs them on a hit too: statecore's window in chunks
    is vLLM's connector's, so a hit restores every block the engine keeps for the group."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from statecore.adapters.vllm import scheduler_config_from_vllm

    common: dict[str, Any] = {"num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    swa = SlidingWindowSpec(
        block_size=4, sliding_window=window, extra_retained_tokens=extra_retained, **common
    )
    kcc = _kv_cache_config(FullAttentionSpec(block_size=4, **common), swa)
    extra = {"num_cpu_chunks": 16, "blocks_per_chunk": blocks_per_chunk}
    cfg = scheduler_config_from_vllm(_vllm_config(extra), kcc)
    assert cfg.window_chunks(1) == get_sliding_window_size_in_chunks(swa, 4 * blocks_per_chunk)


def test_a_chunk_a_lookup_hit_gets_the_requests_payload_for_its_promotion_event() -> None:
    """vLLM's connector records a KV-event payload for a chunk its lookup finds offloaded;
    statecore's did so only for chunks its requests stored, so the promotion of a chunk stored
    before a reset (or by another engine sharing the tier) was announced with a placeholder."""
    from types import SimpleNamespace

    from statecore.adapters.vllm import EventPayloads
    from statecore.keys import make_offload_key
    from statecore.manager import Medium, OffloadingEvent

    hashes = [bytes([i]) * 16 for i in range(1, 3)]
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(8)), lora_request=None)
    payloads = EventPayloads(True, [4], [4], 4, [True], [("full_attention", None)])
    key = make_offload_key(hashes[1], 0)
    payloads.record_lookup(request, [key])
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert (stored.token_ids, stored.block_size) == ([4, 5, 6, 7], 4)
    [removed] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])
    assert len(removed.block_hashes) == 1 and removed.group_idx == 0


def _payloads_of_one_chunk() -> tuple[Any, Any, Any]:
    """An ``EventPayloads`` of one full-attention group (chunks of 4 tokens), a request of two
    chunks, and the key of its second chunk."""
    from types import SimpleNamespace

    from statecore.adapters.vllm import EventPayloads
    from statecore.keys import make_offload_key

    hashes = [bytes([i]) * 16 for i in range(1, 3)]
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(8)), lora_request=None)
    payloads = EventPayloads(True, [4], [4], 4, [True], [("full_attention", None)])
    return payloads, request, make_offload_key(hashes[1], 0)


def test_a_chunk_stored_again_after_a_reset_keeps_its_payload_through_the_resets_removal() -> None:
    """A reset announces the chunks it drops as removed; a running request stores them again
    from its first chunk on, and its store jobs are built before the reset's removal event is
    converted. That removal named the old copy and dropped the payload just recorded for the
    new one, so the new copy was announced with the placeholder (the payload oracle found 653
    such chunks in one reset run)."""
    from statecore.manager import Medium, OffloadingEvent

    payloads, request, key = _payloads_of_one_chunk()
    payloads.record_store(request, [key])
    payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    payloads.reset()
    payloads.record_store(request, [key])  # the request's store job, built after the reset
    [removed] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])
    assert len(removed.block_hashes) == 1
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert (stored.token_ids, stored.block_size) == ([4, 5, 6, 7], 4)


def test_a_chunk_evicted_and_stored_again_in_one_step_keeps_its_payload() -> None:
    """An eviction (made while a store job is prepared) and a store job of the same chunk in
    one step: the removal event, converted after the store job recorded its payload, names
    the evicted copy and must leave the new copy's payload for its store event (vLLM's
    connector loses it too: 44 placeholder announcements in the events_evict run)."""
    from statecore.manager import Medium, OffloadingEvent

    payloads, request, key = _payloads_of_one_chunk()
    payloads.record_store(request, [key])
    payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    payloads.record_store(request, [key])  # stored again; the eviction's event is queued
    [removed] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])
    assert len(removed.block_hashes) == 1
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert (stored.token_ids, stored.block_size) == ([4, 5, 6, 7], 4)
    [removed] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert stored.block_size == 0  # announced since, then removed: the payload is gone


def test_a_lookup_hits_payload_outlives_a_removal_only_while_its_store_is_to_come() -> None:
    """A chunk found ready is the copy the next removal names: its payload goes with it. A
    chunk found write-pending (a promotion in flight) has a store event to come, so a removal
    converted before it names an earlier copy (dropped by a reset, or evicted in that step)
    and leaves the payload for the store event."""
    from statecore.manager import Medium, OffloadingEvent

    payloads, request, key = _payloads_of_one_chunk()
    payloads.record_lookup(request, [key])  # found ready
    payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert stored.block_size == 0  # its payload went with the removed copy
    payloads.reset()
    payloads.record_lookup(request, [key], pending={key})  # a promotion after the reset
    payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])  # the reset's removal
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert (stored.token_ids, stored.block_size) == ([4, 5, 6, 7], 4)
    payloads.record_lookup(request, [key], pending={key})  # evicted, promoted again at once
    payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, True)])
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert (stored.token_ids, stored.block_size) == ([4, 5, 6, 7], 4)


def test_stores_a_reset_flushed_leave_nothing_behind() -> None:
    """Store jobs in flight at a reset are flushed and never announced: once the reset's
    events are converted, the payloads hold as much as fresh ones (every container reached,
    by size)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from retained import containers

    from statecore.keys import make_offload_key

    payloads, request, _ = _payloads_of_one_chunk()
    fresh = containers(_payloads_of_one_chunk()[0], "payloads")
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    payloads.record_store(request, keys)  # both chunks' store job, in flight at the reset
    assert containers(payloads, "payloads") != fresh
    payloads.reset()
    assert payloads.to_kv_events([]) == []
    assert containers(payloads, "payloads") == fresh


def test_a_chunk_moved_into_a_secondary_tier_is_announced_there_with_its_payload() -> None:
    """A tiering manager moves a chunk the CPU tier evicts into its file tier: the CPU removal
    and the file tier's store come in one batch, removal first. The removal dropped the
    payload, so the file tier's copy was announced with the placeholder (about 500 of 1,731
    file-tier stores in one tiering run). The payload now goes at the end of the batch: it
    lives with the CPU tier's copy (and stores still to come), as before."""
    from statecore.manager import Medium, OffloadingEvent

    payloads, request, key = _payloads_of_one_chunk()
    payloads.record_store(request, [key])
    payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    _, stored = payloads.to_kv_events(
        [OffloadingEvent((key,), Medium.CPU, True), OffloadingEvent((key,), Medium.STORAGE, False)]
    )
    assert (stored.token_ids, stored.medium) == ([4, 5, 6, 7], "STORAGE")
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.CPU, False)])
    assert stored.block_size == 0  # gone with the CPU copy (a promotion's lookup records it)
    payloads.record_lookup(request, [key])  # found ready: promoted since
    payloads.to_kv_events(  # evicted, and promoted again, in one batch
        [OffloadingEvent((key,), Medium.CPU, True), OffloadingEvent((key,), Medium.CPU, False)]
    )
    [stored] = payloads.to_kv_events([OffloadingEvent((key,), Medium.STORAGE, False)])
    assert stored.token_ids == [4, 5, 6, 7]  # a CPU copy is left: the payload stays

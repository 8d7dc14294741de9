"""statecore's connector scheduler side in place of vLLM 0.33's ``OffloadingConnectorScheduler``
(the plugin's ``scheduler`` mode; see statecore_substitute.py).

vLLM's ``OffloadingConnector`` builds its scheduler side by the name
``OffloadingConnectorScheduler`` of its module; the plugin rebinds that name to
:class:`StatecoreConnectorScheduler`. The engine's connector, the test fixtures and the test
bodies stay vLLM's, unchanged; every scheduler-side decision (lookups, load and store jobs,
fences, flushes, manager calls) is made by statecore's
:class:`~statecore.adapters.vllm.StatecoreOffloadingConnector` (scheduler role).

The test's spec (vLLM's out-of-tree spec path: ``spec_name`` + ``spec_module_path``) supplies
the manager, a mock, which runs behind statecore's scheduler through statecore's
:class:`~statecore.adapters.vllm_spec.VllmSpecManager`. The worker side stays vLLM's
``OffloadingConnectorWorker`` over the spec's own worker: the scenarios assert on the transfers
the spec's worker received (which GPU blocks went to which offload keys), so the worker must be
one that hands the spec's own load/store specs to it. statecore's metadata is therefore converted
to vLLM's ``OffloadingConnectorMetadata`` at the boundary (types only: job ids, request ids, the
GPU side as vLLM's ``GPULoadStoreSpec``, the manager's own spec as the manager returned it), and
vLLM's ``OffloadingWorkerMetadata`` back to statecore's.

Two things are not statecore's production path, both for the mock's sake: the manager's load and
store specs travel as the manager returned them (:class:`ManagerSpec`; statecore's own workers
need CPU slots, vLLM's worker hands any spec to the spec's worker), and the scheduler side needs
no CPU capacity (``num_cpu_chunks``) since the spec's manager owns it.

The vLLM-internal attributes the fixture or the tests read are name shims: read-only views of
statecore's equivalents (:data:`VIEWS`, the request states, the configuration, the events
tracker) or calls into statecore's own lookup (``_lookup``, ``_maximal_prefix_lookup``), each
recorded per test (:mod:`shims`) so that the table shows which tests pass through which shim.
Any other private attribute is refused with an ``AttributeError`` that says it is
vLLM-internal, and so is assigning one (tests that replace vLLM's private lookup or
configuration cannot steer statecore).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shims import used
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as vllm_connector
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common as vllm_common
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as vllm_sched
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import TransferJobStatus
from vllm.v1.kv_offload import base as vb
from vllm.v1.kv_offload.cpu import common as vllm_cpu

from statecore import kernels
from statecore.adapters import vllm as sc_vllm
from statecore.adapters import vllm_spec
from statecore.errors import ConfigError
from statecore.keys import OffloadKey, key_group
from statecore.manager import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadPolicy,
    ReqContext,
)
from statecore.scheduler import planning
from statecore.scheduler.records import GroupState
from statecore.wire import (
    DirectionStats,
    GPULoadStoreSpec,
    TransferJob,
    TransferStats,
    WorkerMetadata,
)


@dataclass(frozen=True, slots=True)
class ManagerSpec(LoadStoreSpec):
    """A vLLM manager's own load/store spec, carried unchanged to vLLM's worker."""

    spec: Any


PrefixHits = Callable[[Sequence[OffloadKey], ReqContext], "int | None"]
"""How many of a full-attention group's keys, looked up from the request's first uncomputed
chunk on, the offloading store holds (None: a lookup the store deferred)."""


class PassThroughSpecManager(vllm_spec.VllmSpecManager):
    """statecore's conversion of a vLLM manager, with the manager's specs carried as they are
    (vLLM's worker hands them to the spec's worker) instead of read as CPU slots.

    :attr:`prefix_hits`, when set, states what the offloading store holds for full-attention
    groups instead of the manager: a scenario's stub of vLLM's maximal-prefix lookup
    (:meth:`StatecoreConnectorScheduler.__setattr__`). The keys it covers hit, the first key
    after them misses; sliding-window groups' keys are still the manager's to answer.
    """

    prefix_hits: PrefixHits | None = None
    full_attention_groups: frozenset[int] = frozenset()

    def lookup_many(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, until_miss: bool = False
    ) -> list[LookupResult]:
        answer = self.prefix_hits
        if answer is None or not keys or key_group(keys[0]) not in self.full_attention_groups:
            return super().lookup_many(keys, ctx, until_miss)
        hits = answer(keys, ctx)
        if hits is None:  # (vLLM's lookup deferred: the store is still locating a key)
            return [LookupResult.RETRY] * len(keys)
        hits = max(0, min(int(hits), len(keys)))
        misses = len(keys) - hits
        if until_miss:
            misses = min(misses, 1)
        return [LookupResult.HIT] * hits + [LookupResult.MISS] * misses

    def _load_store_spec(self, spec: Any, call: str, n_keys: int) -> LoadStoreSpec:
        return ManagerSpec(spec)


def _spec_manager(vllm_config: Any, kv_cache_config: Any) -> vllm_spec.VllmSpecManager:
    return PassThroughSpecManager(vllm_spec.load_spec(vllm_config, kv_cache_config).get_manager())


# ---------------------------------------------------------------------------------------------
# Metadata at the boundary
# ---------------------------------------------------------------------------------------------


def _vllm_spec(spec: LoadStoreSpec) -> Any:
    if isinstance(spec, GPULoadStoreSpec):
        return vb.GPULoadStoreSpec(
            list(spec.block_ids), list(spec.group_sizes), list(spec.block_indices)
        )
    if isinstance(spec, ManagerSpec):
        return spec.spec
    if isinstance(spec, CPULoadStoreSpec):
        # statecore's own CPU tier (a vLLM registered spec: statecore builds its own tiers):
        # the same chunk indices into the CPU pool, under vLLM's type
        return vllm_cpu.CPULoadStoreSpec(list(spec.slots))
    raise TypeError(f"no vLLM form for statecore's {type(spec).__name__}")


def _vllm_job(job: TransferJob) -> vllm_common.TransferJob:
    return vllm_common.TransferJob(job.req_id, _vllm_spec(job.src), _vllm_spec(job.dst))


def to_vllm_metadata(meta: Any) -> vllm_common.OffloadingConnectorMetadata:
    """statecore's step metadata (in the adapter's wrapper) as vLLM's."""
    inner = meta.inner
    return vllm_common.OffloadingConnectorMetadata(
        load_jobs={i: _vllm_job(j) for i, j in inner.load_jobs.items()},
        store_jobs={i: _vllm_job(j) for i, j in inner.store_jobs.items()},
        jobs_to_flush=set(inner.jobs_to_flush),
    )


def _direction(stats: Any) -> DirectionStats:
    return DirectionStats(int(stats.bytes), float(stats.time), [int(s) for s in stats.sizes])


def to_statecore_report(meta: Any) -> sc_vllm.StatecoreWorkerMetadata | None:
    """vLLM's aggregated worker report as statecore's (per job: workers that completed it)."""
    if not isinstance(meta, vllm_common.OffloadingWorkerMetadata):
        return None
    stats = TransferStats(
        _direction(meta.transfer_stats.load), _direction(meta.transfer_stats.store)
    )
    return sc_vllm.StatecoreWorkerMetadata(
        WorkerMetadata(completed=dict(meta.completed_jobs), stats=stats)
    )


# ---------------------------------------------------------------------------------------------
# Read-only views of statecore's state under the names vLLM's tests read
# ---------------------------------------------------------------------------------------------


class FieldView:
    """A configuration under vLLM's field names, read-only. A field statecore has a counterpart
    for reads statecore's value; a field it has none for (EAGLE groups, the sliding-window
    store horizon's alignment and retention, the KV bytes per token) reads vLLM's own value for
    the same engine configuration (vLLM's ``SchedulerOffloadConfig.from_spec``), which
    statecore does not act on: the shim lets the test go on to what it asserts about
    behaviour. ``_replace`` gives vLLM's configuration with the change (assigning it back is
    the scheduler's affair: :meth:`StatecoreConnectorScheduler.__setattr__`)."""

    __slots__ = ("_fields", "_label", "_vllm")

    def __init__(self, label: str, fields: Mapping[str, Any], vllm: Any) -> None:
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_fields", dict(fields))
        object.__setattr__(self, "_vllm", vllm)

    def __getattr__(self, name: str) -> Any:
        label = object.__getattribute__(self, "_label")
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            used(f"{label}.{name}")
            return fields[name]
        vllm = object.__getattribute__(self, "_vllm")
        if not name.startswith("__") and hasattr(vllm, name):
            used(f"{label}.{name} (vLLM's value)")
            return getattr(vllm, name)
        raise AttributeError(
            f"{name!r}: a vLLM-internal name of vLLM's scheduler configuration that statecore's "
            "configuration does not expose"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{name!r}: vLLM's configuration is read-only here")

    def __repr__(self) -> str:
        label = object.__getattribute__(self, "_label")
        return f"FieldView({label}, {object.__getattribute__(self, '_fields')!r})"


def _config_view(sched: Any, vllm_config: Any) -> FieldView:
    """statecore's scheduler configuration under vLLM's field names (``vllm_config``: vLLM's
    ``SchedulerOffloadConfig`` for the same engine configuration, for the fields statecore has
    no counterpart for)."""
    cfg = sched.config
    groups = tuple(
        FieldView(
            f"config.kv_group_configs[{i}]",
            {
                "group_idx": i,
                "tokens_per_block": g.tokens_per_block,
                "tokens_per_chunk": cfg.tokens_per_chunk(i),
                "hashes_per_chunk": cfg.hashes_per_chunk(i),
                "sliding_window_size_in_chunks": cfg.window_chunks(i),
            },
            vllm_config.kv_group_configs[i],
        )
        for i, g in enumerate(cfg.groups)
    )
    return FieldView(
        "config",
        {
            "kv_group_configs": groups,
            "blocks_per_chunk": cfg.blocks_per_chunk,
            "tokens_per_hash": cfg.hash_tokens,
            "num_workers": cfg.num_workers,
            "offload_prompt_only": cfg.offload_prompt_only,
        },
        vllm_config,
    )


def _job_view(job: Any) -> TransferJobStatus:
    return TransferJobStatus(
        req_id=job.req.req_id,
        pending_count=job.pending,
        keys=set(job.keys),
        is_store=job.is_store,
        deferred_fence_block_ids=list(job.deferred_fence) or None,
        fenced_block_ids=list(job.fenced) or None,
    )


class ManagerView:
    """A manager statecore built itself (a vLLM registered spec: statecore's own tiers), with
    the calls the tests make on vLLM's manager converted to and from vLLM's types (request
    contexts, lookup results, the policy). Types only: every call goes to statecore's manager
    once, unchanged; any other attribute is refused."""

    def __init__(self, manager: Any) -> None:
        self.statecore = manager
        self._contexts: dict[int, ReqContext] = {}

    def _ctx(self, vctx: Any) -> ReqContext:
        ctx = self._contexts.get(id(vctx))
        if ctx is None:  # (one statecore context a vLLM context, as the managers keep state)
            ctx = self._contexts[id(vctx)] = ReqContext(vctx.req_id, vctx.kv_transfer_params)
        return ctx

    def lookup(self, key: Any, req_context: Any) -> Any:
        return vb.LookupResult[self.statecore.lookup(key, self._ctx(req_context)).name]

    def on_new_request(self, req_context: Any) -> Any:
        got = self.statecore.on_new_request(self._ctx(req_context))
        return vb.RequestOffloadingContext(vb.OffloadPolicy[got.policy.name])

    def on_request_finished(self, req_context: Any) -> None:
        self.statecore.on_request_finished(self._contexts.pop(id(req_context)))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{name!r}: statecore's own manager is seen through vLLM's lookup, on_new_request "
            "and on_request_finished only"
        )


class ReadOnlyView:
    """A live, read-only view under vLLM's names (each read asks statecore's record again):
    any other name, read or assigned, is refused with an ``AttributeError`` that says it is
    vLLM-internal."""

    __slots__ = ("_fields", "_label")

    def __init__(self, label: str, **fields: Callable[[], Any]) -> None:
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            used(f"{object.__getattribute__(self, '_label')}.{name}")
            return fields[name]()
        raise AttributeError(
            f"{name!r}: a vLLM-internal name of vLLM's request state that statecore's "
            "request records do not expose"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{name!r}: a vLLM-internal name of vLLM's request state; assigning it cannot "
            "steer statecore's scheduler"
        )


class ReadOnlyList(tuple[Any, ...]):
    """A read-only sequence: changing it in place is refused as vLLM-internal steering."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{name!r}: a vLLM-internal name (changing vLLM's request state in place cannot "
            "steer statecore's scheduler)"
        )


def _group_view(gs: Any, chunk_level: Callable[[], bool]) -> ReadOnlyView:
    """One group of a tracked request. ``next_stored_chunk_idx`` is vLLM's next chunk to
    offer for storing: statecore's store cursor, or, under the chunk-level policy (whose
    loaded chunks are never offered again), the chunks loaded at admission if more."""
    return ReadOnlyView(
        "_req_status[].group_states[]",
        offload_keys=lambda: ReadOnlyList(gs.keys),
        block_ids=lambda: ReadOnlyList(gs.block_ids),
        next_stored_chunk_idx=lambda: max(gs.cursor, gs.skip) if chunk_level() else gs.cursor,
    )


def _request_view(owner: StatecoreConnectorScheduler, rec: Any) -> ReadOnlyView:
    """One tracked request of statecore's scheduler under the names of vLLM's request state:
    the request, its context (as vLLM's manager sees it), its keys and block ids per group,
    its jobs in flight and its locally computed tokens. (vLLM's ``next_stored_chunk_idx`` has
    no single counterpart: statecore keeps a store cursor and, apart, the chunks loaded at
    admission, which the request's policy decides whether to offer again.)"""

    def ctx() -> Any:
        manager = owner.scheduler.manager
        if isinstance(manager, vllm_spec.VllmSpecManager):
            return manager._ctx(rec.ctx)
        return rec.ctx

    def update_offload_keys() -> Callable[[], None]:
        # vLLM's name for turning the request's new block hashes into keys: statecore's own
        return lambda: owner.scheduler._update_keys(rec)

    chunk_level = lambda: rec.policy is OffloadPolicy.CHUNK_LEVEL  # noqa: E731
    groups = tuple(_group_view(gs, chunk_level) for gs in rec.groups)
    return ReadOnlyView(
        "_req_status[]",
        req=lambda: owner.vllm_requests.get(rec.req_id),
        update_offload_keys=update_offload_keys,
        req_context=ctx,
        group_states=lambda: groups,
        transfer_jobs=lambda: frozenset(rec.jobs),
        num_locally_computed_tokens=lambda: rec.num_local_computed,
    )


class RequestStates(Mapping[str, ReadOnlyView]):
    """statecore's tracked requests by id, each as :func:`_request_view` (read-only)."""

    def __init__(self, owner: StatecoreConnectorScheduler) -> None:
        self._owner = owner

    def __getitem__(self, req_id: str) -> ReadOnlyView:
        used("_req_status")
        return _request_view(self._owner, self._owner.scheduler.requests[req_id])

    def __iter__(self) -> Iterator[str]:
        used("_req_status")
        return iter(list(self._owner.scheduler.requests))

    def __len__(self) -> int:
        return len(self._owner.scheduler.requests)

    def __setitem__(self, req_id: str, state: Any) -> None:
        raise TypeError(
            "'_req_status': a vLLM-internal name of OffloadingConnectorScheduler; assigning a "
            "request state cannot steer statecore's scheduler"
        )


VIEWS: Mapping[str, Callable[[Any], Any]] = {
    "_jobs": lambda s: {i: _job_view(j) for i, j in s.jobs.items()},
    "_block_id_to_pending_jobs": lambda s: {b: set(j) for b, j in s.fence_index.items()},
    "_chunks_being_loaded": lambda s: None if s.loading_keys is None else set(s.loading_keys),
    "_job_counter": lambda s: s.next_job_id,
    "_stale_job_threshold": lambda s: s.stale_threshold,
    "_current_batch_jobs_to_flush": lambda s: set(s._batch.flush),
    # statecore takes the manager's lock for each manager call and holds no region across a
    # step: vLLM's step-scoped region is never open between the connector's calls
    "_step_region": lambda s: None,
}
"""vLLM's private name -> statecore's equivalent, converted (read-only)."""


class EventsTrackerView:
    """vLLM's KV-event tracker under its private names, over statecore's
    :class:`~statecore.adapters.vllm.EventPayloads` (what the self-describing events carry
    for each offloaded chunk): ``_pending_event_metadata`` is the chunks statecore holds a
    payload for, ``reset`` forgets them as a cache reset does."""

    def __init__(self, payloads: sc_vllm.EventPayloads | None) -> None:
        self._payloads = payloads

    @property
    def _pending_event_metadata(self) -> Mapping[OffloadKey, Any]:
        used("_events_tracker._pending_event_metadata")
        return {} if self._payloads is None else dict(self._payloads._payloads)

    def reset(self) -> None:
        """vLLM's tracker reset: statecore's payload reset (the next events drop them)."""
        used("_events_tracker.reset")
        if self._payloads is not None:
            self._payloads.reset()
            self._payloads.to_kv_events(())


def _lookup_view(owner: StatecoreConnectorScheduler) -> Callable[..., int | None]:
    """vLLM's ``_lookup(req_status[, max_num_new_tokens])`` (the complete-chunk lookup of a
    request state the test built itself, keys given per group) through statecore's lookup
    plan (:func:`statecore.scheduler.planning.lookup_hits`) with the scheduler's own group
    order, chunk sizes, windows and manager: how many tokens beyond the locally computed ones
    load (0: none), or None to defer."""

    def lookup(req_status: Any, max_num_new_tokens: int | None = None) -> int | None:
        sched = owner.scheduler
        groups = []
        for vgs in req_status.group_states:
            gs = GroupState()
            gs.keys = list(vgs.offload_keys)
            groups.append(gs)
        num_computed = int(req_status.num_locally_computed_tokens)
        limit = 1 << 62
        if max_num_new_tokens is not None:
            limit = num_computed + max_num_new_tokens
        if req_status.max_load_tokens is not None:
            limit = min(limit, num_computed + req_status.max_load_tokens)
        max_hit = min(int(req_status.req.num_tokens) - sched._any_sliding, limit)
        ctx = ReqContext(req_status.req_context.req_id, req_status.req.kv_transfer_params)
        return planning.lookup_hits(
            groups,
            sched._lookup_order,
            sched._tpc,
            sched._window,
            num_computed,
            max_hit,
            limit,
            sched.config.max_recompute_pending_tokens,
            sched.manager.lookup_many,
            ctx,
        )

    return lookup


def _prefix_lookup_view(owner: StatecoreConnectorScheduler) -> Callable[..., int | None]:
    """vLLM's ``_maximal_prefix_lookup(keys, req_context, req, group_config, start)`` called
    by a test: statecore's manager asked for ``keys`` up to the first miss, decided by
    statecore's maximal-prefix kernel (:func:`statecore.kernels.prefix_hits`), the hits'
    KV-event payloads recorded from ``req`` as the adapter's lookup observer records them."""

    def prefix_lookup(keys: Any, req_context: Any, req: Any, *_: Any) -> int | None:
        sched = owner.scheduler
        keys = list(keys)
        rec = sched.requests.get(req_context.req_id)
        ctx = rec.ctx if rec is not None else ReqContext(req_context.req_id)
        results = sched.manager.lookup_many(keys, ctx, True)
        events = owner.statecore.events
        if events is not None:
            hit = (LookupResult.HIT, LookupResult.HIT_PENDING)
            events.record_lookup(req, [k for k, r in zip(keys, results, strict=False) if r in hit])
        return kernels.prefix_hits(results, sched.config.max_recompute_pending_tokens)

    return prefix_lookup


SPIES = frozenset(
    {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "take_events",
    }
)
"""Interface methods a test may wrap on the instance (to record calls or answers): vLLM's
connector calls the wrapper, which calls statecore's."""


class StatecoreConnectorScheduler:
    """vLLM's connector scheduler interface over statecore's connector (scheduler role).

    Built as vLLM's is, ``(spec, vllm_config, kv_cache_config)``; the spec's manager is built
    again by statecore's out-of-tree-spec path, from the same configuration.
    """

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        connector = sc_vllm.StatecoreOffloadingConnector(
            vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
        )
        sched = connector.scheduler
        assert sched is not None
        manager: Any = sched.manager
        if isinstance(manager, vllm_spec.VllmSpecManager):
            manager = manager.manager  # the spec's own (the test's mock)
        else:  # (vLLM's registered specs: statecore builds its own tiers)
            manager = ManagerView(manager)
        vllm_config_view = vllm_sched.SchedulerOffloadConfig.from_spec(
            spec, vllm_config, kv_cache_config
        )
        self.__dict__.update(
            statecore=connector,
            scheduler=sched,
            manager=manager,
            config=_config_view(sched, vllm_config_view),
            vllm_requests={},
        )

    def __getattr__(self, name: str) -> Any:
        view = VIEWS.get(name)
        if view is not None:
            used(name)
            return view(self.__dict__["scheduler"])
        if name == "_req_status":
            return RequestStates(self)
        if name == "_events_tracker":
            return EventsTrackerView(self.__dict__["statecore"].events)
        if name == "_lookup":
            used(name)
            return _lookup_view(self)
        if name == "_maximal_prefix_lookup":
            used(name)
            return _prefix_lookup_view(self)
        raise AttributeError(
            f"{name!r}: a vLLM-internal name of OffloadingConnectorScheduler that statecore's "
            "scheduler does not expose"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SPIES:  # a test's wrapper of an interface method (vLLM's connector calls it)
            self.__dict__[name] = value
            return
        if name == "_maximal_prefix_lookup" and isinstance(
            self.scheduler.manager, PassThroughSpecManager
        ):
            self.__dict__[name] = value
            self._state_prefix_hits(value)
            return
        if name == "manager" and isinstance(self.scheduler.manager, PassThroughSpecManager):
            self._replace_manager(value)
            return
        if name == "config" and getattr(value, "sync_load_budget_bytes", 0):
            # the configuration statecore refuses at start-up, refused the same way here
            raise ConfigError(
                "statecore connector: kv_connector_extra_config 'sync_load_budget_bytes': "
                "synchronous in-step loads are not implemented by statecore (it loads "
                "asynchronously); set sync_load_budget_bytes to 0"
            )
        raise AttributeError(
            f"{name!r}: a vLLM-internal name of OffloadingConnectorScheduler; assigning it "
            "cannot steer statecore's scheduler"
        )

    def _state_prefix_hits(self, stub: Callable[..., int | None]) -> None:
        """A scenario's stub of vLLM's maximal-prefix lookup, as what the store holds.

        vLLM calls it once per full-attention group and lookup, with the group's keys from the
        request's first uncomputed chunk to the end of what the lookup may load, the request's
        context, the request, the group's configuration and that first chunk's index; it
        answers how many of those keys, from the first, are offloaded (None: defer). Here the
        manager statecore's scheduler asks answers exactly those keys as hits and the next one
        as a miss, and statecore's own lookup (which keys, the convergence of the groups, the
        last chunk loaded in part) decides the hit on top of it.
        """
        sched = self.scheduler
        manager: PassThroughSpecManager = sched.manager
        config: Any = self.config

        def prefix_hits(keys: Sequence[OffloadKey], ctx: ReqContext) -> int | None:
            group = key_group(keys[0])
            start = sched.request_keys(ctx.req_id)[group].index(keys[0])
            request = self.vllm_requests.get(ctx.req_id)
            return stub(
                list(keys), manager._ctx(ctx), request, config.kv_group_configs[group], start
            )

        manager.full_attention_groups = frozenset(
            g.group_idx for g in config.kv_group_configs if g.sliding_window_size_in_chunks is None
        )
        manager.prefix_hits = prefix_hits

    def _replace_manager(self, manager: Any) -> None:
        """A scenario's own manager in place of the spec's: statecore's scheduler talks to it
        through the same conversion (what the store holds, if stated, stays stated)."""
        old: PassThroughSpecManager = self.scheduler.manager
        new = PassThroughSpecManager(manager)
        new.prefix_hits, new.full_attention_groups = old.prefix_hits, old.full_attention_groups
        self.scheduler.manager = new
        self.__dict__["manager"] = manager

    # -- vLLM's OffloadingConnectorScheduler interface, as OffloadingConnector calls it ------

    def on_new_request(self, request: Any) -> None:
        self.vllm_requests[request.request_id] = request
        self.statecore.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        # statecore offloads every group it accepts, so vLLM never sets this cap for it
        assert max_num_new_tokens is None
        self.vllm_requests[request.request_id] = request
        return self.statecore.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        return self.statecore.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.vllm_requests[request.request_id] = request
        self.statecore.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return to_vllm_metadata(self.statecore.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        report = to_statecore_report(connector_output.kv_connector_worker_meta)
        original = connector_output.kv_connector_worker_meta
        connector_output.kv_connector_worker_meta = report
        try:
            self.statecore.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = original

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.statecore.request_finished(request, [])

    def has_pending_push_work(self) -> bool:
        return self.statecore.has_pending_push_work()

    def take_events(self) -> Iterable[Any]:
        return self.statecore.take_events()

    def reset_cache(self) -> bool | None:
        return self.statecore.reset_cache()

    def get_stats(self) -> Any:
        return self.statecore.get_kv_connector_stats()

    def shutdown(self) -> None:
        self.statecore.shutdown()


def install() -> None:
    """Rebind vLLM's connector-scheduler name to statecore's, and carry the spec's own specs."""
    vllm_connector.OffloadingConnectorScheduler = StatecoreConnectorScheduler  # type: ignore[misc,assignment]
    vllm_spec.spec_manager = _spec_manager  # type: ignore[assignment]


__all__ = [
    "VIEWS",
    "ManagerSpec",
    "ManagerView",
    "PassThroughSpecManager",
    "StatecoreConnectorScheduler",
    "install",
    "to_statecore_report",
    "to_vllm_metadata",
]

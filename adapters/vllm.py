"""statecore as a vLLM 0.33 KV connector (``kv_connector_module_path``).

Load it with::

    KVTransferConfig(
        kv_connector="StatecoreOffloadingConnector",
        kv_connector_module_path="statecore.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"num_cpu_chunks": 40000, "eviction_policy": "lru"},
    )

A shared Redis/Valkey tier below the CPU tier is one more extra-config key (see
:func:`build_scheduler` for where the CPU pool must live)::

    "secondary_tiers": [{"kind": "redis", "url": "redis://cache:6379/0", "cluster": False}]

The scheduler role runs :class:`statecore.OffloadingScheduler` over a
:class:`statecore.managers.CPUOffloadingManager`; the worker role runs
:class:`statecore.worker.OffloadingWorker` over a transfer backend (the torch adapter once
``register_kv_caches`` hands over the KV tensors, or any backend given to
:meth:`StatecoreOffloadingConnector.attach_backend`).

The conversion layer is thin: :class:`VllmRequestView` reads a vLLM ``Request`` live,
:func:`to_scheduler_output` turns vLLM's ``SchedulerOutput`` into statecore's, and the wire
types travel wrapped in :class:`StatecoreConnectorMetadata` / :class:`StatecoreWorkerMetadata`.

How loads end, as vLLM expects it:

* a load that completed on every rank: the scheduler role adds the request to
  ``KVConnectorOutput.finished_recving`` inside ``update_connector_output`` (the engine reads
  that set right after the call);
* a load that did not complete successfully (a rank failed it, it stalled, or a cache reset
  discarded it): its GPU blocks are echoed to the workers in the next step's metadata, and
  every rank returns them from ``get_block_ids_with_load_errors`` (one KV-cache group) or
  ``failed_recving`` (several groups), together with the request in ``finished_recving``. The
  engine handles invalid blocks before it releases the request, so the tokens are recomputed.

Every vLLM import lives in this module; ``import statecore`` never needs vLLM.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

try:
    import torch
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import RequestStatus
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "statecore.adapters.vllm needs vLLM 0.33 (pip install vllm==0.33.0); "
        f"importing it failed: {exc}"
    ) from exc

from statecore.config import GroupConfig, SchedulerConfig
from statecore.errors import ConfigError
from statecore.keys import key_group, key_hash
from statecore.manager import OffloadingEvent, OffloadingManager
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.redistier import TierLayout
from statecore.managers.tierconfig import TIER_KINDS
from statecore.managers.tiering import TieringOffloadingManager
from statecore.pool import CPUPool
from statecore.scheduler import OffloadingScheduler
from statecore.views import ScheduledRequest, SchedulerOutput
from statecore.wire import ConnectorMetadata, WorkerMetadata
from statecore.worker import OffloadingWorker, TransferBackend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "StatecoreConnectorMetadata",
    "StatecoreConnectorStats",
    "StatecoreOffloadingConnector",
    "StatecoreWorkerMetadata",
    "VllmRequestView",
    "build_scheduler",
    "cpu_chunks_from_config",
    "scheduler_config_from_vllm",
    "secondary_tier_specs",
    "tier_layout_from_vllm",
    "to_kv_events",
    "to_scheduler_output",
]

_NO_BLOCKS: tuple[tuple[int, ...], ...] = ()


# --------------------------------------------------------------------------------------------
# Views: vLLM objects as statecore reads them
# --------------------------------------------------------------------------------------------


class VllmRequestView:
    """A vLLM ``Request`` as a :class:`statecore.RequestLike`, read live (no copies)."""

    __slots__ = ("_req",)

    def __init__(self, request: Request) -> None:
        self._req = request

    @property
    def request_id(self) -> str:
        """The request id."""
        return cast(str, self._req.request_id)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return cast(int, self._req.num_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        return cast(int, self._req.num_prompt_tokens)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed or loaded."""
        return cast(int, self._req.num_computed_tokens)

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """vLLM's block hashes (bytes), one per ``tokens_per_hash`` tokens."""
        return cast(Sequence[bytes], self._req.block_hashes)

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """Per-request connector parameters."""
        return cast("Mapping[str, Any] | None", self._req.kv_transfer_params)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Never load for this request."""
        return bool(getattr(self._req, "skip_reading_prefix_cache", False))

    @property
    def is_aborted(self) -> bool:
        """The request was aborted."""
        return bool(self._req.status == RequestStatus.FINISHED_ABORTED)


def to_scheduler_output(so: VllmSchedulerOutput, num_groups: int) -> SchedulerOutput:
    """vLLM's ``SchedulerOutput`` as statecore's (new requests first, then cached ones).

    Block id lists are passed through without copying (statecore only reads them during
    ``build_connector_meta``). A cached request with no new blocks gets empty lists.
    """
    nst: dict[str, int] = so.num_scheduled_tokens
    scheduled: list[ScheduledRequest] = []
    new_ids: list[str] = []
    for nr in so.scheduled_new_reqs:
        rid = nr.req_id
        new_ids.append(rid)
        scheduled.append(ScheduledRequest(rid, cast(Any, nr.block_ids), nst.get(rid, 0), False))
    cached = so.scheduled_cached_reqs
    if cached.req_ids:
        empty = tuple(() for _ in range(num_groups))
        resumed = cached.resumed_req_ids
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            scheduled.append(
                ScheduledRequest(
                    rid,
                    cast(Any, blocks) if blocks is not None else empty,
                    nst.get(rid, 0),
                    rid in resumed,
                )
            )
    return SchedulerOutput(
        scheduled=scheduled,
        new_req_ids=frozenset(new_ids),
        finished_req_ids=frozenset(so.finished_req_ids),
        preempted_req_ids=frozenset(so.preempted_req_ids or ()),
    )


def to_kv_events(
    events: Iterable[OffloadingEvent], tokens_per_chunk: Sequence[int]
) -> list[KVCacheEvent]:
    """statecore's stored/removed events as vLLM ``BlockStored`` / ``BlockRemoved`` events.

    One vLLM event per statecore event and KV-cache group; the block hashes are the chunk
    keys' hash part (the hash of each chunk's last block).
    """
    out: list[KVCacheEvent] = []
    for ev in events:
        by_group: dict[int, list[bytes]] = {}
        for key in ev.keys:
            by_group.setdefault(key_group(key), []).append(key_hash(key))
        medium = ev.medium.value
        for g, hashes in by_group.items():
            if ev.removed:
                out.append(BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=g))
            else:
                out.append(
                    BlockStored(
                        block_hashes=list(hashes),
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=tokens_per_chunk[g],
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        group_idx=g,
                    )
                )
    return out


# --------------------------------------------------------------------------------------------
# Wire types as vLLM carries them
# --------------------------------------------------------------------------------------------


@dataclass
class StatecoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers for one step.

    Attributes:
        inner: statecore's metadata (load jobs, store jobs, jobs to flush).
        load_error_blocks: GPU blocks of loads that did not complete successfully; every
            rank returns them from ``get_block_ids_with_load_errors``.
        load_error_reqs: the requests of those loads; every rank reports them finished
            (``finished_recving``), and failed (``failed_recving``) when
            ``report_failed_reqs``.
        report_failed_reqs: several KV-cache groups (block ids are not unique across
            groups): report failures by request instead of by block.
    """

    inner: ConnectorMetadata
    load_error_blocks: frozenset[int] = frozenset()
    load_error_reqs: frozenset[str] = frozenset()
    report_failed_reqs: bool = False


@dataclass
class StatecoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler for one step: statecore's per-job counts; ranks add up."""

    inner: WorkerMetadata = field(default_factory=WorkerMetadata)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Sum both reports' counts per job id."""
        if not isinstance(other, StatecoreWorkerMetadata):
            raise TypeError(f"cannot aggregate StatecoreWorkerMetadata with {type(other).__name__}")
        return StatecoreWorkerMetadata(self.inner.aggregate(other.inner))


@dataclass
class StatecoreConnectorStats(KVConnectorStats):
    """statecore's counters and the manager's metrics for vLLM's stats logger.

    Numbers add up when aggregated; lists concatenate.
    """

    def reset(self) -> None:
        """Forget everything."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s values into this object."""
        for k, v in other.data.items():
            mine = self.data.get(k)
            if mine is None:
                self.data[k] = list(v) if isinstance(v, list) else v
            elif isinstance(mine, list) and isinstance(v, list):
                mine.extend(v)
            elif isinstance(mine, int | float) and isinstance(v, int | float):
                self.data[k] = mine + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """Scalars as they are, lists as their sum."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, list):
                out[k] = float(sum(v))
            elif isinstance(v, int | float):
                out[k] = v
        return out

    def is_empty(self) -> bool:
        """No non-zero value."""
        return not any(v for v in self.data.values())


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _extra(vllm_config: VllmConfig) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError("statecore connector: vllm_config.kv_transfer_config is not set")
    return dict(ktc.kv_connector_extra_config or {})


def _blocks_per_chunk(extra: Mapping[str, Any], gpu_block_size: int) -> int:
    bpc = extra.get("blocks_per_chunk")
    tokens = extra.get("block_size")
    if bpc is not None and tokens is not None:
        raise ConfigError("statecore connector: give blocks_per_chunk or block_size, not both")
    if bpc is not None:
        return int(bpc)
    if tokens is not None:
        if int(tokens) % gpu_block_size:
            raise ConfigError(
                f"statecore connector: block_size {tokens} is not a multiple of the GPU "
                f"block size {gpu_block_size}"
            )
        return int(tokens) // gpu_block_size
    return 1


def scheduler_config_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> SchedulerConfig:
    """statecore's scheduler configuration from vLLM's configs and the extra config.

    Groups: every KV-cache group (full attention, or sliding window when its spec has a
    ``sliding_window``). Extra-config keys: ``blocks_per_chunk`` or ``block_size`` (tokens),
    ``offload_prompt_only`` (default True, as upstream), ``max_recompute_pending_tokens``,
    ``stall_timeout_s``, ``stall_check_interval_s``.
    """
    extra = _extra(vllm_config)
    groups: list[GroupConfig] = []
    for grp in kv_cache_config.kv_cache_groups:
        spec = grp.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        groups.append(GroupConfig(int(spec.block_size), int(window) if window else None))
    if not groups:
        raise ConfigError("statecore connector: the KV-cache config has no groups")
    kwargs: dict[str, Any] = {}
    for name, conv in (
        ("stall_timeout_s", float),
        ("stall_check_interval_s", float),
        ("max_recompute_pending_tokens", int),
    ):
        if name in extra:
            kwargs[name] = conv(extra[name])
    return SchedulerConfig(
        groups=tuple(groups),
        blocks_per_chunk=_blocks_per_chunk(extra, min(g.tokens_per_block for g in groups)),
        tokens_per_hash=int(vllm_config.cache_config.block_size),
        num_workers=int(vllm_config.parallel_config.world_size),
        offload_prompt_only=bool(extra.get("offload_prompt_only", True)),
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        **kwargs,
    )


def cpu_chunks_from_config(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, blocks_per_chunk: int
) -> int:
    """CPU tier capacity in chunks: ``num_cpu_chunks``, or ``cpu_bytes_to_use`` divided by
    the page-aligned bytes of one chunk over every rank (the same arithmetic as upstream, so
    one config gives both connectors the same capacity)."""
    extra = _extra(vllm_config)
    if "num_cpu_chunks" in extra:
        return int(extra["num_cpu_chunks"])
    cpu_bytes = extra.get("cpu_bytes_to_use")
    if not cpu_bytes:
        raise ConfigError(
            "statecore connector: set num_cpu_chunks or cpu_bytes_to_use in "
            "kv_connector_extra_config"
        )
    per_block = sum(
        int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
        for g in kv_cache_config.kv_cache_groups
    )
    per_chunk = per_block * int(vllm_config.parallel_config.world_size) * blocks_per_chunk
    if per_chunk <= 0:
        raise ConfigError("statecore connector: a chunk of this KV cache has no bytes")
    align = mmap.PAGESIZE
    aligned = -(-per_chunk // align) * align
    return int(cpu_bytes) // aligned


def tier_layout_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, blocks_per_chunk: int
) -> TierLayout:
    """The layout a shared secondary tier namespaces its keys by: the model, the KV-cache
    dtype, the block shape of every KV-cache group (block size, KV heads, head size, as the
    group's spec gives them) and ``blocks_per_chunk``."""
    model_cfg = getattr(vllm_config, "model_config", None)
    model = str(getattr(model_cfg, "model", "unknown"))
    revision = getattr(model_cfg, "revision", None)
    if revision:
        model = f"{model}@{revision}"
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype == "auto":
        cache_dtype = str(getattr(model_cfg, "dtype", "auto"))
    shape: list[int] = []
    for grp in kv_cache_config.kv_cache_groups:
        spec = grp.kv_cache_spec
        shape.append(int(spec.block_size))
        for attr in ("num_kv_heads", "head_size"):
            value = getattr(spec, attr, None)
            if value is not None:
                shape.append(int(value))
        shape.append(len(grp.layer_names))
    return TierLayout(model, cache_dtype, tuple(shape), blocks_per_chunk)


def secondary_tier_specs(vllm_config: VllmConfig) -> list[dict[str, Any]]:
    """The ``secondary_tiers`` of the extra config: a list of tier specs, each a mapping with
    ``kind`` (``"file"`` or ``"redis"``) and that kind's options (see
    :mod:`statecore.managers.tierconfig`); empty when absent."""
    raw = _extra(vllm_config).get("secondary_tiers") or []
    if not isinstance(raw, list | tuple):
        raise ConfigError(
            f"statecore connector: secondary_tiers must be a list of tier specs, got {raw!r}"
        )
    specs: list[dict[str, Any]] = []
    for i, spec in enumerate(raw):
        if not isinstance(spec, Mapping) or spec.get("kind") not in TIER_KINDS:
            raise ConfigError(
                f"statecore connector: secondary_tiers[{i}] must be a mapping with kind in "
                f"{TIER_KINDS}, got {spec!r}"
            )
        specs.append(dict(spec))
    return specs


def build_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, pool: CPUPool | None = None
) -> OffloadingScheduler:
    """The statecore scheduler and manager the scheduler role runs.

    Extra-config keys for the manager: ``eviction_policy`` (``lru``, ``arc`` or
    ``module:Class``), ``store_threshold``, ``max_tracker_size``, and ``secondary_tiers``
    (:func:`secondary_tier_specs`): with tiers, the manager is a
    :class:`~statecore.managers.tiering.TieringOffloadingManager` whose tiers copy to and
    from ``pool``, the CPU pool of the process's workers; the tiers then need that pool in
    this process (a one-process deployment passes it), and without one this raises
    :class:`~statecore.errors.ConfigError`. KV events are recorded when vLLM's
    ``kv_events_config.enable_kv_cache_events`` is on.
    """
    cfg = scheduler_config_from_vllm(vllm_config, kv_cache_config)
    extra = _extra(vllm_config)
    events_cfg = getattr(vllm_config, "kv_events_config", None)
    tiers = secondary_tier_specs(vllm_config)
    num_chunks = cpu_chunks_from_config(vllm_config, kv_cache_config, cfg.blocks_per_chunk)
    if tiers and pool is None:
        raise ConfigError(
            "statecore connector: secondary_tiers need the CPU pool in the scheduler's "
            "process, and vLLM's multi-process executors keep it in the workers; run one "
            "process (build_scheduler(..., pool=...)) or leave secondary_tiers out "
            "(docs/guides/redis-tier.md)"
        )
    if pool is not None and pool.num_slots != num_chunks:
        raise ConfigError(
            f"statecore connector: the pool has {pool.num_slots} slots, the config asks for "
            f"{num_chunks} CPU chunks"
        )
    cpu = CPUOffloadingManager(
        num_chunks,
        policy=str(extra.get("eviction_policy", "lru")),
        enable_events=bool(events_cfg is not None and events_cfg.enable_kv_cache_events),
        store_threshold=int(extra.get("store_threshold", 0)),
        max_tracker_size=int(extra.get("max_tracker_size", 64_000)),
    )
    manager: OffloadingManager = cpu
    if tiers and pool is not None:
        layout = tier_layout_from_vllm(vllm_config, kv_cache_config, cfg.blocks_per_chunk)
        manager = TieringOffloadingManager.from_config(cpu, pool, tiers, layout)
    return OffloadingScheduler(cfg, manager)


# --------------------------------------------------------------------------------------------
# The connector
# --------------------------------------------------------------------------------------------


class StatecoreOffloadingConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by statecore (see the module documentation)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self.scheduler: OffloadingScheduler | None = None
        self.worker: OffloadingWorker | None = None
        self._load_blocks: dict[str, tuple[int, ...]] = {}
        self._error_blocks: set[int] = set()
        self._error_reqs: set[str] = set()
        self._bound: StatecoreConnectorMetadata | None = None
        self._started: StatecoreConnectorMetadata | None = None
        self._tpc: list[int] = []
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = build_scheduler(vllm_config, kv_cache_config)
            cfg = self.scheduler.config
            self._tpc = [cfg.tokens_per_chunk(g) for g in range(len(cfg.groups))]

    # -- plumbing ---------------------------------------------------------------------------

    def _sched(self) -> OffloadingScheduler:
        if self.scheduler is None:
            raise RuntimeError("statecore connector: scheduler-side call on a worker role")
        return self.scheduler

    def _work(self) -> OffloadingWorker:
        if self.worker is None:
            raise RuntimeError(
                "statecore connector: no transfer backend yet (register_kv_caches or "
                "attach_backend first)"
            )
        return self.worker

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a future miss."""
        return False

    # -- worker role ------------------------------------------------------------------------

    def attach_backend(self, backend: TransferBackend, rank: int = 0) -> None:
        """Run the worker role over ``backend`` (tests, simulators, custom backends)."""
        self.worker = OffloadingWorker(backend, rank=rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the torch transfer backend over the engine's KV tensors."""
        from statecore.adapters import torch as torch_adapter

        factory = getattr(torch_adapter, "backend_from_vllm", None)
        if factory is None:
            raise RuntimeError(
                "statecore.adapters.torch provides no backend_from_vllm(kv_caches, "
                "vllm_config, kv_cache_config); attach a backend with attach_backend()"
            )
        backend = factory(kv_caches, self._vllm_config, self._kv_cache_config)
        self.attach_backend(backend, rank=int(self._vllm_config.parallel_config.rank))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Keep the step's metadata."""
        super().bind_connector_metadata(connector_metadata)
        self._bound = cast(StatecoreConnectorMetadata, connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Forget the step's metadata."""
        super().clear_connector_metadata()
        self._bound = None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the model runner touches any block: flush, then submit this step's loads."""
        self._start(cast(StatecoreConnectorMetadata, kv_connector_metadata))

    def _start(self, meta: StatecoreConnectorMetadata) -> None:
        if self._started is meta:
            return
        self._started = meta
        self._work().start_step(meta.inner)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads were submitted in ``handle_preemptions``; submit them now if it was skipped."""
        if self._bound is not None:
            self._start(self._bound)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Stores are whole-chunk and issued after the step: nothing per layer."""

    def wait_for_save(self) -> None:
        """Queue this step's stores for submission at the start of the next step."""
        if self._bound is not None:
            self._work().end_step(self._bound.inner)
            self._started = None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that failed, as echoed by the scheduler: finished (and failed, by request,
        with several KV-cache groups). Successful loads are reported by the scheduler role."""
        meta = self._bound
        if meta is None or not meta.load_error_reqs:
            return KVConnectorTransferResults()
        reqs = set(meta.load_error_reqs)
        return KVConnectorTransferResults(
            finished_recving=reqs,
            failed_recving=set(reqs) if meta.report_failed_reqs else set(),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving): see :meth:`get_transfer_results`."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of failed loads, as echoed by the scheduler (one KV-cache group)."""
        meta = self._bound
        if meta is None or meta.report_failed_reqs:
            return set()
        return set(meta.load_error_blocks)

    def build_connector_worker_meta(self) -> StatecoreWorkerMetadata | None:
        """This rank's completions and failures since the last call (None when nothing)."""
        if self.worker is None:
            return None
        report = self.worker.build_worker_metadata()
        if report.is_empty():
            return None
        return StatecoreWorkerMetadata(report)

    def shutdown(self) -> None:
        """Shut down whichever side this connector runs."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # -- scheduler role ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Track the request."""
        self._sched().on_new_request(VllmRequestView(request))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the CPU tier (async)."""
        return self._sched().get_num_new_matched_tokens(
            VllmRequestView(request), num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record allocated blocks; with external tokens, create the load job."""
        sched = self._sched()
        sched.update_state_after_alloc(
            VllmRequestView(request), blocks.get_block_ids(), num_external_tokens
        )
        if num_external_tokens > 0:
            job = sched.jobs.get(sched.next_job_id - 1)
            if job is not None and not job.is_store:
                self._load_blocks[job.req.req_id] = job.blocks

    def build_connector_meta(self, scheduler_output: VllmSchedulerOutput) -> KVConnectorMetadata:
        """This step's jobs, plus the failed loads to echo back through the workers."""
        inner = self._sched().build_connector_meta(
            to_scheduler_output(scheduler_output, self._num_groups)
        )
        meta = StatecoreConnectorMetadata(inner)
        if self._error_reqs:
            meta.load_error_blocks = frozenset(self._error_blocks)
            meta.load_error_reqs = frozenset(self._error_reqs)
            meta.report_failed_reqs = self._num_groups > 1
            self._error_blocks = set()
            self._error_reqs = set()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the ranks' aggregated report; release the requests whose loads completed."""
        wm = connector_output.kv_connector_worker_meta
        inner = wm.inner if isinstance(wm, StatecoreWorkerMetadata) else None
        res = self._sched().update_connector_output(inner)
        if not res.finished_loads:
            return
        invalid = res.invalid_block_ids
        done: set[str] = set()
        for rid in res.finished_loads:
            blocks = self._load_blocks.pop(rid, ())
            if invalid and not invalid.isdisjoint(blocks):
                self._error_reqs.add(rid)
                self._error_blocks.update(b for b in blocks if b in invalid)
            else:
                done.add(rid)
        if done:
            if connector_output.finished_recving:
                connector_output.finished_recving |= done
            else:
                connector_output.finished_recving = done

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished; its blocks may be freed at once."""
        return self._sched().request_finished(VllmRequestView(request))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`request_finished` (every group)."""
        return self._sched().request_finished(VllmRequestView(request))

    def has_pending_push_work(self) -> bool:
        """Jobs in flight, failed loads to echo, or manager work: keep stepping."""
        return bool(self._error_reqs) or self._sched().has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The CPU tier's stored/removed events as vLLM KV-cache events."""
        return to_kv_events(self._sched().take_events(), self._tpc)

    def reset_cache(self) -> bool | None:
        """Drop everything offloaded (flushes every in-flight job)."""
        self._sched().reset_cache()
        return True

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """statecore's counters since the last call (scheduler role)."""
        if self.scheduler is None:
            return None
        return StatecoreConnectorStats(data=self.scheduler.get_stats())

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """vLLM's hook to rebuild stats from their serialized form."""
        return StatecoreConnectorStats(data=dict(data) if data is not None else {})

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout requirement."""
        return None

"""statecore as a vLLM KV connector (``kv_connector_module_path``), for vLLM 0.33 and vLLM's
CPU build 0.32 (:mod:`statecore.adapters.vllm_version`; any other release is refused when the
connector starts).

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

import importlib
import mmap
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
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
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import RequestStatus
except ImportError as exc:  # pragma: no cover - depends on the environment
    from statecore.adapters.vllm_version import supported_versions_text

    raise ImportError(
        f"statecore.adapters.vllm needs one of {supported_versions_text()}; "
        f"importing it failed: {exc}"
    ) from exc

from statecore.adapters.vllm_keys import validate_extra_config
from statecore.adapters.vllm_metrics import GAUGES, OffloadPrometheus, TransferSizes, stats_payload
from statecore.adapters.vllm_version import check_vllm_version
from statecore.config import GroupConfig, SchedulerConfig
from statecore.errors import ConfigError
from statecore.keys import OffloadKey, key_group, key_hash
from statecore.manager import LookupResult, Medium, OffloadingEvent, OffloadingManager
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.redistier import TierLayout
from statecore.managers.tiering import TieringOffloadingManager
from statecore.pool import CPUPool
from statecore.scheduler import OffloadingScheduler, ResetStatus
from statecore.views import ScheduledColumns, ScheduledRequest, SchedulerOutput
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
    "KV_CACHE_LAYOUT",
    "EventPayloads",
    "StatecoreConnectorMetadata",
    "StatecoreConnectorStats",
    "StatecoreOffloadingConnector",
    "StatecorePromMetrics",
    "StatecoreWorkerMetadata",
    "VllmRequestView",
    "build_scheduler",
    "cpu_chunks_from_config",
    "register_worker_pool",
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
        # typed Any: the properties return vLLM's fields as they are, without a cast() call
        # each (they are read many times a step; statecore validates them where it reads them)
        self._req: Any = request

    @property
    def request_id(self) -> str:
        """The request id."""
        value: str = self._req.request_id
        return value

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        value: int = self._req.num_tokens
        return value

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        value: int = self._req.num_prompt_tokens
        return value

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed or loaded."""
        value: int = self._req.num_computed_tokens
        return value

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """vLLM's block hashes (bytes), one per ``tokens_per_hash`` tokens."""
        value: Sequence[bytes] = self._req.block_hashes
        return value

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """Per-request connector parameters."""
        value: Mapping[str, Any] | None = self._req.kv_transfer_params
        return value

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Never load for this request."""
        return bool(getattr(self._req, "skip_reading_prefix_cache", False))

    @property
    def is_aborted(self) -> bool:
        """The request was aborted."""
        return bool(self._req.status == RequestStatus.FINISHED_ABORTED)


def to_scheduler_output(so: VllmSchedulerOutput, num_groups: int) -> SchedulerOutput:
    """vLLM's ``SchedulerOutput`` as statecore's: new requests as
    :class:`~statecore.views.ScheduledRequest` entries, cached (running) ones in vLLM's
    columnar form as :class:`~statecore.views.ScheduledColumns` (validated in bulk, so a
    decode entry is not an object of its own). A cached request with no new blocks has None
    in the block column, as in vLLM.
    """
    nst: dict[str, int] = so.num_scheduled_tokens
    scheduled: list[ScheduledRequest] = []
    new_ids: list[str] = []
    for nr in so.scheduled_new_reqs:
        rid = nr.req_id
        new_ids.append(rid)
        scheduled.append(ScheduledRequest(rid, cast(Any, nr.block_ids), nst.get(rid, 0), False))
    cached = so.scheduled_cached_reqs
    columns = None
    rids = cached.req_ids
    if rids:
        columns = ScheduledColumns(
            rids,
            cached.new_block_ids,
            tuple(map(nst.get, rids, repeat(0, len(rids)))),  # a tuple: kept as it is
            frozenset(cached.resumed_req_ids),
        )
    return SchedulerOutput(
        scheduled=scheduled,
        new_req_ids=frozenset(new_ids),
        finished_req_ids=frozenset(so.finished_req_ids),
        preempted_req_ids=frozenset(so.preempted_req_ids or ()),
        columns=columns,
    )


@dataclass(slots=True)
class _ChunkPayload:
    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None


def _external_hash(h: bytes) -> Any:
    """A block hash as vLLM publishes it (``maybe_convert_block_hash``: an int by default)."""
    convert = importlib.import_module("vllm.v1.core.kv_cache_utils").maybe_convert_block_hash
    return convert(h)


class EventPayloads:
    """What vLLM's self-describing KV events carry for each offloaded chunk, recorded from the
    request when its store job is built (``self_describing_kv_events``) and kept until the
    chunk's removal event; without it (or for sliding-window groups) stores carry vLLM's
    placeholder payload (the key's hash, no tokens, block size 0).

    A removal drops the payload at the end of its batch, so that a store of the chunk later
    in the batch still carries it (a tiering manager's CPU removal of a chunk it moves into
    its file tier comes first), unless the chunk is stored again on the removal's medium
    later in the batch, or a store of it is still to be announced: the manager announces
    only the removal of a copy it announced as stored, so a removal converted after a new
    store job (or a write-pending lookup hit) recorded the payload names the copy before it
    (a reset's or an eviction's in the step the chunk is stored again), and the new copy's
    store event still needs the payload.

    Args:
        enabled: record payloads (KV events on and ``self_describing_kv_events``).
        tokens_per_chunk: tokens per offloaded chunk, per KV-cache group.
        tokens_per_block: tokens per GPU block, per KV-cache group.
        tokens_per_hash: tokens per request block hash.
        full_attention: per group, whether it is full attention (others keep placeholders).
        spec_kind: per group, vLLM's ``(kv_cache_spec_kind, sliding_window)`` label.
    """

    def __init__(
        self,
        enabled: bool,
        tokens_per_chunk: Sequence[int],
        tokens_per_block: Sequence[int],
        tokens_per_hash: int,
        full_attention: Sequence[bool],
        spec_kind: Sequence[tuple[str | None, int | None]],
    ) -> None:
        self.enabled = enabled
        self._tpc = list(tokens_per_chunk)
        self._tpb = list(tokens_per_block)
        self._tph = tokens_per_hash
        self._full = list(full_attention)
        self._kind = list(spec_kind)
        self._payloads: dict[OffloadKey, _ChunkPayload] = {}
        self._stale: set[OffloadKey] = set()
        # recorded for a store (or a write-pending hit) whose stored event is still to come
        self._unannounced: set[OffloadKey] = set()

    def record_store(self, request: Any, keys: Sequence[OffloadKey]) -> None:
        """Snapshot the payload of each stored chunk of ``request`` (a vLLM ``Request``)."""
        if not self.enabled:
            return
        hashes: Sequence[bytes] = request.block_hashes
        index: dict[tuple[int, bytes], int] | None = None
        for key in keys:
            g = key_group(key)
            if not self._full[g]:
                continue
            hpc = self._tpc[g] // self._tph
            if index is None:
                index = {}
                for grp in {key_group(k) for k in keys}:
                    step = self._tpc[grp] // self._tph
                    for i in range(step - 1, len(hashes), step):
                        index.setdefault((grp, hashes[i]), i // step)
            chunk = index.get((g, key_hash(key)))
            if chunk is None:
                continue
            first = chunk * hpc
            self._stale.discard(key)
            self._unannounced.add(key)
            lora = getattr(request, "lora_request", None)
            tokens = request.all_token_ids
            self._payloads[key] = _ChunkPayload(
                tuple(hashes[first : first + hpc]),
                hashes[first - 1] if first > 0 else None,
                tuple(tokens[chunk * self._tpc[g] : (chunk + 1) * self._tpc[g]]),
                self._tpb[g],
                None if lora is None else lora.adapter_id,
                None if lora is None else lora.name,
            )

    def record_lookup(
        self, request: Any, keys: Sequence[OffloadKey], pending: Collection[OffloadKey] = ()
    ) -> None:
        """Snapshot the payload of each chunk of ``request`` that a lookup found offloaded
        (ready or write-pending) and that has no payload yet, as vLLM's connector does: a
        chunk stored by another request before a reset, by a promotion from a secondary tier
        or by another engine sharing the tier then gets its payload in the events of its
        promotion and removal, instead of the placeholder. ``pending``: the keys among
        ``keys`` found write-pending (their store event is still to come)."""
        if not self.enabled:
            return
        fresh = [k for k in keys if k not in self._payloads or k in self._stale]
        if fresh:
            self.record_store(request, fresh)
            self._unannounced.difference_update(k for k in fresh if k not in pending)
        self._unannounced.update(k for k in pending if k in self._payloads)

    def reset(self) -> None:
        """A cache reset: every recorded payload is stale. They are dropped after the next
        :meth:`to_kv_events`, so the reset's removal events still carry them; stores
        recorded before it are never announced (the reset flushes them)."""
        self._stale = set(self._payloads)
        self._unannounced.clear()

    def to_kv_events(self, events: Iterable[OffloadingEvent]) -> list[KVCacheEvent]:
        """statecore's manager events as vLLM's: one ``BlockStored`` per stored chunk, one
        ``BlockRemoved`` per removal event and group (payload hashes fanned out)."""
        out: list[KVCacheEvent] = []
        gone: dict[OffloadKey, set[Medium]] = {}  # removed in this batch, not stored back
        for ev in events:
            medium = ev.medium.value
            if ev.removed:
                by_group: dict[int, list[Any]] = {}
                for key in ev.keys:
                    g = key_group(key)
                    p = self._payloads.get(key)
                    if key not in self._unannounced:  # else the copy before a new store
                        gone.setdefault(key, set()).add(ev.medium)
                    hashes = by_group.setdefault(g, [])
                    if p is None:
                        hashes.append(_external_hash(key_hash(key)))
                    else:
                        hashes.extend(_external_hash(h) for h in p.block_hashes)
                for g, hashes in by_group.items():
                    out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g))
                continue
            for key in ev.keys:
                g = key_group(key)
                p = self._payloads.get(key)
                self._unannounced.discard(key)
                if key in gone:
                    gone[key].discard(ev.medium)
                kind, window = self._kind[g] if self.enabled else (None, None)
                if p is None:
                    out.append(
                        BlockStored(
                            block_hashes=[_external_hash(key_hash(key))],
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=0,
                            lora_id=None,
                            medium=medium,
                            lora_name=None,
                            group_idx=g,
                            kv_cache_spec_kind=kind,
                            kv_cache_spec_sliding_window=window,
                        )
                    )
                    continue
                out.append(
                    BlockStored(
                        block_hashes=[_external_hash(h) for h in p.block_hashes],
                        parent_block_hash=None if p.parent is None else _external_hash(p.parent),
                        token_ids=list(p.token_ids),
                        block_size=p.block_size,
                        lora_id=p.lora_id,
                        medium=medium,
                        lora_name=p.lora_name,
                        group_idx=g,
                        kv_cache_spec_kind=kind,
                        kv_cache_spec_sliding_window=window,
                    )
                )
        for key, media in gone.items():
            if media:
                self._payloads.pop(key, None)
        for key in self._stale:
            self._payloads.pop(key, None)
        self._stale.clear()
        return out


def to_kv_events(
    events: Iterable[OffloadingEvent], tokens_per_chunk: Sequence[int]
) -> list[KVCacheEvent]:
    """statecore's stored/removed events as vLLM's placeholder ``BlockStored`` /
    ``BlockRemoved`` events (vLLM's payload without ``self_describing_kv_events``)."""
    n = len(tokens_per_chunk)
    plain = EventPayloads(False, tokens_per_chunk, tokens_per_chunk, 1, [False] * n, [])
    return plain.to_kv_events(events)


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
            if k in GAUGES:
                self.data[k] = v  # a snapshot: the latest wins
            elif mine is None:
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


KV_CACHE_LAYOUT = "LBHNC"
"""The KV-cache layout statecore's transfer adapter copies (each layer's tensor block-first,
one contiguous page per block), the one vLLM's offloading connector asks for too."""

_SUPPORTED_KINDS = ("full attention", "sliding window")


def _group_config(index: int, group: Any) -> GroupConfig:
    """statecore's view of one KV-cache group; a kind it does not model is a start-up error."""
    iface = importlib.import_module("vllm.v1.kv_cache_interface")
    spec = group.kv_cache_spec
    specs = list(spec.kv_cache_specs.values()) if hasattr(spec, "kv_cache_specs") else [spec]
    refused: str | None = None
    windows: set[int | None] = set()
    for one in specs:
        if isinstance(one, iface.MambaSpec):
            refused = "a Mamba (state-space) group"
        elif isinstance(one, iface.ChunkedLocalAttentionSpec):
            refused = "a chunked local attention group"
        elif isinstance(one, iface.SlidingWindowSpec):
            # the engine keeps the tokens a layer retains beyond its window (MTP's
            # extra_retained_tokens) with the window, so a hit must restore them too
            span = int(one.sliding_window)
            extra = int(getattr(one, "extra_retained_tokens", 0) or 0)
            windows.add(max(span, span - 1 + extra))
        elif isinstance(one, iface.FullAttentionSpec) and not getattr(one, "sliding_window", 0):
            windows.add(None)
        else:
            refused = f"a {type(one).__name__} group"
        if refused is None and not getattr(one, "prefix_cacheable", True):
            refused = f"a {type(one).__name__} group that is not prefix-cacheable"
        if refused is not None:
            break
    if refused is None and len(windows) != 1:
        refused = "a group mixing attention kinds"
    if refused is not None:
        raise ConfigError(
            f"statecore connector: KV-cache group {index} is {refused}; statecore models only "
            f"{' and '.join(_SUPPORTED_KINDS)} groups (vLLM's own OffloadingConnector offloads "
            "such models)"
        )
    (window,) = windows
    return GroupConfig(int(spec.block_size), window)


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

    Every extra-config key is checked first (:mod:`statecore.adapters.vllm_keys`): an unknown
    key, a rejected one or an unimplemented value raises :class:`~statecore.errors.ConfigError`
    naming the key. Groups: every KV-cache group must be full attention or sliding window;
    Mamba, chunked local attention and other kinds are refused with the group named.
    """
    extra = _extra(vllm_config)
    validate_extra_config(extra)
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        raise ConfigError(
            "statecore connector: HiSparse KV caches (hisparse_host_num_blocks) are not "
            "modelled by statecore"
        )
    groups = [_group_config(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)]
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
    """The secondary tiers of the extra config as statecore tier specs
    (:mod:`statecore.managers.tierconfig`): vLLM's ``{"type": "fs", "root_dir": ...}``
    entries become file tiers; statecore's own ``{"kind": "file" | "redis", ...}`` entries
    pass through. Empty when absent; every entry was checked by
    :func:`~statecore.adapters.vllm_keys.validate_extra_config`."""
    return [dict(t) for t in validate_extra_config(_extra(vllm_config)).tier_specs]


_WORKER_POOLS: dict[str, CPUPool] = {}


def register_worker_pool(engine_id: str, pool: CPUPool) -> None:
    """Make a worker's CPU pool visible to the scheduler role of the same engine.

    Secondary tiers read and write the primary tier's bytes, which live in the workers' pool,
    so a tiering scheduler needs that very pool: :meth:`StatecoreOffloadingConnector.
    register_kv_caches` registers it (vLLM registers the KV caches before it builds the
    scheduler). Only a pool in the scheduler's own process can be shared this way.
    """
    _WORKER_POOLS[engine_id] = pool


def _engine_id(vllm_config: VllmConfig) -> str:
    ktc = vllm_config.kv_transfer_config
    return str(getattr(ktc, "engine_id", None) or "")


def _worker_pool(vllm_config: VllmConfig) -> CPUPool:
    if int(vllm_config.parallel_config.world_size) != 1:
        raise ConfigError(
            "statecore connector: secondary tiers need the CPU pool in the scheduler's process "
            "(one worker, vLLM's uniprocess executor); world_size "
            f"{vllm_config.parallel_config.world_size} keeps it in the workers "
            "(docs/guides/vllm.md)"
        )
    pool = _WORKER_POOLS.get(_engine_id(vllm_config))
    if pool is None:
        raise ConfigError(
            "statecore connector: secondary tiers need the worker's CPU pool in the "
            f"scheduler's process (engine {_engine_id(vllm_config)!r}): run the worker in the "
            "engine process (one GPU, uniprocess executor), or pass the pool "
            "(build_scheduler(..., pool=...) or register_worker_pool)"
        )
    return pool


def build_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, pool: CPUPool | None = None
) -> OffloadingScheduler:
    """The statecore scheduler and its manager, as the extra config asks.

    ``spec_name`` ``CPUOffloadingSpec`` (the default): a :class:`CPUOffloadingManager`;
    ``TieringOffloadingSpec`` or any ``secondary_tiers``: a
    :class:`~statecore.managers.tiering.TieringOffloadingManager` over it, one tier per entry
    (:func:`secondary_tier_specs`), whose tiers copy to and from ``pool``, the CPU pool of the
    worker (by default the one the worker registered in this process; without one this raises
    :class:`~statecore.errors.ConfigError`). Manager keys: ``eviction_policy`` (with
    ``cache_policy_module_path``), ``store_threshold``, ``max_tracker_size``, and
    ``policy_semantics`` (``vllm``, the default: vLLM 0.33's request-aware ``lru`` and ``arc``
    and a ``store_threshold`` that counts store offers; ``access``: statecore's former
    per-access semantics). KV events are
    recorded when vLLM's ``kv_events_config.enable_kv_cache_events`` is on. An out-of-tree
    ``spec_name`` with ``spec_module_path``: that spec's manager, through
    :class:`~statecore.adapters.vllm_spec.VllmSpecManager` (the spec owns its capacity, so
    this side needs neither ``num_cpu_chunks`` nor ``cpu_bytes_to_use``).
    """
    cfg = scheduler_config_from_vllm(vllm_config, kv_cache_config)
    extra = validate_extra_config(_extra(vllm_config))
    if extra.spec_module_path is not None:  # an out-of-tree spec's manager, converted
        # (it owns its capacity: the CPU chunks are the worker's concern, not this side's)
        from statecore.adapters.vllm_spec import spec_manager

        return OffloadingScheduler(cfg, spec_manager(vllm_config, kv_cache_config))
    num_chunks = cpu_chunks_from_config(vllm_config, kv_cache_config, cfg.blocks_per_chunk)
    tiers = [dict(t) for t in extra.tier_specs]
    if tiers and pool is None:
        pool = _worker_pool(vllm_config)
    if pool is not None and pool.num_slots != num_chunks:
        raise ConfigError(
            f"statecore connector: the pool has {pool.num_slots} slots, the config asks for "
            f"{num_chunks} CPU chunks"
        )
    primary = CPUOffloadingManager(
        num_chunks,
        policy=extra.eviction_policy,
        enable_events=_events_on(vllm_config),
        store_threshold=extra.store_threshold,
        max_tracker_size=extra.max_tracker_size,
        reuse_counts=extra.reuse_counts,
    )
    manager: OffloadingManager = primary
    if extra.tiering:
        if tiers and pool is not None:
            layout = tier_layout_from_vllm(vllm_config, kv_cache_config, cfg.blocks_per_chunk)
            manager = TieringOffloadingManager.from_config(primary, pool, tiers, layout)
        else:
            manager = TieringOffloadingManager(primary, [])
    return OffloadingScheduler(cfg, manager)


def _events_on(vllm_config: VllmConfig) -> bool:
    events_cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(events_cfg is not None and events_cfg.enable_kv_cache_events)


class StatecorePromMetrics(KVConnectorPromMetrics):
    """vLLM's connector Prometheus hook over :class:`~statecore.adapters.vllm_metrics.
    OffloadPrometheus` (vLLM's metric names where both have them, plus statecore's)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from prometheus_client import REGISTRY  # vLLM's metrics live in the default registry

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics = OffloadPrometheus(
            self._counter_cls,
            self._gauge_cls,
            self._histogram_cls,
            labelnames,
            per_engine_labelvalues,
            registry=REGISTRY,  # a second engine in this process replaces the first's metrics
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one stats payload."""
        self.metrics.observe(transfer_stats_data, engine_idx)


# --------------------------------------------------------------------------------------------
# The connector
# --------------------------------------------------------------------------------------------


class StatecoreOffloadingConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by statecore (see the module documentation)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # an unsupported vLLM release fails every role at start-up, naming the supported ones
        self.vllm_release = check_vllm_version(importlib.import_module("vllm").__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self.scheduler: OffloadingScheduler | None = None
        self.worker: OffloadingWorker | None = None
        self._error_blocks: set[int] = set()
        self._error_reqs: set[str] = set()
        self._bound: StatecoreConnectorMetadata | None = None
        self._started: StatecoreConnectorMetadata | None = None
        self._tpc: list[int] = []
        # every role checks the extra config: a bad key fails every process at start-up
        self._extra = validate_extra_config(_extra(vllm_config))
        self._load_sizes = TransferSizes()
        self._store_sizes = TransferSizes()
        self._requests: dict[str, Request] = {}
        self._finished_reqs: list[str] = []
        self._storage_events = self._extra.storage_events or any(
            "kind" in t for t in self._extra.tier_specs
        )
        self.events: EventPayloads | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = build_scheduler(vllm_config, kv_cache_config)
            cfg = self.scheduler.config
            self._tpc = [cfg.tokens_per_chunk(g) for g in range(len(cfg.groups))]
            iface = importlib.import_module("vllm.v1.kv_cache_interface")
            specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
            self.events = EventPayloads(
                _events_on(vllm_config) and self._extra.self_describing_kv_events,
                self._tpc,
                [g.tokens_per_block for g in cfg.groups],
                cfg.tokens_per_hash or cfg.groups[0].tokens_per_block,
                [g.sliding_window is None for g in cfg.groups],
                [
                    (
                        iface.get_kv_cache_spec_kind(sp).value,
                        iface.get_kv_cache_spec_sliding_window(sp),
                    )
                    for sp in specs
                ],
            )
            if self.events.enabled:
                self.scheduler.lookup_observer = self._record_lookup_hits

    # -- plumbing ---------------------------------------------------------------------------

    def _record_lookup_hits(
        self, req_id: str, keys: Sequence[OffloadKey], results: Sequence[LookupResult]
    ) -> None:
        """A lookup's hits (ready or write-pending) get the request's KV-event payload, when
        they have none yet (:meth:`EventPayloads.record_lookup`)."""
        request = self._requests.get(req_id)
        if request is None or self.events is None:
            return
        hits = [
            k
            for k, r in zip(keys, results, strict=False)
            if r is LookupResult.HIT or r is LookupResult.HIT_PENDING
        ]
        pending = {k for k, r in zip(keys, results, strict=False) if r is LookupResult.HIT_PENDING}
        self.events.record_lookup(request, hits, pending)

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
        pool = getattr(backend, "pool", None)
        if self._extra.tiering and isinstance(pool, CPUPool):
            register_worker_pool(_engine_id(self._vllm_config), pool)

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
        """Shut down whichever side this connector runs (and forget a registered pool).

        Both sides are shut down and the pool forgotten even when one of them raises; the
        error is raised after (a :class:`~statecore.errors.ManagerError` when the manager's
        shutdown raised; when both sides raise, the scheduler's, the worker's as its
        context)."""
        try:
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            if self.scheduler is not None:
                try:
                    self.scheduler.shutdown()
                finally:
                    _WORKER_POOLS.pop(_engine_id(self._vllm_config), None)

    # -- scheduler role ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Track the request."""
        self._sched().on_new_request(VllmRequestView(request))
        if self.events is not None and self.events.enabled:
            self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the CPU tier (async).

        vLLM caps a lookup (``max_num_new_tokens``) by the prefix that KV-cache groups it does
        not offload already hold. statecore offloads every group of every configuration it
        accepts (others are refused at start-up), so that cap is never set and the lookup is
        bounded by the request alone, as in vLLM for such configurations.
        """
        if self.events is not None and self.events.enabled:
            self._requests.setdefault(request.request_id, request)
        return self._sched().get_num_new_matched_tokens(
            VllmRequestView(request), num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record allocated blocks; with external tokens, create the load job (its outcome
        comes back per request from :meth:`update_connector_output`)."""
        self._sched().update_state_after_alloc(
            VllmRequestView(request), blocks.get_block_ids(), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: VllmSchedulerOutput) -> KVConnectorMetadata:
        """This step's jobs, plus the failed loads to echo back through the workers."""
        inner = self._sched().build_connector_meta(
            to_scheduler_output(scheduler_output, self._num_groups)
        )
        events = self.events
        if inner.manager_reset and events is not None:
            events.reset()  # the manager's deferred reset, retried by that call, took at last
        if events is not None and events.enabled:
            keys = inner.store_keys
            for job_id, job in inner.store_jobs.items():
                req = self._requests.get(job.req_id)
                if req is not None:
                    events.record_store(req, keys[job_id])
            for rid in self._finished_reqs:  # their final stores were built above
                self._requests.pop(rid, None)
            self._finished_reqs.clear()
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
        if inner is not None:
            self._load_sizes.add(inner.stats.load.sizes)
            self._store_sizes.add(inner.stats.store.sizes)
        if not res.finished_loads:
            return
        failed = res.failed_loads
        if failed:
            self._error_reqs.update(failed)
            self._error_blocks.update(res.invalid_block_ids)
            done = set(res.finished_loads.difference(failed))
        else:
            done = set(res.finished_loads)
        if done:
            if connector_output.finished_recving:
                connector_output.finished_recving |= done
            else:
                connector_output.finished_recving = done

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished; its blocks may be freed at once."""
        if request.request_id in self._requests:  # forgotten after its final stores
            self._finished_reqs.append(request.request_id)
        return self._sched().request_finished(VllmRequestView(request))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`request_finished` (every group)."""
        if request.request_id in self._requests:  # forgotten after its final stores
            self._finished_reqs.append(request.request_id)
        return self._sched().request_finished(VllmRequestView(request))

    def has_pending_push_work(self) -> bool:
        """Jobs in flight, failed loads to echo, or manager work: keep stepping."""
        return bool(self._error_reqs) or self._sched().has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' stored/removed events as vLLM KV-cache events, with vLLM's payloads
        (self-describing ones with ``self_describing_kv_events``); a file-system tier's
        events only with its ``enable_kv_events``."""
        raw = self._sched().take_events()
        if not self._storage_events:
            raw = [e for e in raw if e.medium is not Medium.STORAGE]
        if self.events is None:
            return to_kv_events(raw, self._tpc)
        return self.events.to_kv_events(raw)

    def reset_cache(self) -> bool | None:
        """Drop everything offloaded: every in-flight job is flushed; loads the workers run
        are carried over and complete normally (no request fails). ``False`` (vLLM's
        ``reset_connector_cache`` then returns False) when the manager's reset raised: it may
        still hold its chunks, and the KV-event payloads stay theirs until the reset, retried
        by every ``build_connector_meta``, takes."""
        if self._sched().reset().status is not ResetStatus.DONE:
            return False
        if self.events is not None:
            self.events.reset()
        return True

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """statecore's counters since the last call plus the workers' per-job transfer sizes
        (scheduler role); see :mod:`statecore.adapters.vllm_metrics`."""
        if self.scheduler is None:
            return None
        data = stats_payload(
            self.scheduler.get_stats(), self._load_sizes.take(), self._store_sizes.take()
        )
        return StatecoreConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """vLLM's hook to rebuild stats from their serialized form."""
        return StatecoreConnectorStats(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """vLLM's hook: statecore's Prometheus metrics (:class:`StatecorePromMetrics`)."""
        return StatecorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout statecore's transfer adapter copies (:data:`KV_CACHE_LAYOUT`)."""
        return KV_CACHE_LAYOUT

"""statecore: the correctness-first core for KV-cache offloading in LLM serving engines.

The public surface: the scheduler side of an offloading connector
(:class:`OffloadingScheduler`), the manager contract (:class:`OffloadingManager`) and its
implementations, the worker (:class:`OffloadingWorker`), the wire types exchanged each step,
and the typed errors. Lifecycles live in :mod:`statecore.lifecycle`, invariants and fuzzers in
:mod:`statecore.specs`, engine and tensor adapters in :mod:`statecore.adapters`.
"""

from __future__ import annotations

from statecore.config import GroupConfig, SchedulerConfig
from statecore.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidMetadataError,
    InvariantViolation,
    KeyNotReadyError,
    LifecycleError,
    ManagerError,
    ManagerStateError,
    MetadataError,
    PinUnderflowError,
    SpecError,
    StatecoreError,
    TransferError,
    UnknownKeyError,
    UnknownRequestError,
)
from statecore.keys import OffloadKey, key_group, key_hash, make_offload_key
from statecore.manager import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
)
from statecore.pool import CPUPool
from statecore.scheduler import (
    ConnectorOutputResult,
    CreatedLoad,
    OffloadingScheduler,
    ResetResult,
    ResetStatus,
    SchedulerCounters,
)
from statecore.views import Request, RequestLike, ScheduledRequest, SchedulerOutput
from statecore.wire import (
    ConnectorMetadata,
    DirectionStats,
    GPULoadStoreSpec,
    TransferJob,
    TransferStats,
    WorkerMetadata,
)

__version__ = "0.1.0"

__all__ = [
    "CPULoadStoreSpec",
    "CPUPool",
    "ConfigError",
    "ConnectorMetadata",
    "ConnectorOutputResult",
    "CreatedLoad",
    "DirectionStats",
    "GPULoadStoreSpec",
    "GroupConfig",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidMetadataError",
    "InvariantViolation",
    "KeyNotReadyError",
    "LifecycleError",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerError",
    "ManagerStateError",
    "Medium",
    "MetadataError",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingScheduler",
    "PinUnderflowError",
    "PrepareStoreOutput",
    "ReqContext",
    "Request",
    "RequestLike",
    "RequestOffloadingContext",
    "ResetResult",
    "ResetStatus",
    "ScheduleEndContext",
    "ScheduledRequest",
    "SchedulerConfig",
    "SchedulerCounters",
    "SchedulerOutput",
    "SpecError",
    "StatecoreError",
    "TierFilter",
    "TierMatcher",
    "TransferError",
    "TransferJob",
    "TransferStats",
    "UnknownKeyError",
    "UnknownRequestError",
    "WorkerMetadata",
    "key_group",
    "key_hash",
    "make_offload_key",
]

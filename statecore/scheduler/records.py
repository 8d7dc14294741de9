"""The scheduler's records: one per tracked request (with one :class:`GroupState` per KV-cache
group) and one per transfer job.

A record is attached to its compiled lifecycle (:data:`~statecore.lifecycle.REQUEST`,
:data:`~statecore.lifecycle.JOB`) at creation: ``state`` indexes the lifecycle's states, and
``owner`` is what the lifecycle's actions call (the package's
:class:`~statecore.scheduler.effects.SchedulerEffects`, never the scheduler itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statecore.keys import OffloadKey
from statecore.lifecycle import JOB, REQUEST
from statecore.manager import OffloadPolicy, ReqContext
from statecore.views import RequestLike

if TYPE_CHECKING:
    from statecore.scheduler.effects import SchedulerEffects

__all__ = ["GroupState", "JobRecord", "RequestRecord"]


class GroupState:
    """Per request and KV-cache group: offload keys, GPU block ids and the store cursor.

    Attributes:
        keys: offload key of each whole chunk the request's hashes cover so far.
        block_ids: the request's GPU block ids in this group (0 = null, skipped or stale).
        cursor: first chunk not yet considered for storing (INV-CURSOR).
        skip: chunks loaded at admission, never offered again under the chunk-level policy.
    """

    __slots__ = ("block_ids", "cursor", "keys", "skip")

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.block_ids: list[int] = []
        self.cursor = 0
        self.skip = 0


class RequestRecord:
    """Scheduler state of one tracked request. ``state`` indexes ``REQUEST.states``."""

    __slots__ = (
        "_shadow",
        "_sm",
        "admitted",
        "ctx",
        "deferred_since",
        "groups",
        "hashes_ok",
        "jobs",
        "looked_up",
        "max_load_tokens",
        "max_offload_tokens",
        "n_hashes",
        "num_local_computed",
        "num_scheduled",
        "owner",
        "policy",
        "registered",
        "req_id",
        "request",
        "signalled",
        "state",
        "store_cap",
        "store_floor",
    )

    state: int  # set by REQUEST.attach

    def __init__(
        self,
        owner: SchedulerEffects,
        request: RequestLike,
        ctx: ReqContext,
        policy: OffloadPolicy,
        n_groups: int,
        req_id: str | None = None,
    ) -> None:
        self.owner = owner
        self.req_id = request.request_id if req_id is None else req_id
        self.request = request
        self.ctx = ctx
        self.policy = policy
        self.registered = False
        """The manager's ``on_new_request`` took the request (false while it raised: no
        lookup hits, no stores, no finish notice; retried by the next lookup or store)."""
        self.groups = [GroupState() for _ in range(n_groups)]
        self.jobs: set[int] = set()
        self.max_load_tokens: int | None = None
        self.max_offload_tokens: int | None = None
        self.num_local_computed = 0
        self.num_scheduled = 0
        self.n_hashes = 0  # block hashes already turned into keys
        self.deferred_since: float | None = None
        self.signalled = False
        # no chunk can become storable below this many offloadable tokens (0: unknown)
        self.store_floor = 0
        # offloadable tokens never exceed this (max_offload_tokens, prompt-only)
        self.store_cap = 1 << 62
        # complete block lists of the last allocation, until the next scheduling applies them
        self.admitted: tuple[tuple[int, ...], ...] | None = None
        # looked up since its last admission: the engine (re)starts it from its prefix, so
        # that admission rewinds its store cursors; an admission without a lookup (a streaming
        # session resumed with its blocks kept) keeps them
        self.looked_up = False
        self.hashes_ok = 0  # block hashes already validated (a prefix of the view's list)
        REQUEST.attach(self)


class JobRecord:
    """Scheduler state of one transfer job. ``state`` indexes ``JOB.states``.

    Attributes:
        keys: the job's offload keys (the manager's completion gets exactly these).
        blocks: GPU blocks it reads (store) or writes (load).
        pending: workers that have not reported yet.
        failed: workers that reported a failure.
        seen: bit mask of the ranks that reported, for reports that carry ranks.
        fenced: store sources fenced from creation (sliding-window groups).
        deferred_fence: store sources fenced once the request finishes (full attention).
        deferred_registered: whether ``deferred_fence`` is in the fence index.
        flushed: the job was put in a step's ``jobs_to_flush``: every worker finishes it
            before that step writes any GPU block or submits any load.
        sent: the job went out in a step's metadata (loads are created before that).
        carried: a sent load that outlived a reset: it completes without the manager.
    """

    __slots__ = (
        "_shadow",
        "_sm",
        "blocks",
        "carried",
        "created_at",
        "deferred_fence",
        "deferred_registered",
        "failed",
        "fenced",
        "flushed",
        "is_store",
        "job_id",
        "keys",
        "owner",
        "pending",
        "req",
        "seen",
        "sent",
        "stalled_at",
        "state",
    )

    state: int  # set by JOB.attach

    def __init__(
        self,
        owner: SchedulerEffects,
        job_id: int,
        req: RequestRecord,
        is_store: bool,
        keys: tuple[OffloadKey, ...],
        blocks: tuple[int, ...],
        pending: int,
        now: float,
        fenced: tuple[int, ...] = (),
        deferred_fence: tuple[int, ...] = (),
    ) -> None:
        self.owner = owner
        self.job_id = job_id
        self.req = req
        self.is_store = is_store
        self.keys = keys
        self.blocks = blocks
        self.pending = pending
        self.failed = 0
        self.seen = 0  # mask of ranks that reported (when reports carry ranks)
        self.created_at = now
        self.stalled_at = 0.0
        self.fenced = fenced
        self.deferred_fence = deferred_fence
        self.deferred_registered = False
        self.flushed = False
        self.sent = is_store  # a store is created while its metadata is built
        self.carried = False
        JOB.attach(self)

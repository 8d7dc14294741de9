"""A tiny engine stand-in for scheduler unit tests: requests, steps, worker reports."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from statecore import (
    ConnectorMetadata,
    ConnectorOutputResult,
    GroupConfig,
    OffloadingManager,
    OffloadingScheduler,
    Request,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    WorkerMetadata,
)
from statecore.managers import CPUOffloadingManager
from statecore.specs.fakes import RecordingManager


def chain_hashes(tokens: Sequence[int], tokens_per_hash: int) -> list[bytes]:
    """Chained block hashes, one per whole ``tokens_per_hash`` tokens."""
    out: list[bytes] = []
    parent = b""
    for i in range(len(tokens) // tokens_per_hash):
        chunk = bytes(str(list(tokens[i * tokens_per_hash : (i + 1) * tokens_per_hash])), "ascii")
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


class FakeClock:
    """An injected clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingManager(CPUOffloadingManager):
    """The real CPU manager, recording the calls the scheduler makes (for order checks)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.log: list[tuple[str, str | None]] = []

    def prepare_store(self, keys, ctx):  # type: ignore[no-untyped-def]
        self.log.append(("prepare_store", ctx.req_id))
        return super().prepare_store(keys, ctx)

    def complete_store(self, keys, ctx, success=True):  # type: ignore[no-untyped-def]
        self.log.append(("complete_store", ctx.req_id))
        super().complete_store(keys, ctx, success)

    def on_request_finished(self, ctx):  # type: ignore[no-untyped-def]
        self.log.append(("on_request_finished", ctx.req_id))
        super().on_request_finished(ctx)


def make_manager(kind: str, capacity: int = 64) -> OffloadingManager:
    """``fake`` (RecordingManager) or ``cpu`` (CPUOffloadingManager with a call log)."""
    if kind == "fake":
        return RecordingManager(capacity=capacity)
    return CountingManager(capacity)


def finished_order(manager: OffloadingManager) -> list[tuple[str, str | None]]:
    """The (method, req_id) sequence of store/finish calls the manager saw."""
    if isinstance(manager, RecordingManager):
        return [
            (c.method, c.req_id)
            for c in manager.calls
            if c.method in ("prepare_store", "complete_store", "on_request_finished")
        ]
    assert isinstance(manager, CountingManager)
    return list(manager.log)


@dataclass
class Harness:
    """Drives one OffloadingScheduler the way an engine would, step by step."""

    manager: OffloadingManager
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    clock: FakeClock = field(default_factory=FakeClock)
    next_block: int = 1
    reqs: dict[str, Request] = field(default_factory=dict)
    blocks: dict[str, list[list[int]]] = field(default_factory=dict)
    unsent: dict[str, list[list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sched = OffloadingScheduler(self.config, self.manager, self.clock, checked=True)

    @property
    def tph(self) -> int:
        return self.config.hash_tokens

    def add(self, req_id: str, tokens: Sequence[int], prompt: int | None = None) -> Request:
        """A new request with ``tokens`` (all prompt unless ``prompt`` says otherwise)."""
        req = Request(
            req_id,
            num_prompt_tokens=len(tokens) if prompt is None else prompt,
            num_tokens=len(tokens),
            block_hashes=chain_hashes(tokens, self.tph),
        )
        self.reqs[req_id] = req
        self.sched.on_new_request(req)
        return req

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def blocks_for(self, tokens: int, group: int = 0) -> int:
        tpb = self.config.groups[group].tokens_per_block
        return -(-tokens // tpb)

    def admit(self, req_id: str, num_computed: int = 0) -> tuple[int | None, bool]:
        """Lookup; on a hit allocate and create the load; returns the lookup answer."""
        req = self.reqs[req_id]
        hits, is_async = self.sched.get_num_new_matched_tokens(req, num_computed)
        if hits is None:
            return hits, is_async
        total = num_computed + hits
        groups = [self.alloc(self.blocks_for(total, g)) for g in range(len(self.config.groups))]
        self.blocks[req_id] = groups
        # as in vLLM, blocks allocated at admission reach the connector with the request's
        # first scheduling (as a new request's complete block lists)
        self.unsent[req_id] = [list(g) for g in groups]
        self.sched.update_state_after_alloc(req, groups, hits)
        req.num_computed_tokens = num_computed
        return hits, is_async

    def schedule(
        self,
        req_id: str,
        tokens: int,
        new: bool = False,
        resumed: bool = False,
    ) -> ScheduledRequest:
        """Schedule ``tokens`` more tokens of ``req_id``: allocate blocks as needed."""
        req = self.reqs[req_id]
        have = self.blocks.setdefault(req_id, [[] for _ in self.config.groups])
        new_ids: list[tuple[int, ...]] = []
        for g in range(len(self.config.groups)):
            want = self.blocks_for(req.num_computed_tokens + tokens, g)
            if resumed:
                have[g] = self.alloc(want)
                ids = list(have[g])
            else:
                ids = self.alloc(max(want - len(have[g]), 0))
                have[g].extend(ids)
                ids = self.unsent.get(req_id, [[]] * (g + 1))[g] + ids
            new_ids.append(tuple(ids))
        self.unsent.pop(req_id, None)
        return ScheduledRequest(req_id, tuple(new_ids), tokens, resumed)

    def step(
        self,
        scheduled: Iterable[ScheduledRequest] = (),
        finished: Iterable[str] = (),
        preempted: Iterable[str] = (),
        extra_allocated: Iterable[int] = (),
        new: Iterable[str] = (),
    ) -> ConnectorMetadata:
        """build_connector_meta, then advance num_computed of the scheduled requests."""
        scheduled = list(scheduled)
        meta = self.sched.build_connector_meta(
            SchedulerOutput(
                scheduled=scheduled,
                new_req_ids=frozenset(new),
                finished_req_ids=frozenset(finished),
                preempted_req_ids=frozenset(preempted),
                extra_allocated_block_ids=frozenset(extra_allocated),
            )
        )
        for s in scheduled:
            if s.req_id in self.reqs:  # not another connector's request
                self.reqs[s.req_id].num_computed_tokens += s.num_scheduled_tokens
        return meta

    def report(
        self,
        completed: Iterable[int] = (),
        failed: Iterable[int] = (),
        workers: int | None = None,
    ) -> ConnectorOutputResult:
        """Every worker (or ``workers`` of them) reports the given jobs."""
        n = self.config.num_workers if workers is None else workers
        meta = WorkerMetadata()
        for _ in range(n):
            one = WorkerMetadata()
            for j in completed:
                one.mark_completed(j)
            for j in failed:
                one.mark_failed(j)
            meta = meta.aggregate(one)
        return self.sched.update_connector_output(meta)

    def finish(self, req_id: str) -> None:
        self.sched.request_finished(self.reqs[req_id])


def config(
    tokens_per_block: int = 4,
    blocks_per_chunk: int = 1,
    workers: int = 1,
    sliding: int | None = None,
    **kw: object,
) -> SchedulerConfig:
    """A small configuration: one full-attention group, plus a sliding one if asked."""
    groups = [GroupConfig(tokens_per_block)]
    if sliding is not None:
        groups.append(GroupConfig(tokens_per_block, sliding_window=sliding))
    return SchedulerConfig(
        groups=tuple(groups),
        blocks_per_chunk=blocks_per_chunk,
        num_workers=workers,
        **kw,  # type: ignore[arg-type]
    )


def prefill(h: Harness, rid: str, tokens: int | None = None) -> dict[int, object]:
    """Admit and compute the whole prompt of ``rid`` in one step; return its store jobs."""
    hits, _ = h.admit(rid)
    assert hits is not None
    req = h.reqs[rid]
    req.num_computed_tokens += hits
    n = req.num_tokens - req.num_computed_tokens if tokens is None else tokens
    meta = h.step([h.schedule(rid, n)], new=[rid])
    return dict(meta.store_jobs)


def offloaded(h: Harness, rid: str, tokens: list[int]) -> None:
    """Add ``rid``, compute its whole prompt and complete its store jobs on every worker."""
    h.add(rid, tokens)
    h.report(list(prefill(h, rid)))


def admit_with_load(h: Harness, rid: str, tokens: list[int], hits: int) -> int:
    """Add ``rid``, admit it expecting ``hits`` loadable tokens, and return its load job
    (submitted in the next step, not yet reported)."""
    h.add(rid, tokens)
    assert h.admit(rid) == (hits, True)
    (load,) = h.step().load_jobs
    return load


def impostor(real: object) -> object:
    """A value equal to (and hashed as) ``real`` whose class even compares equal to
    ``type(real)`` (a metaclass ``__eq__``): only an identity check of its type sees that it
    is not a ``type(real)``."""
    claimed = type(real)

    class _Claims(type):
        def __eq__(cls, other: object) -> bool:
            return other is claimed or type.__eq__(cls, other)

        __hash__ = type.__hash__

    class Impostor(metaclass=_Claims):
        def __eq__(self, other: object) -> bool:
            return bool(other == real)

        def __hash__(self) -> int:
            return hash(real)

        def __repr__(self) -> str:
            return f"impostor({real!r})"

    return Impostor()

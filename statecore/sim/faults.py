"""Fault knobs and the report channel that injects them between workers and the scheduler.

Every worker rank produces one :class:`~statecore.wire.WorkerMetadata` per step. The
:class:`ReportChannel` splits each report into per-(rank, job) entries and decides, from its own
seeded random stream, what happens to each one: delivered now, delayed a few steps, delivered
only after the stall timeout (a late report), never delivered (a stalled job), or delivered
twice (a duplicate, before or after the job's quorum). It also invents reports for job ids the
scheduler never issued and replays reports of jobs from before the last ``reset_cache`` (stale
reports).
Delivered entries of a step are merged with :meth:`WorkerMetadata.aggregate`, as an engine does.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass, field

from statecore.wire import TransferStats, WorkerMetadata

__all__ = ["FAULT_KINDS", "ReportChannel", "SimFaults", "parse_faults"]


@dataclass(frozen=True, slots=True)
class SimFaults:
    """Fault probabilities (each in ``[0, 1]``) and report-delay shape.

    Attributes:
        stall: per worker report of a job: the report is lost (the job stalls).
        late: per worker report: delivered only after the stall timeout has expired.
        duplicate: per delivered worker report: delivered again later, either while other
            ranks are still outstanding (must not complete the job early) or after the job's
            quorum (must be absorbed).
        stale: per step: a report for a job issued before the last reset is injected.
        unknown: per step: a report for a job id never issued is injected.
        transfer_failure: per worker and job: the transfer fails (reported as failed).
        reset: per step: ``reset_cache`` is called between steps.
        delay_store: per store job: its copy executes only some steps later (or when
            flushed), so a fenced block reused without a flush would be caught.
        report_delay: per worker report: delivered 1..``max_report_delay`` steps late.
        manager_error: per job completion: the manager applies it, then raises (a typed
            ``ManagerError`` or, as often, an untyped exception: a manager's bug); the
            scheduler must end the job anyway and report the error (INV-MGR-ERROR).
        max_report_delay: upper bound of ordinary report delays, in steps.
        max_store_delay: upper bound of store-copy delays, in steps.
    """

    stall: float = 0.0
    late: float = 0.0
    duplicate: float = 0.0
    stale: float = 0.0
    unknown: float = 0.0
    transfer_failure: float = 0.0
    reset: float = 0.0
    delay_store: float = 0.0
    report_delay: float = 0.0
    manager_error: float = 0.0
    max_report_delay: int = 3
    max_store_delay: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.startswith("max_"):
                if not isinstance(v, int) or v < 0:
                    raise ValueError(f"faults: {f.name} must be an int >= 0, got {v!r}")
            elif not 0.0 <= v <= 1.0:
                raise ValueError(f"faults: {f.name} must be a probability in [0, 1], got {v!r}")

    @classmethod
    def preset(cls, name: str) -> SimFaults:
        """``none``, ``default`` or ``heavy``."""
        if name == "none":
            return cls()
        if name == "default":
            return cls(
                stall=0.004,
                late=0.004,
                duplicate=0.02,
                stale=0.02,
                unknown=0.02,
                transfer_failure=0.01,
                reset=0.004,
                delay_store=0.3,
                report_delay=0.3,
                manager_error=0.005,
            )
        if name == "heavy":
            return cls(
                stall=0.02,
                late=0.02,
                duplicate=0.1,
                stale=0.08,
                unknown=0.08,
                transfer_failure=0.05,
                reset=0.02,
                delay_store=0.6,
                report_delay=0.5,
                manager_error=0.03,
                max_report_delay=6,
                max_store_delay=8,
            )
        raise ValueError(f"faults: unknown preset {name!r} (none, default, heavy)")


FAULT_KINDS: tuple[str, ...] = (
    "stall",
    "late",
    "duplicate",
    "stale",
    "unknown",
    "transfer_failure",
    "reset",
    "delay_store",
    "manager_error",
)
"""The fault kinds the report accounts for (injected and observed)."""


def parse_faults(text: str) -> SimFaults:
    """``none``/``default``/``heavy``, optionally followed by ``k=v`` overrides.

    Examples: ``heavy``, ``stall=0.1,late=0``, ``default,reset=0.05``.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    base = SimFaults.preset("default")
    if parts and "=" not in parts[0]:
        base = SimFaults.preset(parts.pop(0))
    names = {f.name: f for f in dataclasses.fields(SimFaults)}
    changes: dict[str, float | int] = {}
    for p in parts:
        k, sep, v = p.partition("=")
        k = k.strip().replace("-", "_")
        if not sep or k not in names:
            raise ValueError(f"faults: bad item {p!r} (known: {', '.join(names)})")
        try:
            changes[k] = int(v) if k.startswith("max_") else float(v)
        except ValueError:
            raise ValueError(f"faults: {k}={v!r} is not a number") from None
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Entry:
    rank: int
    job_id: int
    ok: bool
    dup: bool = False  # a re-delivery: not counted towards the job's expected reports


@dataclass(slots=True)
class _JobTrack:
    expected: int
    delivered: int = 0
    epoch: int = 0


@dataclass
class ReportChannel:
    """Seeded fault layer between the workers' reports and ``update_connector_output``.

    Args:
        faults: the knobs.
        rng: its own random stream.
        num_workers: ranks per job.
        late_after_steps: a late report is delivered this many steps after the job was emitted
            (beyond the stall timeout plus one check interval).
    """

    faults: SimFaults
    rng: random.Random
    num_workers: int
    late_after_steps: int
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    _queue: dict[int, list[_Entry]] = field(default_factory=lambda: defaultdict(list))
    _jobs: dict[int, _JobTrack] = field(default_factory=dict)
    _emitted_at: dict[int, int] = field(default_factory=dict)
    _pre_reset_ids: list[int] = field(default_factory=list)
    _max_id: int = -1
    _stats: TransferStats = field(default_factory=TransferStats)
    _epoch: int = 0
    lost: set[int] = field(default_factory=set)
    """Job ids with at least one report lost for good (their stall ledger may never drain)."""

    def job_emitted(self, job_id: int, step: int) -> None:
        """The scheduler emitted ``job_id`` in the metadata of ``step``."""
        self._emitted_at[job_id] = step
        self._jobs[job_id] = _JobTrack(self.num_workers, epoch=self._epoch)
        self._max_id = max(self._max_id, job_id)

    def reset_happened(self, carried: frozenset[int] = frozenset()) -> None:
        """``reset_cache`` was called: every id emitted so far, except the loads ``carried``
        over the reset (still live), is now pre-reset."""
        self._epoch += 1
        self._pre_reset_ids.extend(j for j in self._emitted_at if j not in carried)
        if len(self._pre_reset_ids) > 4096:
            del self._pre_reset_ids[:-4096]

    def submit(self, rank: int, meta: WorkerMetadata | None, step: int) -> None:
        """Queue the entries of one rank's report produced at ``step``."""
        if meta is None:
            return
        self._stats = self._stats.merged(meta.stats)
        f, rng = self.faults, self.rng
        entries = [_Entry(rank, j, True) for j, n in meta.completed.items() for _ in range(n)]
        entries += [_Entry(rank, j, False) for j, n in meta.failed.items() for _ in range(n)]
        for e in entries:
            r = rng.random()
            if r < f.stall:
                self.injected["stall"] += 1
                self.lost.add(e.job_id)
                continue
            r -= f.stall
            if r < f.late:
                self.injected["late"] += 1
                due = max(step + 1, self._emitted_at.get(e.job_id, step) + self.late_after_steps)
                self._queue[due].append(e)
                continue
            due = step
            if f.report_delay and rng.random() < f.report_delay and f.max_report_delay:
                due += rng.randint(1, f.max_report_delay)
            self._queue[due].append(e)

    def deliver(self, step: int) -> WorkerMetadata | None:
        """The aggregated report the scheduler receives at ``step`` (None when empty)."""
        f, rng = self.faults, self.rng
        entries = self._queue.pop(step, [])
        if f.stale and self._pre_reset_ids and rng.random() < f.stale:
            self.injected["stale"] += 1
            entries.append(_Entry(0, rng.choice(self._pre_reset_ids), True))
        if f.unknown and rng.random() < f.unknown:
            self.injected["unknown"] += 1
            entries.append(_Entry(0, self._max_id + 1_000_000 + rng.randrange(1000), True))
        stats, self._stats = self._stats, TransferStats()
        if not entries:
            return None if stats.is_empty() else WorkerMetadata(stats=stats)
        per_rank: dict[int, WorkerMetadata] = {}
        for e in entries:
            m = per_rank.setdefault(e.rank, WorkerMetadata(rank=e.rank))
            (m.mark_completed if e.ok else m.mark_failed)(e.job_id)
            track = self._jobs.get(e.job_id)
            if track is None or e.dup:
                continue
            track.delivered += 1
            if track.delivered < track.expected:
                # a rank's report delivered twice while other ranks are still outstanding:
                # rank identity on the wire must keep it from completing the job early
                if f.duplicate and rng.random() < f.duplicate:
                    self.injected["duplicate"] += 1
                    self._queue[step + 1].append(_Entry(e.rank, e.job_id, e.ok, True))
            else:
                del self._jobs[e.job_id]
                if f.duplicate and rng.random() < f.duplicate:
                    self.injected["duplicate"] += 1
                    self._queue[step + rng.randint(1, 3)].append(
                        _Entry(e.rank, e.job_id, True, True)
                    )
        out: WorkerMetadata | None = None
        for rank in sorted(per_rank):
            out = per_rank[rank] if out is None else out.aggregate(per_rank[rank])
        if out is None:  # not reachable: entries is not empty
            return WorkerMetadata(stats=stats)
        out.stats = out.stats.merged(stats)
        return out

    def forget(self, job_id: int) -> None:
        """Stop tracking ``job_id`` for duplicates (e.g. its reports were lost)."""
        self._jobs.pop(job_id, None)

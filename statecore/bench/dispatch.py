"""``statecore bench dispatch``: cost of one lifecycle event, compiled table vs machine instance.

In one run it measures, on records with ``__slots__`` and an owner whose hooks do nothing:

* the compiled table (``JOB.fire`` / ``REQUEST.fire``) per event, on guarded internal
  self-transitions (the commonest hot-path event: a partial worker report, a job ending while
  others remain) and on a full cycle with actions;
* a python-statemachine instance per event (``instance.send``) on the same transitions;
* the construction cost and retained size (``tracemalloc``) of one machine instance;
* a pickle round trip of one step's connector metadata with 64 store jobs and of a worker's
  report (what vLLM's multiprocess executor sends to every worker and back, each step).

Each figure is the best of several repeats. ``raw`` includes the Python ``for`` loop that
drives the events; ``net`` subtracts the cost of the same loop with an empty body. The target
for the table is at most 1 us per event (``net``). This is a command, not a test: nothing here
asserts timings.
"""

from __future__ import annotations

import gc
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence

from statecore.lifecycle import (
    J_PARTIAL,
    JE_WORKER_REPORT,
    JOB,
    R_STORING,
    RE_ALLOC_LOAD,
    RE_JOB_ENDED,
    RE_LOOKUP,
    REQUEST,
    JobLifecycle,
    LifecycleEffects,
    RequestLifecycle,
    effects_class,
)

__all__ = ["JobRecord", "NullOwner", "RequestRecord", "main", "measure"]

TARGET_US = 1.0
"""The budget for one table event, in microseconds."""


def _no_op(hook: str) -> Callable[..., None]:
    def no_op(self: object, record: object, *args: object) -> None:
        return None

    no_op.__name__ = hook
    return no_op


NullOwner = effects_class(
    "NullOwner", _no_op, "A lifecycle owner whose hooks do nothing (isolates dispatch cost)."
)


class JobRecord:
    """A minimal job record as the scheduler keeps one."""

    __slots__ = ("_shadow", "_sm", "failed", "job_id", "owner", "pending", "state")

    def __init__(self, job_id: int, owner: LifecycleEffects, pending: int) -> None:
        self.job_id = job_id
        self.owner = owner
        self.pending = pending
        self.failed = 0
        self.state = JOB.initial


class RequestRecord:
    """A minimal request record as the scheduler keeps one."""

    __slots__ = ("_shadow", "_sm", "jobs", "owner", "req_id", "state")

    def __init__(self, req_id: str, owner: LifecycleEffects) -> None:
        self.req_id = req_id
        self.owner = owner
        self.jobs: set[int] = set()
        self.state = REQUEST.initial


def measure(body: Callable[[int], None], n: int, repeats: int) -> float:
    """Best-of-``repeats`` seconds for ``body(n)``, with the collector off."""
    best = float("inf")
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            body(n)
            best = min(best, time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return best


def _empty_loop(n: int) -> None:
    for _ in range(n):
        pass


def _table_cases() -> list[tuple[str, Callable[[int], None], int]]:
    """(name, body, events per iteration) for the compiled table."""
    owner = NullOwner()
    job = JobRecord(1, owner, pending=3)
    job.state = J_PARTIAL
    req = RequestRecord("r", owner)
    req.jobs = {1, 2}
    req.state = R_STORING
    idle = RequestRecord("i", owner)
    cycle = RequestRecord("c", owner)
    job_fire = JOB.fire
    req_fire = REQUEST.fire

    def job_report(n: int) -> None:  # partial --worker_report [outstanding]--> partial
        for _ in range(n):
            job_fire(job, JE_WORKER_REPORT)

    def req_job_ended(n: int) -> None:  # storing --job_ended [has_jobs]--> storing
        for _ in range(n):
            req_fire(req, RE_JOB_ENDED)

    def req_lookup(n: int) -> None:  # no_transfer --lookup--> no_transfer (no guard)
        for _ in range(n):
            req_fire(idle, RE_LOOKUP)

    def req_cycle(n: int) -> None:  # alloc_load, then job_ended [no_jobs]: 2 events
        for _ in range(n):
            req_fire(cycle, RE_ALLOC_LOAD)
            req_fire(cycle, RE_JOB_ENDED)

    return [
        ("job worker_report [outstanding] (partial)", job_report, 1),
        ("request job_ended [has_jobs] (storing)", req_job_ended, 1),
        ("request lookup (no guard)", req_lookup, 1),
        ("request alloc_load + job_ended [no_jobs]", req_cycle, 2),
    ]


def _machine_cases() -> list[tuple[str, Callable[[int], None], int]]:
    """The same transitions through python-statemachine instances (``send``)."""
    owner = NullOwner()
    job = JobRecord(1, owner, pending=3)
    job_sm = JobLifecycle(model=job, state_field="_shadow", start_value="partial")
    req = RequestRecord("r", owner)
    req.jobs = {1, 2}
    req_sm = RequestLifecycle(model=req, state_field="_shadow", start_value="storing")
    idle = RequestRecord("i", owner)
    idle_sm = RequestLifecycle(model=idle, state_field="_shadow")
    cycle = RequestRecord("c", owner)
    cycle_sm = RequestLifecycle(model=cycle, state_field="_shadow")

    def job_report(n: int) -> None:
        send = job_sm.send
        for _ in range(n):
            send("worker_report")

    def req_job_ended(n: int) -> None:
        send = req_sm.send
        for _ in range(n):
            send("job_ended")

    def req_lookup(n: int) -> None:
        send = idle_sm.send
        for _ in range(n):
            send("lookup")

    def req_cycle(n: int) -> None:
        send = cycle_sm.send
        for _ in range(n):
            send("alloc_load")
            send("job_ended")

    return [
        ("job worker_report [outstanding] (partial)", job_report, 1),
        ("request job_ended [has_jobs] (storing)", req_job_ended, 1),
        ("request lookup (no guard)", req_lookup, 1),
        ("request alloc_load + job_ended [no_jobs]", req_cycle, 2),
    ]


def _construction(count: int, repeats: int) -> tuple[float, float, float, float]:
    """(job us, job bytes, request us, request bytes) per machine instance."""
    owner = NullOwner()
    results: list[float] = []
    for make in (
        lambda i: JobLifecycle(model=JobRecord(i, owner, 2), state_field="_shadow"),
        lambda i: RequestLifecycle(model=RequestRecord(str(i), owner), state_field="_shadow"),
    ):

        def build(n: int, make: Callable[[int], object] = make) -> None:
            for i in range(n):
                make(i)

        seconds = measure(build, count, repeats)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        kept = [make(i) for i in range(count)]
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del kept
        results += [seconds / count * 1e6, (after - before) / count]
    return results[0], results[1], results[2], results[3]


def _record_bytes() -> tuple[int, int]:
    """Bytes of one slotted job record and one request record (with its empty job set)."""
    owner = NullOwner()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    jobs = [JobRecord(i, owner, 2) for i in range(1000)]
    mid = tracemalloc.get_traced_memory()[0]
    reqs = [RequestRecord("r", owner) for _ in range(1000)]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del jobs, reqs
    return (mid - before) // 1000, (after - mid) // 1000


def _wire_round_trips(repeats: int, jobs: int = 64) -> tuple[float, float]:
    """Microseconds per pickle round trip (highest protocol) of a step's metadata with
    ``jobs`` store jobs of 4 blocks and their keys, and of a worker report of ``jobs`` jobs."""
    import pickle

    from statecore.keys import make_offload_key
    from statecore.manager import CPULoadStoreSpec
    from statecore.wire import ConnectorMetadata, GPULoadStoreSpec, TransferJob, WorkerMetadata

    stores = {
        i: TransferJob(
            f"req-{i}",
            GPULoadStoreSpec(tuple(range(4 * i, 4 * i + 4)), (4,), (0,)),
            CPULoadStoreSpec(tuple(range(4 * i, 4 * i + 4))),
        )
        for i in range(jobs)
    }
    keys = {
        i: tuple(make_offload_key(i.to_bytes(4, "big") * 8, 0) for _ in range(4))
        for i in range(jobs)
    }
    meta = ConnectorMetadata(store_jobs=stores, store_keys=keys)
    report = WorkerMetadata(rank=0)
    for i in range(jobs):
        report.mark_completed(i)
    out = []
    for obj in (meta, report):
        n = 200

        def trip(n: int, obj: object = obj) -> None:
            for _ in range(n):
                pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))

        out.append(measure(trip, n, repeats) / n * 1e6)
    return out[0], out[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore bench dispatch``."""
    from statecore.cli import command_parser, int_range

    parser = command_parser(
        "statecore bench dispatch",
        "Cost per lifecycle event: compiled table vs python-statemachine instance.",
    )
    parser.add_argument(
        "--events", type=int_range(1), default=200_000, help="table events per repeat"
    )
    parser.add_argument(
        "--machine-events", type=int_range(1), default=1_000, help="machine events per repeat"
    )
    parser.add_argument("--repeats", type=int_range(1), default=5, help="repeats (best is kept)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    n, m, reps = args.events, args.machine_events, args.repeats

    loop_n = measure(_empty_loop, n, reps) / n * 1e6
    loop_m = measure(_empty_loop, m, reps) / m * 1e6
    table = {name: (measure(body, n, reps) / (n * k) * 1e6, k) for name, body, k in _table_cases()}
    machine = {
        name: (measure(body, m, reps) / (m * k) * 1e6, k) for name, body, k in _machine_cases()
    }
    job_us, job_b, req_us, req_b = _construction(200, reps)
    job_rec_b, req_rec_b = _record_bytes()
    meta_us, report_us = _wire_round_trips(reps)

    print(f"statecore bench dispatch (python {sys.version.split()[0]}, best of {reps})")
    print(f"empty loop overhead: {loop_n:.3f} us per iteration")
    print()
    w = max(len(name) for name in table)
    print(
        f"{'transition':<{w}}  {'table raw':>9}  {'table net':>9}  "
        f"{'machine':>9}  {'speed-up':>8}   (us per event)"
    )
    worst = 0.0
    for name, (raw, k) in table.items():
        net = raw - loop_n / k
        worst = max(worst, net)
        mach = machine[name][0] - loop_m / k
        print(f"{name:<{w}}  {raw:9.3f}  {net:9.3f}  {mach:9.2f}  {mach / net:7.0f}x")
    print()
    print("python-statemachine instance construction:")
    print(f"  JobLifecycle      {job_us:8.1f} us  {job_b / 1024:6.1f} KiB retained")
    print(f"  RequestLifecycle  {req_us:8.1f} us  {req_b / 1024:6.1f} KiB retained")
    print(f"table records: job {job_rec_b} B, request {req_rec_b} B (incl. its empty job set)")
    print(
        f"pickle round trip: a step's metadata with 64 store jobs {meta_us:.1f} us, "
        f"a worker report of 64 jobs {report_us:.1f} us"
    )
    verdict = "within" if worst <= TARGET_US else "ABOVE"
    print()
    print(f"worst table event: {worst:.3f} us net, {verdict} the {TARGET_US:.0f} us target")
    return 0

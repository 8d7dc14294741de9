"""vLLM 0.33's step order as :mod:`statecore.sim.step` writes it, on a model of a few lines:
the running requests' preemption rule, the waiting phase only when nothing was preempted,
and ``has_requests``."""

from __future__ import annotations

from dataclasses import dataclass, field

from statecore.sim.step import StepPass, has_requests, listed, schedule, schedule_running


@dataclass(eq=False)
class Req:
    name: str
    computed: int
    total: int
    blocks: int = 0
    running: bool = True


@dataclass
class Model:
    """Blocks of one token each; ``free`` of them left."""

    free: int
    log: list[str] = field(default_factory=list)

    def is_running(self, r: Req) -> bool:
        return r.running

    def token_counts(self, r: Req) -> tuple[int, int]:
        return r.computed, r.total

    def free_out_of_window(self, r: Req) -> None:
        self.log.append(f"window {r.name}")

    def blocks_needed(self, r: Req, upto: int, computed: int) -> int:
        return max(0, upto - r.blocks)

    def num_free_blocks(self) -> int:
        return self.free

    def preempt_now(self, r: Req) -> None:
        self.log.append(f"preempt {r.name}")
        self.free += r.blocks
        r.blocks, r.computed, r.running = 0, 0, False

    def allocate(self, r: Req, upto: int, computed: int) -> int:
        got = max(0, upto - r.blocks)
        self.free -= got
        r.blocks += got
        return got


def test_a_request_that_outgrows_the_free_blocks_preempts_the_last_running_one() -> None:
    a, b, c = Req("a", 4, 5, 4), Req("b", 4, 5, 4), Req("c", 4, 5, 4)
    model = Model(free=1)
    pass_: StepPass[Req, int] = StepPass(budget=100)
    schedule_running([a, b, c], pass_, model)
    # a takes the free block; b needs one: c (last, not yet scheduled) goes; then c is gone
    assert [(r.name, n) for r, n, _, _ in pass_.scheduled] == [("a", 1), ("b", 1)]
    assert pass_.preempted == {c}
    assert model.log == ["window a", "window b", "preempt c"]


def test_a_request_that_must_preempt_itself_ends_the_running_phase() -> None:
    a, b = Req("a", 0, 8, 0), Req("b", 4, 5, 4)
    model = Model(free=2)
    pass_: StepPass[Req, int] = StepPass(budget=100)
    schedule_running([a, b], pass_, model)
    # a needs 8 blocks: b goes (4 free then), still short: a preempts itself; b is not retried
    assert pass_.scheduled == []
    assert pass_.preempted == {a, b}
    assert model.log == ["window a", "preempt b", "preempt a"]


def test_a_scheduled_request_is_never_a_victim() -> None:
    a, b = Req("a", 4, 5, 4), Req("b", 0, 4, 0)
    model = Model(free=1)
    pass_: StepPass[Req, int] = StepPass(budget=100)
    schedule_running([a, b], pass_, model)
    # b cannot take a's blocks: a was scheduled in this step, so b preempts itself
    assert [r.name for r, _, _, _ in pass_.scheduled] == ["a"]
    assert pass_.preempted == {b}


def test_the_budget_chunks_the_prefill() -> None:
    a, b = Req("a", 0, 10, 0), Req("b", 0, 10, 0)
    model = Model(free=100)
    pass_: StepPass[Req, int] = StepPass(budget=12)
    schedule_running([a, b], pass_, model)
    assert [(r.name, n) for r, n, _, _ in pass_.scheduled] == [("a", 10), ("b", 2)]
    assert pass_.budget == 0


def test_the_waiting_phase_runs_only_when_nothing_was_preempted() -> None:
    calls: list[str] = []

    def running(p: StepPass[str, int]) -> None:
        calls.append("running")
        if len(calls) > 2:
            p.preempted.add("x")

    def waiting(p: StepPass[str, int]) -> None:
        calls.append("waiting")

    schedule(StepPass(budget=1), running, waiting)
    assert calls == ["running", "waiting"]
    schedule(StepPass(budget=1), running, waiting)
    assert calls == ["running", "waiting", "running"]


def test_has_requests_asks_the_connector_only_when_nothing_else_is_left() -> None:
    asked: list[bool] = []

    def push_work() -> bool:
        asked.append(True)
        return True

    assert has_requests(True, False, push_work) and not asked
    assert has_requests(False, True, push_work) and not asked
    assert has_requests(False, False, push_work) and asked == [True]
    assert not has_requests(False, False, lambda: False)


def test_the_output_lists_new_then_resumed_then_running_and_resumed_as_new() -> None:
    run, res, new = Req("run", 4, 5), Req("res", 0, 5), Req("new", 0, 5)
    pass_: StepPass[Req, int] = StepPass(budget=100)
    pass_.scheduled = [(run, 1, 0, False), (res, 5, 5, True), (new, 5, 5, False)]
    pass_.new = {new}
    entries, as_new = listed(pass_)
    assert [(r.name, resumed) for r, _, _, resumed in entries] == [
        ("new", False),
        ("res", False),
        ("run", False),
    ]
    assert as_new == {new, res}

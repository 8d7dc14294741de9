"""The columnar form of a step's scheduled requests (``SchedulerOutput.columns``).

An engine adapter may hand the running requests of a step as :class:`ScheduledColumns`
instead of one :class:`ScheduledRequest` each. These tests pin that the two forms mean the
same thing to the scheduler (same jobs, same counters, in checked mode) and that the
columnar form is validated as strictly as the per-entry one.
"""

from __future__ import annotations

from typing import Any

import pytest
from sched_harness import Harness, config, make_manager

import statecore.bench.scheduler as bench
from statecore import InvalidMetadataError, ScheduledRequest, SchedulerOutput
from statecore.views import ScheduledColumns


def _columnar(**kw: Any) -> SchedulerOutput:
    """A SchedulerOutput with every entry not in ``new_req_ids`` moved into ``columns``
    (no new blocks as None, as vLLM sends them)."""
    entries = tuple(kw.pop("scheduled", ()))
    assert kw.pop("columns", None) is None  # the engine built a per-entry output
    new = kw.get("new_req_ids", frozenset())
    first = [s for s in entries if s.req_id in new]
    rest = [s for s in entries if s.req_id not in new]
    columns = ScheduledColumns(
        [s.req_id for s in rest],
        [s.new_block_ids if any(s.new_block_ids) else None for s in rest],
        [s.num_scheduled_tokens for s in rest],
        frozenset(s.req_id for s in rest if s.resumed_from_preemption),
    )
    return SchedulerOutput(scheduled=first, columns=columns, **kw)


@pytest.mark.parametrize(("n", "steps", "gpu_factor"), [(16, 150, 0.6), (24, 200, 0.5)])
def test_columnar_steps_do_what_per_entry_steps_do(
    monkeypatch: pytest.MonkeyPatch, n: int, steps: int, gpu_factor: float
) -> None:
    """The benchmark engine (admissions, CPU hits and loads, deferred lookups, chunked
    prefill, decode, preemption: a GPU cache smaller than the requests need) run twice on one
    seed, in checked mode: once with per-entry outputs, once with columnar ones. Every counter
    and every request's output length agree."""
    monkeypatch.setenv("STATECORE_CHECKED", "1")
    sc = bench.Scenario(concurrency=n, steps=steps, gpu_cache_factor=gpu_factor)
    # a probe that never stops the run: no memory-per-job measurement (2000 checked jobs)
    plain = bench.run_standalone(sc, probe=lambda *_: False)
    monkeypatch.setattr(bench, "SchedulerOutput", _columnar)
    columnar = bench.run_standalone(sc, probe=lambda *_: False)
    assert plain.counters == columnar.counters
    assert plain.outputs == columnar.outputs
    assert plain.counters["store_jobs_created"] > 0
    assert plain.counters["load_jobs_created"] > 0
    assert plain.counters["preemptions"] > 0


@pytest.mark.usefixtures("view_checks")
def test_columns_normalise_block_lists_to_tuples() -> None:
    c = ScheduledColumns(["a", "b"], [None, ([1, 2],)], [1, 3])
    assert c.req_ids == ("a", "b")
    assert c.new_block_ids == (None, ((1, 2),))
    assert c.num_scheduled_tokens == (1, 3)
    assert c.group_counts == frozenset({1})
    assert SchedulerOutput(columns=c).group_counts == frozenset({1})


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((["a", 1], [None, None], [1, 1]), "req_ids[1]"),
        ((["a"], [None, None], [1]), "columns"),
        ((["a"], [None], [1, 2]), "columns"),
        ((["a"], [None], [-1]), "num_scheduled_tokens[0]"),
        ((["a"], [None], [True]), "num_scheduled_tokens[0]"),
        ((["a"], [None], [1.0]), "num_scheduled_tokens[0]"),
        ((["a"], [[1, 2]], [1]), "new_block_ids[0][0]"),
        ((["a"], [([1, -2],)], [1]), "new_block_ids[0][0]"),
        ((["a"], [("x",)], [1]), "new_block_ids[0][0]"),
        ((["a"], [5], [1]), "new_block_ids[0]"),
        (("a", [None], [1]), "req_ids"),
        ((["a"], None, [1]), "new_block_ids"),
        ((["a"], [None], [1], frozenset({3})), "resumed_req_ids"),
        ((["a"], [None], [1], ["a"]), "resumed_req_ids"),
    ],
)
@pytest.mark.usefixtures("view_checks")
def test_malformed_columns_raise_naming_the_field(args: tuple[Any, ...], named: str) -> None:
    with pytest.raises(InvalidMetadataError, match=named.replace("[", r"\[").replace("]", r"\]")):
        ScheduledColumns(*args)


@pytest.mark.usefixtures("view_checks")
def test_columns_not_a_columns_object_raise() -> None:
    with pytest.raises(InvalidMetadataError, match="columns"):
        SchedulerOutput(columns=[("a", None, 1)])  # type: ignore[arg-type]


def test_wrong_group_count_in_columns_raises_before_any_change() -> None:
    """Two KV-cache groups, an entry with one block list: refused whole, nothing applied."""
    h = Harness(make_manager("cpu"), config(sliding=8))
    h.add("a", list(range(16)))
    h.admit("a")
    first = h.schedule("a", 8)
    h.step([first], new=["a"])
    before = h.sched.request_keys("a"), [list(g.block_ids) for g in h.sched.requests["a"].groups]
    bad = SchedulerOutput(columns=ScheduledColumns(["a"], [((50,),)], [4]))
    with pytest.raises(InvalidMetadataError, match=r"columns\.new_block_ids\[0\]"):
        h.sched.build_connector_meta(bad)
    after = h.sched.request_keys("a"), [list(g.block_ids) for g in h.sched.requests["a"].groups]
    assert before == after


def test_columns_follow_scheduled_entries_and_resume() -> None:
    """Entries in ``columns`` apply after ``scheduled``; a resumed id's lists replace the
    request's lists (its old blocks are never stored)."""
    h = Harness(make_manager("cpu"), config())
    h.add("a", list(range(16)))
    h.admit("a")
    meta = h.step([h.schedule("a", 8)], new=["a"])
    assert len(meta.store_jobs) == 1
    h.report(completed=meta.store_jobs)
    h.sched.build_connector_meta(SchedulerOutput(preempted_req_ids=frozenset({"a"})))
    h.reqs["a"].num_computed_tokens = 0
    resumed: ScheduledRequest = h.schedule("a", 16, resumed=True)
    cols = ScheduledColumns(["a"], [resumed.new_block_ids], [16], frozenset({"a"}))
    meta = h.sched.build_connector_meta(SchedulerOutput(columns=cols))
    (job,) = meta.store_jobs.values()
    assert set(job.src.block_ids) <= set(resumed.new_block_ids[0])


def test_preempted_and_resumed_in_one_output_stores_again() -> None:
    """vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts the running
    requests outside ``schedule()``: the next output lists such a request as preempted AND
    schedules it resumed, with all of its new blocks. The preemption applies before the
    step's entries (it happened first), so the resumed block lists stand and the recomputed
    chunks, dropped by the reset, are stored again (vLLM's CPU build showed the other order
    losing them: the preemption dropped the lists the resume had just set)."""
    h = Harness(make_manager("cpu"), config())
    h.add("a", list(range(16)))
    h.admit("a")
    meta = h.step([h.schedule("a", 16)], new=["a"])
    h.report(completed=meta.store_jobs)
    assert h.sched.reset_cache()
    h.reqs["a"].num_computed_tokens = 0
    resumed: ScheduledRequest = h.schedule("a", 16, resumed=True)
    cols = ScheduledColumns(["a"], [resumed.new_block_ids], [16], frozenset({"a"}))
    meta = h.sched.build_connector_meta(
        SchedulerOutput(columns=cols, preempted_req_ids=frozenset({"a"}))
    )
    (job,) = meta.store_jobs.values()
    assert list(job.src.block_ids) == list(resumed.new_block_ids[0])
    assert [list(g.block_ids) for g in h.sched.requests["a"].groups] == [
        list(resumed.new_block_ids[0])
    ]


# -- dormant requests: decode entries skipped once no chunk can become storable ------------------


def _decode(h: Harness, *rids: str, blocks: dict[str, Any] | None = None) -> Any:
    """One columnar step: one token each, no new blocks unless ``blocks`` gives them."""
    blocks = blocks or {}
    meta = h.sched.build_connector_meta(
        SchedulerOutput(
            columns=ScheduledColumns(list(rids), [blocks.get(r) for r in rids], [1] * len(rids))
        )
    )
    for r in rids:
        h.reqs[r].num_computed_tokens += 1
        h.reqs[r].num_tokens += 1
    return meta


def _prompt_only_harness() -> tuple[Harness, dict[int, object]]:
    from sched_harness import prefill

    h = Harness(make_manager("cpu"), config(offload_prompt_only=True))
    h.add("a", list(range(16)))
    jobs = prefill(h, "a")
    h.report(list(jobs))
    return h, jobs


def test_a_dormant_request_stores_again_after_a_reset() -> None:
    """A prompt-only request whose prompt is stored has nothing left to store: its decode
    entries are skipped (dormant). A reset rewinds its cursors, so its next decode entry,
    without new blocks, stores the prompt again into the reset tier."""
    h, jobs = _prompt_only_harness()
    assert len(jobs) == 1
    for _ in range(3):
        assert not _decode(h, "a").store_jobs  # dormant: nothing to store
    h.sched.reset_cache()
    meta = _decode(h, "a")
    assert len(meta.store_jobs) == 1
    (job,) = meta.store_jobs
    assert len(h.sched.jobs[job].keys) == 4  # the whole prompt again


def test_a_dormant_request_resumed_or_reallocated_is_followed_again() -> None:
    """Preemption clears a dormant request's blocks; its resumed entry brings new ones and
    is applied (block lists, fences) although the request was dormant; an allocation
    (update_state_after_alloc) too."""
    h, _ = _prompt_only_harness()
    _decode(h, "a")
    h.step(preempted=["a"])
    rec = h.sched.requests["a"]
    assert rec.groups[0].block_ids == []
    resumed = SchedulerOutput(
        columns=ScheduledColumns(["a"], [((70, 71, 72, 73, 74),)], [17], frozenset({"a"}))
    )
    h.sched.build_connector_meta(resumed)
    assert rec.groups[0].block_ids == [70, 71, 72, 73, 74]
    _decode(h, "a")
    _decode(h, "a", blocks={"a": ((75,),)})  # a new block of a dormant request is recorded
    assert rec.groups[0].block_ids[-1] == 75
    h.sched.update_state_after_alloc(h.reqs["a"], [[80, 81, 82, 83, 84, 85]], 0)
    _decode(h, "a")  # the allocation's lists are applied: the entry was not skipped
    assert rec.groups[0].block_ids == [80, 81, 82, 83, 84, 85]


def test_checked_mode_catches_a_dormant_request_that_can_still_store() -> None:
    from statecore import InvariantViolation

    h, _ = _prompt_only_harness()
    _decode(h, "a")
    h.sched.requests["a"].store_floor = 0  # e.g. a rewind that forgot the dormant set
    with pytest.raises(InvariantViolation, match="INV-CURSOR"):
        h.sched.check_invariants()


def test_a_resumed_entry_of_a_dormant_request_clears_its_blocks_even_without_new_ones() -> None:
    h, _ = _prompt_only_harness()
    _decode(h, "a")
    h.sched.build_connector_meta(
        SchedulerOutput(columns=ScheduledColumns(["a"], [None], [1], frozenset({"a"})))
    )
    assert h.sched.requests["a"].groups[0].block_ids == []


class _Id(str):
    """A str subclass: accepted as a request id (the diagnosis checks isinstance)."""


@pytest.mark.usefixtures("view_checks")
def test_fast_checks_accept_what_the_diagnosis_accepts_and_freeze_it() -> None:
    """The C-speed checks (``join`` over the ids) and the entry-by-entry diagnosis agree:
    str subclasses are ids; a mutable id set is stored frozen; one group count is kept."""
    resumed = {"b"}
    c = ScheduledColumns([_Id("a"), "b"], [([1],), None], [1, 2], resumed)  # type: ignore[arg-type]
    resumed.add("c")
    assert type(c.resumed_req_ids) is frozenset and c.resumed_req_ids == {"b"}
    assert c.req_ids == ("a", "b") and c.group_counts == frozenset({1})
    two = ScheduledColumns(["a"], [([1], [2])], [1])
    assert two.group_counts == frozenset({2})
    out = SchedulerOutput(finished_req_ids=frozenset({_Id("x")}), columns=two)
    assert out.group_counts == frozenset({2})
    mixed = SchedulerOutput(scheduled=[ScheduledRequest("a", ((1,),), 1)], columns=two)
    assert mixed.group_counts == frozenset({1, 2})


@pytest.mark.parametrize("name", ["new_req_ids", "finished_req_ids", "preempted_req_ids"])
@pytest.mark.usefixtures("view_checks")
def test_each_id_set_of_the_output_is_checked(name: str) -> None:
    with pytest.raises(InvalidMetadataError, match=name):
        SchedulerOutput(**{name: frozenset({"a", 2})})
    with pytest.raises(InvalidMetadataError, match=name):
        SchedulerOutput(**{name: ["a"]})


@pytest.mark.usefixtures("view_checks")
def test_extra_blocks_of_the_output_are_checked() -> None:
    assert SchedulerOutput(extra_allocated_block_ids=frozenset({0, 7})).group_counts == set()
    with pytest.raises(InvalidMetadataError, match="extra_allocated_block_ids"):
        SchedulerOutput(extra_allocated_block_ids=frozenset({1, -1}))
    with pytest.raises(InvalidMetadataError, match="extra_allocated_block_ids"):
        SchedulerOutput(extra_allocated_block_ids=frozenset({1, "2"}))  # type: ignore[arg-type]


class _NoneLike:
    """False and equal to None, but not None: an absent entry in disguise."""

    def __eq__(self, other: object) -> bool:
        return other is None

    def __bool__(self) -> bool:
        return False

    __hash__ = object.__hash__


class _NoneHashed(_NoneLike):
    """Posing as None in sets too: hashed as None."""

    def __hash__(self) -> int:
        return hash(None)


class _Ambiguous:
    """Its truth test and its comparisons raise (as an array's do)."""

    def __eq__(self, other: object) -> bool:
        raise ValueError("ambiguous")

    def __bool__(self) -> bool:
        raise ValueError("ambiguous")

    __hash__ = object.__hash__


@pytest.mark.usefixtures("view_checks")
def test_block_column_holds_only_none_or_tuples() -> None:
    """Absent entries are found without a call each (the entries' truth, then the set of the
    false ones must be {None}); anything else false is looked at entry by entry: an empty entry
    is kept (zero groups, refused by the scheduler), an object posing as None and an entry
    whose tests raise get the typed error."""
    c = ScheduledColumns(["a", "b", "c"], [None, ([1],), None], [1, 1, 1])
    assert c.new_block_ids == (None, ((1,),), None) and c.group_counts == frozenset({1})
    empty = ScheduledColumns(["a", "b"], [([1],), ()], [1, 1])
    assert empty.new_block_ids == (((1,),), ()) and empty.group_counts == frozenset({0, 1})
    assert ScheduledColumns(["a", "b"], [None, []], [1, 1]).new_block_ids == (None, ())
    bad: list[list[Any]] = [
        [None, _NoneLike()],
        [([1],), _NoneLike()],
        [None, _NoneHashed()],
        [([1],), _NoneHashed()],
        [None, _Ambiguous()],
        [([1],), _Ambiguous()],
        [([1],), 0],
        [([1],), ""],
    ]
    for blocks in bad:
        with pytest.raises(InvalidMetadataError, match=r"new_block_ids\[1\]"):
            ScheduledColumns(["a", "b"], blocks, [1, 1])

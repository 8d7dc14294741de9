"""The conformance kit as users run it: the reference manager, planted violations, reproductions.

The full measurement (every planted violation x 20 seeds at the default budget) is a command,
``python -m statecore.specs.planted --seeds 20``; here a fixed-seed slice of it runs.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase

from statecore.keys import OffloadKey, key_group
from statecore.manager import LoadStoreSpec, PrepareStoreOutput, ReqContext
from statecore.managers import CPUOffloadingManager
from statecore.specs.conformance import (
    CONTRACT_METHODS,
    MISUSE_ERRORS,
    SITUATIONS,
    ConformanceError,
    ManagerConformanceTests,
    coverage_report,
    make_manager_conformance,
    run_conformance,
)
from statecore.specs.fifo import FifoManager
from statecore.specs.fuzz import main as fuzz_main
from statecore.specs.planted import PLANTED, run_one
from statecore.specs.thirdparty import resolve_manager

GENERATE = {"phases": [Phase.generate]}


def test_reference_manager_passes_with_every_situation_reached() -> None:
    machine = make_manager_conformance(lambda: FifoManager(4), 4, eviction="fifo")
    run_conformance(machine, examples=150, seed=0)
    report = coverage_report(machine)
    assert "NOT REACHED" not in report and "NOT CALLED" not in report, report
    assert len(report.splitlines()) == 2 + len(SITUATIONS) - 2 + len(CONTRACT_METHODS)


def test_contract_methods_are_every_manager_method_and_every_scheduler_call() -> None:
    """The coverage report's method list is the whole contract, and names every method the
    scheduler calls as called by it (read from the scheduler's source)."""
    import inspect
    import re

    from statecore.manager import OffloadingManager
    from statecore.scheduler import core, effects

    public = {
        name
        for name, value in vars(OffloadingManager).items()
        if callable(value) and not name.startswith("_")
    }
    assert set(CONTRACT_METHODS) == public
    source = inspect.getsource(core) + inspect.getsource(effects)
    called = set(re.findall(r"(?:self|sched)\.manager\.(\w+)", source))
    assert called <= public, called - public
    assert {name for name, by in CONTRACT_METHODS.items() if by} == called


@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_planted_violation_is_caught(planted: Any) -> None:
    outcome = run_one(planted.cls, seed=0)
    assert outcome.caught, f"{planted.name} ({planted.text}) was not caught"


PLANTED_BY_NAME = {p.name: p.cls for p in PLANTED}


def _first_failure(cls: type[FifoManager], seed: int = 0) -> ConformanceError:
    machine = make_manager_conformance(
        lambda: cls(4), 4, repro_factory=f"{cls.__module__}:{cls.__name__}(4)"
    )
    with pytest.raises(ConformanceError) as info:
        run_conformance(machine, seed=seed, **GENERATE)
    return info.value


@pytest.mark.parametrize(
    "name, invariant, phrase",
    [
        ("evicts-pinned", "INV-EVICT", "pinned by"),
        ("partial-pin", "INV-PIN", "raised but left"),
        ("reset-keeps-ready", "RESET", "reset_cache must drop"),
        ("no-eviction-events", "EVENTS", "missing removed events"),
    ],
)
def test_message_names_invariant_and_call(name: str, invariant: str, phrase: str) -> None:
    planted = next(p for p in PLANTED if p.name == name)
    failure = _first_failure(planted.cls)
    assert failure.invariant == invariant, str(failure)
    assert phrase in failure.detail, failure.detail
    assert failure.call.startswith(("m.", "out = m.", "events += m.")), failure.call


class _SilentReset(FifoManager):
    """Drops every key at a reset but announces none of them as removed."""

    def reset_cache(self) -> None:
        self.entries.clear()
        self.free = list(range(self.capacity - 1, -1, -1))


@pytest.mark.parametrize(
    "cls, cause",
    [(_SilentReset, "reset_cache"), (PLANTED_BY_NAME["no-eviction-events"], "prepare_store")],
)
def test_an_event_mismatch_names_the_call_that_caused_it(cls: Any, cause: str) -> None:
    """The mismatch is seen by ``take_events``; "broken by" names the call that left the keys
    announced wrongly (the reset, the store that evicted), not the observing one."""
    failure = _first_failure(cls)
    assert failure.invariant == "EVENTS", str(failure)
    assert cause in failure.call and "take_events" not in failure.call, failure.call
    assert "seen at events += m.take_events()" in failure.detail, failure.detail


@pytest.mark.parametrize("name", ["evicts-pinned", "finish-drops-pins", "failed-store-loadable"])
def test_reproduction_is_a_standalone_failing_test(name: str, tmp_path: Path) -> None:
    planted = next(p for p in PLANTED if p.name == name)
    failure = _first_failure(planted.cls)
    code = failure.reproduction
    assert "bytes.fromhex(" in code and "def test_conformance_reproduction" in code
    assert "hypothesis" not in code and "state." not in code  # calls the manager directly
    path = tmp_path / "test_repro.py"
    path.write_text(code)
    namespace: dict[str, Any] = {"__name__": "test_repro"}
    exec(compile(code, str(path), "exec"), namespace)
    with pytest.raises(Exception) as raised:
        namespace["test_conformance_reproduction"]()
    if isinstance(raised.value, AssertionError):  # a check failed: it names the invariant
        assert str(raised.value).startswith(failure.invariant), raised.value
    else:  # a legal call raised: the same error as the kit saw
        assert f"raised {type(raised.value).__name__}" in failure.detail


@pytest.mark.parametrize("name", ["asserts-when-full", "partial-pin", "load-missing-key"])
def test_raising_and_did_not_raise_findings_come_out_minimised(name: str) -> None:
    """A legal call that raises (here an AssertionError) and a misuse that does not raise are
    replayed with the same failure signature the kit recorded, so the minimiser runs."""
    planted = next(p for p in PLANTED if p.name == name)
    machine = make_manager_conformance(
        lambda: planted.cls(4),
        4,
        repro_factory=f"{planted.cls.__module__}:{planted.cls.__name__}(4)",
    )
    with pytest.raises(ConformanceError) as info:
        run_conformance(machine, seed=0, shrink_seconds=2)
    code = info.value.reproduction
    assert "not deterministic" not in code, code
    namespace: dict[str, Any] = {"__name__": "test_repro"}
    exec(compile(code, "test_repro.py", "exec"), namespace)
    with pytest.raises((Exception, pytest.fail.Exception)) as raised:
        namespace["test_conformance_reproduction"]()
    if name == "asserts-when-full":
        assert "no room while a key is pinned" in str(raised.value)
        assert info.value.invariant == "CONTRACT" and "raised AssertionError" in info.value.detail
    # minimised: statements the failure does not need (step ends, event drains) are gone
    assert "take_events" not in code and "on_schedule_end" not in code, code


class _PathSpec(LoadStoreSpec):
    """A custom spec type: one file name per key."""

    __slots__ = ("paths",)

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = tuple(paths)


class _FileNamed(FifoManager):
    """The reference manager answering with its own spec type."""

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, ctx)
        if out is None:
            return None
        slots = out.store_spec.slots  # type: ignore[attr-defined]
        spec = _PathSpec([f"slot-{s}.bin" for s in slots])
        return PrepareStoreOutput(out.keys_to_store, spec, out.evicted_keys)

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> Any:
        return _PathSpec([f"slot-{s}.bin" for s in super().prepare_load(keys, ctx).slots])


def _paths(spec: LoadStoreSpec) -> Sequence[str]:
    assert isinstance(spec, _PathSpec)
    return spec.paths


def test_custom_spec_type_locations_checked_when_declared() -> None:
    machine = make_manager_conformance(lambda: _FileNamed(4), 4, spec_slots=_paths)
    run_conformance(machine, examples=40, seed=1)
    assert machine.coverage["locations-checked"] > 0  # type: ignore[attr-defined]
    undeclared = make_manager_conformance(lambda: _FileNamed(4), 4)
    run_conformance(undeclared, examples=10, seed=1)
    assert "locations not checked: store spec type _PathSpec" in coverage_report(undeclared)


class _SharesFile(_FileNamed):
    """Bug: every key of a store is written to the same file."""

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, ctx)
        if out is None:
            return None
        spec = _PathSpec(["one.bin"] * len(out.keys_to_store))
        return PrepareStoreOutput(out.keys_to_store, spec, out.evicted_keys)


def test_custom_spec_type_collision_is_caught() -> None:
    machine = make_manager_conformance(lambda: _SharesFile(4), 4, spec_slots=_paths)
    with pytest.raises(ConformanceError, match="share a location"):
        run_conformance(machine, seed=0, **GENERATE)


class _KeyErrorsOnly(FifoManager):
    """Raises plain KeyError for unknown keys (a declared, different error type)."""

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> Any:
        for k in keys:
            if k not in self.entries:
                raise KeyError(k.hex())
        return super().prepare_load(keys, ctx)


class _OddGroupsOnly(FifoManager):
    """Admission policy: stores only keys of odd KV-cache groups."""

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        return super().prepare_store([k for k in keys if key_group(k) % 2], ctx)


def test_declared_behaviours() -> None:
    errors = {"load-unknown": KeyError}
    run_conformance(
        make_manager_conformance(lambda: _KeyErrorsOnly(4), 4, errors=errors),
        examples=40,
        seed=0,
    )
    with pytest.raises(ConformanceError, match="ERRORS"):
        run_conformance(make_manager_conformance(lambda: _KeyErrorsOnly(4), 4), seed=0, **GENERATE)
    run_conformance(
        make_manager_conformance(lambda: _OddGroupsOnly(4), 4, admission=True),
        examples=40,
        seed=0,
    )
    with pytest.raises(ConformanceError, match="INV-EVICT"):
        run_conformance(make_manager_conformance(lambda: _OddGroupsOnly(4), 4), seed=0, **GENERATE)


class _NewestFirst(FifoManager):
    """Evicts the newest idle key first: legal, but not the declared FIFO order."""

    def _victims(self, n: int, offered: set[OffloadKey]) -> list[OffloadKey] | None:
        out = [k for k, e in reversed(self.entries.items()) if e.ready and not e.pins]
        out = [k for k in out if k not in offered][:n]
        return out if len(out) == n else None


def test_declared_eviction_order() -> None:
    lru = make_manager_conformance(lambda: CPUOffloadingManager(4, "lru"), 4, eviction="lru")
    run_conformance(lru, examples=40, seed=0)
    assert lru.coverage["touch"] > 0  # type: ignore[attr-defined]
    with pytest.raises(ConformanceError, match="least recently used"):
        run_conformance(
            make_manager_conformance(lambda: FifoManager(4), 4, eviction="lru"),
            seed=0,
            **GENERATE,
        )
    run_conformance(make_manager_conformance(lambda: _NewestFirst(4), 4), examples=40, seed=0)
    with pytest.raises(ConformanceError, match="EVICTION-ORDER"):
        run_conformance(
            make_manager_conformance(lambda: _NewestFirst(4), 4, eviction="fifo"),
            seed=0,
            **GENERATE,
        )


class TestFifoThroughBaseClass(ManagerConformanceTests):
    """The pytest base class, as a user subclasses it (a fixed seed: the CI recipe)."""

    capacity = 3
    examples = 60
    seed = 0

    @staticmethod
    def make_manager() -> FifoManager:
        return FifoManager(3)


def test_fuzz_manager_import_path(capsys: pytest.CaptureFixture[str]) -> None:
    ok = fuzz_main(
        ["--manager", "statecore.specs.fifo:FifoManager", "--examples", "30", "--seed", "0"]
    )
    out = capsys.readouterr().out
    assert ok == 0, out
    assert "contract situations reached" in out and "no violation found" in out
    bad = fuzz_main(
        [
            "--manager",
            "statecore.specs.planted:EvictsPinned",
            "--seed",
            "0",
            "--shrink-seconds",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert bad == 1
    assert "INV-EVICT" in out and "from statecore.specs.planted import EvictsPinned" in out
    declared = ["--manager", "statecore.specs.fifo:FifoManager", "--examples", "20"]
    assert fuzz_main([*declared, "--seed", "0", "--eviction", "fifo", "--admission"]) == 0
    assert fuzz_main([*declared, "--seed", "1", "--composite"]) == 0
    capsys.readouterr()
    assert fuzz_main(["--manager", "statecore.specs.fifo:Nope"]) == 2
    assert fuzz_main(["--manager", "no_such_module_xyz:F"]) == 2


def test_resolve_manager() -> None:
    assert resolve_manager("statecore.specs.fifo:FifoManager") is FifoManager
    with pytest.raises(ValueError, match=r"expected package\.module:Factory"):
        resolve_manager("statecore.specs.fifo")


def test_measurement_table_format() -> None:
    from statecore.specs.planted import measure

    buf = io.StringIO()
    rows = measure([0], only=["hit-while-pending"], out=buf, examples=20)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("| planted violation | what it does | caught")
    assert lines[2].startswith(
        "| reference (unmodified) | the reference FIFO manager: must pass | 0/1 |"
    )
    assert lines[3].startswith(
        "| hit-while-pending | lookup answers HIT while a store is pending | 1/1 |"
    )
    assert [name for name, _ in rows] == ["reference (unmodified)", "hit-while-pending"]


class _VllmStyle(FifoManager):
    """FifoManager written to vLLM's conventions: misuse trips an assert, a reset announces
    nothing (the engine's AllBlocksCleared does), a key offered twice in one prepare_store and
    a lookup under a finished request trip asserts, and it holds a real, non-reentrant lock."""

    def __init__(self, capacity: int = 4) -> None:
        super().__init__(capacity)
        import threading

        self._lock = threading.Lock()
        self.finished: set[str] = set()
        self.flushes = 0

    @property
    def lock(self) -> Any:
        return self._lock

    def _held(self) -> None:
        assert self._lock.locked(), "called without manager.lock"

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> Any:
        self._held()
        assert ctx.req_id not in self.finished, "lookup for a finished request"
        return super().lookup(key, ctx)

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> Any:
        self._held()
        for k in keys:
            e = self.entries.get(k)
            assert e is not None and e.ready, "load of a key that is not ready"
        return super().prepare_load(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._held()
        for k in keys:
            e = self.entries.get(k)
            assert e is not None and e.ready and e.pins > 0, "release of an unpinned key"
        super().complete_load(keys, ctx)

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> Any:
        self._held()
        assert len(set(keys)) == len(keys), "a key offered twice"
        return super().prepare_store(keys, ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.finished.add(ctx.req_id)

    def reset_cache(self) -> None:
        self._held()
        self.free.extend(e.slot for e in self.entries.values())
        self.entries.clear()  # announces nothing

    def on_reset_flushed(self) -> None:
        self._held()
        self.flushes += 1


def test_vllm_profile_accepts_vllm_conventions_the_statecore_profile_rejects() -> None:
    vllm = make_manager_conformance(lambda: _VllmStyle(4), 4, profile="vllm")
    run_conformance(vllm, examples=150, seed=0)
    report = coverage_report(vllm)
    assert "(vllm profile)" in report
    for reached in ("on_reset_flushed after a reset", "prepare_load naming an absent key"):
        assert f"NOT REACHED  {reached}" not in report, report
    statecore = make_manager_conformance(lambda: _VllmStyle(4), 4)
    with pytest.raises(ConformanceError):
        run_conformance(statecore, examples=150, seed=0, **GENERATE)
    # the statecore profile with the misuse errors declared still sees the other differences
    declared = make_manager_conformance(
        lambda: _VllmStyle(4), 4, errors=dict.fromkeys(MISUSE_ERRORS, AssertionError)
    )
    with pytest.raises(ConformanceError) as info:
        run_conformance(declared, examples=300, seed=0, **GENERATE)
    assert "AssertionError" in info.value.detail or info.value.invariant in ("EVENTS", "RESET")


def test_vllm_profile_still_catches_a_real_bug() -> None:
    class EvictsPinnedVllm(_VllmStyle):
        def _victims(self, n: int, offered: set[OffloadKey]) -> list[OffloadKey] | None:
            out = [k for k, e in self.entries.items() if e.ready and k not in offered][:n]
            return out if len(out) == n else None

    machine = make_manager_conformance(lambda: EvictsPinnedVllm(4), 4, profile="vllm")
    with pytest.raises(ConformanceError) as info:
        run_conformance(machine, seed=0, **GENERATE)
    assert info.value.invariant == "INV-EVICT", str(info.value)


def test_misuse_errors_option() -> None:
    from statecore.errors import UnknownKeyError
    from statecore.specs.thirdparty import parse_misuse_errors

    every = parse_misuse_errors(["AssertionError"])
    assert every == dict.fromkeys(MISUSE_ERRORS, AssertionError)
    one = parse_misuse_errors(
        ["AssertionError", "load-unknown=UnknownKeyError", "release-pending=none"]
    )
    assert one["load-unknown"] is UnknownKeyError and one["release-pending"] is None
    assert parse_misuse_errors(["builtins:KeyError"]) == dict.fromkeys(MISUSE_ERRORS, KeyError)
    for bad in ("nosuch-kind=AssertionError", "NoSuchError", "os:path"):
        with pytest.raises(ValueError):
            parse_misuse_errors([bad])
    status = fuzz_main(
        [
            "--manager",
            "statecore.specs.fifo:FifoManager",
            "--examples",
            "20",
            "--seed",
            "0",
            "--profile",
            "vllm",
            "--misuse-error",
            "load-unknown=UnknownKeyError",
            "--misuse-error",
            "load-pending=KeyNotReadyError",
            "--misuse-error",
            "release-unknown=UnknownKeyError",
            "--misuse-error",
            "release-unpinned=PinUnderflowError",
            "--misuse-error",
            "release-pending=PinUnderflowError",
        ]
    )
    assert status == 0
    assert (
        fuzz_main(["--manager", "statecore.specs.fifo:FifoManager", "--misuse-error", "x=y"]) == 2
    )

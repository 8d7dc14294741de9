"""scripts/mutate.py: its equivalence list stays attached to real code, and the annotation
filter only skips mutants that lie inside type annotations."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_script", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate_script"] = module
    spec.loader.exec_module(module)
    return module


mutate = _load()


def test_every_equivalent_mutant_names_a_line_that_exists() -> None:
    for module, operator, text, *_ in mutate.EQUIVALENT:
        assert module in mutate.CORE_MODULES
        assert operator.startswith("core/")
        lines = [line.strip() for line in (ROOT / module).read_text().splitlines()]
        assert text in lines, f"stale equivalent-mutant entry: {module}: {text}"


def test_core_modules_and_tests_exist_and_postpone_annotations() -> None:
    for module in mutate.CORE_MODULES:
        assert "from __future__ import annotations" in (ROOT / module).read_text()
    for path in mutate.FAST_TESTS:
        assert (ROOT / path).exists(), path


def test_annotation_spans_cover_annotations_only() -> None:
    spans = mutate._annotation_spans("statecore/kernels.py")
    lines = (ROOT / "statecore/kernels.py").read_text().splitlines()
    sig = next(i for i, line in enumerate(lines, 1) if line.startswith("def prefix_hits("))
    col = lines[sig - 1].index("int | None")
    assert mutate._in_annotation((sig, col + 4), spans)  # the `|` of the return annotation
    body = next(i for i, line in enumerate(lines, 1) if "if count - first_pending >" in line)
    assert not mutate._in_annotation((body, lines[body - 1].index(">")), spans)


def test_equivalent_reason_matches_module_operator_and_line() -> None:
    (module, operator, text), reason = next(iter(mutate.EQUIVALENT.items()))
    assert mutate._equivalent_reason(module, operator, "    " + text) == reason
    assert mutate._equivalent_reason(module, "core/AddNot", text) is None
    assert mutate._equivalent_reason("statecore/worker.py", operator, text) is None


def test_an_entry_with_a_mutated_line_matches_only_that_variant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = ("statecore/worker.py", "core/NumberReplacer", "x = 0", "x = -1")
    monkeypatch.setattr(mutate, "EQUIVALENT", {key: "why"})
    op, line = "core/NumberReplacer", "    x = 0"
    assert mutate._equivalent_reason("statecore/worker.py", op, line, lambda: "x = -1") == "why"
    assert mutate._equivalent_reason("statecore/worker.py", op, line, lambda: "x = 1") is None
    assert mutate._equivalent_reason("statecore/worker.py", op, line) is None


def _line_of(module: str, text: str) -> tuple[int, int]:
    lines = (ROOT / module).read_text().splitlines()
    n = next(i for i, line in enumerate(lines, 1) if line.strip() == text)
    return n, len(lines[n - 1]) - len(lines[n - 1].lstrip())


def test_a_mutant_in_a_method_body_is_applied_by_swapping_that_method_code() -> None:
    import statecore.scheduler

    module = "statecore/scheduler/core.py"
    pos = _line_of(module, "self.counters.resets += 1")
    qual = mutate._enclosing(module, pos, {})
    assert qual == "OffloadingScheduler.reset"
    original = (ROOT / module).read_text()
    mutated = original.replace("self.counters.resets += 1", "self.counters.resets += 0")
    plan = mutate._patch_plan(module, qual, original, mutated)
    assert plan is not None
    live, code = plan
    assert live is statecore.scheduler.OffloadingScheduler.reset
    assert code.co_qualname == qual and code.co_consts != live.__code__.co_consts
    assert mutate._patch_plan(module, qual, original, original) is not None


def test_a_mutant_outside_function_bodies_is_not_swapped() -> None:
    module = "statecore/kernels.py"
    assert mutate._enclosing(module, _line_of(module, "LIVE = 0"), {}) is None
    assert mutate._live_function(module, "no_such_function") is None


def test_tracer_names_core_functions_by_module_and_qualname() -> None:
    tracer = mutate._Tracer()
    from statecore import kernels

    tracer.start()
    try:
        kernels.storable_chunks(0, 16, 4, 1, 4)
    finally:
        tracer.stop()
    assert "statecore/kernels.py:storable_chunks" in tracer.hits
    assert all(":" in hit and "<locals>" not in hit for hit in tracer.hits)

"""The documentation site: generated pages current, evidence real, nav complete."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from docs_blocks import DOCS, ROOT, pages
from statemachine import State, StateMachine

from statecore import docsgen
from statecore.lifecycle.diagrams import LIFECYCLES, Lifecycle
from statecore.sim.faults import FAULT_KINDS
from statecore.sim.report import FaultCount, SimReport
from statecore.specs.invariants import INVARIANTS

# -- generated pages ---------------------------------------------------------------------------


def test_generated_pages_are_current(capsys: pytest.CaptureFixture[str]) -> None:
    rc = docsgen.main(["--check"])
    out = capsys.readouterr().out
    assert rc == 0, f"run `python -m statecore.docsgen` (statecore docs):\n{out}"


def test_generation_is_deterministic_and_check_finds_stale_pages(tmp_path: Path) -> None:
    first = docsgen.rendered_pages()
    assert docsgen.rendered_pages() == first
    docsgen.write(tmp_path, first)
    assert docsgen.check(tmp_path, first) == []
    (tmp_path / "invariants.md").write_text("stale\n", encoding="utf-8")
    (tmp_path / "lifecycles" / "job.md").unlink()
    assert docsgen.check(tmp_path, first) == [
        tmp_path / "lifecycles" / "job.md",
        tmp_path / "invariants.md",
    ]
    assert docsgen.main(["--check", "--out", str(tmp_path)]) == 1


def test_print_one_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert docsgen.main(["--print", "invariants.md"]) == 0
    assert capsys.readouterr().out == docsgen.rendered_pages()["invariants.md"]
    assert docsgen.main(["--print", "nope.md"]) == 2


@pytest.mark.parametrize("life", LIFECYCLES, ids=lambda life: life.name)
def test_lifecycle_page_covers_every_state_and_transition(life: Lifecycle) -> None:
    text = (DOCS / "lifecycles" / f"{life.name}.md").read_text(encoding="utf-8")
    lc = life.table
    for sid in lc.states:
        assert f"### `{sid}`" in text
    table = text.split("\n## Transitions\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if re.match(r"\| `\w+` \| `\w+` \|", ln)]
    assert len(rows) == len(lc.transitions)
    assert f'--8<-- "{life.name}.svg"' in text
    assert (DOCS / "diagrams" / f"{life.name}.svg").is_file()


class _PartlyDescribed(StateMachine):
    first = State("first", initial=True)
    """The first state, ``first``."""
    second = State("second", final=True)

    go = first.to(second)


@pytest.mark.parametrize("life", LIFECYCLES, ids=lambda life: life.name)
def test_each_state_is_described_under_its_definition(life: Lifecycle) -> None:
    described = docsgen.state_descriptions(life.table.machine)
    assert list(described) == list(life.table.states)
    text = (DOCS / "lifecycles" / f"{life.name}.md").read_text(encoding="utf-8")
    for sid, description in described.items():
        assert description, sid
        section = text.split(f"### `{sid}`", 1)[1]
        assert section.split("\n\n", 2)[1] == description, f"{sid}: not the heading's paragraph"


def test_a_state_without_a_docstring_fails_generation() -> None:
    with pytest.raises(
        ValueError, match=r"_PartlyDescribed: no docstring under the states \['second'\]"
    ):
        docsgen.state_descriptions(_PartlyDescribed)


def test_transition_calls_follow_actions_into_the_manager() -> None:
    text = (DOCS / "lifecycles" / "job.md").read_text(encoding="utf-8")
    # a job's completion reaches the manager and then the request lifecycle
    assert "`complete_job` → manager `complete_load`, `complete_store` → fires request" in text
    graph = docsgen.scheduler_graph()
    assert "update_connector_output" in graph.entry_points_reaching("request", "job_ended")
    assert "on_request_finished" in graph.manager_reach("notify_finished")
    assert graph.fired_in("job", "reset") == ["reset"]
    assert {"reset", "reset_cache"} <= set(graph.entry_points_reaching("job", "reset"))


def test_every_check_mechanism_is_explained() -> None:
    for inv in INVARIANTS.values():
        for label in inv.checked_by:
            assert docsgen._mechanism(label) is not None, f"{inv.code}: {label!r} unexplained"


def test_invariant_page_lists_every_invariant() -> None:
    text = (DOCS / "invariants.md").read_text(encoding="utf-8")
    for code, inv in INVARIANTS.items():
        assert f"## {code}\n" in text
        assert inv.prevents in text
        if inv.check is not None:
            assert f"`statecore.specs.invariants.{inv.check.__name__}` runs in checked mode" in (
                text
            )


# -- site structure ----------------------------------------------------------------------------


def _nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.MULTILINE))


def test_nav_lists_every_page() -> None:
    assert _nav_pages() == set(pages())


def test_griffe_reads_adapters_and_specs_as_statecore_subpackages() -> None:
    """The API pages are read statically from the checkout: the adapters and specs are found
    under ``statecore/`` by their import names, with no loader extension and no import."""
    griffe = pytest.importorskip("griffe", reason="the docs extra (griffe) is not installed")
    pkg = griffe.GriffeLoader(search_paths=[str(ROOT)]).load("statecore")
    assert pkg["adapters.vllm.StatecoreOffloadingConnector"].docstring is not None
    assert pkg["adapters.torch.TorchTransferBackend"].path == (
        "statecore.adapters.torch.TorchTransferBackend"
    )
    assert pkg["specs.conformance.make_manager_conformance"].is_function


# -- evidence on the hand-written pages --------------------------------------------------------

_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _mutant_names() -> set[str]:
    """The names in the mutant catalogue (``_mutant("name", ...)`` entries)."""
    tree = ast.parse((ROOT / "tests/mutants/catalogue.py").read_text(encoding="utf-8"))
    names = {
        str(node.args[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "_mutant"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert names, "no _mutant(...) entry found in tests/mutants/catalogue.py"
    return names


def _labelled(text: str, label: str) -> list[str]:
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith(f"- **{label}:**"):
            out += re.findall(r"`([\w-]+)`", line)
    return out


@pytest.mark.parametrize("page", [p for p in pages() if _TEST_REF.search((DOCS / p).read_text())])
def test_referenced_tests_exist(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    for path, name in _TEST_REF.findall(text):
        assert (ROOT / path).is_file(), f"{page}: {path} does not exist"
        assert name in _defined_names(ROOT / path), f"{page}: {path}::{name} does not exist"


def test_upstream_page_evidence_is_real() -> None:
    text = (DOCS / "upstream.md").read_text(encoding="utf-8")
    sections = text.split("\n## ")[1:]
    assert len(sections) >= 6
    for section in sections[:-1]:  # the last one is the runnable example
        title = section.splitlines()[0]
        assert _TEST_REF.search(section), f"{title!r} names no test"
    faults = _labelled(text, "Simulator faults")
    assert faults and set(faults) <= set(FAULT_KINDS), set(faults) - set(FAULT_KINDS)
    mutants = _labelled(text, "Mutants caught")
    assert mutants and set(mutants) <= _mutant_names(), set(mutants) - _mutant_names()


def test_simulator_guide_explains_every_report_line() -> None:
    report = SimReport(faults={k: FaultCount() for k in FAULT_KINDS})
    labels = []
    for line in report.format_text().splitlines():
        if line.startswith(" "):
            continue
        label = re.split(r"\s{2,}|:", line, maxsplit=1)[0].strip()
        labels.append(label)
    labels.append("wall time")  # printed by the command after the report
    text = (DOCS / "guides" / "simulator.md").read_text(encoding="utf-8")
    for label in labels:
        assert f"\n`{label}`\n:   " in text, f"report line {label!r} is not explained"
    for kind in FAULT_KINDS:
        assert f"| `{kind}` |" in text, f"fault {kind!r} is not explained"

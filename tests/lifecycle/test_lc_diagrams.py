"""``statecore diagrams``: the committed files are current and show every state and event."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from lifecycle_harness import LIFECYCLES

from statecore.lifecycle import diagrams
from statecore.lifecycle.diagrams import transition_label

DIAGRAMS = Path(__file__).resolve().parents[2] / "docs" / "diagrams"


def test_committed_diagrams_are_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert diagrams.default_out_dir() == DIAGRAMS
    assert diagrams.main(["--check"]) == 0, capsys.readouterr().out


def test_check_lists_stale_and_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = diagrams.write(tmp_path, svg=False)
    assert sorted(p.name for p in written) == sorted(diagrams.rendered_files())
    for svg in DIAGRAMS.glob("*.svg"):
        shutil.copy(svg, tmp_path / svg.name)
    assert diagrams.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "job.mmd").write_text("stateDiagram-v2\n", encoding="utf-8")
    (tmp_path / "request.md").unlink()
    capsys.readouterr()
    assert diagrams.main(["--check", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "job.mmd" in out and "request.md" in out
    assert "request.mmd" not in out and "job.md" not in out


def test_output_is_deterministic(tmp_path: Path) -> None:
    assert diagrams.rendered_files() == diagrams.rendered_files()
    diagrams.main(["--out", str(tmp_path), "--no-svg"])
    for name, text in diagrams.rendered_files().items():
        assert (tmp_path / name).read_text(encoding="utf-8") == text
        assert (DIAGRAMS / name).read_text(encoding="utf-8") == text


def test_svg_goes_through_dot_and_is_skipped_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a stand-in ``dot`` on PATH each lifecycle's DOT text is piped to ``dot -Tsvg`` and
    its output written; without ``dot`` no SVG is written and the command says so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dot"
    cat = shutil.which("cat")
    fake.write_text(f'#!/bin/sh\necho "<svg args=\\"$*\\">"; {cat}; echo "</svg>"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    out = tmp_path / "out"
    diagrams.write(out)
    for life in diagrams.LIFECYCLES:
        svg = (out / f"{life.name}.svg").read_text(encoding="utf-8")
        drawn = f'<svg args="-Tsvg">\n{diagrams.render_dot(life.table)}</svg>\n'
        assert svg == diagrams.svg_header(life) + "\n" + drawn
    assert diagrams.stale_svgs(out) == []
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bare = tmp_path / "bare"
    assert diagrams.main(["--out", str(bare)]) == 0
    assert not list(bare.glob("*.svg"))
    assert "Graphviz `dot` not found" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_svg_rendered_when_graphviz_present(tmp_path: Path) -> None:
    diagrams.write(tmp_path)
    for name in LIFECYCLES:
        svg = (tmp_path / f"{name}.svg").read_text(encoding="utf-8")
        assert "<svg" in svg and "</svg>" in svg


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_mermaid_shows_every_state_and_event(name: str) -> None:
    lc = LIFECYCLES[name]
    text = (DIAGRAMS / f"{name}.mmd").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert "stateDiagram-v2" in lines
    declared = dict(re.findall(r'^\s*state "([^"]+)" as (\w+)$', text, re.M))
    assert sorted(declared.values()) == sorted(lc.states)
    labels = {s.id: s.name for s in lc.machine.states}
    assert {sid: label for label, sid in declared.items()} == labels
    edges = re.findall(r"^\s*(\w+) --> (\w+) : (.+)$", text, re.M)
    assert {e[2].split(" ")[0] for e in edges} == set(lc.events)
    expected = [(t.source, t.target, transition_label(t)) for t in lc.transitions]
    assert edges == expected
    assert f"    [*] --> {lc.states[lc.initial]}" in lines
    finals = {m for m in re.findall(r"^\s*(\w+) --> \[\*\]$", text, re.M)}
    assert finals == {lc.states[i] for i in lc.final}


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_page_embeds_diagram_and_full_transition_table(name: str) -> None:
    lc = LIFECYCLES[name]
    page = (DIAGRAMS / f"{name}.md").read_text(encoding="utf-8")
    mermaid = (DIAGRAMS / f"{name}.mmd").read_text(encoding="utf-8")
    assert f"```mermaid\n{mermaid}```\n" in page
    rows = re.findall(
        r"^\| `(\w+)` \| `(\w+)` \| (.+?) \| `(\w+)` \| (.+?) \| (yes|no) \|$", page, re.M
    )
    assert [(r[0], r[1], r[3]) for r in rows] == [
        (t.event, t.source, t.target) for t in lc.transitions
    ]
    for row, t in zip(rows, lc.transitions, strict=True):
        assert (row[2] == "—") == (not t.guards)
        assert row[5] == ("yes" if t.internal else "no")
        for action in t.actions:
            assert f"`{action.__name__}`" in row[4]


def test_print_shows_every_transition(capsys: pytest.CaptureFixture[str]) -> None:
    assert diagrams.main(["--print"]) == 0
    out = capsys.readouterr().out
    for lc in LIFECYCLES.values():
        assert f"{len(lc.transitions)} transitions" in out
        for event in lc.events:
            assert event in out


def test_label_format() -> None:
    job = LIFECYCLES["job"]
    labels = [transition_label(t) for t in job.transitions]
    assert "worker_report [all_ok] / complete_ok" in labels
    assert "reset" in labels
    assert "stall_timeout / stall_job" in labels


def test_svg_is_checked_by_what_it_was_drawn_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An SVG whose recorded DOT digest is not the current one is stale, whatever its bytes
    (so the check does not depend on the Graphviz version); a missing one is stale too."""
    diagrams.write(tmp_path, svg=False)
    request = diagrams.LIFECYCLES[0]
    committed = (DIAGRAMS / f"{request.name}.svg").read_text(encoding="utf-8")
    assert committed.splitlines()[0] == diagrams.svg_header(request)
    body = committed.split("\n", 1)[1]
    (tmp_path / f"{request.name}.svg").write_text(
        diagrams.svg_header(request) + "\n<svg>drawn by another Graphviz</svg>\n",
        encoding="utf-8",
    )
    assert diagrams.stale_svgs(tmp_path) == [tmp_path / "job.svg"]  # job.svg is missing
    other = diagrams.svg_header(request).replace("sha256 ", "sha256 0")
    (tmp_path / f"{request.name}.svg").write_text(other + "\n" + body, encoding="utf-8")
    assert diagrams.main(["--check", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "request.svg" in out and "job.svg" in out


@pytest.mark.parametrize("life", diagrams.LIFECYCLES, ids=lambda life: life.name)
def test_committed_svg_shows_every_state(life: diagrams.Lifecycle) -> None:
    svg = (DIAGRAMS / f"{life.name}.svg").read_text(encoding="utf-8")
    assert svg.splitlines()[1].startswith("<svg")
    texts = set(re.findall(r"<text[^>]*>([^<]*)</text>", svg))
    labels = {str(state.name) for state in life.table.machine.states}
    assert labels <= {t.replace("&#45;", "-") for t in texts}

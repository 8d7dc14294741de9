"""Every ``python`` block on every documentation page runs, in page order, as one program.

A page's blocks share one namespace (later blocks build on earlier ones) and run in a fresh
temporary directory. A block starting with ``# requires: module`` needs that module; the
page's test is skipped, with the reason, where it is not installed (vLLM is not part of the
test environment: ``scripts/vllm-integration.sh`` builds one that has it).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from docs_blocks import blocks, pages, python_blocks

PAGES = pages()
PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]


def _missing(modules: tuple[str, ...]) -> list[str]:
    out = []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:  # a parent package is missing
            spec = None
        # a bare folder of that name (tests/vllm on sys.path) is a namespace package: not it
        found = spec is not None and spec.origin not in (None, "namespace")
        if not found:
            out.append(name)
    return out


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_page_examples_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code_blocks = python_blocks(page)
    needed = sorted({m for b in code_blocks for m in b.requires})
    missing = _missing(tuple(needed))
    if missing:
        pytest.skip(f"{page} needs {', '.join(missing)}, which is not installed")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_" + re.sub(r"\W", "_", page)}
    for block in code_blocks:
        compiled = compile(block.code, f"docs/{page}:{block.line}", "exec")
        try:
            exec(compiled, namespace)
        except BaseException as exc:
            raise AssertionError(
                f"docs/{page}, code block at line {block.line} raised {type(exc).__name__}: {exc}"
            ) from exc


def test_examples_are_found() -> None:
    # the guides are the pages whose examples matter most: they must have some
    guides = ("connector", "conformance", "simulator", "transfers")
    for page in (f"guides/{g}.md" for g in guides):
        assert page in PAGES_WITH_CODE, f"{page} has no python example"


def test_block_parser_handles_indentation_and_languages() -> None:
    text = "\n".join(
        [
            "# t",
            "```python",
            "x = 1",
            "```",
            '!!! note "n"',
            "    ```py",
            "    if x:",
            "        y = 2",
            "    ```",
            "````bash",
            "```python",
            "not python",
            "```",
            "````",
        ]
    )
    got = blocks("t.md", text)
    assert [(b.lang, b.line) for b in got] == [("python", 2), ("py", 6), ("bash", 10)]
    assert got[1].code == "if x:\n    y = 2"
    assert got[2].code == "```python\nnot python\n```"


def test_requires_marker() -> None:
    (block,) = blocks("t.md", "```python\n# requires: vllm, torch\nimport vllm\n```")
    assert block.requires == ("vllm", "torch")
    assert _missing(("statecore", "no_such_module_xyz")) == ["no_such_module_xyz"]

"""Find the documentation pages and the fenced code blocks in them (shared by the docs tests)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# written by `statecore diagrams`, outside the site; the extension folder holds no pages
EXCLUDED = ("diagrams", "_ext")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^\n`]*)$")
_REQUIRES = re.compile(r"^#\s*requires:\s*(?P<modules>[\w., ]+)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str
    line: int
    lang: str
    code: str

    @property
    def requires(self) -> tuple[str, ...]:
        """Modules named on a leading ``# requires: a, b`` line."""
        first = self.code.lstrip().split("\n", 1)[0].strip()
        m = _REQUIRES.match(first)
        if m is None:
            return ()
        return tuple(x.strip() for x in m.group("modules").split(",") if x.strip())


def pages() -> list[str]:
    """Every markdown page of the site, relative to docs/, sorted."""
    out = []
    for path in sorted(DOCS.rglob("*.md")):
        rel = path.relative_to(DOCS)
        if rel.parts[0] not in EXCLUDED:
            out.append(rel.as_posix())
    return out


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of ``page`` in order (nested fences are not supported)."""
    if text is None:
        text = (DOCS / page).read_text(encoding="utf-8")
    lines = text.split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        ticks, indent = m.group("ticks"), m.group("indent")
        lang = m.group("info").strip().split(" ")[0].lower() if m.group("info").strip() else ""
        start = i + 1
        j = start
        while j < len(lines):
            end = lines[j].strip()
            if end.startswith(ticks[0] * len(ticks)) and set(end) == {ticks[0]}:
                break
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: fence never closed")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[start:j]]
        out.append(Block(page, i + 1, lang, textwrap.dedent("\n".join(body))))
        i = j + 1
    return out


def python_blocks(page: str) -> list[Block]:
    """The ``python`` blocks of ``page``: every one runs in the test suite."""
    return [b for b in blocks(page) if b.lang in ("python", "py")]

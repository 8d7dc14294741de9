"""Files generated from the code (docs pages, diagrams): write them, find stale ones, report.

Shared by ``statecore docs`` and ``statecore diagrams``, which differ only in what they render.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["checkout_docs_dir", "report_stale", "stale_files", "write_files"]


def checkout_docs_dir() -> Path | None:
    """``docs/`` of the source checkout this package runs from; None for an installed package.

    An installed package has no docs folder of its own, and the current directory's ``docs/``
    may belong to any project, so the commands then ask for ``--out`` instead of guessing.
    """
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "docs").is_dir():
        return root / "docs"
    return None


def stale_files(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """The files of ``files`` (relative name -> text) missing under ``out_dir`` or different."""
    stale = []
    for rel, text in files.items():
        path = out_dir / rel
        try:
            current = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != text:
            stale.append(path)
    return stale


def write_files(out_dir: Path, files: Mapping[str, str]) -> list[Path]:
    """Write every file of ``files`` under ``out_dir`` (folders created); the paths written."""
    written = []
    for rel, text in files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def report_stale(command: str, stale: Iterable[Path], count: int, what: str, where: Path) -> int:
    """Print the result of ``command --check``; its exit status (1 when anything is stale)."""
    stale = list(stale)
    if stale:
        print(f"{command}: stale or missing (run `{command}`):")
        for path in stale:
            print(f"  {path}")
        return 1
    print(f"{command}: {count} {what} up to date in {where}")
    return 0

"""Seeded mutants of the file tier: each must fail the tier's misfiled-value harness.

The harness (:func:`tests.managers.test_mgr_filetier.misfiled_findings`) puts under a key's
name a valid chunk file of another key, of another layout, of another layout tag, of another
length, or a directory, for a tier already running and for one that starts on the directory,
and reports every byte served, every hit kept and every refusal not counted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from catalogue import FILE_MUTANTS

from tests.managers.test_mgr_filetier import MISFILED, misfiled_findings


def harness_finding(tmp_path: Path) -> str | None:
    """What the file tier's harness reports (None: it passed)."""
    for kind in MISFILED:
        found = misfiled_findings(tmp_path / kind, kind)
        if found:
            return found[0]
    return None


def test_harness_passes_without_mutants(tmp_path: Path) -> None:
    """The control: the unmodified tier passes the harness."""
    assert harness_finding(tmp_path) is None


@pytest.mark.parametrize("name", sorted(FILE_MUTANTS))
def test_file_mutant_is_caught(tmp_path: Path, name: str) -> None:
    """The harness fails with the mutant applied."""
    with FILE_MUTANTS[name].apply():
        finding = harness_finding(tmp_path)
    assert finding is not None, f"mutant {name!r} survived the file tier's harness"

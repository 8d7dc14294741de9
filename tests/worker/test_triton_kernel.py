"""The Triton copy path without a GPU: its planning and kernel, in Triton's interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch adapter needs torch")
pytest.importorskip("triton", reason="Triton is not installed (it is in the test extra on Linux)")

HERE = Path(__file__).resolve().parent


def test_triton_kernel_matches_host_copies_in_interpreter() -> None:
    """Random multi-group jobs (bpc 1 and 3, sub-block skips, a padded tensor, 8- and
    4-byte words) through ``kernel_args`` and the kernel give the same bytes as the host
    path, everywhere; the warm-up's one kernel variant is the one every later job runs."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(HERE / "triton_interpret_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    m = re.search(r"checked (\d+) jobs, (\d+) page copies", result.stdout)
    assert m is not None, result.stdout
    assert int(m.group(1)) == 24 and int(m.group(2)) > 100
    m = re.search(r"warm-up variant \((\d+), (\d+)\) covers (\d+) launches", result.stdout)
    assert m is not None, result.stdout
    assert (m.group(1), m.group(2), m.group(3)) == ("8", "512", "7")

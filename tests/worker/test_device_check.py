"""The prepared GPU run (``scripts/device_check.sh``) on a machine without a GPU.

The dry run must skip every CUDA stage with its reason and print the budget; the measuring
stages (``scripts/device_stages.py``) must run their logic on CPU tensors where they can,
so the one run on the GPU machine does not fail on a mistake the CPU could have shown.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_STAGES = [
    "install",
    "registration",
    "bytes",
    "bigpool",
    "firstjob",
    "vllm",
    "contention",
    "cuda",
    "bench",
]


def test_dry_run_skips_every_cuda_stage_with_its_reason(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), DRY_RUN="1", SKIP_ENV="1", PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", "scripts/device_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    m = re.search(r"budget BUDGET_S=(\d+)s; stage bounds add up to (\d+)s", out)
    assert m is not None, out
    assert int(m.group(2)) <= int(m.group(1))
    for stage in CUDA_STAGES:
        assert re.search(rf"^{stage}: SKIPPED \(DRY_RUN is set\), bound \d+s$", out, re.M), stage
    assert re.search(r"^env: SKIPPED \(SKIP_ENV is set\)$", out, re.M), out
    assert "DRY RUN FAILED" not in out
    assert (tmp_path / "device_log.txt").read_text().count("SKIPPED") >= len(CUDA_STAGES)


def _stages() -> object:
    spec = importlib.util.spec_from_file_location(
        "device_stages", ROOT / "scripts/device_stages.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stage", ["bytes", "bigpool", "firstjob", "vllm"])
def test_measuring_stage_logic_runs_on_cpu(
    stage: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch", reason="the torch adapter needs torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    stages = _stages()
    rc = stages.main([stage, "--device", "cpu"])  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out and "CHECK" in out, out

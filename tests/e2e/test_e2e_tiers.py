"""Secondary tiers across engine processes: what one engine stored, another one serves.

Each engine with a tier runs in a process of its own
(``python -m statecore.bench.e2e_harness SPEC OUT``), as two serving processes would; the
reference runs without a connector in the test's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from test_e2e_engine import compare, prompts

from statecore.bench.e2e_harness import BLOCK_SIZE, EngineSpec, RunResult, run_engine

HARNESS = "statecore.bench.e2e_harness"


def run_in_process(spec: EngineSpec, workdir: Path, name: str) -> RunResult:
    """Run ``spec`` in a new Python process (bounded in time) and return its result."""
    spec_file = workdir / f"{name}.spec.json"
    out_file = workdir / f"{name}.out.json"
    spec_file.write_text(json.dumps(asdict(spec)))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [sys.executable, "-m", HARNESS, str(spec_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out_file.read_text())
    data["outputs"] = [
        [None if o is None else (o[0], o[1]) for o in rnd] for rnd in data["outputs"]
    ]
    return RunResult(**data)


def test_file_tier_serves_a_second_engine_process(llama_dir: Path, tmp_path: Path) -> None:
    """The first engine process stores two prompts through the CPU tier into a file tier and
    exits; a second process on the same directory (an empty CPU tier) loads the first prompt
    from the files: bit-identical to an engine without a connector."""
    a, b = prompts(2, 600, seed=8)
    tier = {
        "num_cpu_chunks": 64,
        "secondary_tiers": [{"kind": "file", "directory": str(tmp_path / "kv")}],
    }
    common = {"model": str(llama_dir), "gpu_blocks": 24, "max_model_len": 23 * BLOCK_SIZE}
    base = run_engine(EngineSpec(rounds=[[a], [b]], **common))  # type: ignore[arg-type]
    first = run_in_process(
        EngineSpec(rounds=[[a], [b]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "first",
    )
    assert first.stored_tokens > 0
    assert list((tmp_path / "kv").glob("**/*.chunk")), "the first engine wrote no chunk file"
    second = run_in_process(
        EngineSpec(rounds=[[a]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "second",
    )
    assert compare(base, first, bit_identical=True) == 2
    ref = RunResult(outputs=[base.outputs[0]])
    assert compare(ref, second, bit_identical=True) == 1
    print(f"second engine loaded {second.loaded_tokens} tokens")
    assert second.loaded_tokens >= 12 * BLOCK_SIZE, second.counters
    assert second.counters["jobs_failed"] == 0

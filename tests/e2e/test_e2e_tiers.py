"""Secondary tiers across engine processes: what one engine stored, another one serves.

Each engine with a tier runs in a process of its own
(``python -m statecore.bench.e2e_harness SPEC OUT``), as two serving processes would; the
reference runs without a connector in the test's process. The tiers: a directory (file tier),
a real Redis server (``redis-server`` started by
:class:`statecore.services.redisserver.LocalRedis`), and a file tier whose values were corrupted
between the engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from test_e2e_engine import compare, prompts

from statecore.bench.e2e_harness import BLOCK_SIZE, EngineSpec, RunResult, run_engine
from statecore.services.redisserver import LocalRedis, find_server

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


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    """A throw-away ``redis-server`` on loopback (skipped without one, failed under CI)."""
    if find_server() is None:
        reason = "no redis-server or valkey-server on PATH (scripts/_system.sh installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    with LocalRedis() as server:
        yield server


TIER_GAUGES = ("files", "bytes_used", "known_keys", "held_answers")
"""Tier gauges: ``RunResult.stats`` sums every step's value, which means nothing for them."""


def tier_stats(res: RunResult, name: str) -> dict[str, float]:
    """The counters of the secondary tier ``name`` (``file0``, ``redis0``) in ``res.stats``,
    its gauges left out."""
    prefix = name + "."
    return {
        k[len(prefix) :]: v
        for k, v in res.stats.items()
        if k.startswith(prefix) and k[len(prefix) :] not in TIER_GAUGES
    }


def test_redis_tier_serves_a_second_engine_process(
    llama_dir: Path, tmp_path: Path, redis_server: LocalRedis
) -> None:
    """Two engine processes share one real Redis server: the first stores two prompts through
    its CPU tier into Redis and exits; the second (an empty CPU tier) promotes the first
    prompt's chunks from Redis and loads them: bit-identical to an engine without a
    connector."""
    a, b = prompts(2, 600, seed=12)
    tier = {
        "num_cpu_chunks": 64,
        "secondary_tiers": [{"kind": "redis", "url": redis_server.url}],
    }
    common = {"model": str(llama_dir), "gpu_blocks": 24, "max_model_len": 23 * BLOCK_SIZE}
    base = run_engine(EngineSpec(rounds=[[a], [b]], **common))  # type: ignore[arg-type]
    first = run_in_process(
        EngineSpec(rounds=[[a], [b]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "first",
    )
    assert first.stored_tokens > 0
    client = redis_server.client()
    try:
        values = client.dbsize()
    finally:
        client.close()
    print(f"first engine stored {first.stored_tokens} tokens; Redis holds {values} values")
    assert values >= 2 * 18, "the first engine's chunks did not reach Redis"
    second = run_in_process(
        EngineSpec(rounds=[[a]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "second",
    )
    assert compare(base, first, bit_identical=True) == 2
    assert compare(RunResult(outputs=[base.outputs[0]]), second, bit_identical=True) == 1
    redis = tier_stats(second, "redis0")
    print(f"second engine loaded {second.loaded_tokens} tokens; its Redis tier: {redis}")
    assert second.loaded_tokens >= 12 * BLOCK_SIZE, second.counters
    assert second.counters["jobs_failed"] == 0
    assert not any(v for k, v in redis.items() if k.startswith("failed_jobs_")), redis


def corrupt_file(path: Path) -> None:
    """Flip the last bytes of a chunk file's payload (its checksum no longer matches)."""
    data = bytearray(path.read_bytes())
    for i in range(1, 9):
        data[-i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_file_tier_values_are_recomputed(llama_dir: Path, tmp_path: Path) -> None:
    """A prefix's second half corrupted on disk between two engine processes: the second
    engine loads the intact first half, the tier counts the corrupt reads (a failed promotion
    job, ``failed_jobs_corrupt``) and deletes those files, the rest is recomputed (and stored
    again, byte for byte what was there before the corruption), and the output is
    bit-identical to an engine without a connector.

    The halves are told apart by process: a first engine stores the first 288 tokens of the
    prompt (9 chunks), a second one serves them and stores the remaining chunks (the new
    files, which are corrupted), a third one serves the prompt again.
    """
    (a,) = prompts(1, 600, seed=13)
    half = a[: 9 * BLOCK_SIZE]
    kv = tmp_path / "kv"
    tier = {"num_cpu_chunks": 64, "secondary_tiers": [{"kind": "file", "directory": str(kv)}]}
    common = {"model": str(llama_dir), "gpu_blocks": 24, "max_model_len": 23 * BLOCK_SIZE}
    base = run_engine(EngineSpec(rounds=[[a]], **common))  # type: ignore[arg-type]
    run_in_process(
        EngineSpec(rounds=[[half]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "half",
    )
    first_half = set(kv.glob("**/*.chunk"))
    assert len(first_half) == 9, sorted(p.name for p in first_half)
    whole = run_in_process(
        EngineSpec(rounds=[[a]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "whole",
    )
    assert whole.loaded_tokens == 9 * BLOCK_SIZE, whole.counters
    second_half = set(kv.glob("**/*.chunk")) - first_half
    assert len(second_half) >= 9, sorted(p.name for p in second_half)
    original = {path: path.read_bytes() for path in second_half}
    for path in second_half:
        corrupt_file(path)
    after = run_in_process(
        EngineSpec(rounds=[[a]], connector=tier, **common),  # type: ignore[arg-type]
        tmp_path,
        "corrupted",
    )
    ref = RunResult(outputs=[base.outputs[0]])
    assert compare(ref, whole, bit_identical=True) == 1
    assert compare(ref, after, bit_identical=True) == 1
    files = tier_stats(after, "file0")
    print(f"after the corruption: loaded {after.loaded_tokens} tokens; file tier {files}")
    assert after.loaded_tokens == 9 * BLOCK_SIZE, after.counters  # the intact half only
    assert files["corrupt_reads"] == 9, files  # refused, and the files deleted
    assert files["failed_jobs_corrupt"] >= 1, files
    assert after.counters["jobs_failed"] == 0  # a promotion failed, no load into the device
    # the recomputed chunks were stored again: the same bytes as before the corruption
    assert all(path.read_bytes() == data for path, data in original.items())

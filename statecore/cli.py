"""The ``statecore`` command: a registry of subcommands, each a module imported only when run.

Theory of operation. :data:`_COMMANDS` and :data:`_BENCHES` map a command name to the module
that implements it and a one-line summary; adding a command is one line there. Nothing is
imported until a command runs, so ``statecore diagrams`` never imports torch and
``statecore --help`` lists every command without importing any.

The command line is parsed with :mod:`argparse` (standard library: no dependency, and the
same parser objects ``statecore docs`` reads to write the command reference). The top-level
parser handles ``--help``, ``--version`` and the choice of command; everything after the
command name belongs to the command. A command module has one of two shapes:

* ``add_arguments(parser)`` and ``run(args) -> int`` (preferred): this module builds the
  parser (:func:`command_parser`, with the house formatter: defaults shown, no docstring
  markup), parses, and calls ``run``; the module's ``main(argv)`` can be ``return
  statecore.cli.run_module(__name__, argv)``;
* ``main(argv) -> int`` alone (older shape): called with the arguments after the name.

Exit status, for every command: 0 success (the run or the check passed), 1 a check failed
(a violation, a stale file, a failure found), 2 a usage error (bad option or value, an output
path that cannot be written), 130 interrupted (Ctrl-C), 141 output pipe closed early (e.g.
``statecore ... | head``); the last two end quietly, without a traceback.

Logging: library code logs through :mod:`logging`, one logger per module under
``statecore`` (``statecore.managers.redistier``, ``statecore.sim.multi`` ...) and never
prints. The command writes the ``statecore`` loggers' records to stderr, at the level of
``--log-level`` (``warning`` by default: faults, their recovery, other warnings), an option
every command accepts anywhere on its command line (:func:`configure_logging`). Long
commands report progress on stderr (:mod:`statecore.progress`).

Helpers for command modules: :func:`int_range`, :func:`float_above` and :func:`output_file`
are argparse ``type=`` converters whose errors name the allowed range, or the folder that is
missing; argparse prefixes them with the flag.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

__all__ = [
    "EXIT_CODES",
    "LOG_LEVELS",
    "HelpFormatter",
    "command_parser",
    "commands",
    "configure_logging",
    "float_above",
    "int_range",
    "main",
    "module_parser",
    "output_file",
    "parser_for",
    "plain",
    "run_module",
    "version",
]

LOG_LEVELS = ("debug", "info", "warning", "error")
"""The values of ``--log-level``."""

# One line per command: name -> (module, summary). The module is imported only when it runs.
_COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("statecore.sim.cli", "run the deterministic simulator and print its report"),
    "fuzz": ("statecore.specs.fuzz", "time-boxed stateful fuzzing campaign"),
    "diagrams": ("statecore.lifecycle.diagrams", "write (or --check) the lifecycle diagrams"),
    "docs": ("statecore.docsgen", "write (or --check) the documentation pages generated from code"),
    "check": ("statecore.check.cli", "exhaustive bounded model checking of small scopes"),
    "tier": ("statecore.tiercli", "list, inspect and clear the Redis tier's keys on a server"),
}
# One line per benchmark: `statecore bench NAME`.
_BENCHES: dict[str, tuple[str, str]] = {
    "dispatch": ("statecore.bench.dispatch", "cost per lifecycle event: table vs machine"),
    "transfer": ("statecore.bench.transfer", "transfer adapter throughput (GB/s)"),
    "scheduler": ("statecore.bench.scheduler", "connector cost per engine step"),
    "tier": ("statecore.bench.tier", "Redis tier GB/s next to plain pipelined SET/GET"),
    "e2e": ("statecore.bench.e2e", "vLLM CPU build: revisit TTFT, load GB/s, decode tok/s"),
}

# The extra that installs what a command needs (docs/index.md lists them); a missing package
# is a one-line usage error naming it. Commands not listed need no extra.
_EXTRA_OF_COMMAND: dict[str, str] = {
    "simulate": "sim",
    "fuzz": "fuzz",
    "check": "sim",
    "tier": "redis",
    "bench transfer": "torch",
    "bench tier": "redis",
}
# otherwise, the extra that brings a missing top-level module
_EXTRA_OF_MODULE: dict[str, str] = {
    "numpy": "sim",
    "torch": "torch",
    "matplotlib": "sim",
    "hypothesis": "fuzz",
    "redis": "redis",
    "mkdocs": "docs",
    "vllm": "vllm",
    "cosmic_ray": "mutate",
}

EXIT_CODES: dict[int, str] = {
    0: "success: the run or the check passed",
    1: "a check failed (violation, stale file, failure found)",
    2: "usage error (bad option or value, output path that cannot be written)",
    130: "interrupted (Ctrl-C)",
    141: "output pipe closed early (e.g. piped into head)",
}
"""Exit status of every ``statecore`` command, and what it means."""


def version() -> str:
    """The installed distribution's version (the source of truth is ``statecore.__version__``)."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("statecore")
    except PackageNotFoundError:  # pragma: no cover - running from an uninstalled checkout
        from statecore import __version__

        return __version__


# ---------------------------------------------------------------------------------------------
# Help formatting and value checks

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST/markdown inline markup (roles, backquotes)."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default (flags and ``None`` defaults excepted), strips markup."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = plain(action.help or "")
        if (
            "%(default)" not in text
            and action.nargs != 0
            and action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))


def command_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with the house conventions (defaults shown, exit codes listed)."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=HelpFormatter,
        epilog="exit status: 0 pass, 1 check failed, 2 usage error, 130 interrupted",
        allow_abbrev=False,
    )


def int_range(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]`` (either bound may be open)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range_text(low, high)}, got {value}")
        return value

    convert.__name__ = "integer"
    return convert


def _range_text(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"an integer from {low} to {high}"
    if low is not None:
        return f"an integer >= {low}"
    return f"an integer <= {high}"


def float_above(low: float) -> Callable[[str], float]:
    """An argparse ``type``: a number strictly greater than ``low``."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > low:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be a number > {low:g}, got {text}")
        return value

    convert.__name__ = "number"
    return convert


def output_file(text: str) -> Path:
    """An argparse ``type``: a file path whose folder exists and is writable (checked now)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, expected a file name")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist (for {text})")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder} is not writable (for {text})")
    return path


# ---------------------------------------------------------------------------------------------
# Dispatch


def _import(module: str) -> ModuleType:
    return importlib.import_module(module)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _registered(module: str) -> tuple[str, str] | None:
    """``(prog, summary)`` of the command implemented by ``module``, if registered."""
    for name, (mod, text) in _COMMANDS.items():
        if mod == module:
            return f"statecore {name}", text
    for name, (mod, text) in _BENCHES.items():
        if mod == module:
            return f"statecore bench {name}", text
    return None


def module_parser(module: ModuleType, prog: str, summary: str) -> argparse.ArgumentParser | None:
    """The parser of a module with ``add_arguments`` (None for the ``main(argv)`` shape)."""
    add = getattr(module, "add_arguments", None)
    if add is None or getattr(module, "run", None) is None:
        return None
    parser = command_parser(prog, summary[:1].upper() + summary[1:] + ".")
    add(parser)
    return parser


def run_module(module: str, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` with the parser of ``module`` (``add_arguments`` shape) and run it.

    Usage errors and ``--help`` return their exit status (2, 0) instead of raising.
    """
    mod = _import(module)
    prog, summary = _registered(module) or (f"statecore {module.rsplit('.', 1)[-1]}", module)
    parser = module_parser(mod, prog, summary)
    if parser is None:
        raise TypeError(f"{module} has no add_arguments(parser) and run(args)")
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return _exit_code(exc)
    return int(mod.run(args))


def _call(module: str, argv: list[str]) -> int:
    mod = _import(module)
    if hasattr(mod, "add_arguments") and hasattr(mod, "run"):
        return run_module(module, argv)
    return int(mod.main(argv))


def _top_parser() -> argparse.ArgumentParser:
    exits = "\n".join(f"  {code:<4} {text}" for code, text in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        prog="statecore",
        description="statecore: correctness-first KV-cache offloading. Each command has its "
        "own --help.",
        epilog=f"exit status:\n{exits}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"statecore {version()}")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="level of the log lines written to stderr; accepted anywhere on the command line "
        "(before or after the command)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True
    for name, (_, text) in _COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    sub.add_parser("bench", help="benchmarks that print numbers: " + ", ".join(_BENCHES))
    return parser


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statecore bench",
        description="Benchmarks: each prints numbers (no test depends on them) and has its "
        "own --help.",
        epilog="exit status: 0 pass, 1 check failed, 2 usage error, 130 interrupted",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", title="benchmarks")
    sub.required = True
    for name, (_, text) in _BENCHES.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _split(parser: argparse.ArgumentParser, args: list[str]) -> tuple[str, list[str]]:
    """Parse the options before the first word with ``parser``; the word and what follows."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if not arg.startswith("-"):
            parser.parse_args(args[: i + 1])  # options before the word; exits on help/errors
            return arg, args[i + 1 :]
    parser.parse_args(args)  # no command word: help, version or a usage error
    _unreachable(parser)


def _unreachable(parser: argparse.ArgumentParser) -> NoReturn:  # pragma: no cover
    parser.error("a command is required")


class _StderrHandler(logging.Handler):
    """Writes each record as one line to the ``sys.stderr`` of the moment (or ``stream``)."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            out = sys.stderr if self.stream is None else self.stream
            out.write(self.format(record) + "\n")
            out.flush()
        except Exception:  # pragma: no cover - a closed stream: logging's own policy
            self.handleError(record)


def configure_logging(level: str = "warning", stream: Any = None) -> None:
    """Send the ``statecore`` loggers' records at ``level`` and above to ``stream`` (the
    current stderr by default), one line each: time, level, logger, message. Other libraries'
    loggers are left alone; records still propagate to the root logger's handlers, if any."""
    logger = logging.getLogger("statecore")
    for old in list(logger.handlers):
        if isinstance(old, _StderrHandler):
            logger.removeHandler(old)
    handler = _StderrHandler(stream)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def _log_level(args: list[str]) -> tuple[str, list[str]]:
    """``--log-level LEVEL`` (or ``--log-level=LEVEL``) taken out of ``args``, wherever it is
    before ``--``; the level (``warning`` when absent) and the other arguments."""
    level = "warning"
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        value: str | None = None
        if arg == "--log-level":
            if i + 1 >= len(args):
                raise _UsageError("--log-level needs a value: " + ", ".join(LOG_LEVELS))
            value = args[i + 1]
            i += 2
        elif arg.startswith("--log-level="):
            value = arg.split("=", 1)[1]
            i += 1
        else:
            rest.append(arg)
            i += 1
            continue
        if value.lower() not in LOG_LEVELS:
            raise _UsageError(
                f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {value!r}"
            )
        level = value.lower()
    return level, rest


class _UsageError(Exception):
    """A usage error found before a command's parser runs (exit status 2)."""


def _extra_for(command: str, args: list[str], module: str) -> str | None:
    """The extra that brings ``module`` (a missing top-level module) to ``command``."""
    if module.split(".")[0] not in _EXTRA_OF_MODULE and module.split(".")[0] != "xxhash":
        return None
    if command == "fuzz" and any(":" in a for a in args):  # --manager pkg.mod:Factory
        return "conformance"
    if command == "simulate" and module.split(".")[0] in ("redis", "xxhash"):
        return "redis"
    return _EXTRA_OF_COMMAND.get(command) or _EXTRA_OF_MODULE.get(module.split(".")[0])


def _missing_extra(command: str, args: list[str], exc: ModuleNotFoundError) -> int:
    """A package a command needs is not installed: one line naming the extra (status 2)."""
    extra = _extra_for(command, args, exc.name or "")
    if extra is None:
        raise exc
    print(
        f"statecore {command}: needs the {exc.name} package, which is not installed: "
        f'pip install "statecore[{extra}]"',
        file=sys.stderr,
    )
    return 2


def _dispatch(args: list[str]) -> int:
    name, rest = _split(_top_parser(), args)
    command = name
    try:
        if name == "bench":
            name, rest = _split(_bench_parser(), rest)
            command = f"bench {name}"
            if "--help" in rest or "-h" in rest:
                return _call(_BENCHES[name][0], rest)
            from statecore.progress import Heartbeat

            with contextlib.suppress(AttributeError, ValueError):  # a replaced stdout
                sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
            with Heartbeat(f"statecore {command}"):  # each row is printed as it is measured
                return _call(_BENCHES[name][0], rest)
        return _call(_COMMANDS[name][0], rest)
    except ModuleNotFoundError as exc:
        return _missing_extra(command, rest, exc)


def _quiet_pipe() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - stdout replaced
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``statecore`` command; returns the exit status (see module doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    logger = logging.getLogger("statecore")
    before = (logger.level, list(logger.handlers))
    try:
        level, args = _log_level(args)
        configure_logging(level)
        code = _dispatch(args)
        sys.stdout.flush()
        return code
    except SystemExit as exc:
        return _exit_code(exc)
    except _UsageError as exc:
        print(f"statecore: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstatecore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_pipe()
        return 141
    finally:  # called in-process (tests, an embedding): leave logging as it was
        logger.setLevel(before[0])
        logger.handlers[:] = before[1]


def _parser_of(entry: tuple[str, str], prog: str) -> argparse.ArgumentParser | None:
    """The parser of a registry entry; for ``main(argv)`` modules, the one it builds."""
    module, summary = entry
    mod = _import(module)
    parser = module_parser(mod, prog, summary)
    if parser is not None:
        return parser
    return _capture_parser(mod.main)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _capture_parser(entry: Callable[[list[str]], int]) -> argparse.ArgumentParser | None:
    """Run ``entry`` until it parses its arguments, and return the parser it built."""
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        entry([])
    except _Captured as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return None


def commands() -> list[tuple[str, str, str]]:
    """Every command as ``(name, module, summary)``; benchmarks as ``bench NAME``."""
    out = [(name, module, text) for name, (module, text) in _COMMANDS.items()]
    out += [(f"bench {name}", module, text) for name, (module, text) in _BENCHES.items()]
    return out


def parser_for(name: str) -> argparse.ArgumentParser | None:
    """The parser of command ``name`` (``"simulate"``, ``"bench dispatch"``)."""
    if name.startswith("bench "):
        bench = name.split(" ", 1)[1]
        return _parser_of(_BENCHES[bench], f"statecore {name}")
    return _parser_of(_COMMANDS[name], f"statecore {name}")


if __name__ == "__main__":
    raise SystemExit(main())

"""``statecore docs``: the documentation pages generated from the code.

Writes, under ``docs/``:

* ``lifecycles/request.md`` and ``lifecycles/job.md``: per lifecycle the diagram (included
  from ``docs/diagrams/<name>.svg``, which ``statecore diagrams`` writes), every state with its
  explanation and the events that enter and leave it, every event with the scheduler methods
  that fire it and the engine calls that reach them, and the transition table with what each
  transition calls in the scheduler and, through it, in the manager;
* ``invariants.md``: the invariant catalogue of :data:`statecore.specs.invariants.INVARIANTS`
  (statement, failure prevented, where it is checked, its scheduler predicate if any, and the
  modules that name it);
* ``reference/cli.md``: every ``statecore`` command with its options, read from the argparse
  parsers;
* ``bad-inputs.md``: the bad-input table of :mod:`statecore.specs.bad_inputs`, each case run
  to show its typed error and message or its counted tolerance.

Everything is derived from the code: the compiled lifecycles, the scheduler's source (read with
:mod:`ast`: ``REQUEST.fire``/``JOB.fire`` calls, ``self.manager.*`` accesses and calls between
its methods), the action functions' source, the invariant catalogue and the command parsers.
Each state's explanation is the docstring written under the state in its machine
(:func:`state_descriptions` reads it); the only hand-written text here is the per-mechanism
explanation in :data:`CHECK_MECHANISMS`. Generation fails when a state has no docstring.

``--check`` compares the committed pages with what would be generated and exits 1 listing the
stale ones. Output is deterministic (declaration order, sorted sets, no timestamps).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statecore._generated import checkout_docs_dir, report_stale, stale_files, write_files
from statecore.lifecycle import machines
from statecore.lifecycle.diagrams import LIFECYCLES, Lifecycle
from statecore.lifecycle.table import CompiledLifecycle, TransitionInfo

__all__ = [
    "CHECK_MECHANISMS",
    "SchedulerGraph",
    "add_arguments",
    "check",
    "default_docs_dir",
    "main",
    "render_bad_inputs_page",
    "render_cli_page",
    "render_invariants_page",
    "render_lifecycle_page",
    "rendered_pages",
    "run",
    "scheduler_graph",
    "state_descriptions",
    "write",
]

# ---------------------------------------------------------------------------------------------
# Hand-written text, checked against the code

CHECK_MECHANISMS: dict[str, str] = {
    "checked mode": (
        "`OffloadingScheduler(checked=True)` or `STATECORE_CHECKED=1`: every scheduler "
        "predicate runs after every public scheduler call and the first violation raises "
        "`InvariantViolation`. A call that raises (a manager's typed error, which checked "
        "mode propagates instead of absorbing it) keeps its own error: the predicates still "
        "run, and a violation they find, often the trace of the call interrupted half-way, is "
        "added to that error as a note (`__notes__`, printed with its traceback) rather than "
        "raised in its place. `checked_mode()` also runs each lifecycle event through the "
        "python-statemachine class beside the compiled table."
    ),
    "fuzzing": (
        "`statecore fuzz` and the stateful machines in `statecore.specs.stack`: Hypothesis "
        "drives the whole stack (engine events, worker reports, every fault) and evaluates "
        "every invariant after every operation; failures shrink to a short reproduction."
    ),
    "CrossHair": (
        "PEP 316 contracts (`pre:`/`post:` docstring lines) on the pure kernels, checked "
        "symbolically by `crosshair check` in the test command."
    ),
    "conformance": (
        "The manager conformance machine (`statecore.specs.conformance`) drives any "
        "`OffloadingManager` next to a reference model."
    ),
    "simulator": (
        "`statecore simulate` runs the real stack through a seeded workload with faults, "
        "checks every scheduler invariant after every step, compares every loaded byte with "
        "what was stored (byte oracle), bounds how long a request may wait (hung requests) "
        "and looks for leaked state after the drain."
    ),
    "statecore check": (
        "`statecore check` explores every interleaving of the engine's, the workers' and the "
        "clock's actions within a small scope (breadth-first, each distinct state once) and "
        "evaluates the invariant at every state it reaches; a violation is a shortest trace, "
        "written as a replayable pytest file (see the Model checking page)."
    ),
    "lifecycle table": (
        "Structural: the lifecycle machines do not accept the event that would break it "
        "(a rejected event raises `LifecycleError` with the state unchanged)."
    ),
    "differential Hypothesis test": (
        "`tests/lifecycle/test_lc_differential.py` drives the compiled tables and the "
        "python-statemachine classes with the same random event sequences."
    ),
    "unit tests": "Targeted pytest cases under `tests/`.",
    "worker tests": "Byte-exact store/load round trips through the worker and its backends.",
}
"""What each ``checked_by`` mechanism of the invariant catalogue means (matched by prefix)."""


# ---------------------------------------------------------------------------------------------
# Reading the scheduler


@dataclass
class _Method:
    manager: set[str] = field(default_factory=set)
    calls: set[str] = field(default_factory=set)
    fires: set[tuple[str, str]] = field(default_factory=set)


@dataclass(frozen=True)
class SchedulerGraph:
    """What the scheduler's methods do, read from its source.

    Attributes:
        manager_calls: method -> manager methods it uses (directly).
        self_calls: method -> other scheduler methods it calls.
        fires: method -> ``(entity, event)`` pairs it fires (``REQUEST.fire``/``JOB.fire``).
        hooks: the lifecycle-effect method names (:class:`~statecore.lifecycle.LifecycleEffects`).
        entry_points: public methods an engine calls (not hooks, not properties).
    """

    manager_calls: dict[str, frozenset[str]]
    self_calls: dict[str, frozenset[str]]
    fires: dict[str, frozenset[tuple[str, str]]]
    hooks: frozenset[str]
    entry_points: tuple[str, ...]

    def reach(self, start: str, through_lifecycles: bool) -> set[str]:
        """Methods reachable from ``start`` (itself included), optionally through the
        lifecycle actions of the events it fires."""
        seen: set[str] = set()
        todo = [start]
        while todo:
            m = todo.pop()
            if m in seen or m not in self.self_calls:
                continue
            seen.add(m)
            todo.extend(self.self_calls[m])
            if through_lifecycles:
                for entity, event in self.fires[m]:
                    todo.extend(_event_hooks(entity, event))
        return seen

    def manager_reach(self, start: str) -> list[str]:
        """Manager methods used by ``start`` and the scheduler methods it calls (sorted)."""
        out: set[str] = set()
        for m in self.reach(start, through_lifecycles=False):
            out |= self.manager_calls[m]
        return sorted(out)

    def fires_reach(self, start: str) -> list[tuple[str, str]]:
        """Events fired by ``start`` and the scheduler methods it calls (sorted)."""
        out: set[tuple[str, str]] = set()
        for m in self.reach(start, through_lifecycles=False):
            out |= self.fires[m]
        return sorted(out)

    def fired_in(self, entity: str, event: str) -> list[str]:
        """Scheduler methods whose body fires ``event`` of ``entity``."""
        return sorted(m for m, f in self.fires.items() if (entity, event) in f)

    def entry_points_reaching(self, entity: str, event: str) -> list[str]:
        """Engine-facing methods from which ``event`` can be fired (through lifecycles too)."""
        firing = set(self.fired_in(entity, event))
        return [
            e
            for e in self.entry_points
            if firing & self.reach(e, through_lifecycles=True) and e not in self.hooks
        ]


def _lifecycle(entity: str) -> CompiledLifecycle:
    for life in LIFECYCLES:
        if life.table.entity == entity:
            return life.table
    raise KeyError(entity)


def _action_hooks(action: Callable[..., Any]) -> list[str]:
    """``owner`` hooks an action calls: ``model.owner.<hook>(...)`` in its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(action)))
    hooks: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "owner"
            and node.attr not in hooks
        ):
            hooks.append(node.attr)
    return hooks


def _event_hooks(entity: str, event: str) -> list[str]:
    out: list[str] = []
    for t in _lifecycle(entity).transitions:
        if t.event == event:
            for a in t.actions:
                out.extend(h for h in _action_hooks(a) if h not in out)
    return out


def _fired_event(call: ast.Call) -> tuple[str, str] | None:
    """``REQUEST.fire(rec, RE_X)`` -> ``("request", "x")``."""
    func = call.func
    if not (
        isinstance(func, ast.Attribute)
        and func.attr == "fire"
        and isinstance(func.value, ast.Name)
        and func.value.id in ("REQUEST", "JOB")
        and len(call.args) == 2
        and isinstance(call.args[1], ast.Name)
    ):
        return None
    lifecycle = importlib.import_module("statecore.lifecycle")
    table: CompiledLifecycle = getattr(lifecycle, func.value.id)
    index = int(getattr(lifecycle, call.args[1].id))
    return table.entity, table.events[index]


def _is_scheduler(node: ast.expr) -> bool:
    """``self``, or the scheduler as the lifecycle effects name it (``sched``,
    ``self.sched``)."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "sched")
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "sched"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def scheduler_graph() -> SchedulerGraph:
    """Read :class:`~statecore.OffloadingScheduler`'s source (with its base's,
    :class:`~statecore.scheduler.state.SchedulerState`) and that of its lifecycle effects
    (:class:`~statecore.scheduler.effects.SchedulerEffects`) into a :class:`SchedulerGraph`."""
    from statecore.scheduler import OffloadingScheduler
    from statecore.scheduler.effects import SchedulerEffects
    from statecore.scheduler.state import SchedulerState

    bodies: list[ast.FunctionDef] = []
    methods: dict[str, _Method] = {}
    properties: set[str] = set()
    for owner in (SchedulerState, OffloadingScheduler, SchedulerEffects):
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
        cls = tree.body[0]
        if not isinstance(cls, ast.ClassDef):  # pragma: no cover - getsource returns the class
            raise TypeError(f"expected the {owner.__name__} class")
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                bodies.append(item)
                methods[item.name] = _Method()
                if any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    properties.add(item.name)
    for item in bodies:
        info = methods[item.name]
        for node in ast.walk(item):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                inner = node.value
                if _is_scheduler(inner.value) and inner.attr == "manager":
                    info.manager.add(node.attr)
            if (
                isinstance(node, ast.Attribute)
                and _is_scheduler(node.value)
                and node.attr in methods
                and node.attr not in properties
                and node.attr != item.name
            ):
                info.calls.add(node.attr)
            if isinstance(node, ast.Call):
                fired = _fired_event(node)
                if fired is not None:
                    info.fires.add(fired)
    hooks = frozenset(
        name
        for name, value in vars(machines.LifecycleEffects).items()
        if callable(value) and not name.startswith("_")
    )
    entry = tuple(
        name
        for name in methods
        if not name.startswith("_")
        and name not in properties
        and name not in hooks
        and name != "check_invariants"
    )
    return SchedulerGraph(
        manager_calls={k: frozenset(v.manager) for k, v in methods.items()},
        self_calls={k: frozenset(v.calls) for k, v in methods.items()},
        fires={k: frozenset(v.fires) for k, v in methods.items()},
        hooks=hooks,
        entry_points=entry,
    )


# ---------------------------------------------------------------------------------------------
# Markdown helpers


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else "—"


def _code(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _rst_to_md(text: str) -> str:
    """``:class:`X``` -> ```X```, ````code```` -> ```code```."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ---------------------------------------------------------------------------------------------
# Lifecycle pages


def _hook_calls(graph: SchedulerGraph, hook: str) -> str:
    parts = [f"`{hook}`"]
    mgr = graph.manager_reach(hook)
    if mgr:
        parts.append("manager " + _code(mgr))
    fired = graph.fires_reach(hook)
    if fired:
        parts.append("fires " + ", ".join(f"{e} `{ev}`" for e, ev in fired))
    return " → ".join(parts)


def _transition_calls(graph: SchedulerGraph, t: TransitionInfo) -> str:
    out = []
    for action in t.actions:
        for hook in _action_hooks(action):
            out.append(_hook_calls(graph, hook))
    return "; ".join(out)


def state_descriptions(machine: type[Any]) -> dict[str, str]:
    """Each state of ``machine`` (id -> text): the docstring written under the state.

    A state's docstring is the string literal right after its ``name = State(...)`` line in
    the machine's class body (read from the source with :mod:`ast`; at run time it is a no-op
    expression). reST code spans become Markdown ones and the lines are joined into one
    paragraph. Raises ``ValueError`` naming the states that have none.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(machine)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    found: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id == "State"
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[stmt.targets[0].id] = " ".join(_rst_to_md(after.value.value).split())
    states = [s.id for s in machine.states]
    missing = [s for s in states if s not in found]
    if missing:
        raise ValueError(
            f"{machine.__module__}.{machine.__name__}: no docstring under the states {missing}"
        )
    return {s: found[s] for s in states}


def render_lifecycle_page(life: Lifecycle, graph: SchedulerGraph | None = None) -> str:
    """The lifecycle page: diagram, states in prose, events, transitions with their calls."""
    graph = graph if graph is not None else scheduler_graph()
    lc = life.table
    cls = lc.machine
    prose = state_descriptions(cls)
    labels = {s.id: str(s.name) for s in cls.states}
    doc = _rst_to_md(inspect.getdoc(cls) or "")
    out = [
        # the page's own table of contents is hidden so that the diagram gets the width
        "---",
        "hide:",
        "  - toc",
        "---",
        "",
        f"# {life.title}",
        "",
        f"<!-- Generated by `statecore docs` from {cls.__module__}.{cls.__name__}; "
        "do not edit. -->",
        "",
        doc,
        "",
        f"The machine is `{cls.__module__}.{cls.__name__}`, compiled at import into "
        f"`statecore.lifecycle.{life.table.entity.upper()}`, the dispatch table the scheduler "
        f"runs. It has {len(lc.states)} states, {len(lc.events)} events and "
        f"{len(lc.transitions)} transitions. The diagram below is "
        f"`docs/diagrams/{life.name}.svg`, drawn by Graphviz from `{life.name}.dot` and "
        "included in the page itself (it needs no script and no network); "
        f"`{life.name}.mmd` is the same graph for Mermaid. Both are written by "
        "`statecore diagrams`; labels read `event [guard] / actions`, a dashed edge is an "
        "internal transition, a double border a final state.",
        "",
        f'<div class="statecore-diagram" role="img" aria-label="{life.title} diagram">',
        f'--8<-- "{life.name}.svg"',
        "</div>",
        "",
        f"[Open the diagram at full size](../diagrams/{life.name}.svg).",
        "",
        "## States",
        "",
    ]
    for i, sid in enumerate(lc.states):
        tags = []
        if i == lc.initial:
            tags.append("initial")
        if i in lc.final:
            tags.append("final")
        entered = sorted({t.event for t in lc.transitions if t.target == sid and t.source != sid})
        left = sorted({t.event for t in lc.transitions if t.source == sid and t.target != sid})
        kept = sorted({t.event for t in lc.transitions if t.source == sid and t.target == sid})
        title = f"`{sid}`: {labels[sid]}" + (f" ({', '.join(tags)})" if tags else "")
        out += [f"### {title}", "", prose[sid], ""]
        facts = []
        if entered:
            facts.append(f"- Entered by: {_code(entered)}")
        if left:
            facts.append(f"- Left by: {_code(left)}")
        if kept:
            facts.append(f"- Accepted without leaving: {_code(kept)}")
        rejected = [
            e
            for e in lc.events
            if not any(t.source == sid and t.event == e for t in lc.transitions)
        ]
        if rejected and i not in lc.final:
            facts.append(f"- Rejected (`LifecycleError`): {_code(rejected)}")
        out += facts + [""]
    out += [
        "## Events",
        "",
        "Where each event is fired in the scheduler (`OffloadingScheduler`, or the lifecycle "
        "effects of `statecore.scheduler.effects`), and from which engine calls it "
        "can be reached (directly, or through the actions of other lifecycle events).",
        "",
        "| event | fired in | reached from engine calls |",
        "| --- | --- | --- |",
    ]
    for ev in lc.events:
        fired = graph.fired_in(lc.entity, ev)
        entry = graph.entry_points_reaching(lc.entity, ev)
        out.append(f"| `{ev}` | {_cell(_code(fired))} | {_cell(_code(entry))} |")
    out += [
        "",
        "## Transitions",
        "",
        "In declaration order; for one event and source state the first transition whose guard "
        "holds is taken. *Calls* follows each action to the scheduler hook it invokes "
        "(`LifecycleEffects`), the manager methods that hook uses and the events it fires in "
        "turn.",
        "",
        "| event | source | guard | target | actions | calls |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for t in lc.transitions:
        guard = f"`{t.guard_text}`" if t.guards else ""
        actions = _code(a.__name__ for a in t.actions)
        target = f"`{t.target}`" + (" (internal)" if t.internal else "")
        out.append(
            f"| `{t.event}` | `{t.source}` | {_cell(guard)} | {target} | {_cell(actions)} | "
            f"{_cell(_transition_calls(graph, t))} |"
        )
    guards: dict[str, Callable[..., Any]] = {}
    actions_seen: dict[str, Callable[..., Any]] = {}
    for t in lc.transitions:
        for g, _ in t.guards:
            guards.setdefault(g.__name__, g)
        for a in t.actions:
            actions_seen.setdefault(a.__name__, a)
    out += ["", "## Guards", "", "| guard | holds when |", "| --- | --- |"]
    for name, g in guards.items():
        out.append(f"| `{name}` | {_cell(_rst_to_md(_first_line(g)))} |")
    out += ["", "## Actions", "", "| action | does | scheduler hook |", "| --- | --- | --- |"]
    from statecore.scheduler.effects import SchedulerEffects

    for name, a in actions_seen.items():
        hooks = _action_hooks(a)
        hook_doc = "; ".join(
            f"`{h}`: {_rst_to_md(_first_line(getattr(SchedulerEffects, h)))}" for h in hooks
        )
        out.append(f"| `{name}` | {_cell(_rst_to_md(_first_line(a)))} | {_cell(hook_doc)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Invariant catalogue

_INV_RE = re.compile(r"INV-[A-Z]+(?:-[A-Z]+)*")


def _mechanism(label: str) -> str | None:
    for name in sorted(CHECK_MECHANISMS, key=len, reverse=True):
        if label == name or label.startswith(name + " "):
            return name
    return None


def _source_files(root: Path | None) -> Iterator[tuple[str, Path]]:
    """Every source file of the package as ``(checkout-relative name, path)``.

    ``root`` is a checkout (with ``statecore/``); None reads the package wherever it is
    installed, so an installed package renders the same page as its checkout.
    """
    if root is not None:
        base = root / "statecore"
    else:
        spec = importlib.util.find_spec("statecore")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            return
        base = Path(locations[0]).resolve()
    for path in sorted(base.rglob("*.py")):
        yield f"statecore/{path.relative_to(base).as_posix()}", path


def _source_mentions(root: Path | None) -> dict[str, list[str]]:
    """INV code -> source files (relative, sorted) that name it, the catalogue excluded."""
    found: dict[str, set[str]] = {}
    for rel, path in _source_files(root):
        if rel in ("statecore/specs/invariants.py", "statecore/docsgen.py"):
            continue
        for code in set(_INV_RE.findall(path.read_text(encoding="utf-8"))):
            found.setdefault(code, set()).add(rel)
    return {k: sorted(v) for k, v in found.items()}


def render_invariants_page(root: Path | None = None) -> str:
    """The invariant catalogue page."""
    from statecore.specs.invariants import INVARIANTS as invariants

    mentions = _source_mentions(root)
    out = [
        "# Invariant catalogue",
        "",
        "<!-- Generated by `statecore docs` from statecore.specs.invariants.INVARIANTS; "
        "do not edit. -->",
        "",
        "Every correctness rule statecore keeps has a name. The catalogue lives in "
        "`statecore/specs/invariants.py` as executable "
        "`Invariant` records; this page is generated from it. An invariant with a *scheduler "
        "predicate* is a function of the scheduler's state that yields violation messages: "
        "it runs in checked mode after every public scheduler call, and after every step of "
        "the fuzzers and the simulator. The others concern the manager, the bytes or the "
        "lifecycle definitions and are checked by the mechanisms listed with them.",
        "",
        "| code | statement | checked by | scheduler predicate |",
        "| --- | --- | --- | --- |",
    ]
    for code, inv in invariants.items():
        pred = "yes" if inv.check is not None else "no"
        out.append(
            f"| [{code}](#{_anchor(code)}) | {_cell(inv.statement)} | "
            f"{_cell(', '.join(inv.checked_by))} | {pred} |"
        )
    out += [
        "",
        "## How invariants are checked",
        "",
        "| mechanism | what it does |",
        "| --- | --- |",
    ]
    for name, text in CHECK_MECHANISMS.items():
        out.append(f"| {name} | {_cell(text)} |")
    for code, inv in invariants.items():
        out += [
            "",
            f"## {code}",
            "",
            f"**Statement.** {inv.statement}",
            "",
            f"**Prevents.** {inv.prevents}",
            "",
            "**Checked by.**",
            "",
        ]
        for label in inv.checked_by:
            out.append(f"- {label}")
        out.append("")
        if inv.check is not None:
            out.append(
                f"**Scheduler predicate.** `statecore.specs.invariants.{inv.check.__name__}` "
                "runs in checked mode (`OffloadingScheduler(checked=True)` or "
                "`STATECORE_CHECKED=1`) after every public scheduler call, and after every "
                "step of the fuzzers and the simulator; a violation raises "
                f'`InvariantViolation("{code}", ...)`.'
            )
        else:
            out.append(
                "**Scheduler predicate.** None: this invariant is not a property of the "
                "scheduler's state alone; the mechanisms above check it."
            )
        files = mentions.get(code, [])
        if files:
            out += ["", "**Named in.** " + _code(files)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI page


def _option_rows(parser: argparse.ArgumentParser, within: str = "") -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):  # one row per action, then its own
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"| `{within}{name}` | {_cell(helps.get(name, ''))} | |"
                yield from _option_rows(sub, f"{within}{name} ")
            continue
        names = ", ".join(action.option_strings) or str(action.metavar or action.dest)
        if action.nargs != 0 and action.option_strings:
            if action.metavar is not None:
                names += f" {action.metavar}"
            elif action.choices is not None:
                names += " {" + ",".join(str(c) for c in action.choices) + "}"
            else:
                names += f" {action.dest.upper()}"
        text = action.help or ""
        if "%(" in text:
            text = text % {**vars(action), "prog": parser.prog}
        default = ""
        if action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            default = f"`{action.default}`"
        yield f"| `{within}{names}` | {_cell(text)} | {_cell(default)} |"


def render_cli_page() -> str:
    """Every ``statecore`` command and its options, read from the parsers."""
    cli: Any = importlib.import_module("statecore.cli")
    commands: list[tuple[str, str, str]] = cli.commands()
    out = [
        "# Command line",
        "",
        "<!-- Generated by `statecore docs` from statecore.cli and the command parsers; "
        "do not edit. -->",
        "",
        "`statecore [--version] [--help] COMMAND [OPTIONS]`. `statecore --help` lists the "
        "commands, `statecore COMMAND --help` (and `statecore bench --help`, "
        "`statecore bench NAME --help`) shows a command's options with their defaults. "
        "`statecore --version` prints the installed version.",
        "",
        "Every command accepts `--log-level {debug,info,warning,error}` anywhere on its "
        "command line (default `warning`): the `statecore` loggers' lines (one logger per "
        "component, e.g. `statecore.managers.redistier`) go to stderr, the report to stdout. "
        "Long commands report progress on stderr: a line redrawn in place on a terminal, a "
        "heartbeat line every few seconds otherwise.",
        "",
        "The command line is built with the standard library's `argparse` (subcommands from a "
        "registry in `statecore.cli`, one line per command, each module imported only when it "
        "runs): no dependency to install, and these same parser objects are what this page is "
        "generated from, so the reference cannot drift from the commands.",
        "",
        "## Exit status",
        "",
        "The same for every command:",
        "",
        "| status | meaning |",
        "| --- | --- |",
    ]
    for code, meaning in cli.EXIT_CODES.items():
        out.append(f"| {code} | {_cell(meaning)} |")
    out += [
        "",
        "Values are checked before any work starts: a number out of range or an output file "
        "whose folder does not exist is a usage error that names the option and what it "
        "accepts.",
        "",
        "## Commands",
        "",
        "| command | what it does | module |",
        "| --- | --- | --- |",
    ]
    for name, module, text in commands:
        out.append(f"| [`{name}`](#{_anchor('statecore ' + name)}) | {_cell(text)} | `{module}` |")
    for name, _module, text in commands:
        out += ["", f"## statecore {name}", ""]
        parser = cli.parser_for(name)
        if parser is None:  # pragma: no cover - every command uses argparse today
            out += [_cell(text)]
            continue
        desc = (parser.description or text).split("\n\n")[0].replace("\n", " ").strip()
        out += [_rst_to_md(desc), "", f"Usage: `{parser.prog} [OPTIONS]`", ""]
        rows = list(_option_rows(parser))
        if rows:
            out += ["| option | meaning | default |", "| --- | --- | --- |", *rows]
        else:
            out.append("No options.")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Files


def rendered_pages() -> dict[str, str]:
    """Every generated page, by path relative to ``docs/``."""
    graph = scheduler_graph()
    pages = {
        f"lifecycles/{life.name}.md": render_lifecycle_page(life, graph) for life in LIFECYCLES
    }
    pages["invariants.md"] = render_invariants_page()
    pages["reference/cli.md"] = render_cli_page()
    pages["bad-inputs.md"] = render_bad_inputs_page()
    from statecore.adapters.vllm_keys import render_table_page  # no vLLM import

    pages["reference/vllm-config.md"] = render_table_page()
    return pages


def render_bad_inputs_page() -> str:
    """The "bad inputs" page: :mod:`statecore.specs.bad_inputs` run case by case."""
    from statecore.specs.bad_inputs import render_page

    return render_page()


def default_docs_dir() -> Path | None:
    """``docs/`` of the source checkout this package runs from (None when installed)."""
    return checkout_docs_dir()


def check(docs_dir: Path, pages: dict[str, str] | None = None) -> list[Path]:
    """The generated pages under ``docs_dir`` that are missing or stale."""
    return stale_files(docs_dir, pages if pages is not None else rendered_pages())


def write(docs_dir: Path, pages: dict[str, str] | None = None) -> list[Path]:
    """Write every generated page under ``docs_dir``; return the paths written."""
    return write_files(docs_dir, pages if pages is not None else rendered_pages())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``statecore docs``."""
    parser.description = (
        "Write the documentation pages generated from the code of this statecore package "
        "(lifecycle pages, the invariant catalogue, the command reference) into the docs folder "
        "of the source checkout, or into --out."
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 listing stale pages"
    )
    mode.add_argument("--print", metavar="PAGE", help="print one page (e.g. invariants.md)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="docs folder (default: docs of the source checkout this package runs from; "
        "required when it runs from an installed package)",
    )


def run(args: argparse.Namespace) -> int:
    """Write, check or print the generated pages as ``args`` say."""
    if args.print:
        pages = rendered_pages()
        if args.print not in pages:
            print(
                f"statecore docs: argument --print: no generated page {args.print!r}; "
                f"pages: {', '.join(sorted(pages))}",
                file=sys.stderr,
            )
            return 2
        print(pages[args.print], end="")
        return 0
    docs_dir = args.out if args.out is not None else default_docs_dir()
    if docs_dir is None:  # checked before the (slower) rendering
        print(
            "statecore docs: not running from a source checkout; say where the docs are with "
            "--out DIR (e.g. --out docs)",
            file=sys.stderr,
        )
        return 2
    pages = rendered_pages()
    if args.check:
        return report_stale("statecore docs", check(docs_dir, pages), len(pages), "pages", docs_dir)
    for path in write(docs_dir, pages):
        print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore docs``."""
    from statecore.cli import run_module

    return run_module(__name__, argv)

"""The simulation report: what a run did, what it injected, and everything that went wrong.

A :class:`SimReport` is filled by :func:`statecore.sim.run.simulate`: counts, per-step series,
findings, the settings of the run (the whole resolved ``SimConfig``) and its wall time. It
renders as text
(every figure with its unit) or as JSON (the same fields; ``wall_s`` and ``settings`` are left
out of :meth:`SimReport.fingerprint`, which must replay identically from the seed).

Faults are reported twice: *injected* counts what the harness put in, *observed* what the
stack itself counted as the effect (the ``as`` column). The two are not one-to-one, and the
text report says why (:data:`FAULTS_EXPLAINED`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FAULTS_EXPLAINED", "FaultCount", "SimReport"]

FAULTS_EXPLAINED = (
    "injected = faults the harness put in; observed = what the stack counted as their effect "
    "(the 'as' column). They are not one-to-one: one fault can have several effects (a reset "
    "turns every report still on its way into a stale one; a withheld report stalls its job "
    "and may still arrive, late; report delays that are not faults can stall jobs too), and a "
    "fault can have none (a delayed store that lands before a flush waits for it, a fault on "
    "a job a reset already discarded). A kind injected but never observed is listed below."
)
"""How to read the fault table (printed under it)."""


@dataclass(slots=True)
class FaultCount:
    """How often a fault kind was injected and how often its effect was observed."""

    injected: int = 0
    observed: int = 0
    observed_as: str = ""


@dataclass
class SimReport:
    """Everything a run reports. ``ok`` is false on any violation, data error, hang or leak."""

    seed: int = 0
    steps: int = 0
    drain_steps: int = 0
    workers: int = 0
    tiering: bool = False
    checked: bool = False
    requests_wanted: int = 0
    wall_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    groups: str = "full"
    manager: str = "lru"
    requests: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    hit_rate: float = 0.0
    external_hit_rate: float = 0.0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)
    tier_faults: dict[str, int] = field(default_factory=dict)
    """Failed secondary-tier jobs by tier and fault kind (``"redis0 unreachable"``; the
    kinds are :data:`statecore.managers.tiers.FAULT_KINDS`)."""
    reports_absorbed: dict[str, int] = field(default_factory=dict)
    faults: dict[str, FaultCount] = field(default_factory=dict)
    invariant_violations: list[str] = field(default_factory=list)
    data_errors: list[str] = field(default_factory=list)
    hung_requests: list[str] = field(default_factory=list)
    leaked_state: list[str] = field(default_factory=list)
    engine_errors: list[str] = field(default_factory=list)
    harness_anomalies: list[str] = field(default_factory=list)
    engine_jams: list[str] = field(default_factory=list)
    unobserved_faults: list[str] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No violation, data error, hung request, leak, or error raised into the engine."""
        return not (
            self.invariant_violations
            or self.data_errors
            or self.hung_requests
            or self.leaked_state
            or self.engine_errors
            or self.harness_anomalies
        )

    @property
    def warnings(self) -> list[str]:
        """Things that did not fail the run but make its figures mean less than they seem."""
        out = []
        arrived = self.requests.get("arrived", 0)
        if self.requests_wanted and arrived < self.requests_wanted:
            out.append(
                f"only {arrived} of {self.requests_wanted} requests arrived within "
                f"{self.steps} steps; the figures cover those {arrived} (give the run more "
                "steps, or fewer requests)"
            )
        out.extend(
            f"{jam}: the engine model jammed (its GPU pool is too small for the blocks its "
            "waiting requests hold; raise --gpu-blocks); later figures measure nothing"
            for jam in self.engine_jams
        )
        return out

    def to_dict(self, with_series: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (time series left out unless asked for)."""
        d = asdict(self)
        if not with_series:
            d.pop("series")
        d["ok"] = self.ok
        d["warnings"] = self.warnings
        return d

    def to_json(self, with_series: bool = False) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(with_series), indent=2, sort_keys=True)

    def fingerprint(self) -> str:
        """Everything that must replay identically from the seed (wall time excluded)."""
        d = self.to_dict(with_series=True)
        d.pop("wall_s")
        d.pop("settings")
        return json.dumps(d, sort_keys=True)

    def format_text(self, limit: int = 10) -> str:
        """The human-readable report."""
        out: list[str] = []
        add = out.append
        status = "PASS" if self.ok else "FAIL"
        warnings = self.warnings
        if warnings:
            status += f" with {len(warnings)} warning{'s' if len(warnings) > 1 else ''}"
        add(
            f"statecore simulate: {status}  (seed {self.seed}, {self.steps} steps + "
            f"{self.drain_steps} drain steps, {self.workers} workers, "
            f"checked mode {'on' if self.checked else 'off'}, KV groups {self.groups}, "
            f"manager {self.manager})"
        )
        for w in warnings:
            add(f"WARNING       {w}")
        r = self.requests
        wanted = f" (of {self.requests_wanted} requested)" if self.requests_wanted else ""
        add(
            "requests      "
            + ", ".join(
                f"{k.replace('_', ' ')} {v}{wanted if k == 'arrived' else ''}"
                + (" (another connector's)" if k == "foreign" else "")
                for k, v in r.items()
            )
        )
        t = self.tokens
        add(
            f"hit rate      {self.hit_rate:.1%} of admitted prompt tokens (from offloaded "
            f"chunks {self.external_hit_rate:.1%}; from the GPU prefix cache "
            f"{t.get('local_hits', 0)} tokens)"
        )
        add(
            f"tokens        loaded {t.get('loaded', 0)}, recomputed after failed loads "
            f"{t.get('recomputed', 0)}, computed {t.get('computed', 0)}, prompt "
            f"{t.get('prompt', 0)} (tokens)"
        )
        add("bytes moved   " + ", ".join(f"{k} {_human(v)}" for k, v in self.bytes_moved.items()))
        add("jobs          " + ", ".join(f"{k} {v}" for k, v in self.jobs.items()) + " (jobs)")
        if self.tier_faults:
            add(
                "tier faults   "
                + ", ".join(f"{k} {v}" for k, v in self.tier_faults.items())
                + " (failed tier jobs by kind)"
            )
        add(
            "absorbed      "
            + ", ".join(f"{k} {v}" for k, v in self.reports_absorbed.items())
            + " (worker reports)"
        )
        add("faults        kind               injected  observed (as)")
        for kind, fc in self.faults.items():
            add(f"              {kind:<18} {fc.injected:>8}  {fc.observed:>8} ({fc.observed_as})")
        for line in _wrap(FAULTS_EXPLAINED, 80):
            add(f"              {line}")
        if self.unobserved_faults:
            add("              injected, not observed: " + ", ".join(self.unobserved_faults))
        for title, items in (
            ("invariant violations", self.invariant_violations),
            ("data errors", self.data_errors),
            ("hung requests", self.hung_requests),
            ("leaked state", self.leaked_state),
            ("errors raised into the engine", self.engine_errors),
            ("harness anomalies", self.harness_anomalies),
        ):
            add(f"{title + ':':<31}{len(items)}")
            for item in items[:limit]:
                add(f"    {item}")
            if len(items) > limit:
                add(f"    ... {len(items) - limit} more")
        if self.wall_s:
            steps = self.steps + self.drain_steps
            add(f"wall time     {self.wall_s:.1f} s ({steps / self.wall_s:.0f} steps/s)")
        return "\n".join(out)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def _human(n: int) -> str:
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"

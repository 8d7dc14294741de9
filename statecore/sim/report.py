"""The simulation report: what a run did, what it injected, and everything that went wrong."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FaultCount", "SimReport"]


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
    requests: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    hit_rate: float = 0.0
    external_hit_rate: float = 0.0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)
    reports_absorbed: dict[str, int] = field(default_factory=dict)
    faults: dict[str, FaultCount] = field(default_factory=dict)
    invariant_violations: list[str] = field(default_factory=list)
    data_errors: list[str] = field(default_factory=list)
    hung_requests: list[str] = field(default_factory=list)
    leaked_state: list[str] = field(default_factory=list)
    engine_errors: list[str] = field(default_factory=list)
    harness_anomalies: list[str] = field(default_factory=list)
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

    def to_dict(self, with_series: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (time series left out unless asked for)."""
        d = asdict(self)
        if not with_series:
            d.pop("series")
        d["ok"] = self.ok
        return d

    def to_json(self, with_series: bool = False) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(with_series), indent=2, sort_keys=True)

    def fingerprint(self) -> str:
        """Everything that must replay identically from the seed (wall time excluded)."""
        return json.dumps(self.to_dict(with_series=True), sort_keys=True)

    def format_text(self, limit: int = 10) -> str:
        """The human-readable report."""
        out: list[str] = []
        add = out.append
        status = "PASS" if self.ok else "FAIL"
        add(
            f"statecore simulate: {status}  (seed {self.seed}, {self.steps} steps + "
            f"{self.drain_steps} drain, {self.workers} workers"
            f"{', tiering to files' if self.tiering else ''})"
        )
        r = self.requests
        add("requests      " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.items()))
        t = self.tokens
        add(
            f"hit rate      {self.hit_rate:.1%} of prompt tokens (offloaded hits "
            f"{self.external_hit_rate:.1%}; local GPU prefix hits {t.get('local_hits', 0)})"
        )
        add(
            f"tokens        loaded {t.get('loaded', 0)}, recomputed after failed loads "
            f"{t.get('recomputed', 0)}, computed {t.get('computed', 0)}, prompt "
            f"{t.get('prompt', 0)}"
        )
        add("bytes moved   " + ", ".join(f"{k} {_human(v)}" for k, v in self.bytes_moved.items()))
        add("jobs          " + ", ".join(f"{k} {v}" for k, v in self.jobs.items()))
        add("absorbed      " + ", ".join(f"{k} {v}" for k, v in self.reports_absorbed.items()))
        add("faults        kind               injected  observed (as)")
        for kind, fc in self.faults.items():
            add(f"              {kind:<18} {fc.injected:>8}  {fc.observed:>8} ({fc.observed_as})")
        if self.unobserved_faults:
            add("              not observed: " + ", ".join(self.unobserved_faults))
        for title, items in (
            ("invariant violations", self.invariant_violations),
            ("data errors", self.data_errors),
            ("hung requests", self.hung_requests),
            ("leaked state", self.leaked_state),
            ("errors raised into the engine", self.engine_errors),
            ("harness anomalies", self.harness_anomalies),
        ):
            add(f"{title + ':':<30}{len(items)}")
            for item in items[:limit]:
                add(f"    {item}")
            if len(items) > limit:
                add(f"    ... {len(items) - limit} more")
        return "\n".join(out)


def _human(n: int) -> str:
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"

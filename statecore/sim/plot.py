"""``statecore simulate --plot FILE``: one figure of a run, every panel on the same step axis.

Theory of operation. The figure is drawn from the per-step series of a :class:`SimReport`
(the engine's hit rate, and :mod:`statecore.sim.series`'s jobs, CPU tier and fault counts):

1. cumulative hit rate, in % of admitted prompt tokens;
2. jobs in flight by kind (loads, stores), raw per step and as a moving average;
3. CPU tier occupancy, in % of its slots;
4. fault events: one row per fault kind, a mark at every step where one was injected.

Resets are drawn as vertical lines through every panel (they explain the drops of the other
curves), and the drain at the end of the run is shaded. matplotlib is imported only here
(the ``sim`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence

from statecore.sim.faults import FAULT_KINDS
from statecore.sim.report import SimReport

__all__ = ["moving_average", "write_plot"]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The trailing mean of ``values`` over at most ``window`` steps (same length)."""
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plot(report: SimReport, path: str) -> None:
    """Write the run's figure as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report.series
    hit = s.get("hit_rate", [])
    n = len(hit)
    steps = list(range(n))
    loads = s.get("loads_in_flight", [])
    stores = s.get("stores_in_flight", [])
    cpu = s.get("cpu_occupancy", [])
    window = max(5, n // 100)

    fig, axes = plt.subplots(
        4,
        1,
        figsize=(11, 9),
        dpi=100,
        sharex=True,
        gridspec_kw={"height_ratios": [2, 2, 1.5, 1.6]},
    )
    ax_hit, ax_jobs, ax_cpu, ax_faults = axes

    ax_hit.plot(steps, [h * 100 for h in hit], color="tab:blue", lw=1.5)
    ax_hit.set_ylabel("hit rate\n(% of prompt tokens,\ncumulative)")
    ax_hit.set_ylim(0, 100)

    for values, color, label in ((loads, "tab:green", "loads"), (stores, "tab:orange", "stores")):
        if values:
            ax_jobs.plot(steps[: len(values)], values, color=color, lw=0.5, alpha=0.35)
            ax_jobs.plot(
                steps[: len(values)],
                moving_average(values, window),
                color=color,
                lw=1.6,
                label=f"{label} ({window}-step mean)",
            )
    ax_jobs.set_ylabel("jobs in flight\n(jobs)")
    ax_jobs.set_ylim(bottom=0)
    ax_jobs.legend(loc="upper right", fontsize=8, frameon=False)

    if cpu:
        ax_cpu.fill_between(steps[: len(cpu)], cpu, color="tab:purple", alpha=0.3, lw=0)
        ax_cpu.plot(steps[: len(cpu)], cpu, color="tab:purple", lw=1)
    ax_cpu.set_ylabel("CPU tier\n(% of slots used)")
    ax_cpu.set_ylim(0, 105)

    kinds = [k for k in FAULT_KINDS if k != "reset"]
    for row, kind in enumerate(kinds):
        marks = [i for i, v in enumerate(s.get(f"faults_{kind}", [])) if v]
        ax_faults.scatter(
            marks, [row] * len(marks), marker="|", s=40, color="tab:gray", linewidths=0.8
        )
    ax_faults.set_yticks(range(len(kinds)), [k.replace("_", " ") for k in kinds], fontsize=8)
    ax_faults.set_ylim(-0.7, len(kinds) - 0.3)
    ax_faults.set_ylabel("faults injected")
    ax_faults.set_xlabel("engine step (simulated; one step = one scheduler iteration)")

    resets = [i for i, v in enumerate(s.get("faults_reset", [])) if v]
    drain_start = report.steps
    for ax in axes:
        for i in resets:
            ax.axvline(i, color="tab:red", lw=0.8, ls="--", alpha=0.7)
        if report.drain_steps:
            ax.axvspan(drain_start, drain_start + report.drain_steps, color="0.9", lw=0)
        ax.grid(axis="y", alpha=0.3)
        ax.set_xlim(0, max(n - 1, 1))
    if resets:
        ax_hit.plot([], [], color="tab:red", lw=0.8, ls="--", label=f"reset ({len(resets)})")
    if report.drain_steps:
        ax_hit.fill_between([], [], color="0.9", label="drain")
    ax_hit.legend(loc="lower right", fontsize=8, frameon=False)

    status = "PASS" if report.ok else "FAIL"
    if report.warnings:
        status += f" ({len(report.warnings)} warning: see the report)"
    arrived = report.requests.get("arrived", 0)
    fig.suptitle(
        f"statecore simulate: {status}, seed {report.seed}, {report.workers} workers, "
        f"{arrived} requests, {report.steps} steps + {report.drain_steps} drain, "
        f"checked mode {'on' if report.checked else 'off'}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

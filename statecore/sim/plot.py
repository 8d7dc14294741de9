"""``statecore simulate --plot FILE``: hit rate and in-flight jobs over steps (matplotlib)."""

from __future__ import annotations

from statecore.sim.report import SimReport

__all__ = ["write_plot"]


def write_plot(report: SimReport, path: str) -> None:
    """Write a PNG of the run's cumulative hit rate and in-flight jobs per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hit = report.series.get("hit_rate", [])
    jobs = report.series.get("in_flight_jobs", [])
    fig, ax1 = plt.subplots(figsize=(9, 4), dpi=100)
    steps = range(len(hit))
    ax1.plot(steps, [h * 100 for h in hit], color="tab:blue", label="hit rate (cumulative, %)")
    ax1.set_xlabel("engine step")
    ax1.set_ylabel("hit rate (%)", color="tab:blue")
    ax1.set_ylim(0, 100)
    ax2 = ax1.twinx()
    ax2.plot(range(len(jobs)), jobs, color="tab:orange", alpha=0.6, lw=0.8, label="jobs in flight")
    ax2.set_ylabel("jobs in flight", color="tab:orange")
    status = "PASS" if report.ok else "FAIL"
    ax1.set_title(f"statecore simulate (seed {report.seed}, {report.workers} workers): {status}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

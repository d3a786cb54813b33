"""PNG figures of a simulation (matplotlib, imported here only: the package does not need it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pslink.sim.engine import SimResult
from pslink.sim.metrics import binned_mean, ratio_samples
from pslink.sim.trace import ATTRIBUTION


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, path: Path, caption: str) -> Path:
    fig.text(0.01, 0.01, caption, fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_all(pslink: SimResult, static: SimResult, summary: dict, out: Path, title: str) -> list[Path]:
    """cpu_over_time.png, ratio_cdf.png and slowdown_cdf.png in ``out``."""
    plt = _pyplot()
    caption = ATTRIBUTION
    written = []

    ps, st = pslink.timeline.arrays(), static.timeline.arrays()
    start = st["times"][0] if len(st["times"]) else 0.0
    width = 3600.0 if (st["times"][-1] - start) > 3 * 86400 else 60.0
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for arrays, key, label, style in ((st, "requested", "requested (static servers)", dict(color="0.55", lw=0.8)),
                                      (ps, "allocated", "pslink Aggregators", dict(color="tab:blue", lw=0.8)),
                                      (st, "busy", "CPU busy aggregating", dict(color="tab:orange", lw=0.6))):
        x, y = binned_mean(arrays["times"], arrays[key], width)
        ax.plot((x - start) / 86400, y, label=label, **style)
    ax.set_xlabel("days since the first submission")
    ax.set_ylabel(f"CPUs ({'hourly' if width == 3600 else 'per-minute'} mean)")
    ax.set_title(f"{title}: {summary['cpu_time_saved']:.1%} of aggregation CPU time saved")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    written.append(_finish(plt, fig, out / "cpu_over_time.png", caption))

    ratios = np.sort(ratio_samples(pslink.timeline, summary["ratio"]["interval_s"]))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if len(ratios):
        ax.plot(ratios, np.arange(1, len(ratios) + 1) / len(ratios), color="tab:blue")
    ax.axvline(1.0, color="0.5", ls="--", lw=0.8)
    ax.set_xlabel("pslink allocated / requested CPUs (1-minute samples)")
    ax.set_ylabel("CDF")
    ax.set_title(f"ratio above 1 in {summary['ratio']['above_1']:.2%} of the time (paper: Figure 11)", fontsize=10)
    ax.grid(alpha=0.3)
    written.append(_finish(plt, fig, out / "ratio_cdf.png", caption))

    fig, ax = plt.subplots(figsize=(6, 3.6))
    by_model: dict[str, list[float]] = {}
    for o in pslink.jobs:
        by_model.setdefault(o.model, []).append(o.slowdown * 100)
    everyone = np.sort([o.slowdown * 100 for o in pslink.jobs])
    if len(everyone):
        ax.plot(everyone, np.arange(1, len(everyone) + 1) / len(everyone), color="k", lw=1.5, label="all jobs")
    for model, values in sorted(by_model.items()):
        values = np.sort(values)
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), lw=0.8, label=model)
    ax.set_xlabel("job slowdown against static servers (%)")
    ax.set_ylabel("CDF")
    ax.set_xlim(left=0, right=max(12.0, float(np.percentile(everyone, 99))) if len(everyone) else 12.0)
    ax.set_title(f"median job slowdown {summary['slowdown'].get('p50', 0):.1%}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    written.append(_finish(plt, fig, out / "slowdown_cdf.png", caption))
    return written

"""PNG timelines of a benchmark run: the pool's Aggregator count and each job's speed over time
(matplotlib, from the ``sim`` extra, imported only when a picture is asked for)."""

from __future__ import annotations

from pathlib import Path


def timeline_png(path: str, title: str, speeds: dict[str, list[tuple[float, float]]],
                 aggregators: list[tuple[float, int]] | None = None, spans: list[tuple[float, float, str]] = (),
                 speed_label: str = "iterations per second") -> Path:
    """``speeds``: job -> [(seconds, speed)]; ``aggregators``: [(seconds, count)], drawn as a step
    line on the right axis; ``spans``: (start, end, label) shaded (a migration, a packing)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("a PNG timeline needs matplotlib: pip install -c constraints.txt -e '.[sim]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for job, points in sorted(speeds.items()):
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, lw=1.2, label=job)
    ax.set_xlabel("seconds")
    ax.set_ylabel(speed_label)
    for start, end, label in spans:
        ax.axvspan(start, end, color="0.85", zorder=0)
        ax.text(start, ax.get_ylim()[1], f" {label}", va="top", fontsize=8, color="0.3")
    handles, labels = ax.get_legend_handles_labels()
    if aggregators:
        right = ax.twinx()
        xs, ys = zip(*aggregators)
        (line,) = right.step(xs, ys, where="post", color="black", lw=1.6, label="Aggregators")
        right.set_ylabel("Aggregators")
        right.set_ylim(0, max(ys) + 1)
        handles, labels = handles + [line], labels + ["Aggregators"]
    ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)

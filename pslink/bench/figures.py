"""What a benchmark reports: a figure measured beside its anchor, both in the same invocation.

Every ratio a benchmark prints comes from a :class:`Figure`: pslink's value and the anchor's value
(the thing a user would compare with: C++ ps-lite, gloo, Horovod, raw TCP, the same job with no
disturbance), each measured in the same run, alternating, one pair per round. A figure whose anchor
was not run carries no ratio, only the reason (``missing``). Benchmarks print each figure as one
line ``PSLINK_FIGURE {json}``; ``benchmarks/report.py`` collects them into the results table.

No anchor figure is typed into code: :func:`measured` takes both sides' per-round values and
refuses a missing or non-positive anchor, so a ratio can only exist beside the anchor's own figure.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field

MARK = "PSLINK_FIGURE "
BETTER = ("higher", "lower")


@dataclass(frozen=True)
class Figure:
    benchmark: str  # the script's name: "pushpull", "torch_ddp", ...
    what: str  # what was measured, in words: "pushpull 4 MiB, 1 worker, 4 in flight"
    unit: str  # "MB/s", "ms/step", "us", ...
    better: str  # "higher" or "lower": which way pslink's value is better
    values: list[float]  # pslink's value, one per round
    anchor: str | None = None  # what it is measured against: "C++ ps-lite (tcp)", "DDP over gloo"
    anchor_values: list[float] = field(default_factory=list)  # the anchor, one per round (same rounds)
    missing: str = ""  # when there is no anchor: which anchor was not run, and why

    @property
    def value(self) -> float:
        return statistics.median(self.values)

    @property
    def anchor_value(self) -> float | None:
        return statistics.median(self.anchor_values) if self.anchor_values else None

    @property
    def ratio(self) -> float | None:
        """pslink's median over the anchor's median (read with ``better``), or None without an anchor."""
        anchor = self.anchor_value
        return self.value / anchor if anchor else None

    @property
    def spread(self) -> tuple[float, float] | None:
        """The lowest and highest of the rounds' own ratios (round i's value over round i's anchor)."""
        if not self.anchor_values:
            return None
        ratios = [v / a for v, a in zip(self.values, self.anchor_values)]
        return min(ratios), max(ratios)

    def as_json(self) -> dict:
        out = asdict(self)
        out.update(value=self.value, anchor_value=self.anchor_value, ratio=self.ratio, spread=self.spread)
        return out

    def line(self) -> str:
        """The figure in words: value, anchor's value, ratio and spread, or the anchor not run."""
        text = f"{self.what}: {fmt(self.value)} {self.unit}"
        if self.ratio is None:
            return f"{text} (no ratio: {self.missing})"
        low, high = self.spread
        return (f"{text} vs {self.anchor} {fmt(self.anchor_value)} {self.unit}: {self.ratio:.2f}x "
                f"({low:.2f}-{high:.2f} over {len(self.values)} rounds; {self.better} is better)")


def fmt(x: float) -> str:
    """A figure as people read it: three significant digits, whole numbers from 100 up."""
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _checked(name: str, xs) -> list[float]:
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError(f"{name}: no rounds measured")
    for x in xs:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"{name}: {x!r} is not a measured figure")
    return xs


def measured(benchmark: str, what: str, unit: str, better: str, values, anchor: str, anchor_values) -> Figure:
    """A figure and its anchor, each measured once per round in this run (rounds paired in order)."""
    if better not in BETTER:
        raise ValueError(f"better must be one of {BETTER}, not {better!r}")
    values = _checked(f"{benchmark} {what}", values)
    anchor_values = _checked(f"{benchmark} {what}: anchor {anchor}", anchor_values)
    if len(values) != len(anchor_values):
        raise ValueError(f"{benchmark} {what}: {len(values)} rounds of pslink but {len(anchor_values)} of {anchor}")
    if not all(anchor_values):
        raise ValueError(f"{benchmark} {what}: anchor {anchor} measured 0 in a round; no ratio can be taken")
    return Figure(benchmark, what, unit, better, values, anchor, anchor_values)


def unanchored(benchmark: str, what: str, unit: str, better: str, values, missing: str) -> Figure:
    """A figure printed without a ratio: ``missing`` says which anchor was not run and why."""
    if better not in BETTER:
        raise ValueError(f"better must be one of {BETTER}, not {better!r}")
    if not missing:
        raise ValueError(f"{benchmark} {what}: say which anchor was not run")
    return Figure(benchmark, what, unit, better, _checked(f"{benchmark} {what}", values), missing=missing)


def emit(figure: Figure, *, words: bool = True) -> None:
    """Print the figure: in words (unless ``words`` is False: the caller prints its own table) and
    as the machine-readable line the report collects."""
    if words:
        print(figure.line(), flush=True)
    print(MARK + json.dumps(figure.as_json()), flush=True)


def parse(text: str) -> list[Figure]:
    """Every figure printed in ``text`` (a benchmark's output), in order."""
    figures = []
    for line in text.splitlines():
        at = line.find(MARK)
        if at < 0:
            continue
        data = json.loads(line[at + len(MARK):])
        figures.append(Figure(data["benchmark"], data["what"], data["unit"], data["better"], data["values"],
                              data.get("anchor"), data.get("anchor_values") or [], data.get("missing") or ""))
    return figures

"""The PNG figures (needs matplotlib, which the sim extra and CI install)."""

from __future__ import annotations

import pytest

from pslink.sim import experiment
from pslink.sim.costmodel import load_cost_model
from pslink.sim.trace import TraceJob

pytest.importorskip("matplotlib", reason="plots need matplotlib: pip install 'pslink[sim]'")
# matplotlib 3.9 calls a pyparsing name that pyparsing 3.3 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*enablePackrat")

from pslink.sim.plots import plot_all  # noqa: E402


def test_the_three_figures_are_written_and_small(tmp_path):
    rows = [TraceJob(i, f"j{i}", 900.0 * i, 2 + 2 * (i % 4), 7200.0) for i in range(16)]
    outcome = experiment.run(rows, load_cost_model())
    paths = plot_all(outcome.pslink, outcome.static, outcome.summary, tmp_path, "16 jobs")
    assert sorted(p.name for p in paths) == ["cpu_over_time.png", "ratio_cdf.png", "slowdown_cdf.png"]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 200_000

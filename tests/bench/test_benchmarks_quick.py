"""Every benchmark's quick form, as the report runs it: each ratio it prints stands beside the
anchor's own figure, measured in the same run; and no anchor figure is typed into the code.

One run of ``benchmarks/report.py`` (all quick forms, one after another: several minutes) serves
every test here; each benchmark is then judged from its own log.
"""

from __future__ import annotations

import ast
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pslink.bench import figures, report

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    done = subprocess.run([sys.executable, "benchmarks/report.py", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1700, stdin=subprocess.DEVNULL)
    return out, done


@pytest.mark.parametrize("entry", report.ENTRIES, ids=lambda e: e.name)
def test_each_ratio_comes_with_its_anchors_own_figure(run, entry):
    out, done = run
    log = out / "logs" / f"{entry.name}.log"
    if not log.exists():
        reason = report.missing_requirement(entry)
        assert reason, f"{entry.name} did not run and nothing it needs is missing:\n{done.stdout}\n{done.stderr}"
        pytest.skip(f"{entry.name} cannot run here: {reason}")
    text = log.read_text(errors="replace")
    assert "Traceback (most recent call last)" not in text, text[-4000:]
    found = figures.parse(text)
    assert found, f"{entry.name} printed no figure:\n{text[-4000:]}"
    for f in found:
        assert f.benchmark == (entry.script or entry.name), f
        assert f.values and all(v >= 0 for v in f.values), f
        if f.ratio is None:
            assert not f.anchor_values and f.missing, f  # no ratio: it says which anchor was not run
            continue
        # A ratio: the anchor was measured in as many rounds as pslink, and the ratio is theirs.
        assert f.anchor and len(f.anchor_values) == len(f.values) and all(a > 0 for a in f.anchor_values), f
        assert f.ratio == pytest.approx(statistics.median(f.values) / statistics.median(f.anchor_values)), f
    table = (out / "report.md").read_text()
    for f in found:  # and the report's table shows each of them
        assert f"| {f.what} |" in table, f.what


def test_the_report_writes_its_table_and_picture(run):
    out, done = run
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    table = (out / "report.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    anchored = [f for f in figures.parse("\n".join(p.read_text() for p in (out / "logs").glob("*.log")))
                if f.ratio is not None]
    assert len(rows) >= len(anchored) > 0
    pytest.importorskip("matplotlib")
    assert (out / "report.png").stat().st_size > 10_000


FIGURE_WORDS = ("ANCHOR", "BASELINE", "PAPER", "REPORTED")


def _typed_figures(path: Path) -> list[str]:
    """Typed-in figures in a benchmark's source: module-level numbers named as another system's or
    a paper's (ANCHOR_*, BASELINE*, PAPER*, REPORTED*), and any ratio taken with a module-level
    number named as a figure to reach (those, or TARGET*, REQUIRED*, GOAL*). An issue's requirement
    may stay as a printed check (``<=``), never as one side of a ratio."""
    tree = ast.parse(path.read_text())
    constants = set()
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        numbers = [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, (int, float))
                   and not isinstance(n.value, bool)]
        for target in targets:
            name = getattr(target, "id", "")
            if numbers and any(word in name.upper() for word in FIGURE_WORDS + ("TARGET", "REQUIRE", "GOAL")):
                constants.add(name)
            if numbers and any(word in name.upper() for word in FIGURE_WORDS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if names & constants:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} a ratio with {', '.join(sorted(names & constants))}")
    return found


def test_no_anchor_figure_is_typed_into_a_benchmark():
    sources = sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "pslink" / "bench").glob("*.py"))
    assert len(sources) > 20
    assert [hit for path in sources for hit in _typed_figures(path)] == []

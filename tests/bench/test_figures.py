"""The figures benchmarks report, and the results table made from them (pure: no benchmark runs)."""

from __future__ import annotations

import json

import pytest

from pslink.bench import figures, report
from pslink.bench.figures import Figure


def test_a_ratio_is_pslinks_median_over_the_anchors_with_the_rounds_spread():
    f = figures.measured("pushpull", "4 MiB", "MB/s", "higher", [300, 100, 200], "raw TCP", [100, 100, 400])
    assert f.value == 200 and f.anchor_value == 100
    assert f.ratio == pytest.approx(2.0)
    assert f.spread == pytest.approx((0.5, 3.0))  # round by round: 3.0, 1.0, 0.5
    assert "vs raw TCP 100 MB/s: 2.00x (0.50-3.00 over 3 rounds; higher is better)" in f.line()


@pytest.mark.parametrize("anchor_values, error", [
    ([], "no rounds measured"),
    ([1.0], "2 rounds of pslink but 1 of gloo"),
    ([1.0, 0.0], "measured 0 in a round"),
    ([1.0, float("nan")], "is not a measured figure"),
])
def test_a_ratio_needs_the_anchor_measured_in_every_round(anchor_values, error):
    with pytest.raises(ValueError, match=error):
        figures.measured("torch_ddp", "step", "ms", "lower", [1.0, 2.0], "gloo", anchor_values)


def test_a_figure_without_its_anchor_has_no_ratio_and_says_which_anchor_was_not_run():
    f = figures.unanchored("pslite_bench", "zpush 4K", "MB/s", "higher", [80.0], "C++ ps-lite not run: give --pslite")
    assert f.ratio is None and f.spread is None and f.anchor_value is None
    assert f.line().endswith("(no ratio: C++ ps-lite not run: give --pslite)")
    with pytest.raises(ValueError, match="say which anchor was not run"):
        figures.unanchored("pslite_bench", "zpush 4K", "MB/s", "higher", [80.0], "")
    with pytest.raises(ValueError, match="better must be one of"):
        figures.unanchored("pslite_bench", "zpush 4K", "MB/s", "faster", [80.0], "not run")


def test_printed_figures_parse_back_from_a_benchmarks_output(capsys):
    a = figures.measured("tls", "4 KiB latency", "us", "lower", [50, 60], "plain TCP", [40, 45])
    b = figures.unanchored("sparse", "rows/s", "rows/s", "higher", [1e6], "C++ ps-lite not run")
    print("some table the benchmark prints")
    figures.emit(a)
    figures.emit(b, words=False)
    out = capsys.readouterr().out
    assert figures.parse(out) == [a, b]
    line = next(x for x in out.splitlines() if x.startswith(figures.MARK))
    data = json.loads(line[len(figures.MARK):])
    assert data["anchor_value"] == 42.5 and data["ratio"] == pytest.approx(55 / 42.5)


def test_the_table_shows_every_figure_its_anchor_and_what_was_not_run(tmp_path):
    fast = figures.measured("torch_ddp", "DDP step, hook", "ms", "lower", [100, 110], "DDP over gloo", [200, 200])
    alone = figures.unanchored("pslite_bench", "zpull 4K", "MB/s", "higher", [90.0], "C++ ps-lite not run")
    ran = report.Outcome(report.Entry("torch_ddp"), ["python", "benchmarks/torch_ddp.py", "--quick"],
                         figures=[fast, alone])
    missing = report.Outcome(report.Entry("compression", modules=("mxnet",)), ["python", "benchmarks/compression.py"],
                             skipped="mxnet is not installed")
    text = report.markdown([ran, missing], "2026-11-29", "here")
    rows = [line for line in text.splitlines() if line.startswith("| DDP") or line.startswith("| zpull")]
    assert len(rows) == 2
    assert "DDP over gloo: 200 ms" in rows[0] and "**0.53**" in rows[0] and "0.50-0.55 (2)" in rows[0]
    assert "no ratio" in rows[1] and "| C++ ps-lite not run |" in rows[1]
    assert "`python benchmarks/compression.py`: mxnet is not installed" in text
    assert report.advantage(fast) == pytest.approx(1 / fast.ratio)


def test_the_table_renders_from_saved_outputs(tmp_path, capsys):
    f = figures.measured("roundtrip", "4 KiB round trip", "us", "lower", [30, 32], "pyzmq", [60, 66])
    log = tmp_path / "roundtrip.log"
    log.write_text("$ python benchmarks/roundtrip.py\nwhatever it printed\n" + figures.MARK + json.dumps(f.as_json()))
    assert report.main(["--from", str(log), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "`python benchmarks/roundtrip.py`" in text and "pyzmq: 63 us" in text
    assert json.loads((tmp_path / "out" / "figures.json").read_text())[0]["anchor_values"] == [60, 66]
    capsys.readouterr()


def test_figure_fields_survive_json(tmp_path):
    f = figures.measured("x", "y", "s", "lower", [1, 2], "z", [2, 2])
    assert Figure(**{k: v for k, v in f.as_json().items() if k in Figure.__dataclass_fields__}) == f

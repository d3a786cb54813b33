"""Reading traces and windows: good rows become jobs, bad ones an error that says where."""

from __future__ import annotations

import gzip

import pytest

from pslink.sim.trace import TraceError, load_trace, parse_trace, parse_when, philly_path, select

GOOD = """jobid,submit_time,num_gpus,duration_s,vc
b,2017-10-01 00:10:00,2,600,x
a,2017-10-01 00:00:00,8,3600,x
c,2017-10-02 00:00:00,1,60,y
"""


def test_rows_become_jobs_sorted_by_submission_in_seconds_since_the_first():
    trace = parse_trace(GOOD.splitlines(), "test")
    assert [(j.job, j.submit, j.gpus, j.duration, j.index) for j in trace.jobs] == [
        ("a", 0.0, 8, 3600.0, 1), ("b", 600.0, 2, 600.0, 0), ("c", 86400.0, 1, 60.0, 2)]
    assert trace.when(600) == "2017-10-01 00:10:00"


def test_submit_times_may_be_seconds():
    trace = parse_trace(["jobid,submit_time,num_gpus,duration_s", "x,100,2,10", "y,40,4,10"], "s")
    assert [(j.job, j.submit) for j in trace.jobs] == [("y", 0.0), ("x", 60.0)] and trace.epoch is None


@pytest.mark.parametrize("lines, message", [
    ([], "is empty"),
    (["jobid,submit_time,duration_s"], "missing column(s) num_gpus"),
    (["jobid,submit_time,num_gpus,duration_s"], "has a header but no jobs"),
    (["jobid,submit_time,num_gpus,duration_s", "a,2017-10-01 00:00:00,two,5"], "line 2: num_gpus 'two'"),
    (["jobid,submit_time,num_gpus,duration_s", "a,2017-10-01 00:00:00,2,-5"], "line 2: duration_s '-5'"),
    (["jobid,submit_time,num_gpus,duration_s", "a,yesterday,2,5"], "line 2: submit_time 'yesterday'"),
    (["jobid,submit_time,num_gpus,duration_s", "a,2017-10-01 00:00:00,2,5", "b,30,2,5"], "line 3: submit_time '30' mixes"),
    (["jobid,submit_time,num_gpus,duration_s", "a,2017-10-01 00:00:00,2"], "line 2: 3 fields"),
])
def test_malformed_traces_name_the_line_and_the_value(lines, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_trace(lines, "bad.csv")


def test_files_are_read_gzipped_or_not_and_missing_ones_are_named(tmp_path):
    plain = tmp_path / "t.csv"
    plain.write_text(GOOD)
    packed = tmp_path / "t.csv.gz"
    packed.write_bytes(gzip.compress(GOOD.encode()))
    assert load_trace(str(plain)).jobs == load_trace(str(packed)).jobs
    with pytest.raises(TraceError, match="trace file '.*nope.csv' not found"):
        load_trace(str(tmp_path / "nope.csv"))
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(str(tmp_path))
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(str(tmp_path / "bin.csv"))


def test_the_packaged_philly_trace_and_its_attribution_ship_with_the_package():
    trace = load_trace("philly")
    assert len(trace.jobs) == 82247 and sum(j.gpus > 1 for j in trace.jobs) == 5620
    assert trace.when(0) == "2017-09-04 10:30:41"
    readme = (philly_path().parent / "README.md").read_text()
    assert "Jeon et al." in readme and "CC-BY-4.0" in readme


def test_windows_take_dates_or_offsets_and_reject_the_rest():
    trace = parse_trace(GOOD.splitlines(), "test")
    assert parse_when("90m", trace, "--start") == 5400
    assert parse_when("1.5d", trace, "--start") == 129600
    assert parse_when("2017-10-01 00:05:00", trace, "--end") == 300
    assert [j.job for j in select(trace, 300, 86400)] == ["b"]
    with pytest.raises(TraceError, match="--start 'soon' is not a date-time"):
        parse_when("soon", trace, "--start")
    with pytest.raises(TraceError, match="ends .* before it starts"):
        select(trace, 600, 300)
    with pytest.raises(TraceError, match="no job of trace test was submitted between 2017-10-03"):
        select(trace, 2 * 86400, None)

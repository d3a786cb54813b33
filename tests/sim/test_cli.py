"""``pslink simulate`` end to end on a small window, and its answers to bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from pslink.cli import app

WINDOW = ["--trace", "philly", "--start", "2017-10-02", "--end", "2017-10-03", "--jobs", "12"]


def run_cli(args, out, hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), COLUMNS="120")
    proc = subprocess.run([sys.executable, "-m", "pslink.cli", "simulate", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((out / "summary.json").read_text())


def test_a_small_window_runs_writes_its_files_and_repeats_exactly(tmp_path):
    proc, first = run_cli(WINDOW + ["--no-plots"], tmp_path / "a", hash_seed=1)
    assert "aggregation CPU time saved" in proc.stdout and "12/12" in proc.stderr  # the table, the progress bar
    results = first["results"]
    assert results["jobs"] == 12 and 0 < results["cpu_time_saved"] < 1
    assert results["cpu_hours"]["pslink"] < results["cpu_hours"]["static"]
    assert first["trace"]["first_submit"].startswith("2017-10-02") and "Jeon et al." in first["attribution"]
    lines = (tmp_path / "a" / "jobs.csv").read_text().splitlines()
    assert lines[0].startswith("job,model,workers") and len(lines) == 13
    # another process, another hash order of names: the same figures
    _, again = run_cli(WINDOW + ["--no-plots"], tmp_path / "b", hash_seed=2)
    assert again["results"] == results


@pytest.mark.parametrize("args, message", [
    (["--trace", "/no/such/trace.csv"], "trace file '/no/such/trace.csv' not found"),
    (["--start", "next tuesday"], "--start 'next tuesday' is not a date-time"),
    (["--start", "2017-10-03", "--end", "2017-10-02"], "before it starts"),
    (["--start", "2018-01-01"], "no job of trace philly was submitted between 2018-01-01"),
    (["--mix", "alexnet=1,gpt=2"], "unknown model 'gpt'"),
    (["--single-gpu", "never"], "single_gpu must be one of skip, ps"),
])
def test_bad_input_is_one_clear_line_and_no_traceback(tmp_path, args, message):
    result = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_a_malformed_trace_names_its_line(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("jobid,submit_time,num_gpus,duration_s\na,2017-10-01 00:00:00,4,100\nb,2017-10-01 00:01:00,4,x\n")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "line 3: duration_s 'x'" in " ".join(result.output.split())


def test_single_gpu_jobs_alone_are_refused_unless_they_get_servers(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("jobid,submit_time,num_gpus,duration_s\na,0,1,100\nb,50,1,100\n")
    refused = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--out", str(tmp_path / "o")])
    assert refused.exit_code == 1 and "--single-gpu ps" in refused.output
    served = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--single-gpu", "ps", "--no-plots",
                                      "--out", str(tmp_path / "o")])
    assert served.exit_code == 0, served.output
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["results"]["jobs"] == 2


def test_importing_the_cli_and_the_simulator_does_not_import_matplotlib():
    code = ("import sys, pslink.cli, pslink.sim.engine, pslink.sim.experiment; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr

"""``pslink launch --pslite`` with real processes: the ports of ps-lite's tests in
examples/pslite/ run as a scheduler, servers and workers, in both server modes.

Every run has a deadline, and the launcher reaps every process it started, also on failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "pslite")
CLI = [sys.executable, "-m", "pslink.cli", "launch"]


def launch(args, timeout=100):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLINK_"))}
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env)


def example(name, *args):
    return [sys.executable, os.path.join(EXAMPLES, name), *args]


def lines_of(done, prefix):
    return [line[len(prefix):] for line in done.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("mode,servers", [("classic", 2), ("service", 1)])
def test_simple_app_port_every_node_handles_every_request(mode, servers):
    done = launch(["--pslite", "-s", str(servers), "-n", "2", "--server-mode", mode] + example("simple_app.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    names = ["scheduler", "worker0", "worker1"] + (["server0", "server1"] if mode == "classic" else [])
    for name in names:
        assert lines_of(done, f"[{name}]: ") == ["handled 100 requests"], done.stdout
    assert "[server" not in done.stdout or mode == "classic"


@pytest.mark.parametrize("servers,workers,extra", [(1, 1, []), (2, 2, []), (2, 2, ["--variable", "--num-keys", "40"])])
def test_kv_app_port_classic_mode(servers, workers, extra):
    done = launch(["--pslite", "-s", str(servers), "-n", str(workers)] + example("kv_app.py", "--repeat", "50", *extra))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(workers):
        (line,) = lines_of(done, f"[worker{rank}]: ")
        assert line.startswith(f"worker {rank}:") and line.endswith("error 0.0"), done.stdout


def test_kv_app_port_service_mode_has_no_server_processes():
    done = launch(["--pslite", "-s", "2", "-n", "2", "--server-mode", "service"]
                  + example("kv_app.py", "--repeat", "20", "--variable", "--num-keys", "30"))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert lines_of(done, f"[worker{rank}]: ")[0].endswith("error 0.0"), done.stdout
    assert "[server" not in done.stdout


@pytest.mark.parametrize("mode", ["classic", "service"])
def test_multi_workers_port_two_customers_per_worker(mode):
    keys = "2000" if mode == "classic" else "300"
    done = launch(["--pslite", "-s", "1", "-n", "2", "--server-mode", mode]
                  + example("kv_app_multi_workers.py", "--num-keys", keys, "--repeat", "20"))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        lines = lines_of(done, f"[worker{rank}]: ")
        assert sorted(lines) == [f"worker {rank} customer {c}: error 0.0" for c in (0, 1)], done.stdout


FAILING = textwrap.dedent("""
    import sys, time
    from pslink import pslite as ps
    ps.start()
    if ps.is_worker() and ps.my_rank() == 1:
        print("worker 1 fails now", flush=True)
        sys.exit(3)
    ps.finalize()
""")


def test_a_failing_worker_stops_the_deployment_and_its_status_is_returned(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    started = time.monotonic()
    done = launch(["--pslite", "-s", "1", "-n", "2", sys.executable, str(script)])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "[worker1]: worker 1 fails now" in done.stdout
    assert "pslink launch: worker 1 exited with status 3; stopping the other processes" in done.stdout
    assert time.monotonic() - started < 60


HANGING = textwrap.dedent("""
    import time
    from pslink import pslite as ps
    ps.start()
    print("ready", flush=True)
    time.sleep(600)
""")


def test_ctrl_c_stops_the_scheduler_servers_and_workers(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING)
    proc = subprocess.Popen(CLI + ["--pslite", "-s", "1", "-n", "2", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen, deadline = 0, time.monotonic() + 60
        while seen < 4:  # scheduler, server and both workers are up
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "the deployment did not start"
            seen += "ready" in line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_program_run_without_the_launcher_names_the_missing_variables():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "PSLINK_"))}
    env["DMLC_ROLE"] = "server"
    done = subprocess.run(example("kv_app.py"), capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0
    assert ("DMLC_ROLE=server cannot start: DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, "
            "DMLC_NUM_SERVER are not set") in done.stderr


def test_ps_lite_options_without_pslite_are_refused():
    done = launch(["-n", "1", "-s", "2", sys.executable, "-c", "pass"])
    assert done.returncode != 0
    assert "-s and --server-mode describe a ps-lite deployment: add --pslite" in done.stderr + done.stdout
    done = launch(["--pslite", "-n", "1", "--server-mode", "fast", sys.executable, "-c", "pass"])
    assert done.returncode != 0 and "--server-mode must be classic or service" in done.stderr + done.stdout


def test_the_benchmark_runs_in_both_modes_and_ends_with_one_json_line():
    """A smoke run of benchmarks/pslite_bench.py without C++ ps-lite: every case measured, and no
    ratio printed, each figure saying which anchor was not run."""
    import json

    bench = os.path.join(ROOT, "benchmarks", "pslite_bench.py")
    done = subprocess.run([sys.executable, bench, "--sizes", "4K", "--seconds", "0.05", "--rounds", "1",
                           "--variants", "classic,service"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cases = {(c["mode"], c["op"]) for c in report["cases"]}
    assert cases == {(m, op) for m in ("classic", "service") for op in ("zpush", "zpull", "zpushpull")}
    assert all(c["MBps"] > 0 for c in report["cases"])
    assert len(report["figures"]) == 6
    assert all(f["ratio"] is None and "--pslite" in f["missing"] for f in report["figures"])

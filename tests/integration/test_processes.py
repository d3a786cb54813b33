"""Real processes and sockets on 127.0.0.1: the CLI, the example workers, killed and hung peers.

Every wait has a deadline and every process started here is reaped, also when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import pslink
from pslink.core.service.client import ControlClient
from pslink.core.service import Service
from pslink.errors import PeerError, PslinkError

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "numpy", "train_digits.py")
CLI = [sys.executable, "-m", "pslink.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except PslinkError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def status_of(master: str) -> dict:
    with ControlClient(master, timeout=2.0) as client:
        return client.status()


@pytest.fixture
def service_up(tmp_path):
    """``pslink service up`` in a subprocess; yields its address and the process."""
    port = free_port()
    master = f"tcp://127.0.0.1:{port}"
    log = open(tmp_path / "service.log", "wb")
    # INFO: pMaster logs each Aggregator it starts or releases, and why (for a failing test).
    proc = subprocess.Popen(CLI + ["service", "up", "--port", str(port), "--aggregators", "2",
                                   "--state", str(tmp_path / "state"), "--log-level", "INFO"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: len([a for a in status_of(master)["aggregators"] if a["alive"]]) == 2, 60,
                   "the service's two Aggregators")
        yield master, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def test_service_up_and_two_example_workers_train_together(service_up, tmp_path):
    master, proc = service_up
    aggregator_pids = [a["pid"] for a in status_of(master)["aggregators"]]
    workers = [
        subprocess.Popen([sys.executable, EXAMPLE, "--job", "digits", "--rank", str(rank), "--num-workers", "2",
                          "--master", master, "--epochs", "4", "--no-progress",
                          "--result", str(tmp_path / f"r{rank}.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for rank in range(2)
    ]
    outputs = []
    try:
        for w in workers:
            out, _ = w.communicate(timeout=120)
            outputs.append(out.decode())
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert [w.returncode for w in workers] == [0, 0], outputs
    results = [json.load(open(tmp_path / f"r{rank}.json")) for rank in range(2)]
    assert all(r["accuracy"] > 0.85 for r in results), results  # chance is 0.10
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-6)
    assert "test accuracy" in outputs[0]

    shown = subprocess.run(CLI + ["service", "status", "-m", master], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "agg-0" in shown.stdout and "agg-1" in shown.stdout

    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(30) == 0
    for pid in aggregator_pids:  # every process it started is gone
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_service_up_serves_metrics_and_service_stop_stops_it_cleanly(service_up, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    import urllib.request

    master, proc = service_up
    aggregator_pids = [a["pid"] for a in status_of(master)["aggregators"]]
    http = status_of(master)["master"]["http"]  # metrics are on by default in `service up`
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", http)
    wait_until(lambda: http in (tmp_path / "service.log").read_text(), 10, "the page's address to be printed")
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as answer:
        families = {f.name for f in text_string_to_metric_families(answer.read().decode())}
    assert {"pslink_aggregators", "pslink_aggregator_tasks", "pslink_migrations"} <= families

    stopped = subprocess.run(CLI + ["service", "stop", "-m", master], capture_output=True, text=True, timeout=30)
    assert stopped.returncode == 0 and "stopping" in stopped.stdout, stopped.stdout + stopped.stderr
    assert proc.wait(30) == 0
    for pid in aggregator_pids:  # every process it started is gone
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    again = subprocess.run(CLI + ["service", "stop", "-m", master], capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "error" in again.stderr  # nothing runs there now: said, not a traceback
    assert "Traceback" not in again.stderr


def test_garbage_to_an_aggregator_process_is_counted_and_others_are_served(service_up):
    master, _ = service_up
    with pslink.connect("g", 0, 1, master=master, timeout=20) as agent:
        agent.init("w", np.zeros(16)).wait()
        name, address = agent.key_info("w")["parts"][0][3:5]
        host, port = address[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as bad:
            bad.sendall(os.urandom(4096))
            bad.settimeout(5)
            try:
                assert bad.recv(100) == b""  # dropped
            except ConnectionResetError:
                pass
        for _ in range(10):
            np.testing.assert_array_equal(agent.pushpull("w", np.ones(16)).wait(), np.ones(16))

        def counted():
            return [a for a in status_of(master)["aggregators"] if a["name"] == name and a["errors"] >= 1]

        wait_until(counted, 20, "the Aggregator to report the bad peer")


def test_cli_job_create_and_token_checks(service_up):
    master, _ = service_up
    made = subprocess.run(CLI + ["job", "create", "tok-job", "--workers", "1", "-m", master],
                          capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    token = re.search(r"PSLINK_TOKEN=([0-9a-f]+)", made.stdout).group(1)
    with pytest.raises(pslink.AuthError, match="needs its token"):
        pslink.connect("tok-job", 0, 1, master=master)
    with pslink.connect("tok-job", 0, 1, master=master, token=token) as agent:
        agent.pushpull("k", np.ones(3)).wait()
    bad = subprocess.run(CLI + ["service", "status", "-m", "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "cannot connect to tcp://127.0.0.1:1" in bad.stderr


@pytest.fixture
def local_service(tmp_path):
    service = Service(aggregators=1, log_dir=str(tmp_path / "logs")).start()
    yield service
    service.stop()


def test_a_killed_aggregator_process_fails_requests_with_its_name(local_service):
    # Without failover (an Agent's opt-out), the lost connection is the error, naming the peer.
    with pslink.connect("killed", 0, 2, master=local_service.address, timeout=20, failover=False) as agent:
        agent.init("w", np.zeros(4)).wait()
        name, address = agent.key_info("w")["parts"][0][3:5]
        handle = agent.pushpull("w", np.ones(4))  # waits for rank 1, who never comes
        os.kill(local_service.provider.pid(name), signal.SIGKILL)
        with pytest.raises(PeerError, match=rf"lost connection to aggregator {name} at {address}"):
            handle.wait(timeout=10)


def test_a_hung_aggregator_process_is_detected(local_service):
    # Without failover (an Agent's opt-out) the silence is the error, naming the Aggregator.
    with pslink.connect("hung", 0, 1, master=local_service.address, timeout=20, peer_timeout=1.0,
                        probe_interval=0.1, failover=False) as agent:
        agent.init("w", np.zeros(4)).wait()
        name = agent.key_info("w")["parts"][0][3]
        pid = local_service.provider.pid(name)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(PeerError, match=rf"aggregator {name} at tcp://127\.0\.0\.1:\d+ did not answer"):
                agent.pushpull("w", np.ones(4)).wait(timeout=10)
        finally:
            os.kill(pid, signal.SIGCONT)


def test_a_hung_aggregator_process_is_failed_over_once_its_lease_ran_out(tmp_path):
    """Gap (issue 23): an Agent whose Aggregator hung (SIGSTOP: its sockets stay open) failed its
    requests, or waited up to 15.5 s for pMaster, which still saw the Aggregator connected. Now it
    asks pMaster, which fails the silent Aggregator over once its lease ran out; when it wakes
    it has been told nothing, refuses (its lease ran out) and, registered again, drops the part."""
    service = Service(aggregators=2, log_dir=str(tmp_path / "logs")).start()
    try:
        with pslink.connect("hung-over", 0, 1, master=service.address, timeout=30, peer_timeout=1.0,
                            probe_interval=0.1) as agent:
            agent.init("w", np.zeros(4)).wait()
            name = agent.key_info("w")["parts"][0][3]
            pid = service.provider.pid(name)
            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                np.testing.assert_array_equal(agent.pushpull("w", np.ones(4)).wait(timeout=25), np.ones(4))
                took = time.monotonic() - started
                assert agent.key_info("w")["parts"][0][3] != name
                assert service.master.failover.by_lease == 1
                assert took < 15.0  # well before aggregator_timeout: peer_timeout + the lease + a second
            finally:
                os.kill(pid, signal.SIGCONT)
            np.testing.assert_array_equal(agent.pushpull("w", np.full(4, 2.0)).wait(timeout=10), np.full(4, 2.0))
    finally:
        service.stop()


def test_pslink_demo_trains_and_reports_accuracy():
    done = subprocess.run(CLI + ["demo", "--epochs", "4"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)%", done.stdout).group(1))
    assert accuracy > 85.0
    assert "workers hold identical weights: yes" in done.stdout


def test_the_benchmark_runs_and_ends_with_json():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pushpull.py"), "--sizes", "4K",
                           "--workers", "1", "--inflight", "1", "--ops", "pushpull", "--seconds", "0.1"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    (case,) = figures["cases"]
    assert case["op"] == "pushpull" and case["MBps"] > 0 and figures["raw_tcp_stream_MBps"] > 0

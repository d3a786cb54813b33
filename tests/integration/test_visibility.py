"""Seeing the service: ``/metrics`` against ``status``, the stall inspector naming the rank a
round waits for, and the live page in a real headless browser (Debian's chromium)."""

from __future__ import annotations

import html.parser
import json
import logging
import os
import shutil
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pslink
from pslink.core.service import Service
from pslink.core.service.client import ControlClient
from pslink.core.transport import Transports
from pslink.errors import PslinkTimeoutError
from tests.helpers import run_workers, start_cluster

pytestmark = pytest.mark.integration

ROUNDS = 12
SIZE = 1000  # float32 elements per key


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def scrape(http: str) -> dict:
    """{(metric sample name, frozenset(labels)): value} of one scrape, parsed by prometheus_client."""
    samples = {}
    for family in text_string_to_metric_families(fetch(f"{http}/metrics").decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def train(master: str, jobs: dict, release: threading.Event, scraped: list, http: str):
    """Two jobs of two workers each: ROUNDS push-pulls of two keys; rank 0 of job a scrapes
    /metrics half way. Returns the open Agents (the jobs stay registered)."""

    def worker(index):
        job, rank = sorted(jobs)[index // 2], index % 2
        agent = pslink.connect(job, rank, 2, master=master, heartbeat_interval=0.2)
        grads = {key: np.full(SIZE, rank + 1, np.float32) for key in ("w", "b")}
        for key, value in grads.items():
            agent.init(key, value).wait()
        for step in range(ROUNDS):
            for key in grads:
                agent.pushpull(key, grads[key], out=np.empty(SIZE, np.float32)).wait()
            if step == ROUNDS // 2 and index == 0:
                scraped.append(scrape(http))
        return agent

    return run_workers(4, worker)


def test_metrics_parse_and_match_the_status_of_a_two_job_run():
    service = start_cluster("tcp", 2, metrics_port=0)
    http = service.master.observing.http_address
    agents = []
    try:
        scraped: list = []
        agents = train(service.address, {"alpha": 0, "beta": 1}, threading.Event(), scraped, http)
        assert scraped and any(name == "pslink_job_rounds_total" for name, _ in scraped[0])  # parsed mid-run

        pushed = ROUNDS * 2 * 2 * SIZE * 4  # rounds x workers x keys x bytes

        def settled():
            with ControlClient(service.address) as client:
                status = client.status()
            jobs = {j["job"]: j for j in status["jobs"]}
            done = all(jobs[j]["pushed_bytes"] == pushed and jobs[j]["iteration_seconds"]["count"] > 0
                       for j in ("alpha", "beta"))
            return status if done else None

        status = wait_until(settled, 15, "the Aggregators' heartbeats to report every push")
        metrics = scrape(http)
        for job in status["jobs"]:
            label = frozenset({("job", job["job"])})
            assert metrics[("pslink_job_rounds_total", label)] == job["round"] == ROUNDS
            assert metrics[("pslink_job_pushed_bytes_total", label)] == job["pushed_bytes"] == pushed
            assert metrics[("pslink_job_pulled_bytes_total", label)] == job["pulled_bytes"] >= pushed
            assert metrics[("pslink_job_workers", label)] == job["workers"] == 2
            assert metrics[("pslink_job_keys", label)] == job["keys"] == 2
            assert metrics[("pslink_job_stalls_total", label)] == job["stalls"] == 0
            for name in ("parts_short_of_replicas", "parts_on_lost_aggregators"):  # (no replication asked)
                assert metrics[(f"pslink_job_{name}", label)] == job[name] == 0
            count = job["iteration_seconds"]["count"]
            assert metrics[("pslink_job_iteration_seconds_count", label)] == count
            assert metrics[("pslink_job_iteration_seconds_bucket", label | {("le", "+Inf")})] == count
        for agg in status["aggregators"]:
            label = frozenset({("aggregator", agg["name"])})
            assert metrics[("pslink_aggregator_tasks", label)] == agg["tasks"]
            assert metrics[("pslink_aggregator_held_bytes", label)] == agg["bytes"]
            assert metrics[("pslink_aggregator_bad_messages_total", label)] == agg["errors"]
            assert metrics[("pslink_aggregator_replicas", label)] == agg["replicas"] == 0
            assert metrics[("pslink_aggregator_replicas_without_state", label)] == agg["replicas_without_state"] == 0
        assert sum(a["tasks"] for a in status["aggregators"]) == 4
        counters = status["counters"]
        # The service started two Aggregators; the pool the others (each job is profiled alone).
        assert counters["allocations"] == len(status["aggregators"]) - 2 and counters["releases"] == 0
        for name in ("migrations", "failovers", "reverts", "allocations", "releases"):
            assert metrics[(f"pslink_{name}_total", frozenset())] == counters[name]
        # Labels are job and aggregator (and a histogram's le) only: never keys.
        assert {k for _, labels in metrics for k, _ in labels} <= {"job", "aggregator", "le"}
        assert json.loads(fetch(f"{http}/status.json"))["counters"] == counters
    finally:
        for agent in agents or []:
            agent.close()
        service.stop()


def test_a_stalled_round_is_named_with_the_missing_rank_within_the_threshold(caplog):
    threshold = 0.5
    transports = Transports()
    service = Service("tcp://127.0.0.1:0", 1, provider="thread", transports=transports,
                      aggregator_options={"stall_seconds": threshold}).start()
    agents = []
    try:
        agents = [pslink.connect("held", rank, 2, master=service.address, transports=transports) for rank in (0, 1)]
        value = np.ones(64, np.float32)
        for handle in [a.init("w", value) for a in agents]:
            handle.wait(10)
        for handle in [a.pushpull("w", value, out=np.empty_like(value)) for a in agents]:
            handle.wait(10)
        caplog.set_level(logging.WARNING, logger="pslink.core.aggregator.process")
        out = np.empty_like(value)
        pushed_at = time.monotonic()
        handle = agents[0].pushpull("w", value, out=out)  # rank 1 is held back
        with pytest.raises(PslinkTimeoutError) as timed_out:
            handle.wait(threshold * 2)
        # The worker's own timeout names the rank its round waits for.
        assert "round 2 of key 'w' waits for rank(s) [1] (pushed: [0])" in str(timed_out.value)

        logged = wait_until(lambda: [r for r in caplog.records if "stalled" in r.getMessage()], threshold + 2.0,
                            "the Aggregator to log the stalled round")
        # Named within the threshold and one scan period (a scan every threshold / 2).
        assert logged[0].created - (time.time() - (time.monotonic() - pushed_at)) <= threshold * 1.5 + 0.5
        assert "job 'held' key 'w' round 2" in logged[0].getMessage()
        assert "for rank(s) [1] (pushed: [0])" in logged[0].getMessage()

        def listed():
            with ControlClient(service.address, transports=transports) as client:
                return client.status()["stalled"]

        stalled = wait_until(listed, 5, "status to list the stalled round")
        assert stalled[0]["job"] == "held" and stalled[0]["waiting"] == [1] and stalled[0]["round"] == 2
        shown = []
        from rich.console import Console

        from pslink.status_view import render_status
        with ControlClient(service.address, transports=transports) as client:
            console = Console(width=200, record=True, file=open(os.devnull, "w"))
            render_status(client.status(), console)
            shown.append(console.export_text())
        assert "Stalled rounds" in shown[0] and "held" in shown[0]

        # Rank 1 comes: the round closes, nothing was lost, and the stall is gone.
        agents[1].pushpull("w", value, out=np.empty_like(value)).wait(10)
        handle.wait(10)
        np.testing.assert_array_equal(out, value * 2)
        wait_until(lambda: not listed(), 5, "the stall to clear")
    finally:
        for agent in agents:
            agent.close()
        service.stop()
        transports.close()


# -- the live page in a real browser ------------------------------------------------------------------


class _Cells(html.parser.HTMLParser):
    """Rows of the page by their data-* name: {(table id, row name): {field: text}}."""

    def __init__(self):
        super().__init__()
        self.rows: dict = {}
        self.counters: dict = {}
        self._table = self._row = self._field = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = attrs.get("id")
        elif tag == "tr" and (attrs.get("data-aggregator") or attrs.get("data-job")):
            self._row = (self._table, attrs.get("data-aggregator") or attrs.get("data-job"))
            self.rows[self._row] = {}
        elif tag == "td" and self._row is not None:
            self._field = attrs.get("data-field")
            if attrs.get("data-aggregator"):
                self._field = f"on {attrs['data-aggregator']}"
            self.rows[self._row].setdefault(self._field, "")
        elif tag == "span" and (attrs.get("id") or "").startswith("counter-"):
            self.counters[attrs["id"][len("counter-"):]] = int(attrs["data-value"])

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._field = None

    def handle_data(self, data):
        if self._row is not None and self._field is not None:
            self.rows[self._row][self._field] += data.strip()


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    return path


def browse(browser: str, url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--virtual-time-budget=4000", *args, url]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    return subprocess.CompletedProcess(command, proc.returncode, out.decode(errors="replace"),
                                       err.decode(errors="replace"))


def test_the_live_page_shows_what_status_says_in_headless_chromium(tmp_path):
    browser = chromium()
    service = start_cluster("tcp", 2, metrics_port=0)
    http = service.master.observing.http_address
    agents = []
    try:
        def worker(rank):
            agent = pslink.connect("pagejob", rank, 2, master=service.address)
            value = np.ones(256, np.float32)
            for key in ("a", "b", "c"):
                agent.init(key, value).wait()
                for _ in range(3):
                    agent.pushpull(key, value, out=np.empty_like(value)).wait()
            return agent

        agents = run_workers(2, worker)
        with ControlClient(service.address) as client:
            status = wait_until(lambda: (lambda s: s if s["jobs"][0]["round"] == 3 else None)(client.status()), 10,
                                "the rounds to be reported")
        dom = browse(browser, f"{http}/", "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert 'data-loaded="yes"' in dom.stdout, dom.stdout[:3000]
        page = _Cells()
        page.feed(dom.stdout)
        for agg in status["aggregators"]:
            row = page.rows[("aggregators", agg["name"])]
            assert row["tasks"] == str(agg["tasks"]) and row["alive"] == "yes"
            assert row["mb"] == f"{agg['bytes'] / 1e6:.2f}"
        job = status["jobs"][0]
        row = page.rows[("jobs", "pagejob")]
        assert row["workers"] == "2/2" and row["keys"] == "3" and row["round"] == str(job["round"])
        assert row["aggregators"] == ", ".join(job["aggregators"])
        placement = page.rows[("placement", "pagejob")]
        for agg in status["aggregators"]:
            assert placement[f"on {agg['name']}"] == (str(agg["jobs"]["pagejob"]) if agg["jobs"].get("pagejob") else "")
        # Counters only grow, and the control plane may count something (a pack, a profile) while
        # the page loads: each shown value lies between the status before the page and after it.
        with ControlClient(service.address) as client:
            after = client.status()["counters"]
        assert set(page.counters) == set(status["counters"])
        for name, shown in page.counters.items():
            assert status["counters"][name] <= shown <= after[name], (name, status["counters"][name], shown, after[name])

        shot = tmp_path / "page.png"
        taken = browse(browser, f"{http}/", f"--screenshot={shot}", "--window-size=1280,1000")
        assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        for agent in agents:
            agent.close()
        service.stop()

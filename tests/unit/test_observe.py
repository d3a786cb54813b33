"""The cores of seeing the service, without I/O: stall inspection, pMaster's counters and
histograms, metrics made from a status, and timelines (steps, paths, files cut short, merging)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.aggregator.stalls import StallInspector, stall_threshold, waiting_for
from pslink.core.aggregator.tasks import Request, Summer
from pslink.core.master.actions import Allocate, Migrate, Release
from pslink.core.master.watch import Histogram, Watch
from pslink.core.observe.metrics import metric_families
from pslink.core.observe.timeline import Timeline, merge, parse_steps, path_for, read
from pslink.core.wire.protocol import Op
from pslink.errors import ConfigError

TOKEN = b"t" * 16


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def core_with_task(workers=3):
    clock = Clock()
    core = AggregatorCore("agg-t", summer=Summer(threads=1), clock=clock)
    info = {"job": "j", "token": TOKEN, "membership": {"ranks": list(range(workers)), "epoch": 0}, "mode": "sum"}
    task = core.assign(info, [{"key": "w", "part": 0, "shape": [4], "span": [0, 4], "dtype": "float32",
                               "needs_init": False}])[0]
    ids = itertools.count(1)

    def push(rank, rnd):
        payload = core.receive_buffer(task)
        payload[:] = 1.0
        return core.handle(task, Request(f"r{rank}", next(ids), Op.PUSH, rank, rnd, payload))

    return core, task, clock, push


def test_a_round_past_the_threshold_is_a_stall_once_naming_the_ranks_it_waits_for():
    core, task, clock, push = core_with_task()
    inspector = StallInspector(threshold=2.0)
    push(0, 1)
    clock.now += 1.0
    push(2, 1)
    assert inspector.scan(core.tasks.values(), clock.now) == []  # 1 s: under the threshold
    clock.now += 1.5
    new = inspector.scan(core.tasks.values(), clock.now)
    assert [(s.job, s.key, s.round, s.waiting, s.pushed) for s in new] == [("j", "w", 1, (1,), (0, 2))]
    assert "round 1 has waited 2.5 s for rank(s) [1] (pushed: [0, 2])" in new[0].describe(clock.now)
    assert inspector.scan(core.tasks.values(), clock.now + 1) == []  # logged once
    assert inspector.report(clock.now)[0]["waiting"] == [1] and inspector.counts == {"j": 1}
    push(1, 1)  # the round closes: no longer stalled
    assert inspector.scan(core.tasks.values(), clock.now) == [] and inspector.current == []
    assert inspector.counts == {"j": 1}


def test_waiting_for_answers_the_oldest_open_round_or_the_one_asked():
    core, task, clock, push = core_with_task()
    assert waiting_for(task, 0) == {"round": 1, "closed": 0, "pushed": [], "waiting": [0, 1, 2]}
    push(1, 1)
    push(1, 2)
    assert waiting_for(task, 0)["waiting"] == [0, 2]
    assert waiting_for(task, 2) == {"round": 2, "closed": 0, "pushed": [1], "waiting": [0, 2]}
    reply = core.handle(task, Request("x", 99, Op.WAITING, 0, 1))[0]
    assert reply.body["pushed"] == [1] and reply.id == 99


def test_the_stall_threshold_comes_from_the_argument_or_the_environment_and_is_checked():
    assert stall_threshold(3.0) == 3.0 and stall_threshold(0) == 0.0
    assert stall_threshold(None, {}) == 10.0
    assert stall_threshold(None, {"PSLINK_STALL_SECONDS": "0.25"}) == 0.25
    with pytest.raises(ConfigError, match="PSLINK_STALL_SECONDS='soon' is not a number"):
        stall_threshold(None, {"PSLINK_STALL_SECONDS": "soon"})
    with pytest.raises(ConfigError, match=">= 0"):
        stall_threshold(-1.0)


def test_histograms_are_cumulative_with_inf_last():
    h = Histogram()
    for value in (0.003, 0.02, 0.02, 7.0, 100.0):
        h.observe(value)
    wire = h.to_wire()
    assert wire["count"] == 5 and wire["sum"] == pytest.approx(107.043)
    buckets = dict((str(le), n) for le, n in wire["buckets"])
    assert buckets["0.005"] == 1 and buckets["0.025"] == 3 and buckets["10.0"] == 4 and buckets["+Inf"] == 5


class _Agg:
    def __init__(self, name, jobs, stalled=(), alive=True):
        self.name, self.alive = name, alive
        self.stats = {"_jobs": jobs, "stalled": list(stalled)}


def test_watch_adds_counters_bytes_stalls_and_histograms_to_a_status():
    watch = Watch()
    for action in (Allocate("c", "p", "why"), Allocate("c", "q", "why"), Release("agg-1", "idle"),
                   Migrate(("j", "w", 0), "a", "b", "why")):
        watch.action(action)
    watch.iterations_reported("j", [0.1, 0.2, -1])
    aggs = {
        "agg-0": _Agg("agg-0", {"j": {"pushed_bytes": 100, "pulled_bytes": 50, "stalls": 1}},
                      [{"job": "j", "key": "w", "part": 0, "round": 3, "waiting": [1], "pushed": [0], "seconds": 4.0}]),
        "agg-1": _Agg("agg-1", {"j": {"pushed_bytes": 20, "pulled_bytes": 5}}),
    }
    status = {"jobs": [{"job": "j", "control": {"reverts": 2}}, {"job": "k"}], "aggregators": []}
    watch.add_to(status, aggs, migrations=7, failovers=1)
    j, k = status["jobs"]
    assert (j["pushed_bytes"], j["pulled_bytes"], j["stalls"], j["stalled_rounds"]) == (120, 55, 1, 1)
    assert j["iteration_seconds"]["count"] == 2 and k["iteration_seconds"]["count"] == 0
    assert k["pushed_bytes"] == 0 and k["stalled_rounds"] == 0
    assert status["stalled"][0]["aggregator"] == "agg-0"
    assert status["counters"] == {"migrations": 7, "failovers": 1, "reverts": 2, "allocations": 2, "releases": 1}


def test_metrics_follow_prometheus_naming_and_never_label_keys():
    status = {
        "aggregators": [{"name": "agg-0", "alive": True, "tasks": 3, "bytes": 4096, "load": 0.5, "cycle": 0.0,
                         "task_rounds_per_s": 10.0, "errors": 2, "requests": 9}],
        "jobs": [{"job": "j", "workers": 2, "keys": 3, "held_bytes": 4096, "round": 5, "rounds_per_s": 1.0,
                  "pushed_bytes": 10, "pulled_bytes": 10, "stalls": 0, "stalled_rounds": 0,
                  "control": {"loss": 0.05}, "iteration_seconds": Histogram().to_wire()}],
        "counters": {"migrations": 1, "failovers": 0, "reverts": 0, "allocations": 2, "releases": 0},
        "migrations": [], "master": {"bad_messages": 3, "refused": 1},
    }
    families = list(metric_families(status))
    names = [f.name for f in families]
    assert all(n.startswith("pslink_") for n in names) and len(names) == len(set(names))
    samples = {s.name: s for f in families for s in f.samples}
    assert samples["pslink_aggregator_bad_messages_total"].value == 2
    assert samples["pslink_job_loss_ratio"].value == 0.05
    assert samples["pslink_migrations_total"].value == 1
    assert {label for f in families for s in f.samples for label in s.labels} <= {"job", "aggregator", "le"}


def test_timeline_steps_and_paths():
    assert parse_steps(None) is None and parse_steps(" ") is None
    assert parse_steps("10:20") == (10, 20) and parse_steps("5:") == (5, None) and parse_steps(":3") == (0, 3)
    for bad in ("10", "a:b", "5:5", "-1:3"):
        with pytest.raises(ConfigError, match="PSLINK_TIMELINE_STEPS"):
            parse_steps(bad)
    assert path_for("/t/trace.json", 1, 1) == "/t/trace.json"
    assert path_for("/t/trace.json", 1, 4) == "/t/trace.rank1.json"
    assert path_for("/t/{rank}/x.json", 3, 4) == "/t/3/x.json"


def test_a_timeline_records_its_window_only_and_a_file_cut_short_still_reads(tmp_path):
    timeline = Timeline(str(tmp_path / "t.json"), "j", 0, steps=(1, 2))
    for step in range(3):
        timeline.pushed(["a", "b"])  # a key pushed again begins the next step
        assert timeline.step == step
        if timeline.active:
            start = timeline.now()
            timeline.span("pushpull", "a", start, timeline.now(), {"round": step + 1})
            timeline.instant("migrated", "a", {"to": "agg-1"})
    timeline.close()
    events = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert [s["args"]["step"] for s in spans] == [1] and spans[0]["args"]["round"] == 2
    assert [e["name"] for e in events if e["ph"] == "i"] == ["migrated"]

    cut = tmp_path / "cut.json"
    cut.write_text('[{"name": "x", "ph": "X", "pid": 1, "tid": 1, "ts": 1, "dur": 2},\n')
    assert read(str(cut)) == [{"name": "x", "ph": "X", "pid": 1, "tid": 1, "ts": 1, "dur": 2}]
    merged = tmp_path / "merged.json"
    assert merge([str(tmp_path / "t.json"), str(cut)], str(merged)) == len(events) + 1
    assert len(json.loads(merged.read_text())["traceEvents"]) == len(events) + 1


def test_a_timeline_that_cannot_be_written_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the timeline"):
        Timeline(str(blocker / "t.json"), "j", 0)


def test_byte_counters_count_pushes_added_and_answers_sent():
    core, task, clock, push = core_with_task(workers=2)
    push(0, 1)
    push(0, 1)  # a repeat is added once
    push(1, 1)
    assert core.stats()["j"]["pushed_bytes"] == 2 * 16
    core.handle(task, Request("p", 50, Op.PULL, 0, 1))
    assert core.stats()["j"]["pulled_bytes"] == 16
    assert np.array_equal(task.value, np.full(4, 2.0, np.float32))

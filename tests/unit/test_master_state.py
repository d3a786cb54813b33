"""pMaster's decisions and its durable state, without sockets."""

from __future__ import annotations

import pytest

from pslink.core.master.state import MasterState
from pslink.core.master.watch import status_of
from pslink.core.partition import partition_spans
from pslink.core.master.store import SqliteStore
from pslink.errors import (
    AuthError,
    ConfigError,
    KeyStateError,
    MembershipError,
    ServiceError,
    ShapeMismatchError,
    UnknownJobError,
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def state():
    s = MasterState(clock=Clock())
    for i in range(3):
        record = s.register_aggregator(f"tcp://127.0.0.1:{9000 + i}")
        s.aggregator_joined(record.name)
    return s


def tasks_on(state: MasterState) -> dict[str, int]:
    return {name: len(plan.tasks) for p in state.control.pool.clusters.values() for name, plan in p.aggregators.items()}


def item(key, shape=(4,), dtype="float32", intent="push"):
    return {"key": key, "shape": list(shape), "dtype": dtype, "intent": intent}


def test_partition_spans_cover_the_tensor_in_aligned_parts():
    assert partition_spans(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]
    assert partition_spans(0, 4, 16) == [(0, 0)]
    assert partition_spans(3, 8, 4) == [(0, 1), (1, 2), (2, 3)]  # never an empty or split element
    spans = partition_spans(25_600_000, 4)
    assert spans[0] == (0, 1 << 20) and spans[-1][1] == 25_600_000


def test_first_worker_creates_the_job_and_gets_its_token(state):
    job = state.register_worker("mnist", 0, 2, token=None)
    assert len(job.token) == 16
    assert job.membership.ranks == {0, 1}
    again = state.register_worker("mnist", 1, 2, token=None)  # first use of rank 1: allowed
    assert again is job


def test_registration_rules(state):
    job = state.register_worker("mnist", 0, 2, token=None)
    with pytest.raises(MembershipError, match="job 'mnist' has 2 workers; rank 1 says 3"):
        state.register_worker("mnist", 1, 3, token=None)
    with pytest.raises(MembershipError, match="rank 5 is out of range"):
        state.register_worker("mnist", 5, 2, token=job.token)
    with pytest.raises(MembershipError, match="rank 0 of job 'mnist' is already connected"):
        state.register_worker("mnist", 0, 2, token=job.token)
    with pytest.raises(AuthError, match="wrong token for job 'mnist'"):
        state.register_worker("mnist", 1, 2, token=b"x" * 16)
    state.worker_disconnected("mnist", 0)
    with pytest.raises(AuthError, match="needs its token to register rank 0"):
        state.register_worker("mnist", 0, 2, token=None)  # rank 0 joined before: token needed now
    state.register_worker("mnist", 0, 2, token=job.token)  # a reconnect with the token
    with pytest.raises(UnknownJobError, match="job 'nope' is not registered"):
        state.register_worker("nope", 0, 1, token=b"t")
    with pytest.raises(ConfigError, match="runs with mode 'sum'"):
        state.register_worker("mnist", 1, 2, token=job.token, config={"mode": "optimizer", "optimizer": {"type": "sgd", "lr": 1}})
    with pytest.raises(ConfigError, match="runs with sync 'bsp'; rank 1 asked for 'asp'"):
        state.register_worker("mnist", 1, 2, token=job.token, config={"sync": "asp"})


def test_the_same_agent_may_register_again_without_the_token_until_it_used_it(state):
    """Its registration's answer (the token) may have been lost with the connection. Another
    Agent, even of the same process (a second store for the same rank), may not."""
    job = state.register_worker("lost", 0, 1, token=None, pid=41, host_id="h1", agent="a1")
    state.worker_disconnected("lost", 0)
    for agent in ("a2", ""):  # another Agent (of the same process, or not saying): the token, as before
        with pytest.raises(AuthError, match="needs its token to register rank 0"):
            state.register_worker("lost", 0, 1, token=None, pid=41, host_id="h1", agent=agent)
    assert state.register_worker("lost", 0, 1, token=None, pid=41, host_id="h1", agent="a1") is job  # the same
    state.authorize("lost", job.token, 0)  # it got the answer: it sent the token
    with pytest.raises(AuthError, match="needs its token to register rank 0"):
        state.register_worker("lost", 0, 1, token=None, pid=41, host_id="h1", agent="a1")
    bert = state.register_job("bert", 1)
    state.register_worker("bert", 0, 1, token=bert.token, pid=41, host_id="h1", agent="a1")
    state.worker_disconnected("bert", 0)
    with pytest.raises(AuthError, match="needs its token"):  # an operator's job: never without it
        state.register_worker("bert", 0, 1, token=None, pid=41, host_id="h1", agent="a1")


def test_preregistered_job_always_needs_the_token(state):
    job = state.register_job("bert", 2, {"mode": "optimizer", "optimizer": {"type": "adam"}})
    with pytest.raises(AuthError, match="needs its token"):
        state.register_worker("bert", 0, 2, token=None)
    registered = state.register_worker("bert", 0, 2, token=job.token)
    assert registered.mode == "optimizer" and registered.optimizer == {"type": "adam"}


def test_a_crashed_job_ends_after_the_timeout_and_its_name_is_free_again(state):
    job = state.register_worker("mnist", 0, 1, token=None)
    state.declare(job, 0, item("w"))
    state.worker_disconnected("mnist", 0)
    with pytest.raises(AuthError, match="needs its token"):  # no hijacking while it may come back
        state.register_worker("mnist", 0, 1, token=None)
    state.clock.now += 11
    ended, _ = state.sweep(worker_timeout=10, aggregator_timeout=100)
    assert ended == [job]
    assert tasks_on(state) == {"agg-0": 0, "agg-1": 0, "agg-2": 0}  # its placements were released
    fresh = state.register_worker("mnist", 0, 1, token=None)
    assert fresh is not job and fresh.token != job.token


def test_job_settings_are_validated(state):
    with pytest.raises(ConfigError, match="mode must be one of"):
        state.register_job("x", 1, {"mode": "magic"})
    with pytest.raises(ConfigError, match="unknown job setting"):
        state.register_job("x", 1, {"modes": "sum"})
    with pytest.raises(ConfigError, match="an optimizer needs mode 'optimizer'"):
        state.register_job("x", 1, {"mode": "sum", "optimizer": {"type": "sgd", "lr": 1}})
    with pytest.raises(ConfigError, match="partition_bytes"):
        state.register_job("x", 1, {"partition_bytes": 3})
    with pytest.raises(ConfigError, match="num_workers must be >= 1"):
        state.register_job("x", 0)
    with pytest.raises(ConfigError, match="sync must be one of"):
        state.register_job("x", 1, {"sync": "pbs"})
    with pytest.raises(ConfigError, match="sync 'ssp' needs staleness >= 1"):
        state.register_job("x", 1, {"sync": "ssp"})
    with pytest.raises(ConfigError, match="staleness applies to sync 'ssp', not 'bsp'"):
        state.register_job("x", 1, {"staleness": 2})
    with pytest.raises(ConfigError, match="straggler_timeout applies to sync 'bsp' or 'ssp'"):
        state.register_job("x", 1, {"sync": "asp", "straggler_timeout": 1.0})
    with pytest.raises(ConfigError, match="max_workers 1 is below its 2 workers"):
        state.register_job("x", 2, {"max_workers": 1})


def test_a_profiling_job_spreads_its_parts_over_its_own_aggregators(state):
    job = state.register_job("j", 1, {"partition_bytes": 1024, "servers": 2})
    assert state.control.jobs["j"].temporaries == ["agg-0", "agg-1"]  # the idle ones, as many as it asks
    spec, created = state.declare(job, 0, item("big", shape=(1000,)))  # 4000 bytes -> 4 parts
    assert created and [p.span for p in spec.parts] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert [p.aggregator for p in spec.parts] == ["agg-0", "agg-1", "agg-0", "agg-1"]
    small, _ = state.declare(job, 0, item("small", shape=(10,)))
    assert small.parts[0].aggregator == "agg-1"  # fewer bytes there (1024 + 928 vs 2048)
    same, created = state.declare(job, 0, item("big", shape=(1000,)))
    assert same is spec and not created
    # a second job does not land on the first one's Aggregators while that one is profiling
    other = state.register_job("k", 1)
    assert state.control.jobs["k"].temporaries == ["agg-2"]
    assert state.declare(other, 0, item("x"))[0].parts[0].aggregator == "agg-2"


def test_a_second_shape_for_a_key_names_both(state):
    job = state.register_worker("j", 0, 2, token=None)
    state.declare(job, 0, item("w", shape=(2, 3)))
    with pytest.raises(ShapeMismatchError) as info:
        state.declare(job, 1, item("w", shape=(3, 2)))
    message = str(info.value)
    assert "key 'w' of job 'j': rank 1 uses shape (3, 2) float32, but rank 0 declared it as shape (2, 3) float32" in message
    with pytest.raises(ShapeMismatchError, match="float64"):
        state.declare(job, 1, item("w", shape=(2, 3), dtype="float64"))


def test_pull_of_an_unknown_key_and_bad_items(state):
    job = state.register_worker("j", 0, 1, token=None)
    with pytest.raises(KeyStateError, match="key 'w' of job 'j' was never initialized"):
        state.declare(job, 0, {"key": "w", "intent": "pull"})
    state.declare(job, 0, item("w", shape=(5,)))
    spec, _ = state.declare(job, 0, {"key": "w", "intent": "pull"})
    assert spec.shape == (5,)


def test_optimizer_mode_keys_need_init_and_sum_mode_push_keys_do_not(state):
    sum_job = state.register_job("s", 1)
    assert not state.declare(sum_job, 0, item("a"))[0].needs_init
    assert state.declare(sum_job, 0, item("b", intent="init"))[0].needs_init
    opt_job = state.register_job("o", 1, {"optimizer": {"type": "sgd", "lr": 0.1}})
    assert opt_job.mode == "optimizer"
    assert state.declare(opt_job, 0, item("c"))[0].needs_init


def test_no_aggregator_means_a_clear_error():
    state = MasterState(clock=Clock(), plane_options={"elastic": False})
    job = state.register_job("j", 1)
    with pytest.raises(ServiceError, match="no Aggregator can take key 'w'"):
        state.declare(job, 0, item("w"))


def test_set_optimizer_switches_an_empty_sum_job(state):
    job = state.register_job("j", 1)
    state.set_optimizer(job, {"type": "sgd", "lr": 0.1, "momentum": 0.9})
    assert job.mode == "optimizer"
    assert job.sum_through == []


def test_set_optimizer_after_init_switches_from_the_round_after_the_callers_pushes(state):
    """MXNet's dist_sync takes the optimizer after init: the keys' rounds the caller pushed stay
    sums; pMaster records them (for the Aggregators, in jobinfo, and across its restarts)."""
    job = state.register_job("k", 1)
    state.declare(job, 0, item("w"))
    state.declare(job, 0, item(7))
    state.set_optimizer(job, {"type": "sgd", "lr": 0.1}, pushed=[["w", 3], [7, 0], ["unknown", 5]])
    assert job.mode == "optimizer"
    assert job.sum_through == [["w", 3]]  # a key not pushed switches at once; an unknown key is no key
    assert job.jobinfo()["sum_through"] == [["w", 3]] and job.extra()["sum_through"] == [["w", 3]]
    # A second worker's call (the same optimizer, later pushes) moves nothing: the switch is done.
    state.set_optimizer(job, {"type": "sgd", "lr": 0.2}, pushed=[["w", 4]])
    assert job.sum_through == [["w", 3]] and job.optimizer["lr"] == 0.2
    with pytest.raises(ConfigError):
        state.set_optimizer(job, {"type": "no-such-optimizer"})


def test_leaving_ends_the_job_once_every_worker_left(state):
    job = state.register_worker("j", 0, 2, token=None)
    state.register_worker("j", 1, 2, token=None)
    assert not state.leave(job, 0)
    assert state.leave(job, 1)
    assert "j" not in state.jobs


def test_sweep_marks_silent_workers_and_aggregators(state):
    clock = state.clock
    state.register_worker("j", 0, 1, token=None)
    clock.now += 5
    ended, silent = state.sweep(worker_timeout=10, aggregator_timeout=10)
    assert ended == [] and silent == []
    clock.now += 10
    ended, silent = state.sweep(worker_timeout=10, aggregator_timeout=10)
    assert [r.job for r in ended] == ["j"] and sorted(silent) == ["agg-0", "agg-1", "agg-2"]
    assert not any(a.alive for a in state.aggregators.values())


def test_status_reports_jobs_and_aggregators(state):
    job = state.register_worker("j", 0, 1, token=None)
    state.declare(job, 0, item("w", shape=(256,)))
    state.aggregator_heartbeat("agg-0", {"jobs": {"j": {"tasks": 1, "bytes": 1024, "task_rounds": 0, "round": 0}}})
    state.clock.now += 2
    state.aggregator_heartbeat("agg-0", {"jobs": {"j": {"tasks": 1, "bytes": 1024, "task_rounds": 20, "round": 20}}})
    status = status_of(state)
    (job_row,) = status["jobs"]
    assert job_row["workers"] == 1 and job_row["bytes"] == 1024 and job_row["round"] == 20
    assert job_row["rounds_per_s"] == 10.0
    agg0 = status["aggregators"][0]
    assert agg0["name"] == "agg-0" and agg0["tasks"] == 1 and agg0["task_rounds_per_s"] == 10.0


@pytest.fixture(params=["sqlite", "redis"])
def reopen(request, tmp_path):
    """Opens the same durable state again each call: an SQLite file, or a Redis database (a real
    redis-server; skipped, naming it, where there is none) under one leader's epoch."""
    if request.param == "sqlite":
        return lambda: SqliteStore(str(tmp_path / "pmaster.sqlite"))
    from pslink.core.master.leadership import Lease
    from pslink.core.master.store_redis import RedisStore

    url = request.getfixturevalue("redis_url")
    lease = Lease(url, "tcp://127.0.0.1:1")
    epoch = lease.try_acquire()
    request.addfinalizer(lease.close)
    return lambda: RedisStore(url, epoch)


def test_store_round_trips_jobs_keys_and_aggregators(reopen, state):
    store = reopen()
    job = state.register_worker("j", 0, 2, token=None, config={"partition_bytes": 64, "sync": "asp"})
    spec, _ = state.declare(job, 0, item(7, shape=(40,)))
    spec2, _ = state.declare(job, 0, item("layer.w", shape=(3,), dtype="int64"))
    for agg in state.aggregators.values():
        store.save_aggregator(agg)
    store.save_job(job)
    store.save_key("j", spec)
    store.save_key("j", spec2)
    store.close()

    reloaded = MasterState(clock=Clock())
    reopen().load(reloaded)
    again = reloaded.jobs["j"]
    assert again.token == job.token and again.joined == {0} and again.partition_bytes == 64
    assert again.sync == "asp" and again.jobinfo()["sync"] == "asp"
    assert set(again.keys) == {7, "layer.w"}  # int and str keys keep their type
    assert [(p.span, p.aggregator) for p in again.keys[7].parts] == [(p.span, p.aggregator) for p in spec.parts]
    assert all(s.ready for s in again.keys.values())
    assert {a.name: a.alive for a in reloaded.aggregators.values()} == {"agg-0": False, "agg-1": False, "agg-2": False}
    # the control plane adopted the job where it was: 40 float32 in parts of 64 bytes, plus one
    assert sum(tasks_on(reloaded).values()) == len(spec.parts) + 1
    assert reloaded.control.jobs["j"].adopted
    # the token still guards rank 0, which had joined, and it may reconnect with it
    with pytest.raises(AuthError):
        reloaded.register_worker("j", 0, 2, token=None)
    reloaded.register_worker("j", 0, 2, token=job.token)
    # a job nobody comes back to ends one worker timeout after the restart
    reloaded.worker_disconnected("j", 0)
    reloaded.clock.now += 11
    assert [r.job for r in reloaded.sweep(worker_timeout=10, aggregator_timeout=100)[0]] == ["j"]


def test_store_keeps_an_aborted_key_aborted(reopen, state):
    """A key poisoned before a pMaster restart is still poisoned after it, with its error (the
    restarted pMaster tells Aggregators that take a part of it later)."""
    from pslink.errors import ShapeMismatchError

    store = reopen()
    job = state.register_worker("j", 0, 2, token=None)
    spec, _ = state.declare(job, 0, item("w", shape=(8,)))
    spec.aborted = ShapeMismatchError("key 'w': rank 1 uses shape (5,)", key="w", ranks=[1, 0])
    store.save_job(job)
    store.save_key("j", spec)
    store.close()
    reloaded = MasterState(clock=Clock())
    reopen().load(reloaded)
    again = reloaded.jobs["j"].keys["w"]
    assert isinstance(again.aborted, ShapeMismatchError) and again.aborted.message == spec.aborted.message
    assert again.aborted.details["ranks"] == [1, 0]
    assert all("aborted" in entry for entry in again.task_specs())


def test_an_aggregator_a_key_names_but_the_store_forgot_is_failed_over_at_the_first_sweep(reopen, state):
    """A failover stores the loss (the Aggregator's row goes) before the parts' new places: a
    pMaster that died in between finds keys naming an Aggregator it no longer has. The restarted
    one must fail it over again, at once, and keep its name from new Aggregators (before: the
    name was free, a new Aggregator took it, and the keys' replicas pointed at one without their
    state; the chaos run's pMaster killed at kill=pmaster@failover lost keys so)."""
    store = reopen()
    job = state.register_worker("j", 0, 2, token=None)
    spec, _ = state.declare(job, 0, item("w", shape=(40,)))
    gone = spec.parts[0].aggregator
    for agg in state.aggregators.values():
        store.save_aggregator(agg)
    store.save_job(job)
    store.save_key("j", spec)
    store.delete_aggregator(gone)  # the failover's first step, and pMaster died
    store.close()
    reloaded = MasterState(clock=Clock())
    reopen().load(reloaded)
    assert gone in reloaded.aggregators and reloaded.aggregators[gone].address == ""
    assert gone in reloaded.sweep(worker_timeout=10, aggregator_timeout=100)[1]  # silent at once: failed over
    assert reloaded.register_aggregator("tcp://127.0.0.1:1").name != gone  # its name stays taken


def test_store_refuses_a_newer_schema(tmp_path):
    path = str(tmp_path / "s.sqlite")
    store = SqliteStore(path)
    store.db.execute("UPDATE meta SET value='99' WHERE name='schema'")
    store.close()
    with pytest.raises(RuntimeError, match="schema 99"):
        SqliteStore(path)


def test_a_rank_registered_anew_leaves_and_comes_back_as_a_newcomer(state):
    """``rejoin``: the rank leaves the membership (the shell announces it) and the registration
    adds it back, late; only the process that holds the rank (or nobody) may do so."""
    job = state.register_worker("j", 0, 2, token=None, pid=10, host="h")
    state.register_worker("j", 1, 2, token=None, pid=11, host="h")
    state.declare(job, 0, item("w"))  # the job runs: a rank added now is late
    epoch = job.membership.epoch
    with pytest.raises(AuthError, match="wrong token"):
        state.take_out_to_rejoin("j", 1, b"x" * 16, pid=11, host="h")
    assert not state.take_out_to_rejoin("j", 1, job.token, pid=99, host="h")  # another live process
    assert job.membership.ranks == {0, 1}
    with pytest.raises(MembershipError, match="already connected"):
        state.register_worker("j", 1, 2, token=job.token, pid=99, host="h")
    state.membership_changed.clear()
    assert state.take_out_to_rejoin("j", 1, job.token, pid=11, host="h")
    assert job.membership.ranks == {0} and job.membership.epoch == epoch + 1
    assert state.membership_changed == [job]  # announced before the rank comes back
    state.register_worker("j", 1, 2, token=job.token, pid=11, host="h")
    assert job.membership.ranks == {0, 1} and job.membership.epoch == epoch + 2 and job.late
    state.worker_disconnected("j", 0)  # a dead worker's rank, taken over by a new process
    assert state.take_out_to_rejoin("j", 0, job.token, pid=12, host="h")
    assert not state.take_out_to_rejoin("j", 2, job.token)  # not a member: a plain registration
    assert not state.take_out_to_rejoin("nope", 0, job.token)  # register_worker says why


def test_status_counts_replicas_no_round_reached_and_parts_short_of_replicas(state):
    """A replica counts as up to date once its holder's heartbeat reports a round in it: until
    then (just placed, or its primary never told), a failover would promote an empty copy."""
    job = state.register_worker("j", 0, 1, token=None, config={"replication": 1})
    spec, _ = state.declare(job, 0, item("w"))
    (holder,) = spec.parts[0].replicas

    def replica_row():
        (row,) = [a for a in status_of(state)["aggregators"] if a["name"] == holder]
        return row["replicas"], row["replicas_without_state"]

    assert replica_row() == (1, 1)  # no heartbeat yet: not known to have any round
    state.aggregator_heartbeat(holder, {"replicas_with_state": [["j", "other", 0], ["j", "w"], "junk"]})
    assert replica_row() == (1, 1)  # another part, and malformed entries, do not count
    state.aggregator_heartbeat(holder, {"replicas_with_state": [["j", "w", 0]]})
    assert replica_row() == (1, 0)

    def job_row():
        (row,) = status_of(state)["jobs"]
        return row["parts_short_of_replicas"], row["parts_on_lost_aggregators"]

    assert job_row() == (0, 0)
    state.aggregator_lost(holder)  # its connection closed: the replica is not a live one
    assert job_row() == (1, 0)
    state.aggregator_heartbeat(holder, {"replicas_with_state": [["j", "w", 0]]})  # back
    state.aggregator_lost(spec.parts[0].aggregator)  # the primary: the part waits for its failover
    assert job_row() == (0, 1)

"""An operator adding and removing Aggregators: the control plane's and pMaster state's decisions,
fed by hand (no processes, no sockets, no sleeps)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from pslink.status_view import render_status
from pslink.core.master.actions import Allocate, Migrate, Release
from pslink.core.master.control import ControlPlane
from pslink.core.master.state import MasterState
from pslink.core.master.watch import status_of
from pslink.core.master.failover_plan import Rereplicate
from pslink.errors import ConfigError, ServiceError


def plane(*names, **options) -> ControlPlane:
    """Jobs packed at once (no profiling); a task of N bytes costs N ms per 1 s iteration."""
    options.setdefault("profile_iterations", 0)
    options.setdefault("cost_per_byte", 1e-3)
    control = ControlPlane(**options)
    for name in names:
        control.aggregator_added(name)
    return control


def declare(control, job, sizes):
    control.job_arrived(job, workers=1, servers=1)
    return [control.place_part(job, key, 0, nbytes)[0] for key, nbytes in enumerate(sizes)]


def test_a_removed_aggregator_drains_into_the_others_then_is_released():
    control = plane("agg-0", "agg-1", min_aggregators=2)
    assert declare(control, "j", [300, 300]) == ["agg-0", "agg-0"]  # best fit packs them together
    actions, moves = control.remove_aggregator("agg-0")
    assert moves == {("j", 0, 0): "agg-1", ("j", 1, 0): "agg-1"}
    assert sorted(actions[:-1], key=lambda a: a.task) == [
        Migrate(("j", k, 0), "agg-0", "agg-1", "removing agg-0") for k in (0, 1)]
    assert actions[-1] == Release("agg-0", "removed by an operator")  # after the moves
    assert control.pool.draining == {"agg-0"}
    assert "agg-0" not in control.pool.cluster_of and control.aggregator_count() == 1
    assert control.pool.min_aggregators == 1  # the operator asked for a smaller pool
    # no new task goes there, while it drains or after
    assert control.place_part("j", 2, 0, 100)[0] == "agg-1"
    assert control.job_arrived("k", workers=1, servers=1) == []
    control.released("agg-0")
    assert control.pool.draining == set()


def test_without_room_elsewhere_a_new_aggregator_takes_the_tasks_and_the_release_waits_for_it():
    control = plane("agg-0", "agg-1")
    assert declare(control, "j", [600, 600]) == ["agg-0", "agg-1"]  # 0.6 s of 1 s each: no two fit together
    actions, moves = control.remove_aggregator("agg-0")
    (allocate,) = actions  # the move and the Release wait until it is up
    assert isinstance(allocate, Allocate) and moves == {("j", 0, 0): allocate.placeholder}
    assert control.aggregator_count() == 2
    follow = control.bind(allocate.placeholder, "agg-2")
    assert follow == [Migrate(("j", 0, 0), "agg-0", "agg-2", "removing agg-0"), Release("agg-0", "removed by an operator")]
    assert control.pool.clusters["cluster-0"].where[("j", 0, 0)] == "agg-2"


def test_without_a_provider_the_others_take_the_tasks_even_past_their_room():
    control = plane("agg-0", "agg-1", elastic=False)
    declare(control, "j", [600, 600])
    actions, moves = control.remove_aggregator("agg-0")
    assert moves == {("j", 0, 0): "agg-1"}
    assert [type(a) for a in actions] == [Migrate, Release]


def test_removal_errors_name_what_is_wrong():
    control = plane("agg-0", "agg-1")
    with pytest.raises(ServiceError, match=r"aggregator 'agg-7' is not in the pool \(it has: agg-0, agg-1\)"):
        control.remove_aggregator("agg-7")
    control.remove_aggregator("agg-1")
    with pytest.raises(ServiceError, match="agg-1 is already being removed"):
        control.remove_aggregator("agg-1")
    fixed = plane("agg-0", elastic=False)
    with pytest.raises(ServiceError, match="agg-0 is the last one in the pool and pMaster has no provider"):
        fixed.remove_aggregator("agg-0")
    assert fixed.pool.cluster_of == {"agg-0": "cluster-0"}  # a refused removal changes nothing


def test_the_last_aggregator_of_an_elastic_pool_is_replaced_before_it_goes():
    control = plane("agg-0")
    declare(control, "j", [300])
    actions, moves = control.remove_aggregator("agg-0")
    (allocate,) = [a for a in actions if isinstance(a, Allocate)]
    assert moves == {("j", 0, 0): allocate.placeholder}
    assert not [a for a in actions if isinstance(a, (Migrate, Release))]  # both wait for the new one
    later = control.bind(allocate.placeholder, "agg-1")
    assert [type(a) for a in later] == [Migrate, Release] and later[0].target == "agg-1"


def test_a_failed_removal_keeps_the_aggregator():
    control = plane("agg-0", "agg-1")
    declare(control, "j", [300])
    control.remove_aggregator("agg-0")
    control.undrain("agg-0")
    assert control.pool.draining == set() and "agg-0" in control.pool.cluster_of
    assert control.move_task(("j", 0, 0), "agg-0", "migration failed").target == "agg-0"  # the plan goes back


def test_added_aggregators_are_kept_by_scaling():
    control = plane("agg-0", min_aggregators=1)
    actions = control.add_aggregators(2)
    assert [type(a) for a in actions] == [Allocate, Allocate]
    assert control.pool.min_aggregators == 3 and control.aggregator_count() == 3
    for i, action in enumerate(actions):
        assert control.bind(action.placeholder, f"agg-{i + 1}") == []
    assert control.release_idle() == []  # empty, but the operator asked for them
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        control.add_aggregators(0)
    with pytest.raises(ConfigError, match="max_aggregators=3"):
        plane("agg-0", max_aggregators=3).add_aggregators(3)


def one_replicated_part():
    """pMaster's state with 3 Aggregators and job "j" (replication 1) holding key "w" in one part:
    (state, the job's record, the part)."""
    state = MasterState(clock=lambda: 0.0, plane_options={"profile_iterations": 0, "elastic": False})
    for i in range(3):
        state.register_aggregator(f"tcp://127.0.0.1:{9000 + i}", f"agg-{i}")
        state.aggregator_joined(f"agg-{i}")
    record = state.register_worker("j", 0, 1, None, {"replication": 1})
    state.declare(record, 0, {"key": "w", "shape": [4], "dtype": "float32", "intent": "init"})
    (part,) = record.keys["w"].parts
    return state, record, part


def test_replicas_on_a_removed_aggregator_are_made_elsewhere():
    state, record, part = one_replicated_part()
    (holder,) = part.replicas
    assert state.control.pool.replica_holders() == {holder}  # what scaling keeps
    moves, replicas = state.remove_from_pool(holder)
    assert moves == {}
    (change,) = replicas
    assert isinstance(change, Rereplicate) and change.part is part
    assert part.replicas == change.added and len(part.replicas) == 1  # the replica count is kept
    assert part.replicas[0] not in (holder, part.aggregator)
    status = status_of(state)
    assert [a["draining"] for a in status["aggregators"] if a["name"] == holder] == [True]
    out = Console(file=io.StringIO(), width=200)
    render_status(status, out)  # what `pslink service status` prints
    assert re.search(rf"{holder} .* draining", out.file.getvalue())
    # new replicas avoid it while it drains
    spec, _ = state.declare(record, 0, {"key": "v", "shape": [4], "dtype": "float32", "intent": "init"})
    assert holder not in spec.parts[0].replicas and holder != spec.parts[0].aggregator
    with pytest.raises(ServiceError, match="aggregator 'agg-9' is not registered with this pMaster"):
        state.remove_from_pool("agg-9")


def test_an_aggregator_released_while_moves_leave_it_takes_no_replica():
    """Found by the chaos run: a pack released the job's profiling Aggregators (their release
    waiting for the moves off them), the moves gave them replicas meanwhile, and the release took
    those replicas with it, leaving parts with none. A released Aggregator is no candidate."""
    state = MasterState(clock=lambda: 0.0, plane_options={"profile_iterations": 0, "elastic": True})
    for i in range(3):
        state.register_aggregator(f"tcp://127.0.0.1:{9000 + i}", f"agg-{i}")
        state.aggregator_joined(f"agg-{i}")
    assert set(state.replica_candidates()) == {"agg-0", "agg-1", "agg-2"}
    (release,) = [a for a in state.control.scaling.release_empty("a pack emptied it") if isinstance(a, Release)][:1]
    assert release.aggregator in state.live_aggregators()  # pMaster releases it once the moves are over
    assert release.aggregator not in state.replica_candidates()


def test_a_removal_waits_for_moves_off_it_that_wait_for_a_new_aggregator():
    control = plane("agg-0", "agg-1")
    declare(control, "j", [300])
    allocation = control.pool.allocate("cluster-0", "a revert")  # as the guard does: the move waits for it
    control.pool.emit([], control.move_task(("j", 0, 0), allocation.placeholder, "revert"))
    actions, moves = control.remove_aggregator("agg-0")
    assert actions == [] and moves == {}  # the task is leaving already; the Release must not pass it
    follow = control.bind(allocation.placeholder, "agg-2")
    assert [type(a) for a in follow] == [Migrate, Release] and follow[0].source == "agg-0"


def test_a_part_moving_onto_a_lost_aggregator_is_offered_back_to_its_source_first():
    """Its copy was not known to have landed: the source may still be serving the part, and a
    promoted replica would then be a second server. (If the source had handed the part over, it
    refuses, and pMaster promotes the replica: see core/master/failover.py.)"""
    from pslink.core.master.failover_plan import Promote

    state, record, part = one_replicated_part()
    source, (replica,) = part.aggregator, part.replicas
    (target,) = {"agg-0", "agg-1", "agg-2"} - {source, replica}
    state.control.move_task(("j", "w", 0), target)
    part.aggregator = target  # what pMaster does once the source took the MIGRATE
    (action,) = state.fail_over(target, {("j", "w", 0): source})
    assert isinstance(action, Promote) and action.moving
    assert action.part.aggregator == source and action.part.replicas == [replica]


def test_a_part_handed_over_by_a_lost_source_is_not_failed_over_it_waits_for_a_copy_from_a_replica():
    """The source of a move died after pMaster pointed the part at the target: the plan leaves
    the part there (pMaster has a replica send the copy), and the replica stays a replica."""
    from pslink.core.master.failover_plan import copy_sources

    state, record, part = one_replicated_part()
    source, (replica,) = part.aggregator, part.replicas
    (target,) = {"agg-0", "agg-1", "agg-2"} - {source, replica}
    state.control.move_task(("j", "w", 0), target)
    part.aggregator = target
    assert state.fail_over(source) == []
    assert part.aggregator == target and part.replicas == [replica]
    live = {target, replica}
    assert copy_sources(part.replicas, target, False, live, source) == [replica]
    assert copy_sources(part.replicas, target, False, {target}, source) == []  # the replica is gone too


def test_copy_sources_put_a_target_that_held_the_replica_first():
    """When the move began the target held the part's replica; pMaster gave that replica's place
    to a newcomer the source never heard of: only the target has the rounds since."""
    from pslink.core.master.failover_plan import copy_sources

    live = {"agg-1", "agg-2", "agg-3"}
    assert copy_sources(["agg-3"], "agg-1", True, live, "agg-0") == ["agg-1", "agg-3"]
    assert copy_sources(["agg-3", "agg-0", "agg-1"], "agg-1", False, live, "agg-0") == ["agg-3"]
    assert copy_sources(["agg-3"], "agg-1", True, live - {"agg-1"}, "agg-0") == ["agg-3"]

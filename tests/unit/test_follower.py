"""A move's target follows the part before the hand-over (pure cores): the seed, each round's sum
applied as the source applies it, and a hand-over that carries none of the state, checked bit for
bit, refused (then sent whole) where the target's state is not the source's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.aggregator.moves import MAX_FOLLOW_BEHIND, MIN_FOLLOW_BYTES, state_checksum
from pslink.core.aggregator.tasks import CopyOut, Follow, Replicate, Reply, Request, Summer
from pslink.core.wire.protocol import Op
from pslink.errors import KeyStateError

from test_aggregator_core import follow_through, jobinfo

TARGET = ("agg-new", "tcp://127.0.0.1:9999")
N = MIN_FOLLOW_BYTES // 2  # elements of a part: followed in float32 and float16 (smaller ones move whole)
MOMENTUM = {"type": "sgd", "lr": 0.1, "momentum": 0.9}


class Part:
    """One part on one core, driven as the shell drives it (two workers unless told)."""

    def __init__(self, name="agg-src", workers=2, mode="optimizer", optimizer=MOMENTUM, dtype="float32",
                 table=None, replica=False, **extra):
        self.core = AggregatorCore(name, summer=Summer(threads=1))
        self.info = jobinfo(workers=workers, mode=mode, optimizer=optimizer)
        self.spec = {"key": "w", "part": 0, "shape": [N], "span": [0, N], "dtype": dtype, "needs_init": True,
                     "declared_by": 0, **({"table": table} if table else {}), **extra}
        if replica:
            self.core.assign(self.info, [dict(self.spec, replica=True)])
        else:
            self.task = self.core.assign(self.info, [self.spec])[0]
        self.ids = itertools.count(1)
        self.workers = workers

    @property
    def ident(self):
        return ("j", "w", 0)

    def send(self, op, rank, rnd, payload=None):
        task = self.core.tasks[self.ident]
        if isinstance(payload, np.ndarray) and task.table is None:
            buffer = self.core.receive_buffer(task)
            buffer[:] = payload
            payload = buffer
        return self.core.handle(task, Request(f"rank{rank}", next(self.ids), op, rank, rnd, payload))

    def round(self, r, pushes) -> list:
        outputs = []
        for rank in range(self.workers):
            outputs += self.send(Op.PUSHPULL, rank, r, pushes[rank])
        return outputs

    def target(self) -> AggregatorCore:
        """A core expecting this part (ASSIGN with incoming=True), as pMaster makes a move's target."""
        core = AggregatorCore("agg-new", summer=Summer(threads=1))
        core.assign(self.info, [dict(self.spec, incoming=True)])
        return core


def gradients(r, workers=2, n=N, dtype=np.float32):
    rng = np.random.default_rng(r)
    return [rng.standard_normal(n).astype(dtype) for _ in range(workers)]


def answers(outputs):
    return [o for o in outputs if isinstance(o, Reply) and o.payload is not None]


def start(source: Part, target: AggregatorCore, quiet=True) -> list:
    outputs = source.core.moves.begin_migration(source.ident, TARGET)
    return follow_through(source.core, target, outputs) if quiet else outputs


@pytest.mark.parametrize("dtype, optimizer", [
    ("float32", MOMENTUM),
    ("float32", {"type": "adam", "lr": 0.01}),
    ("float16", dict(MOMENTUM, multi_precision=True)),  # sums widened to float32, a float32 master copy
])
def test_the_followed_state_is_the_sources_bit_for_bit_and_the_hand_over_carries_none_of_it(dtype, optimizer):
    moved, still = Part(dtype=dtype, optimizer=optimizer), Part(dtype=dtype, optimizer=optimizer)
    init = np.linspace(-1, 1, N).astype(dtype)
    for part in (moved, still):
        part.send(Op.INIT, 0, 0, init)
    for r in (1, 2, 3):  # rounds before the move: the seed carries them
        for part in (moved, still):
            part.round(r, gradients(r, dtype=dtype))
    target = moved.target()
    assert start(moved, target) == []
    assert target.tasks[moved.ident].following == 3 and target.tasks[moved.ident].incoming
    # Round 4's sum goes to the target, confirmed or not yet: the seed was, so the part is handed
    # over at round 4's end (the workers connect to the target while they compute).
    outputs = follow_through(moved.core, target, moved.round(4, gradients(4, dtype=dtype)))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert all(a.moved == TARGET for a in answers(outputs))
    assert out.arrays == [] and out.held  # nothing of the state travels
    state = dict(out.state, checksum=state_checksum(out.held))
    still.round(4, gradients(4, dtype=dtype))
    target.moves.install(target.tasks[moved.ident], state, [])
    served = target.tasks[moved.ident]
    np.testing.assert_array_equal(served.value, still.task.value)
    for name, value in still.task.opt_state.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(served.opt_state[name], value)
        else:
            assert served.opt_state[name] == value
    for r in (5, 6):  # and the job goes on there as it would have
        got = answers(sum((target.handle(served, Request(f"rank{rank}", 100 + 10 * r + rank, Op.PUSHPULL, rank, r,
                                                          g.copy())) for rank, g in
                           enumerate(gradients(r, dtype=dtype))), []))
        np.testing.assert_array_equal(got[0].payload, answers(still.round(r, gradients(r, dtype=dtype)))[0].payload)


def test_the_hand_over_waits_for_the_target_to_confirm_and_gives_following_up_when_it_falls_behind():
    source = Part(workers=1)
    source.send(Op.INIT, 0, 0, np.zeros(N, np.float32))
    target = source.target()
    outputs = start(source, target, quiet=False)
    (seed,) = outputs
    assert isinstance(seed, Follow) and seed.kind == "seed"
    for r in range(1, 3):  # the seed is not taken yet (never quiet): nothing follows, nothing moves
        assert not [o for o in source.round(r, gradients(r, 1)) if isinstance(o, (Follow, CopyOut))]
    seed = source.core.moves.seed(source.ident)  # taken and sent, its confirmation not back yet
    target.moves.seeded(target.tasks[source.ident], seed.state, [a.copy() for a in seed.arrays])
    assert target.tasks[source.ident].following == 2
    pending = []
    for r in range(3, 3 + MAX_FOLLOW_BEHIND):  # forwarded, never confirmed: no hand-over
        outputs = source.round(r, gradients(r, 1))
        assert not [o for o in outputs if isinstance(o, CopyOut)]
        pending += [o for o in outputs if isinstance(o, Follow)]
    assert [f.round for f in pending] == list(range(3, 3 + MAX_FOLLOW_BEHIND))
    outputs = source.round(3 + MAX_FOLLOW_BEHIND, gradients(3 + MAX_FOLLOW_BEHIND, 1))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]  # too far behind: the whole state goes
    assert out.held is None and "value" in out.state["arrays"] and not [o for o in outputs if isinstance(o, Follow)]


def test_a_target_behind_or_with_other_state_refuses_the_hand_over_and_the_copy_whole_is_kept():
    source = Part(workers=1)
    source.send(Op.INIT, 0, 0, np.ones(N, np.float32))
    target = source.target()
    start(source, target)
    outputs = source.round(1, gradients(1, 1))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    state = dict(out.state, checksum=state_checksum(out.held))
    task = target.tasks[source.ident]
    with pytest.raises(KeyStateError, match="round 0; the source sends it whole"):
        target.moves.install(task, state, [])  # round 1's sum never reached it
    follow_through(source.core, target, [o for o in outputs if isinstance(o, Follow)])
    task.value[7] += 1.0  # (a follower that went astray)
    with pytest.raises(KeyStateError, match="differs from the source's at round 1"):
        target.moves.install(task, state, [])
    whole_state, whole_arrays = out.whole
    assert "value" in whole_state["arrays"] and len(whole_arrays) == len(whole_state["arrays"])
    target.moves.install(task, whole_state, [a.copy() for a in whole_arrays])  # what the source sends then
    np.testing.assert_array_equal(task.value, source.task.value)
    assert not task.incoming


def test_a_round_out_of_order_or_for_a_part_not_expected_is_refused():
    source = Part(workers=1)
    source.send(Op.INIT, 0, 0, np.ones(N, np.float32))
    target = source.target()
    start(source, target)
    (forward,) = [o for o in source.round(1, gradients(1, 1)) if isinstance(o, Follow)]
    task = target.tasks[source.ident]
    with pytest.raises(KeyStateError, match="round 2 arrived for a follower at round 0"):
        target.moves.follow(task, dict(forward.state, follow=2), forward.arrays)
    task.incoming = False
    with pytest.raises(KeyStateError, match="not incoming"):
        target.moves.follow(task, forward.state, forward.arrays)


def test_a_target_that_holds_a_replica_is_promoted_without_a_copy():
    source = Part()
    holder = Part(name="agg-new", replica=True)
    source.task.replicas = [TARGET]

    def replicate(outputs):
        (rep,) = [o for o in outputs if isinstance(o, Replicate)]
        holder.core.moves.replica_update({"job": "j", "key": "w", "part": 0}, rep.state, [a.copy() for a in rep.arrays])
        return [o for o in outputs if not isinstance(o, Replicate)] + source.core.moves.replicated(source.ident,
                                                                                                   rep.round)

    replicate(source.send(Op.INIT, 0, 0, np.ones(N, np.float32)))
    replicate(source.round(1, gradients(1)))
    holder.core.assign(source.info, [dict(source.spec, incoming=True)])  # pMaster's ASSIGN of the move
    assert source.core.moves.begin_migration(source.ident, TARGET) == []  # no seed: it has every round
    outputs = replicate(source.round(2, gradients(2)))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.state["follower"] == "replica" and out.arrays == []
    task = holder.core.tasks[source.ident]
    holder.core.moves.install(task, dict(out.state, checksum=state_checksum(out.held)), [])
    np.testing.assert_array_equal(task.value, source.task.value)
    np.testing.assert_array_equal(task.opt_state["momentum_buffer"], source.task.opt_state["momentum_buffer"])


def test_a_move_called_off_stops_the_following_and_a_forced_one_hands_over_from_it():
    source = Part(workers=1)
    source.send(Op.INIT, 0, 0, np.ones(N, np.float32))
    target = source.target()
    start(source, target)
    assert source.core.moves.promote(source.ident, []) == []  # its target is gone: the move is off
    outputs = source.round(1, gradients(1, 1))
    assert not [o for o in outputs if isinstance(o, (Follow, CopyOut))]
    assert all(a.next is None for a in answers(outputs))
    target = source.target()
    start(source, target)  # (seeded with round 1; no round closes after it)
    outputs = source.core.moves.begin_migration(source.ident, TARGET, force=True)  # pMaster's deadline
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.state["follower"] == "follower" and out.arrays == []
    target.moves.install(target.tasks[source.ident], dict(out.state, checksum=state_checksum(out.held)), [])
    np.testing.assert_array_equal(target.tasks[source.ident].value, source.task.value)


def test_a_tables_shard_is_not_followed_and_moves_whole_at_a_rounds_end():
    """Reads add a table's rows and touch them (eviction goes by those times): its rounds alone
    do not make a follower's shard the source's, so the shard moves whole, bit for bit."""
    table = {"width": 4, "init": ["uniform", -0.1, 0.1], "seed": 3}
    moved, still = (Part(mode="optimizer", optimizer={"type": "sgd", "lr": 0.5}, table=table, needs_init=False)
                    for _ in range(2))

    def pushes(r):
        rng = np.random.default_rng(r)
        return [(rng.integers(0, 50, 8).astype(np.uint64), rng.standard_normal((8, 4)).astype(np.float32))
                for _ in range(2)]

    for r in (1, 2):
        for part in (moved, still):
            part.round(r, pushes(r))
    target = moved.target()
    assert start(moved, target) == []  # no seed
    outputs = moved.round(3, pushes(3))
    assert not [o for o in outputs if isinstance(o, Follow)]
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.held is None and "rows" in out.state["arrays"]
    still.round(3, pushes(3))
    task = target.tasks[moved.ident]
    target.moves.install(task, out.state, [a.copy() for a in out.arrays])
    everything = np.arange(50, dtype=np.uint64)
    np.testing.assert_array_equal(task.table.read(everything), still.core.tasks[still.ident].table.read(everything))


def test_a_seed_goes_while_the_workers_compute_and_only_if_it_lands_before_they_are_back():
    from pslink.core.aggregator.moves import seed_delay

    # The part's rounds open every 0.4 s, the last at 10.0: the next is due at 10.4. Quiet means
    # 0.1 s without a message (a quarter of the iteration).
    assert seed_delay(10.2, 10.0, 10.0, None, 0.02) == 0.0  # pace unknown: at once
    assert seed_delay(10.15, 10.1, 10.0, 0.4, 0.02) == pytest.approx(0.05)  # quiet in 0.05 s
    assert seed_delay(10.2, 10.05, 10.0, 0.4, 0.02) == 0.0  # quiet, and it lands by 10.22
    assert seed_delay(10.38, 10.05, 10.0, 0.4, 0.02) == pytest.approx(0.22)  # would overlap: after 10.4 + 0.2
    assert seed_delay(10.4 - 0.02 - 0.04, 10.05, 10.0, 0.4, 0.02) == 0.0  # (just fits: a tenth of 0.4 s clear)
    assert seed_delay(10.35, 10.05, 10.0, 0.4, 0.02) > 0  # (not clear by a tenth)
    assert seed_delay(10.65, 10.05, 10.0, 0.4, 0.02) == 0.0  # the workers are late past 10.6: paused
    assert seed_delay(10.37, 10.05, 10.0, 0.4, 0.3) == 0.0  # a seed of over half an iteration goes when quiet


def test_a_seed_waits_for_the_jobs_whole_exchange_to_end_when_the_workers_told_their_compute():
    from pslink.core.aggregator.moves import exchange_end, seed_delay

    # Rounds open every 0.8 s, the last at 10.0 (the next due at 10.8); the workers compute 0.4 s
    # between exchanges, so the job's exchange ends about 10.4, though this Aggregator fell quiet
    # (0.2 s without a message) at 10.25; a tenth of the iteration is kept clear after that end (an
    # exchange may run longer than the last) and before the round. A seed takes 0.07 s.
    assert exchange_end(10.0, 0.8, 0.4) == pytest.approx(10.48)
    assert seed_delay(10.3, 10.05, 10.0, 0.8, 0.07) == 0.0  # compute not told: once quiet, as before
    assert seed_delay(10.3, 10.05, 10.0, 0.8, 0.07, 0.4) == pytest.approx(0.18)  # after the exchange
    assert seed_delay(10.5, 10.05, 10.0, 0.8, 0.07, 0.4) == 0.0
    assert seed_delay(10.7, 10.05, 10.0, 0.8, 0.07, 0.4) == pytest.approx(0.5)  # no room left: after 10.8 + 0.4
    # A compute too short for the copy and both margins: the exchange's end is no bound (once quiet).
    assert exchange_end(10.0, 0.8, 0.2, needs=0.15) == float("-inf")
    assert seed_delay(10.3, 10.05, 10.0, 0.8, 0.07, 0.2) == 0.0
    assert exchange_end(None, 0.8, 0.4) == exchange_end(10.0, None, 0.4) == exchange_end(10.0, 0.8, None) \
        == float("-inf")


def test_a_round_opens_when_its_first_push_header_was_heard_and_keeps_the_shortest_compute_told():
    """The pace a move's copies are timed by: a round opens when the shell heard its first push's
    header (its bytes may queue behind other keys' for much of the exchange), else when its first
    push was complete; the compute its workers told (ms) is kept as the shortest of the round's."""
    now = [1.0]
    part = Part()
    part.core.clock = part.core.moves.clock = lambda: now[0]
    task = part.task
    part.send(Op.INIT, 0, 0, np.zeros(N, np.float32))
    for r, heard, idle in [(1, 0.9, [300, 280]), (2, 1.7, [400, 420])]:
        now[0] = heard + 0.2  # the pushes are complete 0.2 s after their first header
        task.heard_round, task.heard_at = r, heard  # (the shell's header callback sets them)
        for rank, pushed in enumerate(gradients(r)):
            buffer = part.core.receive_buffer(task)
            buffer[:] = pushed
            part.core.handle(task, Request(f"rank{rank}", next(part.ids), Op.PUSHPULL, rank, r, buffer,
                                           idle=idle[rank]))
    assert task.closed == 2
    assert task.last_opened == 1.7 and task.round_gap == pytest.approx(0.8)  # headers, not complete pushes
    assert task.compute_gap == pytest.approx(0.4)
    task.heard_round, now[0] = 2, 2.6  # a round whose header was not heard (a ring: header and bytes at once)
    for rank, pushed in enumerate(gradients(3)):
        buffer = part.core.receive_buffer(task)
        buffer[:] = pushed
        part.core.handle(task, Request(f"rank{rank}", next(part.ids), Op.PUSHPULL, rank, 3, buffer))
    assert task.closed == 3 and task.last_opened == 2.6 and task.compute_gap is None

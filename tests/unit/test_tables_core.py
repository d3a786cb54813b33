"""Sparse tables' pure core (pslink.core.tables): sharding, lazy rows, sums, optimizers, eviction."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core.tables import (TableShard, as_ids, initial_rows, shard_of, split_by_shard, sum_duplicates,
                                table_options)
from pslink.core.wire.protocol import Op, decode, encode
from pslink.errors import ConfigError, ProtocolError


def shard(width=4, dtype=np.float32, clock=lambda: 0.0, **options):
    return TableShard(table_options({"width": width, **options}, "t"), dtype, clock)


def test_ids_spread_over_shards_whatever_their_range():
    for ids in (np.arange(100_000, dtype=np.uint64), np.arange(100_000, dtype=np.uint64) << np.uint64(40)):
        counts = np.bincount(shard_of(ids, 8), minlength=8)
        assert counts.min() > 0.9 * counts.mean()  # consecutive ids and strided ids both spread evenly
    ids = np.array([9, 1, 9, 4, 1 << 63], np.uint64)
    order, bounds = split_by_shard(ids, 3)
    grouped = shard_of(ids[order], 3)
    assert (np.diff(grouped) >= 0).all() and bounds[-1] == ids.size
    for s in range(3):  # each shard's ids keep the order they came in
        mine = order[bounds[s]:bounds[s + 1]]
        assert list(mine) == sorted(mine)


@pytest.mark.parametrize("init", [["uniform", -0.5, 0.5], ["normal", 1.0, 0.1], ["zeros"]])
def test_lazy_rows_are_identical_whatever_the_shard_count_or_order_of_touch(init):
    ids = np.random.default_rng(0).integers(0, 1 << 62, 2000).astype(np.uint64)
    expected = initial_rows(ids, 8, np.dtype(np.float32), init, seed=11)
    for shards in (1, 3, 7):
        tables = [shard(8, init=init, seed=11, shards=shards) for _ in range(shards)]
        order, bounds = split_by_shard(ids[::-1].copy(), shards)  # touched in another order
        for s, table in enumerate(tables):
            table.read(ids[::-1][order[bounds[s]:bounds[s + 1]]])
        got = np.concatenate([tables[s].read(ids[shard_of(ids, shards) == s]) for s in range(shards)])
        want = np.concatenate([expected[shard_of(ids, shards) == s] for s in range(shards)])
        np.testing.assert_array_equal(got, want)
    if init[0] == "uniform":
        assert expected.min() >= -0.5 and expected.max() < 0.5 and abs(expected.mean()) < 0.01
    if init[0] == "normal":
        assert abs(expected.mean() - 1.0) < 0.01 and abs(expected.std() - 0.1) < 0.01
    other_seed = initial_rows(ids[:10], 8, np.dtype(np.float32), init, seed=12)
    assert init[0] == "zeros" or not np.array_equal(other_seed, expected[:10])


def test_duplicate_ids_are_summed_in_the_order_they_came():
    rng = np.random.default_rng(1)
    ids = np.concatenate([[5, 2, 5, 5, 2, 7], rng.integers(0, 50, 2000)]).astype(np.uint64)
    rows = rng.normal(size=(ids.size, 3)).astype(np.float32)
    unique, summed = sum_duplicates(ids, rows)
    assert list(unique) == sorted(set(ids.tolist()))
    for u, got in zip(unique, summed):
        first, *rest = np.flatnonzero(ids == u)
        want = rows[first].copy()
        for i in rest:  # left to right, in float32: the order is the result
            want = want + rows[i]
        np.testing.assert_array_equal(got, want)


def test_sum_table_accumulates_pushes_as_ps_lites_default_handle():
    table = shard(2)
    table.apply(np.array([1, 1, 3], np.uint64), np.ones((3, 2), np.float32))
    table.apply(np.array([3], np.uint64), np.full((1, 2), 5, np.float32), contributors=2)  # sum: not averaged
    np.testing.assert_array_equal(table.read(np.array([1, 3, 4], np.uint64)), [[2, 2], [6, 6], [0, 0]])


def reference_step(name, opt, w, state, g, step):
    """One row optimizer step in float64, written out plainly."""
    if name == "sgd":
        return w - opt["lr"] * g
    if name == "adagrad":
        state["acc"] = state.get("acc", np.full_like(w, opt.get("initial_accumulator_value", 0.0))) + g * g
        return w - opt["lr"] * g / (np.sqrt(state["acc"]) + opt["eps"])
    m = opt["beta1"] * state.get("m", 0) + (1 - opt["beta1"]) * g
    v = opt["beta2"] * state.get("v", 0) + (1 - opt["beta2"]) * g * g
    state.update(m=m, v=v)
    mhat, vhat = m / (1 - opt["beta1"] ** step), v / (1 - opt["beta2"] ** step)
    return w - opt["lr"] * mhat / (np.sqrt(vhat) + opt["eps"])


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_row_optimizers_match_their_update_rules_and_touch_only_pushed_rows(name):
    table = shard(4, dtype=np.float64, init=["uniform", -1, 1], optimizer={"name": name, "lr": 0.1})
    opt = table.optimizer
    rng = np.random.default_rng(2)
    ids_all = np.arange(10, dtype=np.uint64)
    weights = {int(i): row.copy() for i, row in zip(ids_all, table.read(ids_all))}
    states: dict = {}
    for step in range(1, 6):
        ids = rng.choice(10, 4, replace=False).astype(np.uint64)
        grads = rng.normal(size=(4, 4))
        table.apply(ids, grads * 2, contributors=2)  # a round of 2 workers: the mean steps
        for i, g in zip(ids.tolist(), grads):
            weights[i] = reference_step(name, opt, weights[i], states.setdefault(i, {}), g, step)
    got = table.read(ids_all)
    for i in range(10):
        np.testing.assert_allclose(got[i], weights[i], rtol=1e-12, atol=1e-12)


def test_a_capped_shard_evicts_least_recently_used_rows_and_counts_them():
    table = shard(2, capacity=100)
    hot = np.arange(10, dtype=np.uint64)
    for batch in range(40):
        table.read(hot)  # touched every time: never evicted
        table.read(np.arange(1000 + 30 * batch, 1030 + 30 * batch, dtype=np.uint64))
        assert table.size <= 100
    assert table.evicted == 10 + 40 * 30 - table.size
    table.apply(hot, np.ones((10, 2), np.float32))
    np.testing.assert_array_equal(table.read(hot), np.ones((10, 2)))  # the hot rows kept their values
    with pytest.raises(ConfigError, match="capped at 100 rows"):
        table.read(np.arange(5000, 5101, dtype=np.uint64))


def test_ttl_eviction_drops_rows_untouched_for_longer_than_the_ttl():
    now = [0.0]
    table = shard(2, evict="ttl", ttl=10.0, clock=lambda: now[0])
    table.apply(np.array([1, 2], np.uint64), np.ones((2, 2), np.float32))
    now[0] = 8.0
    table.read(np.array([1], np.uint64))
    now[0] = 15.0  # row 2 was last touched at 0: gone; row 1 at 8: kept
    np.testing.assert_array_equal(table.read(np.array([1, 2], np.uint64)), [[1, 1], [0, 0]])
    assert table.evicted == 1


def test_a_shard_exported_and_loaded_elsewhere_is_the_same_shard():
    table = shard(3, optimizer="adam", init=["normal", 0, 1], capacity=50)
    rng = np.random.default_rng(3)
    for _ in range(5):
        table.apply(rng.integers(0, 80, 20).astype(np.uint64), rng.normal(size=(20, 3)).astype(np.float32))
    scalars, named = table.export()
    copy = shard(3, optimizer="adam", init=["normal", 0, 1], capacity=50)
    copy.load(scalars, {name: array.reshape(-1) for name, array in named})  # frames arrive flat
    ids = rng.integers(0, 80, 30).astype(np.uint64)
    grads = rng.normal(size=(30, 3)).astype(np.float32)
    table.apply(ids, grads)
    copy.apply(ids, grads)
    for start in (0, 40):  # in two reads: a read of 80 rows would not fit the cap of 50
        some = np.arange(start, start + 40, dtype=np.uint64)
        np.testing.assert_array_equal(copy.read(some), table.read(some))
    assert (copy.evicted, copy.steps) == (table.evicted, table.steps)


def test_bad_table_settings_and_ids_are_named():
    for options, match in [({"width": 0}, "width 0"), ({"width": 4, "shards": 0}, "shards 0"),
                           ({"width": 4, "init": "gauss"}, "init"), ({"width": 4, "optimizer": "lamb"}, "lamb"),
                           ({"width": 4, "optimizer": {"name": "sgd", "momentum": 0.9}}, "momentum"),
                           ({"width": 4, "evict": "ttl"}, "ttl"), ({"width": 4, "capacity": -1}, "capacity"),
                           ({"width": 4, "colour": 1}, "colour")]:
        with pytest.raises(ConfigError, match=match):
            table_options(options, "table 'emb'")
    with pytest.raises(ConfigError, match="non-negative"):
        as_ids(np.array([3, -1]), "table 'emb'")
    with pytest.raises(ConfigError, match="integers"):
        as_ids(np.array([0.5]), "table 'emb'")
    with pytest.raises(ConfigError, match="only sum"):
        shard(2, dtype=np.int32, optimizer="sgd")


def test_table_requests_are_validated_before_their_payloads_are_read():
    fields = dict(id=1, job="j", tok=b"t", rank=0, key="emb", part=0, rnd=1, dtype="float32", shape=[2, 4], span=[0, 4])
    header = encode(Op.TABLE_PUSH, n=3, **fields)
    assert decode(header, [24, 48])["n"] == 3
    with pytest.raises(ProtocolError, match=r"take frames of \[24, 48\] bytes"):
        decode(header, [24, 40])
    with pytest.raises(ProtocolError, match="field 'n'"):
        decode(encode(Op.TABLE_PULL, n=-1, **fields), [8])
    with pytest.raises(ProtocolError, match=r"must be \[shards, width\]"):
        decode(encode(Op.TABLE_PULL, n=1, **dict(fields, shape=[8])), [8])

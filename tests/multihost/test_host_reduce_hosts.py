"""Host-local reduce across hosts: two hosts (network namespaces A and B) of two workers each,
pMaster and the pool on M. The workers are numbered as a launcher numbers them (PSLINK_LOCAL_RANK,
PSLINK_LOCAL_SIZE); where namespaces cannot be made, every test skips, naming why."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.multihost.harness import PSLINK, PYTHON, ROOT, WORKER, Cluster, make_hosts

pytestmark = [pytest.mark.integration, pytest.mark.multihost]
HOSTS = "AABB"  # ranks 0, 1 on A; 2, 3 on B


@pytest.fixture
def cluster():
    made = Cluster(make_hosts(["M", "A", "B"]))
    yield made
    made.close()


def start_job(cluster, job: str, host_reduce: bool, *args: str, out=None):
    workers = []
    for rank, host in enumerate(HOSTS):
        env = {"PSLINK_LOCAL_RANK": str(rank % 2), "PSLINK_LOCAL_SIZE": "2",
               "PSLINK_HOST_REDUCE": "1" if host_reduce else "0"}
        argv = ["--job", job, "--rank", str(rank), "--num-workers", "4", "--master", cluster.master(), *args]
        workers.append(cluster.start(host, [PYTHON, WORKER, *argv, *(["--out", out(rank)] if out else [])], env=env))
    return workers


@pytest.mark.parametrize("mode", ["sum", "optimizer"])
def test_two_hosts_of_two_workers_reduce_on_the_host_to_the_flat_weights(cluster, tmp_path, mode):
    cluster.service("M", 2)
    args = ["--exact", "--rounds", "30", "--keys", "4", "--values", "300000"]
    args += ["--optimizer"] if mode == "optimizer" else []
    weights = {}
    for job, host_reduce in (("flat", False), ("local", True)):
        workers = start_job(cluster, job, host_reduce, *args, out=lambda rank: str(tmp_path / f"{job}{rank}.npy"))
        for worker in workers:
            assert worker.finish(180) == 0, worker.text()
        weights[job] = [np.load(tmp_path / f"{job}{rank}.npy") for rank in range(4)]
    for rank in range(4):
        np.testing.assert_array_equal(weights["local"][rank], weights["flat"][rank])


def test_the_pushing_worker_killed_mid_round_loses_no_round(cluster, tmp_path):
    # Rank 0 pushes host A's sums; it is killed while its job runs. Rank 1 sends what waited at
    # it and everything after to the pool itself; pMaster removes rank 0; every other worker
    # finishes every round, and all three end with the same weights.
    cluster.service("M", 2)
    workers = start_job(cluster, "killed", True, "--rounds", "200", "--pause", "0.01",
                        out=lambda rank: str(tmp_path / f"w{rank}.npy"))
    workers[0].wait_for("round 40", 120)
    workers[0].proc.kill()
    workers[0].proc.wait(10)
    for worker in workers[1:]:
        assert worker.finish(180) == 0, worker.text()
        assert any(line == "round 199" for line in worker.lines), worker.text()
    assert any("lost rank 0, this host's leader" in line for line in workers[1].lines), workers[1].text()
    final = [np.load(tmp_path / f"w{rank}.npy") for rank in (1, 2, 3)]
    np.testing.assert_array_equal(final[0], final[1])
    np.testing.assert_array_equal(final[0], final[2])


def test_pslink_launch_over_two_hosts_of_two_reduces_on_each_host_by_default(cluster, tmp_path):
    pytest.importorskip("sklearn", reason="the digits data set ships with scikit-learn (CI installs it)")
    cluster.service("M", 2)
    result = str(tmp_path / "rank{rank}.json")
    launches = [cluster.start(host, [*PSLINK, "launch", "--nnodes", "2", "--node-rank", str(index), "-n", "2",
                                     "--service", cluster.master(), "--job", "launched", "--master-addr",
                                     cluster.address("A"), PYTHON, os.path.join(ROOT, "examples", "numpy",
                                                                                  "train_digits.py"),
                                     "--epochs", "3", "--no-progress", "--result", result])
                for index, host in enumerate("AB")]
    for launch in launches:
        assert launch.finish(240) == 0, launch.text()
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert [r["host_role"] for r in results] == ["leader", "follower", "leader", "follower"]
    assert len({r["checksum"] for r in results}) == 1 and results[0]["accuracy"] > 0.9

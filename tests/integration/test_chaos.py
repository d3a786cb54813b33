"""The chaos run, short (issue 23): three jobs of two workers train on ``pslink service up``, and an
elastic job of two under ``pslink launch``, while a seeded schedule kills Aggregators, pMaster
and the elastic job's workers (each replaced); every job's final weights are exact (the run
without faults, bit for bit); and on two hosts (network namespaces), with partitions of the
second from the first among the faults. ``benchmarks/chaos.py`` runs the same for 10 minutes."""

from __future__ import annotations

import pytest

from pslink.bench import chaos

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_a_short_chaos_run_loses_and_doubles_no_round(tmp_path):
    run = chaos.Chaos(seed=7, jobs=3, workers=2, aggregators=3, workdir=str(tmp_path), elastic=True)
    try:
        report = run.run(seconds=45, warmup=2.0, gap=(3.0, 5.0), pmaster_share=0.3, worker_share=0.3)
    finally:
        run.close()
    assert not report["errors"], "\n".join(report["errors"]) + "\nthe service said:\n" + run.log_excerpt()
    kinds = [fault["kind"] for fault in report["schedule"]]
    assert {"aggregator", "pmaster", "worker"} <= set(kinds), kinds  # seed 7 draws each
    assert report["jobs"]["chaos-elastic"]["steps"] > 0
    for job, figures in report["jobs"].items():
        assert figures.get("exact"), f"{job}: {figures}"


@pytest.mark.timeout(360)
def test_a_short_chaos_run_with_partitions_between_two_hosts_loses_and_doubles_no_round(tmp_path):
    from pslink.bench import netns

    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two hosts need network namespaces: {why}")
    with netns.VirtualHosts(["M", "B"]) as hosts:
        run = chaos.Chaos(seed=11, jobs=3, workers=2, aggregators=2, workdir=str(tmp_path), elastic=False, hosts=hosts)
        try:
            report = run.run(seconds=0, warmup=2.0, gap=(3.0, 5.0), pmaster_share=0.2, worker_share=0.0,
                             partition_share=0.5, faults=5)
        finally:
            run.close()
    assert not report["errors"], "\n".join(report["errors"]) + "\nthe service said:\n" + run.log_excerpt()
    kinds = [fault["kind"] for fault in report["schedule"]]
    assert kinds == ["partition"] * 3 + ["pmaster", "aggregator"], kinds  # what seed 11 draws
    # Each partition cut off what the jobs use every round: parts served on host B, or the
    # replicas there of parts served on M (a replica goes to another host than its primary).
    cuts = [f for f in report["schedule"] if f["kind"] == "partition"]
    assert all(f["parts_cut_off"] + f["replicas_cut_off"] > 0 for f in cuts), report["schedule"]
    for job, figures in report["jobs"].items():
        assert figures.get("exact"), f"{job}: {figures}"


@pytest.mark.timeout(360)
def test_a_short_chaos_run_killing_pmaster_at_named_points_loses_and_doubles_no_round(tmp_path):
    # Every named point in turn: a drain (pslink service remove) drives pMaster to the
    # migration's (hand-over, copy-landed), an Aggregator killed to the failover's.
    points = ["hand-over", "copy-landed", "failover", "promoted"]
    run = chaos.Chaos(seed=5, jobs=2, workers=2, aggregators=3, workdir=str(tmp_path), elastic=False, points=points)
    try:
        report = run.run(seconds=0, warmup=2.0, gap=(2.0, 3.0), pmaster_share=0.0, worker_share=0.0,
                         partition_share=0.0, point_share=1.0, faults=6)
    finally:
        run.close()
    assert not report["errors"], "\n".join(report["errors"]) + "\nthe service said:\n" + run.log_excerpt()
    faults = [fault for fault in report["schedule"] if fault["kind"] == "pmaster-point"]
    assert [fault["victim"].split()[0] for fault in faults] == points + points[:2], report["schedule"]
    assert all(fault["reached"] for fault in faults), report["schedule"]  # pMaster died there each time
    for job, figures in report["jobs"].items():
        assert figures.get("exact"), f"{job}: {figures}"


@pytest.mark.timeout(360)
def test_a_short_chaos_run_with_control_messages_lost_repeated_and_held_loses_and_doubles_no_round(tmp_path):
    # Every control message of the service's processes may be lost with its connection,
    # repeated or held back (PSLINK_FAULTS ctl_*), while pMaster is killed (plainly and at the
    # named points) and Aggregators are killed. Each fault comes once the last one is mended:
    # every part served by a live Aggregator, with a replica a round reached (the harness waits).
    run = chaos.Chaos(seed=1, jobs=2, workers=2, aggregators=3, workdir=str(tmp_path), elastic=False,
                      control_faults="ctl_drop=0.01,ctl_dup=0.05,ctl_delay=0.05,delay_ms=50")
    try:
        report = run.run(seconds=0, warmup=2.0, gap=(2.0, 3.0), pmaster_share=0.3, worker_share=0.0,
                         partition_share=0.0, point_share=0.3, faults=6)
    finally:
        run.close()
    assert not report["errors"], "\n".join(report["errors"]) + "\nthe service said:\n" + run.log_excerpt()
    kinds = [fault["kind"] for fault in report["schedule"]]
    assert {"aggregator", "pmaster", "pmaster-point"} <= set(kinds), kinds
    with open(tmp_path / "service.log", errors="replace") as log:
        cut = sum("(PSLINK_FAULTS ctl_drop)" in line for line in log)
    assert cut > 0, "no control connection was cut: the run did not test what it says"
    for job, figures in report["jobs"].items():
        assert figures.get("exact"), f"{job}: {figures}"

"""The chaos run, short (issue 23): three jobs of two workers train on ``pslink service up``, and an
elastic job of two under ``pslink launch``, while a seeded schedule kills Aggregators, pMaster
and the elastic job's workers (each replaced); every job's final weights are exact (the run
without faults, bit for bit). ``benchmarks/chaos.py`` runs the same for 10 minutes."""

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

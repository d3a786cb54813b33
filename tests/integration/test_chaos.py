"""The chaos run, short (issue 23): three jobs of two workers train on ``pslink service up`` while a
seeded schedule kills Aggregators and pMaster; every job's final weights are exact (the run
without faults, bit for bit). ``benchmarks/chaos.py`` runs the same for 10 minutes."""

from __future__ import annotations

import pytest

from pslink.bench import chaos

pytestmark = pytest.mark.integration


def test_a_short_chaos_run_loses_and_doubles_no_round(tmp_path):
    run = chaos.Chaos(seed=7, jobs=3, workers=2, aggregators=3, workdir=str(tmp_path))
    try:
        report = run.run(seconds=45, warmup=2.0, gap=(3.0, 5.0), pmaster_share=0.34)
    finally:
        run.close()
    assert not report["errors"], "\n".join(report["errors"]) + "\nthe service said:\n" + run.log_excerpt()
    kinds = [fault["kind"] for fault in report["schedule"]]
    assert "aggregator" in kinds and "pmaster" in kinds, kinds  # seed 7 draws both
    for job, figures in report["jobs"].items():
        assert figures.get("exact"), f"{job}: {figures}"

"""MXNet's kvstore and the TensorFlow adapter when a worker goes away: the others do not hang.

Both adapters sit on the core's membership: pMaster drops a dead worker after the heartbeat
timeout and the open rounds close with the workers left. Each test runs two real workers under
``pslink launch --min-np 1 --max-np 2``; rank 1 kills itself (SIGKILL, no goodbye) before its
fourth step, rank 0 goes on to step 12. The sums rank 0 sees say who took part in each round.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS, DIES_AT = 12, 3

MXNET_WORKER = """
    import os, signal
    import mxnet as mx
    import pslink.mxnet  # registers the 'pslink' kvstore

    kv = mx.kv.create("pslink")
    kv.init("w", mx.nd.zeros((4,)))
    out = mx.nd.zeros((4,))
    for step in range({steps}):
        if kv.rank == 1 and step == {dies_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        kv.push("w", mx.nd.full((4,), kv.rank + 1.0))
        kv.pull("w", out=out)
        print(f"step {{step}} sum {{out.asnumpy()[0]:g}}", flush=True)
    print("done", flush=True)
"""

TF_WORKER = """
    import os, signal
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import pslink.tf as hvd

    hvd.init()
    for step in range({steps}):
        if hvd.rank() == 1 and step == {dies_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        total = hvd.allreduce(tf.constant([hvd.rank() + 1.0]), average=False, name="x")
        print(f"step {{step}} sum {{float(total[0]):g}}", flush=True)
    print("done", flush=True)
"""


def run_two_workers(tmp_path: Path, source: str) -> str:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(source.format(steps=STEPS, dies_at=DIES_AT)))
    env = dict(os.environ, PSLINK_TIMEOUT="60", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "pslink.cli", "launch", "--min-np", "1", "--max-np", "2", "-n", "2",
               "--max-restarts", "0", "--heartbeat-timeout", "2", sys.executable, str(script)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=env, cwd=str(REPO))
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers on SIGTERM
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the job hung:\n{out}") from None
    assert proc.returncode == 0, out
    return out


def check(out: str) -> None:
    sums = [line.split("sum ")[1] for line in out.splitlines() if line.startswith("[rank0]: step ")]
    # both pushed in the first steps; after rank 1 died, rank 0's rounds close with it alone
    assert sums == ["3"] * DIES_AT + ["1"] * (STEPS - DIES_AT), out
    assert "[rank0]: done" in out and "[rank1]: done" not in out
    assert "rank 1 (pid" in out and "was killed by SIGKILL; 1 worker(s) continue" in out


def test_mxnet_kvstore_goes_on_without_a_killed_worker(tmp_path):
    check(run_two_workers(tmp_path, MXNET_WORKER))


def test_tensorflow_allreduce_goes_on_without_a_killed_worker(tmp_path):
    check(run_two_workers(tmp_path, TF_WORKER))

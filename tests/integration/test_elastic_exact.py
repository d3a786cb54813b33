"""Elastic jobs lose no step and count none twice: a worker killed in the middle of a step (its
partners' round then closes without it) makes every worker go back to the last commit, so the
step is redone by the new world; the final weights equal the run without the kill, bit for bit.

The job's gradient is the sum over a fixed global batch of 8 samples, split over whatever
workers there are (each sums its share, ``hvd.allreduce(op=Sum)`` adds the shares), so any
world computes the same step; small integer gradients and a power-of-two learning rate make
every update exact in float32.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests.helpers import launch_elastic

pytest.importorskip("torch", reason="pslink.torch.elastic needs torch (CI installs it)")

pytestmark = pytest.mark.integration

STEPS, SAMPLES, LR = 30, 8, 0.125

WORKER = """
    import os, signal, sys
    import numpy as np
    import torch
    import pslink.torch as hvd

    STEPS, SAMPLES, LR = {steps}, {samples}, {lr}
    here = sys.argv[1]
    died = os.path.join(here, "died")
    hvd.init()
    first = os.environ["PSLINK_RANK"] == "1" and not os.path.exists(died)

    def gradient(sample, step):
        return (np.arange(16) % 3 + (sample + step) % 5).astype(np.float32)

    state = hvd.elastic.ObjectState(step=0, w=np.zeros(16, np.float32))

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS or hvd.size() < 2:  # (alone, it waits for the replacement by training on)
            if first and state.step == {dies_at}:
                open(died, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # before its share of this step went out
            share = sum((gradient(i, state.step) for i in range(hvd.rank(), SAMPLES, hvd.size())),
                        np.zeros(16, np.float32))
            total = hvd.allreduce(torch.from_numpy(share), op=hvd.Sum, name="g").numpy()
            state.w = state.w - np.float32(LR) * total / np.float32(SAMPLES)
            state.step += 1
            print(f"step {{state.step}} size {{hvd.size()}}", flush=True)
            state.commit()

    train(state)
    print(f"final {{state.step}} " + " ".join(f"{{v:.6f}}" for v in state.w), flush=True)
"""


def expected(steps: int) -> np.ndarray:
    w = np.zeros(16, np.float32)
    for step in range(steps):
        total = sum(((np.arange(16) % 3 + (i + step) % 5).astype(np.float32) for i in range(SAMPLES)),
                    np.zeros(16, np.float32))
        w = w - np.float32(LR) * total / np.float32(SAMPLES)
    return w


@pytest.mark.timeout(200)
def test_a_worker_killed_mid_step_loses_no_step_and_doubles_none(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(steps=STEPS, samples=SAMPLES, lr=LR, dies_at=7)))
    out = launch_elastic(script, [tmp_path], max_restarts=1, timeout=170)
    finals = [line.split("final ")[1].split(" ", 1) for line in out.splitlines() if "]: final " in line]
    assert len(finals) == 2 and finals[0] == finals[1], out  # both ranks, the same step and weights
    steps, weights = int(finals[0][0]), finals[0][1]
    want = " ".join(f"{v:.6f}" for v in expected(steps))
    assert steps >= STEPS and weights == want, f"expected {want} after {steps} steps\n{out}"
    assert "was killed by SIGKILL" in out

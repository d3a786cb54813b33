"""MXNet's kvstore and the TensorFlow adapter when a worker goes away: the others do not hang.

Both adapters sit on the core's membership: pMaster drops a dead worker after the heartbeat
timeout and the open rounds close with the workers left. Each test runs two real workers under
``pslink launch --min-np 1 --max-np 2``; rank 1 kills itself (SIGKILL, no goodbye) before its
fourth step, rank 0 goes on to step 12. The sums rank 0 sees say who took part in each round.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.helpers import launch_elastic

pytestmark = pytest.mark.integration

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
    return launch_elastic(script)


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


MXNET_JOINER = """
    import os, signal, sys
    import mxnet as mx
    import pslink.mxnet  # registers the 'pslink' kvstore

    here = {here!r}
    died, joined, done = (os.path.join(here, name) for name in ("died", "joined", "done"))
    kv = mx.kv.create("pslink")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0))  # state on the service
    kv.init("w", mx.nd.zeros((4,)))
    out = mx.nd.zeros((4,))
    kv.pull("w", out=out)
    replacement = kv.rank == 1 and os.path.exists(died)
    print(f"start {{out.asnumpy()[0]:.6f}} replacement {{replacement}}", flush=True)
    if replacement:
        open(joined, "w").close()
    step = 0
    while True:
        if kv.rank == 1 and not replacement and step == 3:
            open(died, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if kv.rank == 1 and replacement and step == 5 or kv.rank == 0 and os.path.exists(done):
            break
        kv.push("w", mx.nd.full((4,), 1.0))
        kv.pull("w", out=out)
        print(f"step {{step}} w {{out.asnumpy()[0]:.6f}}", flush=True)
        step += 1
    if replacement:
        open(done, "w").close()
    print("done", flush=True)
"""


@pytest.mark.timeout(200)
def test_a_worker_that_replaces_a_killed_one_in_an_mxnet_job_starts_from_the_jobs_weights(tmp_path):
    """Issue 23: a worker that joins a running MXNet job gets its state. With the optimizer on the
    service (kv.set_optimizer), the weights and the optimizer's state (momentum) live there: the
    replacement of a killed rank 1 (``pslink launch --max-restarts 1``) pulls the job's current
    weights, not its init's zeros, and from then on both ranks see the same weights each round.
    Before, the two waited for each other: the replacement in kv.init's barrier, which the others
    had passed long ago, the others in rounds that now counted the replacement."""
    script = tmp_path / "joiner.py"
    script.write_text(textwrap.dedent(MXNET_JOINER.format(here=str(tmp_path))))
    out = launch_elastic(script, max_restarts=1, timeout=150)
    lines = {rank: [line.split("]: ", 1)[1] for line in out.splitlines() if line.startswith(f"[rank{rank}]: ")]
             for rank in (0, 1)}
    starts = [line for line in lines[1] if line.startswith("start ")]
    assert starts[0] == "start 0.000000 replacement False" and len(starts) == 2, out
    joined_at = float(starts[1].split()[1])
    seen_by_0 = [float(line.split()[-1]) for line in lines[0] if line.startswith("step ")]
    assert joined_at < 0 and joined_at in seen_by_0, out  # the job's weights, as rank 0 had them
    after = lines[1][lines[1].index(starts[1]):]
    replacement_steps = [float(line.split()[-1]) for line in after if line.startswith("step ")]
    assert len(replacement_steps) == 5 and set(replacement_steps) <= set(seen_by_0), out  # the same rounds
    assert "[rank0]: done" in out and lines[1][-1] == "done"


TF_ELASTIC = """
    import os, signal
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    import pslink.tf as hvd

    here = {here!r}
    died, done = (os.path.join(here, name) for name in ("died", "done"))
    hvd.init()
    replacement = hvd.rank() == 1 and os.path.exists(died)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
    x = np.array([[1.0, 2.0]], np.float32)

    def show(what):
        print(f"{{what}} {{state.step}} size {{hvd.size()}} it {{int(optimizer.iterations.numpy())}} "
              f"w {{' '.join(f'{{v:.6f}}' for v in model.weights[0].numpy().ravel())}}", flush=True)

    @hvd.elastic.run
    def train(state):
        show("enter")
        steps = 0
        while True:
            if hvd.rank() == 1 and not replacement and state.step == 3:
                open(died, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if replacement and steps == 5 or not replacement and os.path.exists(done):
                return
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x * (hvd.rank() + 1.0)))
            grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            state.step += 1
            steps += 1
            show("step")
            state.commit()

    train(state)
    if replacement:
        open(done, "w").close()
    print("done", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_worker_that_replaces_a_killed_one_in_a_tensorflow_elastic_job_gets_the_state(tmp_path):
    """Issues 23 and 25: pslink.tf.elastic. Rank 1 of two is killed after 3 steps; rank 0 goes
    on alone; the replacement (``--max-restarts 1``) enters with rank 0's weights, optimizer
    state (its step count) and attributes, and from then on both train the same steps, their
    gradients averaged again."""
    script = tmp_path / "tf_elastic.py"
    script.write_text(textwrap.dedent(TF_ELASTIC.format(here=str(tmp_path))))
    out = launch_elastic(script, max_restarts=1, timeout=200)
    lines = {rank: [line.split("]: ", 1)[1] for line in out.splitlines() if line.startswith(f"[rank{rank}]: ")]
             for rank in (0, 1)}
    steps = {rank: {int(line.split()[1]): line for line in lines[rank] if line.startswith("step ")} for rank in (0, 1)}
    entered = [line for line in lines[1] if line.startswith("enter ")]
    assert entered[0] == "enter 0 size 2 it 0 w 0.000000 0.000000", out
    joined = entered[-1].split()
    joined_at = int(joined[1])
    assert joined_at > 3 and joined[3] == "2", out  # rank 0's progress, in a world of two again
    # the replacement's first view: rank 0's step count and weights after the same number of steps
    assert entered[-1].split(" it ")[1] == steps[0][joined_at].split(" it ")[1], out
    after = sorted(s for s in steps[1] if s > joined_at)
    assert len(after) == 5 and all(steps[1][s] == steps[0][s] for s in after), out  # the same steps since
    assert all(" size 2 " in steps[0][s] for s in after), out
    assert "[rank0]: done" in out and lines[1][-1] == "done"

"""gluon.Trainer with kvstore='pslink': two worker processes against MXNet's local kvstore.

Each configuration runs examples/mxnet/gluon_train.py twice: as 2 workers with `pslink launch`
(each on its half of every combined minibatch) and alone with MXNet's local kvstore on the
combined minibatch. dist_sync sums the workers' gradients, so both must end with the same
weights (up to float32 rounding), and training must converge.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

from pslink.core.service import Service  # noqa: E402
from tests.mxnet.mxnet_procs import EXAMPLE, launch, run_alone  # noqa: E402

pytestmark = pytest.mark.integration

COMMON = ["--epochs", "3", "--no-progress", "--seed", "3"]
BATCH = 32  # per worker; the local reference trains on 2 x BATCH

CONFIGS = {
    # kvstore='pslink' by name; update_on_kvstore defaults to true: the service steps momentum SGD.
    "sgd-momentum-on-service": (["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9"], True, 1e-5),
    # The service sums gradients; each worker's own optimizer steps.
    "sgd-momentum-on-workers": (["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
                                 "--update-on-kvstore", "false"], False, 1e-5),
    # The store passed as an instance; Adam with weight decay on the service (MXNet's epsilon rule).
    "adam-on-service-instance": (["--optimizer", "adam", "--lr", "0.01", "--wd", "0.001", "--instance"], True, 1e-4),
}


@pytest.fixture(scope="module")
def service():
    with Service(aggregators=2) as s:
        yield s


def read_run(tmp_path, name):
    return json.loads((tmp_path / f"{name}.json").read_text()), dict(np.load(tmp_path / f"{name}.npz"))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_workers_end_with_the_weights_of_the_local_kvstore_on_the_combined_batch(service, tmp_path, config):
    args, on_service, atol = CONFIGS[config]
    code, out = launch(EXAMPLE, COMMON + args + [
        "--batch-size", BATCH, "--save", tmp_path / "w-{rank}.npz", "--result", tmp_path / "w-{rank}.json",
        "--save-states", tmp_path / "states-{rank}",
    ], service.address, job=f"gluon-{config}")
    assert code == 0, out
    code, ref_out = run_alone(EXAMPLE, COMMON + [a for a in args if a != "--instance"] + [
        "--kvstore", "local", "--batch-size", 2 * BATCH,
        "--save", tmp_path / "ref.npz", "--result", tmp_path / "ref.json", "--save-states", tmp_path / "ref-states",
    ])
    assert code == 0, ref_out

    ref, ref_weights = read_run(tmp_path, "ref")
    assert ref["update_on_kvstore"] is on_service and ref["kvstore"] == "local"
    for rank in (0, 1):
        result, weights = read_run(tmp_path, f"w-{rank}")
        assert result["workers"] == 2 and result["kvstore"] == "pslink_dist_sync", result
        assert result["update_on_kvstore"] is on_service, result
        assert result["steps"] == ref["steps"] > 0
        # Converged: a trained classifier, far from the initial loss.
        assert result["train_accuracy"] > 0.9 and result["test_accuracy"] > 0.85, result
        assert result["last_loss"] < result["first_loss"] / 4, result
        assert weights.keys() == ref_weights.keys()
        for name in ref_weights:
            np.testing.assert_allclose(weights[name], ref_weights[name], rtol=1e-4, atol=atol,
                                       err_msg=f"rank {rank}, parameter {name}, {config}")
    assert abs(result["train_accuracy"] - ref["train_accuracy"]) < 0.01

    # Trainer.save_states went through the store: MXNet's updater format, with the optimizer.
    states = pickle.loads((tmp_path / "states-0").read_bytes())
    if on_service:
        saved_states, optimizer = states
        # the service's momentum / moments, as MXNet's local updater keeps them after the same steps
        ref_states, _ = pickle.loads((tmp_path / "ref-states").read_bytes())
        assert saved_states.keys() == ref_states.keys() and saved_states
        for key, ref_state in ref_states.items():
            pairs = zip(saved_states[key], ref_state) if isinstance(ref_state, tuple) else [(saved_states[key], ref_state)]
            for got, want in pairs:
                np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-3, atol=max(atol, 1e-6),
                                           err_msg=f"optimizer state of key {key}, {config}")
        assert type(optimizer).__name__.lower() == args[args.index("--optimizer") + 1]
        assert optimizer.lr == float(args[args.index("--lr") + 1])
        assert optimizer.num_update == result["steps"]  # counted per key update, as MXNet's server does


def test_async_rounds_train_through_pslink_async(service, tmp_path):
    code, out = launch(EXAMPLE, COMMON + [
        "--kvstore", "pslink_async", "--batch-size", BATCH, "--lr", "0.05", "--result", tmp_path / "a-{rank}.json",
    ], service.address, job="gluon-async")
    assert code == 0, out
    for rank in (0, 1):
        result = json.loads((tmp_path / f"a-{rank}.json").read_text())
        assert result["kvstore"] == "pslink_dist_async"
        assert result["update_on_kvstore"] is True  # MXNet's Trainer forces it for async stores
        assert result["train_accuracy"] > 0.85 and result["last_loss"] < result["first_loss"] / 4, result


def test_two_groups_syncing_every_step_end_with_the_flat_jobs_weights(service, tmp_path):
    """4 workers as 2 groups of 2 (`pslink launch --sync local:1 --groups 2`): a group sums 2 of
    the 4 gradients (each Trainer normalizes by the combined batch of 4), so at twice the
    learning rate, with momentum SGD on the workers (linear in the gradients), averaging the
    groups' weights after every step is the flat 4-worker job."""
    common = ["--epochs", "1", "--no-progress", "--seed", "3", "--optimizer", "sgd", "--momentum", "0.9", "--batch-size", BATCH]
    runs = {}
    for name, lr, launcher in (("flat", "0.1", ()), ("groups", "0.2", ("--sync", "local:1", "--groups", "2"))):
        code, out = launch(EXAMPLE, common + ["--lr", lr, "--save", tmp_path / f"{name}-{{rank}}.npz",
                                              "--result", tmp_path / f"{name}-{{rank}}.json"],
                           service.address, job=f"gluon-{name}-4", workers=4, timeout=150, launcher=launcher)
        assert code == 0, out
        runs[name] = [dict(np.load(tmp_path / f"{name}-{rank}.npz")) for rank in range(4)]
        # The group store has no optimizer capability: the Trainer steps on the workers by itself.
        assert json.loads((tmp_path / f"{name}-0.json").read_text())["update_on_kvstore"] == (name == "flat")
    for rank in range(4):
        for key, flat in runs["flat"][rank].items():
            np.testing.assert_allclose(runs["groups"][rank][key], flat, rtol=1e-4, atol=1e-5, err_msg=f"rank {rank} {key}")
    for rank in (1, 2, 3):  # one model on every worker after the last step's sync
        for key, first in runs["groups"][0].items():
            np.testing.assert_array_equal(runs["groups"][rank][key], first)

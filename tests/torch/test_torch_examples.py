"""The examples and a Horovod script, run by ``pslink launch`` with 2 real worker processes."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")
pytest.importorskip("sklearn", reason="the examples train on scikit-learn's digits data set")

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "torch")
CLI = [sys.executable, "-m", "pslink.cli", "launch"]


def launch(args: list[str], timeout: float = 110.0, launcher: tuple[str, ...] = ("-n", "2")) -> subprocess.CompletedProcess:
    done = subprocess.run(CLI + list(launcher) + [sys.executable] + args, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PSLINK_TIMEOUT="60"))
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_horovod_example_equals_one_process_on_the_combined_batches(tmp_path):
    epochs, batch_size, lr = 2, 32, 0.1
    saved = tmp_path / "weights.pt"
    done = launch([os.path.join(EXAMPLES, "train_horovod.py"), "--epochs", str(epochs), "--batch-size",
                   str(batch_size), "--lr", str(lr), "--save", str(saved)])
    assert "[rank0]: test accuracy" in done.stdout
    distributed = torch.load(saved)

    # One process, no pslink: rank 0's initial weights, each step on both ranks' batches at once.
    example = load_example("train_horovod")
    train, _ = example.datasets()
    model = example.build_model(seed=0)
    optimizer = example.build_optimizer(model, lr)
    for epoch in range(epochs):
        shards = [example.loader(train, rank, 2, batch_size, epoch) for rank in (0, 1)]
        for (x0, y0), (x1, y1) in zip(*shards, strict=True):
            assert len(x0) == len(x1)  # equal shards: the mean of the means is the combined mean
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
            optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(distributed[name], value, rtol=1e-4, atol=1e-5)


def test_the_ddp_example_trains_and_differs_from_stock_ddp_by_the_hook_line():
    path = os.path.join(EXAMPLES, "train_ddp.py")
    with open(path) as f:
        source = f.read()
    # Lines whose code (not strings or comments) names pslink: the import and the hook.
    rows = sorted({t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
                   if t.type == tokenize.NAME and t.string == "pslink"})
    lines = [source.splitlines()[row - 1].strip() for row in rows]
    assert [line.split("(")[0] for line in lines] == ["import pslink.torch", "model.register_comm_hook"]
    done = launch([path, "--epochs", "3"])
    accuracies = re.findall(r"\[rank(\d)\]: rank \1: test accuracy (\d\.\d+)", done.stdout)
    assert len(accuracies) == 2, done.stdout
    assert accuracies[0][1] == accuracies[1][1]  # the same model on both ranks
    assert float(accuracies[0][1]) > 0.8


def test_a_horovod_script_runs_after_changing_only_its_import_line(tmp_path):
    with open(os.path.join(os.path.dirname(__file__), "horovod_script.py")) as f:
        original = f.read()
    assert original.count("import horovod.torch as hvd\n") == 1 and "pslink" not in original.split('"""', 2)[2]
    script = tmp_path / "horovod_script.py"
    script.write_text(original.replace("import horovod.torch as hvd\n", "import pslink.torch as hvd\n"))
    done = launch([str(script), "--epochs", "2", "--fp16-allreduce", "--uneven"])
    assert "[rank0]: epoch 2: rank 0 joined last" in done.stdout  # rank 1 ran out of data first
    results = re.findall(r"\[rank(\d)\]: rank \1 of 2: accuracy (\S+) config \{'epochs': 2\} ranks \[0, 1\]",
                         done.stdout)
    assert len(results) == 2, done.stdout
    assert results[0][1] == results[1][1]
    assert "Test set: Average loss" in done.stdout


def test_a_horovod_script_trains_as_two_groups_with_one_launcher_option(tmp_path):
    script = tmp_path / "horovod_script.py"
    with open(os.path.join(os.path.dirname(__file__), "horovod_script.py")) as f:
        script.write_text(f.read().replace("import horovod.torch as hvd\n", "import pslink.torch as hvd\n"))
    # 2 groups of 2: each a Horovod job of its own (rank r of 2), sharding the data between its
    # workers; 23 steps an epoch, so syncing every 23 ends each epoch on one model. Both groups
    # start from one seed and read the same shards: their average is the 2-worker job's model.
    pattern = r"\[rank(\d)\]: rank (\d) of 2: accuracy (\S+) config \{'epochs': 2\} ranks \[0, 1\]"
    done = launch([str(script), "--epochs", "2"], timeout=150.0,
                  launcher=("-n", "4", "--sync", "local:23", "--groups", "2"))
    results = re.findall(pattern, done.stdout)
    assert sorted((int(rank), int(local)) for rank, local, _ in results) == [(0, 0), (1, 1), (2, 0), (3, 1)], done.stdout
    flat = re.findall(pattern, launch([str(script), "--epochs", "2"]).stdout)
    assert len(flat) == 2
    assert {accuracy for _, _, accuracy in results} == {flat[0][2]}, (results, flat)


def test_the_ctr_example_learns_with_its_table_on_the_service():
    done = launch([os.path.join(EXAMPLES, "ctr.py"), "--embedding", "service", "--steps", "300", "--vocabulary",
                   "2000"])
    found = re.findall(r"\[rank(\d)\]: .*held-out AUC ([0-9.]+) \(the hidden model's: ([0-9.]+)\)", done.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], done.stdout
    for _, got, best in found:
        # Far above chance (0.5) and close to what the hidden model itself scores.
        assert float(got) > 0.65 and float(got) > float(best) - 0.06, done.stdout
    assert len({got for _, got, _ in found}) == 1  # both ranks evaluate the same model

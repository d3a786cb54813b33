"""The trainers users run on top of torch.distributed, over the ``pslink`` backend: PyTorch
Lightning's ``Trainer`` (``DDPStrategy(process_group_backend="pslink")``), Hugging Face Accelerate's
``Accelerator`` with a manual loop, and transformers' ``Trainer``. Each trains a tiny model for a
few steps on 2 real processes, once over gloo and once over pslink, from the same seeds and data,
and the final weights must be equal bit for bit: every reduction is DDP's (or the trainer's) sum of
2 float32 values, which is the same whichever rank's value comes first, and gathers and broadcasts
copy bits. Each framework that is not installed is a visible skip (``pip install 'pslink[trainers]'``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")

from pslink.core.service import Service  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = [sys.executable, "-m", "pslink.cli", "launch", "-n", "2"]
# One thread per process: 2 ranks on a 2-core machine, and the same for the gloo and pslink runs.
# Nothing may reach the Hugging Face hub (the models are built from configs).
ENVIRONMENT = {"PSLINK_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
RUN_TIMEOUT = 150.0  # seconds for one run of 2 processes (importing transformers alone takes ~5 s each)
# A test makes up to 2 runs (the first Lightning test also its fixture's gloo run).
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2 * RUN_TIMEOUT + 30)]


def run(command: list[str], scratch, timeout: float = RUN_TIMEOUT, **env) -> str:
    """Runs ``command`` (a launcher and its 2 ranks) in a process group of its own, killed whole
    if it does not finish in time, and returns its output (shown in the failure otherwise)."""
    scratch.mkdir(exist_ok=True)
    process = subprocess.Popen(command + [str(scratch)], env=dict(os.environ, **ENVIRONMENT, **env),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and every rank it (or the trainer) started
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout:g} s:\n{output[-4000:]}")
    assert process.returncode == 0, f"{' '.join(command)} exited with {process.returncode}:\n{output[-4000:]}"
    return output


def results(scratch) -> list[dict]:
    found = sorted(os.listdir(scratch))
    assert {"rank0.pt", "rank1.pt"} <= set(found), f"a rank wrote no result: {found}"
    return [torch.load(scratch / f"rank{rank}.pt") for rank in (0, 1)]


def launched(worker: str, backend: str, scratch) -> list[dict]:
    run(LAUNCH + [sys.executable, os.path.join(HERE, worker), backend], scratch)
    return results(scratch)


def assert_same_weights(expected: dict, got: dict, what: str) -> None:
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        difference = (got[name].double() - value.double()).abs().max().item()
        assert torch.equal(got[name], value), f"{what}: parameter {name!r} differs by up to {difference:g}"


def assert_trained_alike(reference: list[dict], runs: list[dict]) -> None:
    """Both ranks of ``runs`` end with the reference's weights, bit for bit, and training moved
    them (a run that did nothing cannot pass)."""
    for rank, (expected, got) in enumerate(zip(reference, runs, strict=True)):
        assert_same_weights(expected["initial"], got["initial"], f"rank {rank}'s initial weights")
        assert_same_weights(expected["weights"], got["weights"], f"rank {rank}, pslink against gloo")
        assert any(not torch.equal(got["weights"][n], got["initial"][n]) for n in got["weights"]), \
            f"rank {rank}: training left every weight as it was"
    assert_same_weights(runs[0]["weights"], runs[1]["weights"], "rank 1 against rank 0")


# -- PyTorch Lightning -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_over_gloo(tmp_path_factory) -> list[dict]:
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install 'pslink[trainers]')")
    runs = launched("trainers_lightning.py", "gloo", tmp_path_factory.mktemp("lightning-gloo"))
    assert [r["backend"] for r in runs] == ["gloo", "gloo"]
    return runs


def test_lightning_ddp_strategy_on_pslink_under_pslink_launch_equals_gloo(tmp_path, lightning_over_gloo):
    runs = launched("trainers_lightning.py", "pslink", tmp_path)
    for rank, result in enumerate(runs):
        assert (result["backend"], result["launcher"], result["world_size"]) == ("pslink", "pslink launch", 2)
        assert result["steps"] == lightning_over_gloo[rank]["steps"] == 6
        # self.log(..., sync_dist=True): Lightning's own all-reduce of the logged loss.
        assert torch.equal(result["loss"], lightning_over_gloo[rank]["loss"])
    assert_trained_alike(lightning_over_gloo, runs)


def test_lightning_starting_its_own_processes_on_pslink_equals_gloo(tmp_path, lightning_over_gloo):
    """``python train.py`` with ``devices=2``: Lightning starts rank 1 itself; the service is one the
    user runs (here in the test process) and names with ``PSLINK_MASTER``."""
    with Service(aggregators=1) as service:
        run([sys.executable, os.path.join(HERE, "trainers_lightning.py"), "pslink"], tmp_path,
            PSLINK_MASTER=service.address)
    runs = results(tmp_path)
    assert [(r["backend"], r["launcher"]) for r in runs] == [("pslink", "lightning")] * 2
    assert_trained_alike(lightning_over_gloo, runs)


# -- Hugging Face ------------------------------------------------------------------------------------------


def test_accelerate_with_the_group_made_first_on_pslink_equals_gloo(tmp_path):
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'pslink[trainers]')")
    reference = launched("trainers_accelerate.py", "gloo", tmp_path / "gloo")
    runs = launched("trainers_accelerate.py", "pslink", tmp_path / "pslink")
    for rank, (expected, got) in enumerate(zip(reference, runs, strict=True)):
        assert (expected["backend"], got["backend"]) == ("gloo", "pslink")
        # Accelerate names the backend it would have chosen, not the group's: on CPU always "gloo".
        assert got["accelerate_backend"] == "gloo" and got["distributed_type"] == "DistributedType.MULTI_CPU"
        assert (got["num_processes"], got["rank"], got["steps"]) == (2, rank, 6)
        assert torch.equal(got["losses"], expected["losses"])  # accelerator.gather, every step
        assert torch.equal(got["mean_loss"], expected["mean_loss"])  # accelerator.reduce
    assert_trained_alike(reference, runs)


def test_transformers_trainer_with_the_group_made_first_on_pslink_equals_gloo(tmp_path):
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'pslink[trainers]')")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pslink[trainers]')")
    reference = launched("trainers_transformers.py", "gloo", tmp_path / "gloo")
    runs = launched("trainers_transformers.py", "pslink", tmp_path / "pslink")
    for rank, (expected, got) in enumerate(zip(reference, runs, strict=True)):
        assert (expected["backend"], got["backend"]) == ("gloo", "pslink")
        assert (got["parallel_mode"], got["world_size"], got["rank"], got["steps"]) == \
            ("ParallelMode.DISTRIBUTED", 2, rank, 4)
        assert got["losses"] == expected["losses"] and len(got["losses"]) == 4  # averaged over the ranks
        assert got["eval_loss"] == expected["eval_loss"]  # every rank's predictions gathered
    assert_trained_alike(reference, runs)

"""examples/tf/train_digits_keras.py, run the way its docstring says: ``pslink launch -n 2``."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (the example trains on its digits)")

import tf_harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = tf_harness.REPO / "examples" / "tf" / "train_digits_keras.py"


def run_launch_cli(args: list[str], timeout: float) -> tuple[int, str]:
    """``pslink launch`` as a user types it; on a timeout, Ctrl-C it (it stops its workers and
    service), then kill whatever is left."""
    proc = subprocess.Popen([sys.executable, "-m", "pslink.cli", "launch", *args], cwd=tf_harness.REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        descendants = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=30)
        finally:
            for child in descendants:
                if child.is_running():
                    child.kill()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        pytest.fail(f"pslink launch did not finish within {timeout} s:\n{output[-4000:]}")


@pytest.mark.timeout(360)
def test_the_keras_example_trains_two_workers_with_keras_progress_output():
    code, output = run_launch_cli(["-n", "2", sys.executable, str(EXAMPLE), "--epochs", "3"], timeout=300)
    assert code == 0, output[-4000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: worker {rank} of 2:" in output
        # Keras' own progress output, one line per epoch, averaged over the workers
        epochs = re.findall(rf"^\[rank{rank}\]: Epoch (\d)/3$", output, re.MULTILINE)
        assert epochs == ["1", "2", "3"], output[-4000:]
        lines = re.findall(rf"^\[rank{rank}\]: \d+/\d+ - .*accuracy: ([\d.]+) - loss: ([\d.]+) - "
                           rf"val_accuracy: ([\d.]+) - val_loss: ([\d.]+)$", output, re.MULTILINE)
        assert len(lines) == 3, output[-4000:]
        assert float(lines[-1][1]) < float(lines[0][1]), "the loss did not fall"
        accuracy = re.search(rf"^\[rank{rank}\]: worker {rank}: test accuracy ([\d.]+)", output, re.MULTILINE)
        assert accuracy and float(accuracy.group(1)) > 0.8, output[-4000:]
    # Metrics are averaged over the workers, and the workers hold one model: equal figures.
    assert (re.findall(r"^\[rank0\]: \d+/\d+ - \S+ - \S+ - (.*)$", output, re.MULTILINE)
            == re.findall(r"^\[rank1\]: \d+/\d+ - \S+ - \S+ - (.*)$", output, re.MULTILINE))

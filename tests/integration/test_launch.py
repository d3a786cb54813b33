"""``pslink launch``: environment, prefixed output, failure propagation, Ctrl-C. Real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "pslink.cli"]

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import pslink

    mode = sys.argv[1]
    rank = int(os.environ["PSLINK_RANK"])
    if mode == "train":
        with pslink.connect() as agent:   # everything from the environment
            out = agent.pushpull("w", np.full(4, rank + 1.0)).wait()
            print(f"sum {out[0]:.0f} of {agent.num_workers} workers, local rank {os.environ['PSLINK_LOCAL_RANK']}")
            env = os.environ
            print(f"torchrun {env['RANK']}/{env['WORLD_SIZE']} local {env['LOCAL_RANK']}/{env['LOCAL_WORLD_SIZE']} "
                  f"at {env['MASTER_ADDR']}:{env['MASTER_PORT']}")
            print(f"horovodrun {env['HOROVOD_RANK']}/{env['HOROVOD_SIZE']} local {env['HOROVOD_LOCAL_RANK']}/"
                  f"{env['HOROVOD_LOCAL_SIZE']} cross {env['HOROVOD_CROSS_RANK']}/{env['HOROVOD_CROSS_SIZE']}")
    elif mode == "fail":
        if rank == 1:
            print("rank 1 fails now", flush=True)
            sys.exit(3)
        time.sleep(600)
    elif mode == "kill":
        if rank == 0:
            os.kill(os.getpid(), 9)
        time.sleep(600)
    elif mode == "hang":
        print("ready", flush=True)
        time.sleep(600)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def run_launch(args, timeout=120):
    return subprocess.run(CLI + ["launch"] + args, capture_output=True, text=True, timeout=timeout)


def test_workers_get_their_environment_and_prefixed_output(script):
    done = run_launch(["-n", "3", sys.executable, script, "train"])
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(3):
        assert f"[rank{rank}]: sum 6 of 3 workers, local rank {rank}" in done.stdout
    # torchrun's variables too, one rendezvous port shared by every rank
    ports = set()
    for rank in range(3):
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"[rank{rank}]: torchrun"))
        assert f"torchrun {rank}/3 local {rank}/3 at 127.0.0.1:" in line
        ports.add(int(line.rsplit(":", 1)[1]))
        assert f"[rank{rank}]: horovodrun {rank}/3 local {rank}/3 cross 0/1" in done.stdout  # and horovodrun's
    assert len(ports) == 1 and 0 < ports.pop() < 65536


def test_the_first_failure_is_returned_and_the_others_are_stopped(script):
    started = time.monotonic()
    done = run_launch(["-n", "3", sys.executable, script, "fail"])
    assert done.returncode == 3
    assert "[rank1]: rank 1 fails now" in done.stdout
    assert "pslink launch: rank 1 exited with status 3; stopping the other workers" in done.stdout
    assert time.monotonic() - started < 60  # the sleeping ranks were stopped, not waited for


def test_a_killed_worker_makes_launch_exit_non_zero_naming_it(script):
    done = run_launch(["-n", "2", sys.executable, script, "kill"])
    assert done.returncode == 128 + 9
    assert "rank 0 was killed by SIGKILL" in done.stdout


def test_an_existing_service_is_used_when_given(script):
    from pslink.core.service import Service

    with Service(aggregators=1) as service:
        done = run_launch(["-n", "2", "--service", service.address, "--job", "given", sys.executable, script, "train"])
        assert done.returncode == 0, done.stdout
        assert "[rank1]: sum 3 of 2 workers" in done.stdout


def test_ctrl_c_stops_every_process(script):
    proc = subprocess.Popen(CLI + ["launch", "-n", "2", sys.executable, script, "hang"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 2:  # both workers are up
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "workers did not start"
            seen += "ready" in line
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 4  # 2 workers + the embedded service's 2 Aggregators
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        gone, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launch_without_a_command_is_a_clear_error():
    done = run_launch(["-n", "2"])
    assert done.returncode != 0
    assert "Missing argument" in done.stderr or "needs a command" in done.stderr


@pytest.mark.parametrize("options, words", [
    (["--sync", "local:x"], "'local:T'"),
    (["--groups", "2"], "--groups goes with --sync"),
    (["--sync", "local:2", "--min-np", "1"], "not for ps-lite or elastic jobs"),
])
def test_group_options_that_cannot_work_are_refused_before_anything_starts(options, words):
    done = run_launch(["-n", "2", *options, sys.executable, "-c", "pass"])
    assert done.returncode != 0
    assert words in " ".join(done.stderr.split()), done.stderr  # (rich wraps long lines)

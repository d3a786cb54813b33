"""The DDP comm hook: same gradients and weights as gloo's all-reduce on 2 real processes, bad
input (no service, buckets that differ, a worker killed mid-run, a rank that never answers), and
what it does inside one process (keys across bucket rebuilds, staging of bfloat16 buckets)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")
dist = pytest.importorskip("torch.distributed", reason="torch was built without torch.distributed")

import pslink  # noqa: E402
import pslink.torch  # noqa: E402
from pslink.core.transport import Transports  # noqa: E402
from pslink.core.transport.options import rings_supported  # noqa: E402
from pslink.errors import ConfigError, PeerError  # noqa: E402
from pslink.torch.ddp import HookState  # noqa: E402
from tests.helpers import start_cluster  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
CLI = [sys.executable, "-m", "pslink.cli", "launch"]


def launch(case: str, scratch, timeout: float = 100.0, workers: int = 2, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **env)
    return subprocess.run(CLI + ["-n", str(workers), sys.executable, WORKER, case, str(scratch)],
                          capture_output=True, text=True, timeout=timeout, env=environment)


# -- two processes ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("case", ["compare", "compare-large"])
def test_the_hook_gives_the_gradients_and_weights_of_gloo_all_reduce(tmp_path, case):
    done = launch(case, tmp_path, PSLINK_TIMEOUT="60")
    assert done.returncode == 0, done.stdout + done.stderr
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for result in results:
        assert len(result["stock"]) == len(result["hooked"]) == 6
        for step, (stock, hooked) in enumerate(zip(result["stock"], result["hooked"], strict=True)):
            for a, b in zip(stock, hooked, strict=True):
                torch.testing.assert_close(b, a, msg=lambda m, step=step: f"step {step}: {m}")
        for a, b in zip(result["stock_weights"], result["hooked_weights"], strict=True):
            torch.testing.assert_close(b, a)
        assert len(result["generations"]) >= 2  # several buckets
        if case == "compare":
            # Small buckets: DDP's rebuild of them after the first step gives a second key generation.
            assert max(result["generations"].values()) >= 1
            assert not result["rings"]  # payloads under 64 KiB stay on the socket
        else:
            assert result["rings"] == rings_supported()  # 1 MB buckets cross through shared memory
    for a, b in zip(results[0]["hooked_weights"], results[1]["hooked_weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.integration
def test_the_hook_with_groups_syncs_weights_every_t_steps_and_every_step_is_the_flat_job(tmp_path):
    done = launch("groups", tmp_path, timeout=150.0, workers=4, PSLINK_TIMEOUT="60")
    assert done.returncode == 0, done.stdout + done.stderr
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    assert [r["every1_job"] for r in results][::2] == [results[0]["every1_job"][:-1] + "0",
                                                       results[0]["every1_job"][:-1] + "1"]  # <job>.g0, <job>.g1
    for result in results:
        for step, (flat, grouped) in enumerate(zip(result["flat"], result["every1"], strict=True)):
            for a, b in zip(flat, grouped, strict=True):  # the same sums, in another order: to rounding
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")

    def same(rank_a, rank_b, step):
        return all(torch.equal(a, b) for a, b in zip(results[rank_a]["every3"][step], results[rank_b]["every3"][step]))

    for step in range(6):
        assert same(0, 1, step) and same(2, 3, step)  # a group steps as one
        # The groups train on their own data and meet at the end of steps 3 and 6 (indices 2, 5).
        assert same(0, 2, step) == (step in (2, 5)), f"step {step + 1}"


@pytest.mark.integration
def test_ranks_whose_buckets_differ_get_an_error_naming_the_bucket_and_both_shapes(tmp_path):
    done = launch("mismatch", tmp_path, PSLINK_TIMEOUT="60")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith(f"[rank{rank}]: backward failed")), "")
        assert "ShapeMismatchError: DDP gradient bucket 0" in line, done.stdout
        assert "rank 0 has shape (" in line and "rank 1 has shape (" in line
        assert "bucket_cap_mb" in line


@pytest.mark.integration
def test_a_worker_killed_mid_run_stops_the_launch_naming_it(tmp_path):
    # A long timeout: only the launcher noticing the death can end this run in time.
    done = launch("kill", tmp_path, timeout=90.0, PSLINK_TIMEOUT="600")
    assert done.returncode == 128 + 9, done.stdout + done.stderr
    assert "[rank0]: step 2" in done.stdout  # it was training when rank 1 died
    assert "pslink launch: rank 1 was killed by SIGKILL; stopping the other workers" in done.stdout


# -- one process ------------------------------------------------------------------------------------


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    gc.collect()  # DDP models first (ENVIRONMENT.md)
    dist.destroy_process_group()


@pytest.fixture
def cluster():
    transports = Transports()
    service = start_cluster("tcp", aggregators=1, transports=transports)
    yield service, transports
    service.stop()
    transports.close()


def test_no_reachable_service_fails_when_the_hook_is_registered(process_group):
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    with pytest.raises(PeerError) as info:
        ddp.register_comm_hook(pslink.torch.connect(job="lonely", master="tcp://127.0.0.1:9", connect_timeout=2.0),
                               pslink.torch.comm_hook)
    assert "no parameter service reachable" in info.value.message
    assert "tcp://127.0.0.1:9" in info.value.message
    assert "pslink launch" in info.value.message
    del ddp


def test_connect_checks_its_settings(process_group, cluster):
    service, transports = cluster
    with pytest.raises(ConfigError, match="2 workers"):
        pslink.torch.connect(job="sizes", rank=0, num_workers=2, master=service.address, transports=transports)
    # One set of names for every connect: a word from torchrun or Horovod is named for what it means.
    with pytest.raises(ConfigError, match="unknown option 'size'; did you mean 'num_workers'"):
        pslink.torch.connect(job="sizes", rank=0, size=2, master=service.address, transports=transports)
    with pytest.raises(ConfigError, match="unknown option 'world_size'; did you mean 'num_workers'"):
        pslink.connect("sizes", 0, master=service.address, world_size=2)
    with pytest.raises(ConfigError, match="unknown option 'timout'; did you mean 'timeout'"):
        pslink.connect("sizes", 0, 2, service.address, timout=3)
    with pytest.raises(ConfigError, match="mode 'sum'"):
        pslink.torch.connect(job="modes", master=service.address, optimizer={"type": "sgd", "lr": 0.1})
    with pytest.raises(ConfigError, match="name"):
        pslink.torch.connect(job="names", master=service.address, transports=transports, name="a/b")


def grads_of(model, x):
    model.zero_grad()
    model(x).float().pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_one_rank_with_bfloat16_buckets_gets_its_own_gradients_back(process_group, cluster):
    service, transports = cluster
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    plain = [p.detach().clone() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    state = pslink.torch.connect(job="bf16", master=service.address, transports=transports)
    ddp.register_comm_hook(state, pslink.torch.comm_hook)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    with torch.no_grad():
        for p, value in zip(reference.parameters(), plain, strict=True):
            p.copy_(value)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    for _ in range(3):  # before and after DDP rebuilds its buckets
        for got, expected in zip(grads_of(ddp, x), grads_of(reference, x), strict=True):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, expected)
    assert state._staging._buffers, "bfloat16 buckets travel through float32 staging buffers"
    del ddp
    state.close()


def test_a_bucket_nobody_else_pushes_fails_after_the_timeout(process_group, cluster):
    service, transports = cluster
    # A job of 2 workers of which only rank 0 runs: its buckets can never complete.
    agent = pslink.connect("half", 0, 2, master=service.address, transports=transports, mode="sum")
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    ddp.register_comm_hook(HookState(agent, timeout=1.0), pslink.torch.comm_hook)
    with pytest.raises(RuntimeError) as info:
        ddp(torch.randn(3, 4)).sum().backward()
    assert "DDP gradient bucket 0" in str(info.value)
    assert "got no average within 1 s" in str(info.value) and "another rank died or stalled" in str(info.value)
    del ddp
    agent.close()


def test_a_ddp_model_deleted_without_close_leaves_the_job_when_its_state_is_collected(process_group, cluster):
    # Left open, its Agent would complete the bucket futures still in flight from its own thread,
    # maybe while the interpreter shuts down: a worker died so with SIGABRT ("terminate called
    # without an active exception"). Now the Agent leaves the job with the state.
    service, transports = cluster
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    state = pslink.torch.connect(job="forgotten", rank=0, num_workers=1, master=service.address,
                                 transports=transports)
    agent = state.agent
    ddp.register_comm_hook(state, pslink.torch.comm_hook)
    del state
    assert not agent.closed
    del ddp
    gc.collect()
    assert agent.closed


class FakeBucket:
    """The part of dist.GradBucket that keys depend on."""

    def __init__(self, index: int, numel: int, dtype=torch.float32):
        self._index, self._buffer = index, torch.zeros(numel, dtype=dtype)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_bucket_keys_follow_the_layout_not_the_iteration(cluster):
    service, transports = cluster
    with pslink.connect("keys", 0, 1, master=service.address, transports=transports) as agent:
        state = HookState(agent, name="net")
        first = [state.bucket_key(FakeBucket(0, 1000))]  # iteration 1: one bucket
        rebuilt = [state.bucket_key(FakeBucket(0, 600)), state.bucket_key(FakeBucket(1, 400))]
        again = [state.bucket_key(FakeBucket(0, 600)), state.bucket_key(FakeBucket(1, 400))]
        half = state.bucket_key(FakeBucket(1, 400, torch.float16))
    assert first == ["net/b0.0"]
    assert rebuilt == again == ["net/b0.1", "net/b1.0"]
    assert half == "net/b1.1"


@pytest.mark.integration
def test_a_timeline_of_a_two_worker_ddp_run_is_a_chrome_trace_with_every_key_of_its_window(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    environment = dict(os.environ, PSLINK_TIMEOUT="60", PSLINK_TIMELINE_STEPS="2:5")
    done = subprocess.run(CLI + ["-n", "2", "--timeline", str(trace), sys.executable, WORKER, "compare",
                                 str(tmp_path)], capture_output=True, text=True, timeout=100, env=environment)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "timeline of 2 rank(s)" in done.stdout and str(trace) in done.stdout
    loaded = json.loads(trace.read_text())  # valid JSON, in Chrome's object form
    events = loaded["traceEvents"]
    assert all({"name", "ph", "pid", "tid"} <= set(e) for e in events)
    assert all(("ts" in e and "dur" in e) for e in events if e["ph"] == "X")
    for rank in (0, 1):
        lanes = {e["tid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == rank}
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "request"]
        assert spans and all(2 <= e["args"]["step"] < 5 for e in spans)
        per_key: dict = {}
        for span in spans:
            per_key.setdefault(lanes[span["tid"]], []).append(span)
        # Every bucket's key (as DDP last built them) has a span in each of the window's 3 steps.
        generations = torch.load(tmp_path / f"rank{rank}.pt")["generations"]
        expected = {f"b{index}.{generation}'" for index, generation in generations.items()}
        assert {name.rsplit("/", 1)[1] for name in per_key} == expected
        assert all(len(found) == 3 for found in per_key.values()), {k: len(v) for k, v in per_key.items()}

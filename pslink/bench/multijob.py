"""Four jobs on one Aggregator pool against the same four jobs on servers of their own: the pieces
``benchmarks/multijob.py`` runs (the model each worker trains, the worker process, how a phase's
iterations and the servers' CPU are read).

Each worker trains a small multi-layer perceptron with numpy on the CPU (forward and backward, real
matrix products), and push-pulls its gradients every iteration; the averaged gradients come back and
the worker applies SGD itself (the service's ``sum`` mode, as a DDP hook uses it). Each worker holds
two replicas of its model: one trained through the pool, one through the job's own servers, from the
same seed and on the same batches, so their final weights must be bit-identical.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
import traceback
from dataclasses import dataclass

import numpy as np

POOL = "pool"
DEDICATED = "dedicated"
VARIANTS = (POOL, DEDICATED)
SCALE = 25  # the real models' parameters over each stand-in's
BATCHES = 4  # batches each worker draws once and cycles through (drawing them each iteration is CPU a GPU host does not spend)
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Model:
    """A stand-in for a well-known model: ``layers`` dense layers of ``width`` (weights and bias
    each, so ``2 * layers`` tensors) holding about ``params / SCALE`` parameters; ``batch`` rows a
    step sizes its compute."""

    name: str
    params: int  # the real model's (shared data README)
    tensors: int  # the real model's
    layers: int
    width: int
    batch: int

    @property
    def parameters(self) -> int:
        return self.layers * (self.width * self.width + self.width)

    @property
    def flops(self) -> float:
        """Floating-point operations of one step: forward 2, backward 4 per parameter and row."""
        return 6.0 * self.batch * self.layers * self.width * self.width


def _stand_in(name: str, params: int, tensors: int, layers: int, gflop: float) -> Model:
    width = round(math.sqrt(params / SCALE / layers))
    batch = max(8, round(gflop * 1e9 / (6.0 * layers * width * width)))
    return Model(name, params, tensors, layers, width, batch)


#: The four models of the shared data README (parameters, tensors), each as an MLP with 1/SCALE of
#: its parameters over a fifth of its tensors (at least 8). A step's compute, in GFLOP, is in the
#: order of the real models' per sample, AlexNet the lightest and VGG19 and BERT the heaviest
#: (compressed: about 1 : 3 : 9 : 9, so that the 8 workers fit on a few cores); the batch sets it.
MODELS = {m.name: m for m in (
    _stand_in("alexnet", 61_100_000, 16, layers=4, gflop=0.5),
    _stand_in("resnet50", 25_600_000, 161, layers=16, gflop=1.5),
    _stand_in("vgg19", 143_700_000, 38, layers=8, gflop=4.5),
    _stand_in("bert", 109_500_000, 199, layers=12, gflop=4.5),
)}


class Mlp:
    """ReLU layers of ``model.width``, the last one linear, trained on a squared error. Buffers are
    allocated once: a step's arrays would otherwise be fresh pages every iteration."""

    def __init__(self, model: Model, seed: int):
        rng = np.random.default_rng(seed)
        w, n = model.width, model.batch
        self.model = model
        self.weights: list[np.ndarray] = []
        for _ in range(model.layers):
            self.weights.append((rng.standard_normal((w, w)) * math.sqrt(2.0 / w)).astype(np.float32))
            self.weights.append(np.zeros(w, np.float32))
        self.grads = [np.empty_like(p) for p in self.weights]
        self._acts = [np.empty((n, w), np.float32) for _ in range(model.layers)]  # each layer's output
        self._dz = np.empty((n, w), np.float32)
        self._da = np.empty((n, w), np.float32)

    def gradients(self, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
        """The gradients of ``0.5 * |f(x) - y|^2`` averaged over the batch (into ``self.grads``)."""
        layers = self.model.layers
        inputs = [x] + self._acts[:-1]
        for i in range(layers):
            out = self._acts[i]
            np.matmul(inputs[i], self.weights[2 * i], out=out)
            out += self.weights[2 * i + 1]
            if i < layers - 1:
                np.maximum(out, 0.0, out=out)
        dz = self._dz
        np.subtract(self._acts[-1], y, out=dz)
        dz *= np.float32(1.0 / x.shape[0])
        for i in reversed(range(layers)):
            np.matmul(inputs[i].T, dz, out=self.grads[2 * i])
            np.sum(dz, axis=0, out=self.grads[2 * i + 1])
            if i:
                np.matmul(dz, self.weights[2 * i].T, out=self._da)
                np.multiply(self._da, inputs[i] > 0, out=dz)
        return self.grads

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        self.gradients(x, y)
        return float(0.5 * np.mean(np.sum((self._acts[-1] - y) ** 2, axis=1)))

    def step(self, grads: list[np.ndarray], lr: float = LEARNING_RATE) -> None:
        for p, g in zip(self.weights, grads):
            p -= np.float32(lr) * g

    def digest(self) -> str:
        return hashlib.sha256(b"".join(p.tobytes() for p in self.weights)).hexdigest()


def batches(model: Model, job_index: int, rank: int, count: int = BATCHES) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each worker's own inputs and targets (a rank's differ from the other's), drawn once."""
    rng = np.random.default_rng([job_index, rank])
    shape = (model.batch, model.width)
    return [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)) for _ in range(count)]


def worker(job: str, job_index: int, rank: int, model_name: str, addresses: dict[str, str], commands, reports,
           timeout: float) -> None:
    """One rank of a 2-worker job, with an Agent on each variant's service: runs the parent's
    ``("run", variant, iterations, train)`` commands until ``("stop",)``. Reports
    ``("ready" | "ran" | "done" | "error", job, rank, body)`` on ``reports``; "ran" carries the
    ``(start, end)`` of each iteration on the monotonic clock (one clock for every process here)."""
    try:
        from pslink.core.worker.connect import connect

        model = MODELS[model_name]
        nets = {variant: Mlp(model, seed=job_index) for variant in VARIANTS}
        data = batches(model, job_index, rank)
        trained = dict.fromkeys(VARIANTS, 0)
        keys = list(range(2 * model.layers))
        outs = [np.empty_like(p) for p in nets[POOL].weights]
        with connect(job, rank, 2, master=addresses[POOL], servers=2, timeout=timeout) as pooled, \
                connect(job, rank, 2, master=addresses[DEDICATED], servers=2, timeout=timeout) as own:
            agents = {POOL: pooled, DEDICATED: own}
            for agent in agents.values():
                agent.init_many(keys, [np.zeros_like(p) for p in outs]).wait(timeout)
            reports.put(("ready", job, rank, None))
            while True:
                command = commands.get(timeout=timeout)
                if command[0] == "stop":
                    break
                _, variant, iterations, train = command
                net, agent, spans = nets[variant], agents[variant], []
                for _ in range(iterations):
                    start = time.monotonic()
                    x, y = data[trained[variant] % len(data)]
                    agent.pushpull_many(keys, net.gradients(x, y), outs=outs, average=True).wait(timeout)
                    if train:  # warm-up iterations leave the replica as it was
                        net.step(outs)
                        trained[variant] += 1
                    spans.append((start, time.monotonic()))
                reports.put(("ran", job, rank, (variant, spans)))
            reports.put(("done", job, rank, {v: (trained[v], nets[v].digest()) for v in VARIANTS}))
    except Exception:  # the parent waits on reports: it must hear of the failure, not time out
        reports.put(("error", job, rank, traceback.format_exc()))


# -- reading a phase ----------------------------------------------------------------------------------


def common_window(spans: dict[str, list[tuple[float, float]]]) -> tuple[float, float]:
    """From the last job's first iteration to the first job's last one: while every job ran, so
    that each job's iterations are read under the same company in both variants."""
    if not spans or any(not s for s in spans.values()):
        raise ValueError(f"a job ran no iteration: {sorted(j for j, s in spans.items() if not s)}")
    return max(s[0][0] for s in spans.values()), min(s[-1][1] for s in spans.values())


def durations_within(spans: list[tuple[float, float]], window: tuple[float, float]) -> list[float]:
    """The durations of the iterations that started and ended inside ``window``."""
    low, high = window
    return [end - start for start, end in spans if start >= low and end <= high]


def iteration_counts(medians: dict[str, float], seconds: float, least: int) -> dict[str, int]:
    """How many iterations each job runs in a phase of about ``seconds`` at its median iteration
    (at least ``least``, so that a phase always holds a few of the slowest job's)."""
    if seconds <= 0 or least < 1:
        raise ValueError(f"a phase needs seconds > 0 and at least 1 iteration, not {seconds} and {least}")
    bad = {job: m for job, m in medians.items() if not m > 0}
    if bad:
        raise ValueError(f"iteration medians must be positive, got {bad}")
    return {job: max(least, round(seconds / m)) for job, m in medians.items()}


class CpuMeter:
    """CPU seconds (user + system) a set of processes burned between :meth:`start` and the last
    :meth:`sample`. Processes that appear later count from zero (all their life is in the window);
    one that ends keeps what it was last seen at."""

    def __init__(self, pids):
        self._pids = pids  # a callable: the pids to watch now
        self._base: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self.most = 0  # the most processes alive at once

    @staticmethod
    def _read(pid: int) -> float | None:
        import psutil

        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        return times.user + times.system

    def start(self) -> None:
        self._base, self._last = {}, {}
        for pid in self._pids():
            seconds = self._read(pid)
            if seconds is not None:
                self._base[pid] = self._last[pid] = seconds
        self.most = len(self._base)

    def sample(self) -> None:
        alive = 0
        for pid in self._pids():
            seconds = self._read(pid)
            if seconds is None:
                continue
            alive += 1
            self._base.setdefault(pid, 0.0)
            self._last[pid] = seconds
        self.most = max(self.most, alive)

    @property
    def seconds(self) -> float:
        return sum(self._last[pid] - self._base[pid] for pid in self._last)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3

"""Measure the cost model on the real Aggregator: ``pslink simulate calibrate``.

An :class:`~pslink.core.aggregator.core.AggregatorCore` (the very object an Aggregator process runs)
serves one task while this module plays its workers, exactly as the process shell does: admit the
header, receive the payload into the buffer the core hands out, let the core handle the request,
send the replies. Sockets are left out so that only the Aggregator's own CPU is counted; the two
copies a socket makes on the Aggregator's CPU (receiving a push, sending a reply) are made here
with ``numpy.copyto`` into and out of the same buffers, each reply into its own destination as
each worker has its own connection. What a round costs is the thread's CPU time
(``time.thread_time``, as the Aggregator measures e_t), the median over several rounds.

Rounds are measured for 1, 2, 4 and 8 workers, for ``sum`` mode and for ``optimizer`` mode with
SGD (momentum) and Adam, on a full 4 MiB partition and on a 4 KiB tensor, and fitted to
:class:`~pslink.sim.costmodel.CostModel` (:func:`fit`): the 4 KiB rounds pin the per-message cost,
the 4 MiB rounds the per-byte costs, per worker and per round, of each mode.
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
import time
from typing import Callable

import numpy as np

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.aggregator.tasks import Request, Summer
from pslink.core.partition import DEFAULT_PARTITION_BYTES
from pslink.core.wire.protocol import Op
from pslink.sim.costmodel import OPTIMIZERS, CostModel, round_seconds

WORKERS = (1, 2, 4, 8)
SMALL_BYTES = 4 << 10
_TOKEN = b"calibration-token"
_OPTIMIZER_CONFIGS = {
    "sum": None,
    "sgd": {"type": "sgd", "lr": 0.01, "momentum": 0.9},
    "adam": {"type": "adam", "lr": 1e-3},
}


class _Round:
    """One task on a fresh AggregatorCore, and ``workers`` simulated workers pushing to it."""

    def __init__(self, workers: int, nbytes: int, optimizer: str):
        self.core = AggregatorCore("calibration", summer=Summer(threads=1))
        self.workers = workers
        self.numel = max(1, nbytes // 4)
        config = _OPTIMIZER_CONFIGS[optimizer]
        mode = "sum" if config is None else "optimizer"
        info = {"job": "calibration", "token": _TOKEN, "mode": mode, "optimizer": config, "sync": "bsp",
                "membership": {"ranks": list(range(workers)), "epoch": 0}}
        spec = {"key": "w", "part": 0, "shape": [self.numel], "span": [0, self.numel], "dtype": "float32",
                "needs_init": mode == "optimizer"}
        self.core.assign(info, [spec])
        rng = np.random.default_rng(0)
        self.gradients = [rng.standard_normal(self.numel, dtype=np.float32) for _ in range(workers)]
        self.sockets = [np.empty(self.numel, np.float32) for _ in range(workers)]  # each worker's connection
        self.ids = itertools.count(1)
        self.round = 0
        if mode == "optimizer":
            self._request(Op.INIT, 0, 0, rng.standard_normal(self.numel, dtype=np.float32))

    def _request(self, op: Op, rank: int, round_: int, payload: np.ndarray | None) -> list:
        header = {"op": op, "id": next(self.ids), "job": "calibration", "tok": _TOKEN, "rank": rank, "key": "w",
                  "part": 0, "rnd": round_, "dtype": "float32", "shape": [self.numel], "span": [0, self.numel]}
        task = self.core.admit(header)
        buffer = None
        if payload is not None:
            buffer = self.core.receive_buffer(task)
            np.copyto(buffer, payload)  # the socket's copy into the Aggregator's buffer
        return self.core.handle(task, Request(rank, header["id"], op, rank, round_, buffer))

    def run(self) -> float:
        """One BSP round (every worker push-pulls); returns its CPU seconds."""
        self.round += 1
        started = time.thread_time()
        replies = []
        for rank in range(self.workers):
            replies += self._request(Op.PUSHPULL, rank, self.round, self.gradients[rank])
        for reply in replies:
            if reply.error is not None:
                raise RuntimeError(f"calibration round failed: {reply.error}")
            if reply.payload is not None:
                np.copyto(self.sockets[reply.origin], reply.payload)  # the socket's copy out
        spent = time.thread_time() - started
        del replies
        return spent


def measure_rounds(nbytes: int, workers: int, optimizer: str, rounds: int, warmup: int = 3) -> list[float]:
    """CPU seconds of ``rounds`` rounds, after ``warmup`` (buffers allocated, caches warm)."""
    bench = _Round(workers, nbytes, optimizer)
    for _ in range(warmup):
        bench.run()
    return [bench.run() for _ in range(rounds)]


def measure(nbytes: int, workers: int, optimizer: str, rounds: int, warmup: int = 3) -> float:
    """Median CPU seconds of one round."""
    return statistics.median(measure_rounds(nbytes, workers, optimizer, rounds, warmup))


def fit(samples: list[dict]) -> tuple[float, dict[str, float], dict[str, float]]:
    """(per_message, per_byte_worker, per_byte_round) from measured rounds: one least-squares fit
    of every round to ``W * per_message + bytes * (W * worker[mode] + round[mode])``, on relative
    errors so that a one-worker 4 KiB round counts as much as an eight-worker 4 MiB one, with
    every coefficient >= 0. Unconstrained, the packaged measurements gave ``sum`` a per-round
    cost of -1.8e-10 s/B: a least-squares artifact (a round never gives CPU back), which
    predicted a negative cost for a one-worker round of a large enough tensor."""
    modes = [m for m in OPTIMIZERS if any(s["optimizer"] == m for s in samples)]
    for mode in modes:
        if len({(s["workers"], s["bytes"]) for s in samples if s["optimizer"] == mode}) < 3:
            raise ValueError(f"calibration of {mode!r} needs rounds of two sizes and two numbers of workers")
    rows, targets = [], []
    for s in samples:
        w, b = float(s["workers"]), float(s["bytes"])
        row = [w]
        for mode in modes:
            on = 1.0 if s["optimizer"] == mode else 0.0
            row += [on * b * w, on * b]
        scale = 1.0 / max(s["seconds"], 1e-12)
        rows.append([x * scale for x in row])
        targets.append(s["seconds"] * scale)
    solution = nonnegative_least_squares(np.array(rows), np.array(targets))
    per_message = float(solution[0])
    per_worker = {m: float(solution[1 + 2 * i]) for i, m in enumerate(modes)}
    per_round = {m: float(solution[2 + 2 * i]) for i, m in enumerate(modes)}
    return per_message, per_worker, per_round


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| subject to x >= 0, exactly: the optimum is the unconstrained fit on some
    subset of the columns (the others at 0), so every subset is tried and the best feasible one
    kept. The cost model has at most 7 coefficients (128 subsets of a 24-row system), which
    keeps this simpler than an active-set method and needs no scipy."""
    columns = a.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(b * b))
    for mask in range(1, 1 << columns):
        chosen = [c for c in range(columns) if mask >> c & 1]
        x, *_ = np.linalg.lstsq(a[:, chosen], b, rcond=None)
        if (x < 0).any():
            continue
        residual = float(np.sum((a[:, chosen] @ x - b) ** 2))
        if residual < best_residual - 1e-15:
            best_residual = residual
            best = np.zeros(columns)
            best[chosen] = x
    return best


def held_out_errors(samples: list[dict]) -> list[dict]:
    """Each measured round predicted by a fit of all the others (leave-one-out): how far the
    model is from rounds it was not fitted to, per point (relative error, + when it predicts
    more than was measured). A point whose mode would lack what the fit needs without it is
    left out of the check."""
    out = []
    for index, sample in enumerate(samples):
        others = samples[:index] + samples[index + 1:]
        try:
            per_message, per_worker, per_round = fit(others)
        except ValueError:
            continue
        mode, workers, nbytes = sample["optimizer"], sample["workers"], sample["bytes"]
        predicted = round_seconds(per_message, per_worker[mode], per_round[mode], nbytes, workers)
        out.append({"optimizer": mode, "workers": workers, "bytes": nbytes,
                    "measured": sample["seconds"], "predicted": predicted,
                    "error": predicted / sample["seconds"] - 1.0})
    return out


def summarize_errors(errors: list[dict]) -> dict:
    """Median and largest |relative error|, over every held-out point and per (optimizer, size)."""
    def stats(rows):
        values = sorted(abs(r["error"]) for r in rows)
        return {"points": len(values), "median": statistics.median(values) if values else None,
                "max": values[-1] if values else None}

    groups: dict[str, list[dict]] = {}
    for row in errors:
        groups.setdefault(f"{row['optimizer']} {row['bytes']} B", []).append(row)
    return {"method": "leave-one-out", "all": stats(errors), "by_point": {k: stats(v) for k, v in sorted(groups.items())}}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def calibrate(rounds: int = 15, passes: int = 3, nbytes: int = DEFAULT_PARTITION_BYTES,
              small_bytes: int = SMALL_BYTES, workers: tuple[int, ...] = WORKERS,
              on_step: Callable[[str], None] | None = None) -> CostModel:
    """Measure every (optimizer, workers, size) and fit the cost model. The sweep runs ``passes``
    times and each point keeps the median of all its rounds, so that a spell of load from
    elsewhere on a shared machine weighs on every point alike rather than on a few. The sizes
    and worker counts can be made tiny (the tests do) but the fit needs two of each."""
    if nbytes % 4 or small_bytes % 4:
        raise ValueError(f"sizes are of float32 tensors: multiples of 4 bytes, got {nbytes} and {small_bytes}")
    if not 4 <= small_bytes < nbytes:
        raise ValueError(f"the small size ({small_bytes} bytes) must be at least 4 and below the large one ({nbytes})")
    workers = tuple(sorted(set(workers)))
    if len(workers) < 2 or workers[0] < 1:
        raise ValueError(f"calibration needs at least two numbers of workers, each >= 1, got {list(workers)}")
    if rounds < 1 or passes < 1:
        raise ValueError("rounds and passes must be >= 1")
    points = [(o, w, size) for o in OPTIMIZERS for w in workers for size in (nbytes, small_bytes)]
    times: dict[tuple, list[float]] = {p: [] for p in points}
    for number in range(passes):
        for point in points:
            times[point] += measure_rounds(point[2], point[1], point[0], rounds)
        if on_step is not None:
            on_step(f"pass {number + 1} of {passes} done")
    samples = []
    for (optimizer, count, size), measured in times.items():
        seconds = statistics.median(measured)
        samples.append({"optimizer": optimizer, "workers": count, "bytes": size, "seconds": seconds})
        if on_step is not None:
            on_step(f"{optimizer:4} {count} workers {size / 1024:>8.1f} KiB: {seconds * 1e3:.3f} ms")
    per_message, per_worker, per_round = fit(samples)
    return CostModel(per_message, per_worker, per_round, machine=machine(),
                     measured={"rounds": rounds, "passes": passes,
                               "method": "AggregatorCore, thread CPU time, median per round", "samples": samples,
                               "held_out": summarize_errors(held_out_errors(samples))})

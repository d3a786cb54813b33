"""What the migration and failover benchmarks share: a 2-worker job whose iterations are timed
while the driver disturbs the service at a chosen iteration (moves the job, kills an Aggregator),
run disturbed and undisturbed in alternating rounds, so that each disturbed run is compared with
an undisturbed run of the same round over the same iterations (the host's own noise)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import time

import numpy as np

WINDOW = 6  # iterations before the disturbance whose median is the baseline
GRADIENT_BANK = 7  # arrays each worker draws once; iteration it, key k pushes bank[(it + 3k) % 7]


def train(agent, rank: int, keys: int, tensor: int, iterations: int, at: int | None, compute: float, signal,
          after_step=None, starts: list | None = None) -> tuple[list[float], str]:
    """Init ``keys`` tensors of ``tensor`` float32, then push-pull random gradients each iteration
    after ``compute`` s of simulated compute; rank 0 tells the driver (``signal``) when iteration
    ``at`` starts. ``after_step(it)`` runs after each iteration; ``starts`` (a list) gets each
    iteration's start on the wall clock (what the driver's own clock, in another process, is
    compared with). Returns the iteration durations and a digest of the final weights."""
    weights = [np.full(tensor, 0.01 * k, np.float32) for k in range(keys)]
    agent.init_many(range(keys), weights).wait()
    agent.pull_many(range(keys), outs=weights).wait()
    # Gradients from a bank drawn once: drawing 100 MB of normals every iteration took ~260 ms
    # of CPU per worker, which an accelerator job's host does not spend, and on a 2-core host it
    # took that time from the Aggregators while the job "computed" (a sleep).
    bank = [np.random.default_rng(1000 * rank + b).standard_normal(tensor).astype(np.float32)
            for b in range(GRADIENT_BANK)]
    durations = []
    for it in range(iterations):
        if it == at and signal is not None and rank == 0:
            signal.put(time.time())  # the driver disturbs the service now
        grads = [bank[(it + 3 * k) % GRADIENT_BANK] for k in range(keys)]
        if starts is not None:
            starts.append(time.time())
        start = time.perf_counter()
        time.sleep(compute)
        agent.pushpull_many(range(keys), grads, outs=weights).wait()
        durations.append(time.perf_counter() - start)
        if after_step is not None:
            after_step(it)
    return durations, hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()


def run_workers(worker, args: tuple, disturbed: bool, disturb, ranks: int = 2) -> dict:
    """Start ``worker(*args, signal, results)`` as ranks 0 to ``ranks`` - 1 (spawned processes); when
    ``disturbed``, call ``disturb()`` once rank 0 signals. Returns each rank's result tuple (what
    the worker put, without its leading rank)."""
    context = mp.get_context("spawn")
    signal = context.Queue() if disturbed else None
    results = context.Queue()
    procs = [context.Process(target=worker, args=(*args[:2], rank, *args[2:], signal, results))
             for rank in range(ranks)]
    for p in procs:
        p.start()
    finished = False
    try:
        if signal is not None:
            signal.get(timeout=600)
            disturb()
        outcome = {}
        for _ in range(ranks):
            rank, *rest = results.get(timeout=900)
            outcome[rank] = tuple(rest)
        finished = True
    finally:  # a wait that timed out, or a disturbance that failed, leaves no worker behind
        for p in procs:
            p.join(60 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join(10)
    return outcome


def median_before(durations: list[float], at: int) -> float:
    if at < 1:
        raise ValueError(f"the disturbance must come after at least one iteration, not at iteration {at}")
    return statistics.median(durations[max(0, at - WINDOW):at])


def stall(durations: list[float], start: int, end: int) -> float:
    """The longest iteration of ``[start, end)`` over the median of the iterations before ``start``:
    a ratio to the run's own pace, so that a run on a busier moment of the host is not charged for it."""
    return max(durations[start:end]) / median_before(durations, start)


def alternate(rounds: int, run) -> list[dict]:
    """``run(disturbed, index)`` for both variants, ``rounds`` times; the disturbed run goes first on
    even rounds and second on odd ones, so that a drift of the host is not charged to one variant.
    Returns one ``{True: disturbed result, False: undisturbed result}`` per round."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    out = []
    for index in range(rounds):
        pair = {}
        for disturbed in (True, False) if index % 2 == 0 else (False, True):
            pair[disturbed] = run(disturbed, index)
        out.append(pair)
    return out

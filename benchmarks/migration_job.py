"""What benchmarks/migration.py and benchmarks/migration_hosts.py share: the 2-worker job they
move (4 MiB tensors, momentum SGD on the service), the reading of each round against the same
round's still run (pslink.bench.migration_runs), and its printing and pictures."""

from __future__ import annotations

import statistics

from disturbed_job import train

from pslink.bench.migration_runs import Episode, Round, Window, read_round, speed_points

TENSOR = 1 << 20  # float32 elements: 4 MiB, one task each
SETTINGS = {"type": "sgd", "lr": 0.01, "momentum": 0.9}


def worker(master, job, rank, keys, iterations, at, compute, connect_options, signal, results):
    """One rank of the job: trains, then reports (rank, durations, digest, places, starts)."""
    import pslink

    with pslink.connect(job, rank, 2, master=master, optimizer=SETTINGS, timeout=120, **connect_options) as agent:
        starts: list[float] = []
        durations, digest = train(agent, rank, keys, TENSOR, iterations, at, compute, signal, starts=starts)
        places = sorted({p[3] for k in range(keys) for p in agent.key_info(k)["parts"]})
        results.put((rank, durations, digest, places, starts))


def outcome_of(outcome: dict) -> dict:
    """What a run's driver keeps of its workers' results."""
    return {"durations": outcome[0][0], "digests": [outcome[r][1] for r in sorted(outcome)],
            "places": outcome[0][2], "starts": outcome[0][3]}


def read(label: str, index: int, moved: dict, still: dict, moves: Episode | None, margin_ms: float) -> dict:
    """One round of a scenario, read and printed; ``moves``: its migration as the watch saw it
    (None: nothing moved, said so)."""
    d, base = moved["durations"], still["durations"]
    if moves is None:
        print(f"{label} round {index + 1}: NO MOVE was made (nothing to measure); places {moved['places']}", flush=True)
        return {"moved": False, "places": moved["places"], "durations_ms": [x * 1e3 for x in d],
                "baseline_durations_ms": [x * 1e3 for x in base]}
    window = Window.of(moved["starts"], moves, len(d))
    r: Round = read_round(d, base, window, margin_ms)
    during = [x * 1e3 for x in d[window.start:window.end]]
    print(f"{label} round {index + 1}: {moves.moves} move(s) done (pMaster's count), parts now on {moved['places']}; took {moves.seconds * 1e3:.0f} ms, "
          f"{window.taken} iteration(s) (first begun in iteration {window.start}); during "
          f"{', '.join(f'{x:.0f}' for x in during)} ms (iterations {window.start}-{window.end - 1}); "
          f"{r.verdict()}", flush=True)
    before = statistics.median(d[max(0, window.start - 6):window.start])
    return {"moved": True, "window": [window.start, window.end - 1], "iterations_taken": window.taken,
            "migration_ms": moves.seconds * 1e3, "moves": moves.moves, "places": moved["places"],
            "stall_ms": r.stall_ms, "noise_ms": r.noise_ms, "met": r.met, "before_ms": before * 1e3,
            "stall": max(d[window.start:window.end]) / before,
            "still_stall": max(base[window.start:window.end]) / statistics.median(base[max(0, window.start - 6):window.start]),
            "mean_ms": statistics.mean(d[window.start:window.end]) * 1e3,
            "still_mean_ms": statistics.mean(base[window.start:window.end]) * 1e3,
            "durations_ms": [x * 1e3 for x in d], "baseline_durations_ms": [x * 1e3 for x in base],
            "moves_offset_s": moves.begun - moved["starts"][0], "moves_end_s": moves.ended - moved["starts"][0]}


def summary(label: str, rounds: list[dict], identical: bool, margin_ms: float) -> None:
    """The scenario's check, round by round, and the weights' check."""
    measured = [r for r in rounds if r["moved"]]
    verdicts = ", ".join(("met" if r["met"] else "NOT met") if r["moved"] else "no move" for r in rounds)
    all_met = len(measured) == len(rounds) and all(r["met"] for r in measured)
    print(f"{label}: issue 54's requirement, stall <= noise + {margin_ms:.0f} ms in each round: "
          f"{'met' if all_met else 'NOT met'} ({verdicts})", flush=True)
    if measured:
        took = ", ".join(f"{r['migration_ms']:.0f} ms in {r['iterations_taken']} iteration(s)" for r in measured)
        print(f"{label}: the migration (first move begun to last move done) took {took}", flush=True)
    print(f"{label}: final weights bit-identical to the still runs': {'yes' if identical else 'NO'}", flush=True)


def picture(path: str, title: str, r: dict) -> str:
    """The round's iteration times around the move, migrated and still, the migration shaded."""
    from pslink.bench.pictures import timeline_png

    def times(durations_ms):
        return [(t, 1e3 / speed) for t, speed in speed_points([x / 1e3 for x in durations_ms])]

    moved = times(r["durations_ms"])
    spans = [(r["moves_offset_s"], r["moves_end_s"], "migration")] if r.get("moved") else []
    return str(timeline_png(path, title, {"migrated": moved, "still": times(r["baseline_durations_ms"])},
                            spans=spans, speed_label="iteration (ms)"))


def rounded(r: dict) -> dict:
    return {k: ([round(x, 2) for x in v] if isinstance(v, list) and k.endswith("_ms") else
                round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}

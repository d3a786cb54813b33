"""``pslink demo``: an embedded parameter service and worker processes training on real data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

from pslink.core.service import Service
from pslink.errors import ConfigError, ServiceError


def run_demo(workers: int = 2, aggregators: int = 2, epochs: int = 15, mode: str = "sum",
             console: Console | None = None) -> list[dict]:
    """Start a service, run ``workers`` processes of the digits demo through it, report."""
    console = console or Console()
    try:
        import sklearn  # noqa: F401  (the data set lives in it)
    except ImportError:
        raise ConfigError("pslink demo needs scikit-learn for its data set: pip install 'pslink[demo]'") from None
    with tempfile.TemporaryDirectory(prefix="pslink-demo-") as scratch:
        started = time.perf_counter()
        with Service(aggregators=aggregators, log_dir=os.path.join(scratch, "logs")) as service:
            console.print(f"[bold]pslink demo[/]: pMaster at {service.address}, {aggregators} Aggregator "
                          f"processes, {workers} worker processes, mode [cyan]{mode}[/]")
            procs = _start_workers(service.address, workers, epochs, mode, scratch)
            try:
                codes = [p.wait() for p in procs]
            except KeyboardInterrupt:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(10)
                raise
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        if failed:
            logs = "\n".join(_tail(os.path.join(scratch, f"worker-{rank}.log")) for rank, _ in failed)
            raise ServiceError(f"worker(s) {failed} (rank, exit status) failed:\n{logs}")
        results = [json.load(open(os.path.join(scratch, f"result-{rank}.json"))) for rank in range(workers)]
    _report(console, results, time.perf_counter() - started)
    return results


def _start_workers(master: str, workers: int, epochs: int, mode: str, scratch: str) -> list[subprocess.Popen]:
    procs = []
    job = f"digits-demo-{os.getpid()}"
    for rank in range(workers):
        env = dict(os.environ, PSLINK_MASTER=master, PSLINK_JOB=job, PSLINK_RANK=str(rank),
                   PSLINK_NUM_WORKERS=str(workers))
        command = [sys.executable, "-m", "pslink.demo.digits", "--epochs", str(epochs), "--mode", mode,
                   "--result", os.path.join(scratch, f"result-{rank}.json")]
        if rank == 0:  # rank 0 draws the progress bar on this terminal
            procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
        else:
            log = open(os.path.join(scratch, f"worker-{rank}.log"), "wb")
            command.append("--no-progress")
            procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
            log.close()
    return procs


def _tail(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        return f.read()[-3000:].decode(errors="replace")


def _report(console: Console, results: list[dict], seconds: float) -> None:
    table = Table(title="digits: 64-64-10 MLP, data-parallel through pslink")
    for column in ("rank", "test accuracy", "final loss", "rounds", "weights checksum"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["rank"]), f"{r['accuracy']:.1%}", f"{r['loss']:.3f}", str(r["rounds"]), f"{r['checksum']:.4f}")
    console.print(table)
    same = len({round(r["checksum"], 3) for r in results}) == 1
    console.print(f"workers hold identical weights: [bold]{'yes' if same else 'NO'}[/]")
    accuracy = results[0]["accuracy"]
    console.print(f"[bold green]final test accuracy: {accuracy:.1%}[/] (chance is 10%), "
                  f"{seconds:.1f} s in all")

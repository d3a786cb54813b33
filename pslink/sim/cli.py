"""``pslink simulate``: the trace-driven simulation, and ``pslink simulate calibrate``."""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from pslink.core.master.control import DEFAULT_HEADROOM, DEFAULT_PLACEMENT_SHARE
from pslink.core.master.move_cost import DEFAULT_COPY_BANDWIDTH, DEFAULT_SWITCH_LATENCY
from pslink.errors import ConfigError, PslinkError

simulate_app = typer.Typer(
    help="Trace-driven simulation of a cluster's aggregation CPUs: static servers per job (ps-lite) "
         "against pslink's shared, elastic service.",
    invoke_without_command=True, add_completion=False)
console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(1)


@simulate_app.callback(invoke_without_command=True)
def simulate(
    ctx: typer.Context,
    trace: str = typer.Option("philly", "--trace", help="philly (the packaged Philly trace) or a CSV path "
                              "with columns jobid, submit_time, num_gpus, duration_s"),
    out: Path = typer.Option(Path("simulation"), "--out", help="directory for summary.json, jobs.csv and the plots"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="simulate only the first N jobs (after "
                                       "the window and the single-GPU rule)"),
    start: Optional[str] = typer.Option(None, "--start", help="first submission to take: a date-time "
                                        "(2017-10-01 or '2017-10-01 12:00') or an offset from the trace's "
                                        "start (3600, 90m, 36h, 3d)"),
    end: Optional[str] = typer.Option(None, "--end", help="take submissions before this (same forms as --start)"),
    seed: int = typer.Option(0, "--seed", help="seed of the per-job draws (model, iteration, contention)"),
    mix: str = typer.Option("alexnet=1,vgg19=1,resnet50=1,bert-base=1", "--mix",
                            help="model mix, name=weight,... (alexnet, vgg19, resnet50, bert-base)"),
    single_gpu: str = typer.Option("skip", "--single-gpu", help="skip: single-GPU jobs use no parameter "
                                   "server (left out); ps: they ask for one server each"),
    servers_per_worker: float = typer.Option(1.0, "--servers-per-worker", min=0.01,
                                             help="servers a job requests per worker (rounded, >= 1)"),
    aggregation: str = typer.Option("optimizer", "--aggregation", help="optimizer: the servers run the "
                                    "optimizer (ps-lite, MXNet); sum: they only sum"),
    iteration_spread: float = typer.Option(0.2, "--iteration-spread", min=0.0,
                                           help="sigma of the lognormal per-job factor on iteration times"),
    contention: float = typer.Option(0.1, "--contention", min=0.0, help="sigma of the per-job factor "
                                     "exp(|N(0, sigma)|) >= 1 on task costs while sharing Aggregators"),
    loss_limit: float = typer.Option(0.1, "--loss-limit", min=0.001, max=0.999, help="the slowdown a job "
                                     "accepts from sharing (its SLO) unless --slo-classes gives it one"),
    slo_classes: Optional[str] = typer.Option(None, "--slo-classes", help="jobs in service-level classes: "
                                              "limit:share pairs, e.g. 0.05:1,0.2:1 (half the jobs accept 5%, "
                                              "half 20%)"),
    headroom: float = typer.Option(DEFAULT_HEADROOM, "--headroom", min=0.0, max=0.9, help="share of a shared "
                                   "Aggregator's cycle packing leaves free"),
    placement_share: float = typer.Option(DEFAULT_PLACEMENT_SHARE, "--placement-share", min=0.01, max=1.0,
                                          help="share of a job's SLO its placement may use (the rest: moves)"),
    host_cpus: int = typer.Option(16, "--host-cpus", min=0, help="Aggregators run on hosts of this many CPUs, "
                                  "each with one NIC (0: no hosts, no network)"),
    nic_gbit: float = typer.Option(25.0, "--nic-gbit", min=0.001, help="each host's NIC, Gbit/s each way"),
    arrivals: float = typer.Option(1.0, "--arrivals", min=0.01, help="scale the arrival rate: 10 submits every "
                                   "job 10 times sooner (submit times divided by 10; durations kept)"),
    scale_period: float = typer.Option(0.0, "--scale-period", min=0.0, help="hybrid scaling period, "
                                       "seconds (0: release on job exit)"),
    startup: float = typer.Option(2.0, "--startup", min=0.0, help="seconds an Aggregator takes to start"),
    copy_gbit: float = typer.Option(DEFAULT_COPY_BANDWIDTH * 8 / 1e9, "--copy-gbit", min=0.001,
                                    help="Gbit/s a migration's copy crosses at (it runs while the job trains)"),
    switch_ms: float = typer.Option(DEFAULT_SWITCH_LATENCY * 1e3, "--switch-ms", min=0.0,
                                    help="milliseconds a migration's switch at a round boundary costs its job"),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model", help="cost model JSON (default: the "
                                              "packaged calibration)"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="write PNG plots (needs matplotlib)"),
):
    """Simulate the trace under static servers and under pslink; write the figures to --out."""
    if ctx.invoked_subcommand is not None:
        return
    from pslink.sim import experiment
    from pslink.sim.costmodel import load_cost_model
    from pslink.sim.engine import ServiceOptions
    from pslink.sim.models import parse_mix
    from pslink.sim.trace import ATTRIBUTION, load_trace, parse_when, scale_arrivals, select
    from pslink.sim.workload import WorkloadOptions

    started = time.perf_counter()
    try:
        model = load_cost_model(cost_model)
        loaded = load_trace(trace)
        window = (parse_when(start, loaded, "--start") if start else None,
                  parse_when(end, loaded, "--end") if end else None)
        rows = scale_arrivals(select(loaded, *window), arrivals)
        try:
            workload = WorkloadOptions(mix=parse_mix(mix), seed=seed, iteration_spread=iteration_spread,
                                       contention=contention, single_gpu=single_gpu,
                                       servers_per_worker=servers_per_worker, aggregation=aggregation,
                                       slo_classes=parse_slo_classes(slo_classes) if slo_classes else None)
            service = ServiceOptions(loss_limit=loss_limit, scale_period=scale_period, startup=startup,
                                     headroom=headroom, placement_share=placement_share, host_cpus=host_cpus,
                                     nic_gbit=nic_gbit, copy_bandwidth=copy_gbit * 1e9 / 8,
                                     switch_latency=switch_ms / 1e3)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if single_gpu == "skip" and not any(r.gpus > 1 for r in rows):
            raise ConfigError(f"the {len(rows)} jobs selected all use one GPU and would use no parameter server; "
                              "widen the window or pass --single-gpu ps")
        out.mkdir(parents=True, exist_ok=True)
    except PslinkError as exc:
        _fail(exc.message)
    except OSError as exc:
        _fail(f"cannot create output directory {str(out)!r}: {exc.strerror}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]simulating[/] jobs finished"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=False) as progress:
        bar = progress.add_task("jobs", total=None)
        # A bar redrawn in place says nothing in a log file: there, a line every tenth of the jobs.
        lines = not err_console.is_terminal

        def on_progress(done: int, total: int) -> None:
            if done % 25 == 0 or done == total:
                progress.update(bar, completed=done, total=total)
            if lines and (done * 10 // total > (done - 1) * 10 // total):
                err_console.print(f"simulated {done:,} of {total:,} jobs ({time.perf_counter() - started:.0f} s)",
                                  highlight=False)

        outcome = experiment.run(rows, model, workload, service, limit=jobs, on_progress=on_progress)
    wall = time.perf_counter() - started
    summary = outcome.summary
    first = outcome.jobs[0].submit if outcome.jobs else 0.0
    last = outcome.jobs[-1].submit if outcome.jobs else 0.0
    report = {
        "attribution": ATTRIBUTION,
        "trace": {"source": loaded.source, "first_submit": loaded.when(first), "last_submit": loaded.when(last),
                  "rows_in_window": len(rows), "single_gpu": single_gpu},
        "workload": {**dataclasses.asdict(workload), "jobs_limit": jobs, "arrivals_scaled": arrivals},
        "service": dataclasses.asdict(service),
        "cost_model": {"per_message": model.per_message, "per_byte_worker": model.per_byte_worker,
                       "per_byte_round": model.per_byte_round, "machine": model.machine,
                       "file": str(cost_model) if cost_model else "packaged"},
        "results": summary,
        "wall_seconds": wall,
        "peak_memory_mb": _peak_memory_mb(),
    }
    try:
        (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
        _write_jobs(out / "jobs.csv", outcome.pslink.jobs)
        written = []
        if plots:
            written = _plots(outcome, summary, out, f"{len(outcome.jobs)} jobs")
    except OSError as exc:
        _fail(f"cannot write to {str(out)!r}: {exc.strerror}")
    _print_summary(summary, wall, out, written)


def _peak_memory_mb() -> float:
    """This process's peak resident memory (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_slo_classes(text: str) -> dict[float, float]:
    """``0.05:1,0.2:1`` -> {0.05: 1.0, 0.2: 1.0} (limit: share)."""
    classes: dict[float, float] = {}
    for item in text.split(","):
        try:
            limit, share = (float(x) for x in item.split(":"))
        except ValueError:
            raise ConfigError(f"--slo-classes {text!r}: each class is limit:share, e.g. 0.05:1, got {item!r}") from None
        if not 0 < limit < 1 or share <= 0:
            raise ConfigError(f"--slo-classes {text!r}: a limit is in (0, 1) and a share > 0, got {item!r}")
        classes[limit] = classes.get(limit, 0.0) + share
    return classes


def _plots(outcome, summary: dict, out: Path, title: str) -> list[Path]:
    try:
        from pslink.sim.plots import plot_all
    except ImportError:
        err_console.print("[yellow]matplotlib is not installed: no plots (pip install 'pslink[sim]')[/]")
        return []
    return plot_all(outcome.pslink, outcome.static, summary, out, title)


def _write_jobs(path: Path, outcomes) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job", "model", "workers", "servers", "submit_s", "duration_s", "end_s", "iteration_s",
                         "busy_cpus", "slo", "slowdown", "migrations", "parts_moved", "relocations", "reverts"])
        for o in outcomes:
            writer.writerow([o.name, o.model, o.workers, o.servers, f"{o.submit:.1f}", f"{o.duration:.1f}",
                             f"{o.end:.1f}" if o.end is not None else "", f"{o.iteration:.4f}", f"{o.busy:.4f}",
                             f"{o.slo:g}" if o.slo is not None else "", f"{o.slowdown:.5f}", o.migrations,
                             o.parts_moved, o.relocations, o.reverts])


def _print_summary(summary: dict, wall: float, out: Path, written: list[Path]) -> None:
    table = Table(title=f"{summary['jobs']} jobs, {summary['span_hours'] / 24:.1f} days", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    cpu = summary["cpu_hours"]
    ratio, slow = summary["ratio"], summary["slowdown"]
    rows = [
        ("CPU hours, static servers (requested)", f"{cpu['static']:,.0f}"),
        ("CPU hours, pslink", f"{cpu['pslink']:,.0f}"),
        ("CPU hours busy aggregating", f"{cpu['busy']:,.0f}"),
        ("aggregation CPU time saved", f"{summary['cpu_time_saved']:.1%}"),
        ("utilization static / pslink", f"{summary['utilization']['static']:.1%} / {summary['utilization']['pslink']:.1%}"),
        ("allocated/requested > 1, share of time", f"{ratio['above_1']:.2%}"),
        ("allocated/requested median / p99 / max", f"{ratio.get('p50', 0):.2f} / {ratio.get('p99', 0):.2f} / "
                                                   f"{ratio.get('max', 0):.2f}"),
        ("job slowdown median / p90 / p99", f"{slow.get('p50', 0):.1%} / {slow.get('p90', 0):.1%} / "
                                            f"{slow.get('p99', 0):.1%}"),
        ("jobs above their SLO", f"{summary['over_slo']:.2%}"),
        *[(f"  SLO {slo}: jobs, above, p99 slowdown", f"{c['jobs']:,} / {c['over_slo']:.2%} / {c.get('p99', 0):.1%}")
          for slo, c in summary["slo_classes"].items() if len(summary["slo_classes"]) > 1],
        ("migrations / parts moved / reverts", f"{summary['migrations']['total']:,} / "
                                               f"{summary['parts_moved']['total']:,} / "
                                               f"{summary['counters'].get('reverts', 0):,.0f}"),
        ("per job: migrations, parts moved, relocations (median)",
         f"{summary['migrations']['per_job_median']:.0f} / {summary['parts_moved']['per_job_median']:.0f} / "
         f"{summary['relocations']['per_job_median']:.0f}"),
        ("wall time, peak memory", f"{wall:.0f} s, {_peak_memory_mb():,.0f} MB"),
        ("hosts at peak, NIC peak load, jobs a NIC slowed",
         f"{summary['counters'].get('hosts at peak', 0):,.0f}, {summary['counters'].get('NIC peak load', 0):.0%}, "
         f"{summary['network_slowed']:.2%}" if "hosts at peak" in summary["counters"] else "no hosts (--host-cpus 0)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(f"wrote {out / 'summary.json'}, {out / 'jobs.csv'}"
                  + "".join(f", {p.name}" for p in written))


@simulate_app.command("calibrate")
def calibrate_command(
    out: Path = typer.Option(Path("costmodel.json"), "--out", help="where to write the cost model (JSON)"),
    rounds: int = typer.Option(15, "--rounds", min=3, help="measured rounds per point and pass"),
    passes: int = typer.Option(3, "--passes", min=1, help="sweeps over every point (each point keeps the "
                               "median of all its rounds)"),
    nbytes: int = typer.Option(4 << 20, "--bytes", min=8, help="the large tensor measured, bytes (default: "
                               "a full 4 MiB partition; it pins the per-byte costs)"),
    small_bytes: int = typer.Option(4 << 10, "--small-bytes", min=4, help="the small tensor measured, bytes "
                                    "(it pins the per-message cost)"),
    workers: str = typer.Option("1,2,4,8", "--workers", help="numbers of workers to measure, comma-separated"),
):
    """Measure aggregation CPU per byte on the real Aggregator core and write a cost model."""
    from pslink.sim.calibrate import calibrate
    from pslink.sim.costmodel import save_cost_model

    try:
        counts = tuple(int(w) for w in workers.split(",") if w.strip())
    except ValueError:
        _fail(f"--workers {workers!r} is not a comma-separated list of whole numbers")
    try:
        model = calibrate(rounds=rounds, passes=passes, nbytes=nbytes, small_bytes=small_bytes, workers=counts,
                          on_step=lambda line: err_console.print(f"  {line}"))
    except ValueError as exc:
        _fail(str(exc))
    try:
        save_cost_model(model, out)
    except OSError as exc:
        _fail(f"cannot write {str(out)!r}: {exc.strerror}")
    table = Table(title="cost of one round: W x per_message + bytes x (W x per_byte_worker + per_byte_round)")
    for column in ("optimizer", "per byte per worker", "per byte per round", "4 MiB, 8 workers"):
        table.add_column(column, justify="right")
    for name in model.per_byte_round:
        table.add_row(name, f"{model.per_byte_worker[name]:.3e} s", f"{model.per_byte_round[name]:.3e} s",
                      f"{model.task_cost(4 << 20, 8, name) * 1e3:.2f} ms")
    console.print(table)
    held = model.measured.get("held_out", {})
    if held.get("all", {}).get("points"):
        errors = Table(title="held-out check: each measured round predicted by a fit of all the others")
        for column in ("point", "rounds", "median |error|", "max |error|"):
            errors.add_column(column, justify="right")
        for name, row in [*held["by_point"].items(), ("all", held["all"])]:
            errors.add_row(name, str(row["points"]), f"{row['median']:.1%}", f"{row['max']:.1%}")
        console.print(errors)
    console.print(f"per message {model.per_message * 1e6:.2f} us; machine: {model.machine.get('cpu')}, "
                  f"{model.machine.get('cores')} cores; wrote {out}")

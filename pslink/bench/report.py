"""The results table for this machine: the quick form of every benchmark that needs no root and
no other checkout, run one after another, their figures collected into a markdown table and a PNG.

Each benchmark runs as its own process (``python benchmarks/NAME.py --quick``) with a time limit,
its whole output kept in ``OUT/logs/NAME.log``; the figures it printed (``PSLINK_FIGURE`` lines,
:mod:`pslink.bench.figures`) become the table's rows. A benchmark that cannot run here (a framework
not installed, a tool missing) is listed under "not run" with the reason, never silently left out.
``--from LOG ...`` renders the table from saved outputs instead (how docs/benchmarks.md's table is
made from the full runs).

    python benchmarks/report.py --out report/           # or: pslink bench report --out report/
    python benchmarks/report.py --pslite ~/src/ps-lite  # with C++ ps-lite side by side
    python benchmarks/report.py --from full-runs/*.log --out docs-table/
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pslink.bench.figures import Figure, fmt, parse


@dataclass(frozen=True)
class Entry:
    name: str  # what the report calls it (unique); the script too unless ``script`` says otherwise
    args: tuple[str, ...] = ("--quick",)
    script: str = ""  # benchmarks/<script>.py
    modules: tuple[str, ...] = ()  # what must import for it to run (frameworks)
    tools: tuple[str, ...] = ()  # programs it runs
    timeout: float = 240.0

    def command(self, extra: tuple[str, ...] = ()) -> list[str]:
        return ["python", f"benchmarks/{self.script or self.name}.py", *self.args, *extra]


#: The quick form of every benchmark a user can run without root and without another checkout.
#: Left out: multihost.py, hierarchy.py and migration_hosts.py (network namespaces: root),
#: horovod_api.py (Horovod built from its sdist: added with --horovod), chaos.py (exactness, no
#: ratio), hvd_latency.py (one side of benchmarks/before_after.sh).
ENTRIES = (
    Entry("pushpull"),
    Entry("pslite_bench"),
    Entry("sparse"),
    Entry("tls", tools=("openssl",)),
    Entry("roundtrip"),
    Entry("summation"),
    Entry("placement"),
    Entry("migration"),
    Entry("migration_drain"),
    Entry("failover"),
    Entry("fuzz"),
    Entry("multijob"),
    Entry("torch_ddp", modules=("torch",)),
    Entry("many_keys", args=("--many-keys", "--quick"), script="pushpull", modules=("torch",)),
    Entry("visibility", modules=("torch",)),
    Entry("compression", modules=("mxnet",)),
    Entry("tf_strategy", modules=("tensorflow",)),
    Entry("mxnet_gluon", modules=("mxnet",)),
)
ROOT_ONLY = ("multihost", "hierarchy", "migration_hosts")


@dataclass
class Outcome:
    entry: Entry
    command: list[str]
    seconds: float = 0.0
    figures: list[Figure] = field(default_factory=list)
    skipped: str = ""  # why it did not run
    failed: str = ""  # why it ran but gave no figures


def missing_requirement(entry: Entry) -> str:
    for module in entry.modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[{_extra(module)}]')"
    for tool in entry.tools:
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    return ""


def _extra(module: str) -> str:
    return {"torch": "torch", "mxnet": "mxnet", "tensorflow": "tf"}.get(module, module)


def run_entry(entry: Entry, root: Path, logs: Path, extra: tuple[str, ...] = ()) -> Outcome:
    command = entry.command(extra)
    outcome = Outcome(entry, command)
    outcome.skipped = missing_requirement(entry)
    if outcome.skipped:
        return outcome
    log = logs / f"{entry.name}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        # A new session, so that a timeout ends the benchmark's own children too (by process group).
        proc = subprocess.Popen([sys.executable, *command[1:]], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(entry.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
    outcome.seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    outcome.figures = parse(text)
    if code is None:
        outcome.failed = f"did not finish in {entry.timeout:.0f} s"
    elif code != 0:
        outcome.failed = f"exited with status {code}: {_last_line(text)}"
    elif not outcome.figures:
        outcome.failed = "printed no figure"
    return outcome


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


# -- the table ------------------------------------------------------------------------------------


def advantage(figure: Figure) -> float | None:
    """How many times better than its anchor pslink is (> 1: ahead), whichever way is better."""
    if figure.ratio is None:
        return None
    return figure.ratio if figure.better == "higher" else 1.0 / figure.ratio


def table_rows(outcomes: list[Outcome], date: str) -> list[list[str]]:
    rows = []
    for outcome in outcomes:
        command = shlex.join(outcome.command)
        for f in outcome.figures:
            if f.ratio is None:
                ratio, spread, anchor = "no ratio", "", f.missing
            else:
                low, high = f.spread
                ratio = f"**{f.ratio:.2f}**"
                spread = f"{low:.2f}-{high:.2f} ({len(f.values)})"
                anchor = f"{f.anchor}: {fmt(f.anchor_value)} {f.unit}"
            rows.append([f.what, f"{fmt(f.value)} {f.unit}", anchor, ratio, f"{f.better} is better", spread, date,
                         f"`{command}`"])
    return rows


HEADER = ["what", "pslink", "anchor (same run)", "ratio", "reading", "spread (rounds)", "date", "command"]


def markdown(outcomes: list[Outcome], date: str, machine: str) -> str:
    lines = [f"Measured on {machine}, {date}. Ratio = pslink / anchor, both medians of the same run's "
             "alternating rounds; spread = the lowest and highest of the rounds' own ratios.", ""]
    lines.append("| " + " | ".join(HEADER) + " |")
    lines.append("|" + "---|" * len(HEADER))
    for row in table_rows(outcomes, date):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    gaps = [o for o in outcomes if o.skipped or o.failed]
    if gaps:
        lines += ["", "Not run or no figures:", ""]
        for o in gaps:
            lines.append(f"- `{shlex.join(o.command)}`: {o.skipped or o.failed}")
    return "\n".join(lines) + "\n"


def png(outcomes: list[Outcome], path: Path, title: str) -> Path | None:
    """Each anchored figure as a bar of how many times better than its anchor pslink is (log
    scale, 1 = even), the whisker the rounds' spread. None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    bars = []
    for o in outcomes:
        for f in o.figures:
            adv = advantage(f)
            if adv is None:
                continue
            low, high = f.spread
            lo, hi = (low, high) if f.better == "higher" else (1 / high, 1 / low)
            bars.append((f"{f.benchmark}: {f.what} vs {f.anchor}", adv, lo, hi))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(bars) + 1.2))
    ys = range(len(bars))
    values = [b[1] for b in bars]
    colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
    ax.barh(list(ys), values, color=colors, alpha=0.8)
    ax.errorbar(values, list(ys), xerr=[[v - b[2] for v, b in zip(values, bars)],
                                         [b[3] - v for v, b in zip(values, bars)]], fmt="none", ecolor="black", lw=0.8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([b[0][:90] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("times better than the anchor measured in the same run (> 1: pslink ahead)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()})"


def write(outcomes: list[Outcome], out: Path, date: str) -> tuple[Path, Path | None]:
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(markdown(outcomes, date, machine()))
    (out / "figures.json").write_text(json.dumps(
        [dict(f.as_json(), command=shlex.join(o.command)) for o in outcomes for f in o.figures], indent=1))
    picture = png(outcomes, out / "report.png", f"pslink against its anchors, {machine()}, {date}")
    return md, picture


def repository_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks").is_dir():
        raise SystemExit(f"no benchmarks/ beside the pslink package ({root}): the report runs the scripts of a source "
                         "checkout; clone the repository and install it with pip install -e .")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pslink bench report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-report", help="directory for report.md, report.png, figures.json, logs/")
    parser.add_argument("--only", default="", help="comma-separated benchmark names to run (default: all)")
    parser.add_argument("--pslite", help="a ps-lite checkout: pslite_bench and sparse run C++ ps-lite beside pslink")
    parser.add_argument("--horovod", help="a directory Horovod 0.28.1 is installed in: adds horovod_api against it")
    parser.add_argument("--from", dest="logs", nargs="+", metavar="LOG",
                        help="render the table from saved benchmark outputs instead of running anything")
    args = parser.parse_args(argv)
    out = Path(args.out)
    date = datetime.date.today().isoformat()
    if args.logs:
        outcomes = []
        for log in args.logs:
            text = Path(log).read_text(errors="replace")
            # The first line of a saved log may carry the command that made it: "$ python benchmarks/...".
            first = text.splitlines()[0] if text else ""
            command = shlex.split(first[2:]) if first.startswith("$ ") else [str(log)]
            found = parse(text)
            outcomes.append(Outcome(Entry(Path(log).stem, ()), command, figures=found,
                                    failed="" if found else "no figures in the log"))
        md, picture = write(outcomes, out, date)
        print(md.read_text())
        return 0

    root = repository_root()
    entries = list(ENTRIES)
    if args.horovod:
        entries.append(Entry("horovod_api", args=("--quick", "--horovod-path", args.horovod), modules=("torch",),
                             timeout=400))
    if args.only:
        wanted = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = wanted - {e.name for e in entries}
        if unknown:
            parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(sorted({e.name for e in entries}))}")
        entries = [e for e in entries if e.name in wanted]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    outcomes = []
    started = time.monotonic()
    print(f"pslink bench report on {machine()}: {len(entries)} benchmarks, quick forms, one at a time; "
          f"not run here: {', '.join(ROOT_ONLY)} (need root: run them with sudo)", flush=True)
    for entry in entries:
        extra = ("--pslite", args.pslite) if args.pslite and entry.name in ("pslite_bench", "sparse") else ()
        outcome = run_entry(entry, root, logs, extra)
        state = outcome.skipped and f"skipped: {outcome.skipped}" or outcome.failed or f"{len(outcome.figures)} figures"
        print(f"  {shlex.join(outcome.command)}: {outcome.seconds:.0f} s, {state}", flush=True)
        outcomes.append(outcome)
    md, picture = write(outcomes, out, date)
    print(f"done in {time.monotonic() - started:.0f} s: {md}" + (f", {picture}" if picture else
                                                                  " (no PNG: matplotlib is not installed)"))
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())

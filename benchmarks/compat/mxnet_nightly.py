"""MXNet's own kvstore tests, unchanged but for the store's name, against the pslink kvstore (issue 50).

MXNet's files are not ours to vendor: give the path of an MXNet checkout (1.9.1's tests were run)::

    git clone --branch 1.9.1 --depth 1 https://github.com/apache/mxnet ~/src/mxnet

**Nightly** (the default): ``tests/nightly/dist_sync_kvstore.py``, the distributed test MXNet's CI
runs with ``tools/launch.py -n 7 --launcher local`` (``ci/docker/runtime_functions.sh``), here
its 9 commands, each as ``--workers`` workers (4) under ``pslink launch`` (an embedded service
each time), with a timeout. The file is copied to a temporary directory with two changes, which
are printed: ``mx.kv.create('dist_sync')`` becomes ``mx.kv.create('pslink')`` and
``import pslink.mxnet`` follows ``import mxnet as mx``. ``tests/nightly`` (for its
``test_kvstore``) is on the workers' ``PYTHONPATH``. A command passes when every worker exits 0.

    python benchmarks/compat/mxnet_nightly.py --mxnet ~/src/mxnet --out results/mxnet_nightly
    python benchmarks/compat/mxnet_nightly.py --mxnet ~/src/mxnet --only compressed_cpu

default_cpu reshapes to ``(num_rows/2, 2)``, a float shape that Python 3.10+ refuses in MXNet's
reshape (with every store): ``--py310`` also makes it ``num_rows//2`` (in the printed diff).
``--dist-sync`` is the baseline: the file (unchanged, or with ``--py310`` only that) on MXNet's
own dist_sync, a ps-lite scheduler, one server and the workers started as MXNet's
``tools/launch.py --launcher local`` starts them.

**Unit tests** (``--unittest``): ``tests/python/unittest/test_kvstore.py``, unchanged, under
pytest twice: as it is (its stores are ``mx.kv.create()``, i.e. 'local', and 'device'), then with
this file loaded as a pytest plugin (``-p mxnet_nightly``) that starts a service in the pytest
process and makes ``mx.kv.create('local')`` and ``mx.kv.create('device')`` return a pslink store,
each a job of one worker of its own (the tests create many stores). Prints the counts and every
test that passes on MXNet's stores but not on pslink's, with its first error line. MXNet's test
helpers (``tests/python/unittest/common.py``) import ``nose.tools``; where nose is not installed
a stand-in of the two functions they use is put on the path (and said so).

    python benchmarks/compat/mxnet_nightly.py --mxnet ~/src/mxnet --unittest --out results/mxnet_unittest

Runs by hand, not in CI (tests/mxnet covers each behaviour there). Needs MXNet 1.9.1 with
numpy < 1.24 in this python.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
NIGHTLY = Path("tests") / "nightly" / "dist_sync_kvstore.py"
UNITTEST = Path("tests") / "python" / "unittest" / "test_kvstore.py"

# MXNet 1.9.1's CI (ci/docker/runtime_functions.sh, integrationtest_ubuntu_cpu_dist_kvstore and
# integrationtest_ubuntu_gpu_dist_kvstore): the name printed for each, and its arguments.
# init_gpu runs with --no-gpu: this MXNet has no CUDA, and the CPU half of it is the point.
COMMANDS = (
    ("gluon_step_cpu", ["--type=gluon_step_cpu"]),
    ("gluon_sparse_step_cpu", ["--type=gluon_sparse_step_cpu"]),
    ("invalid_cpu", ["--type=invalid_cpu"]),
    ("gluon_type_cpu", ["--type=gluon_type_cpu"]),
    ("default_cpu", []),
    ("default_cpu --no-multiprecision", ["--no-multiprecision"]),
    ("compressed_cpu", ["--type=compressed_cpu"]),
    ("compressed_cpu --no-multiprecision", ["--type=compressed_cpu", "--no-multiprecision"]),
    ("init_gpu --no-gpu", ["--type=init_gpu", "--no-gpu"]),
)

STORE_LINE = "mx.kv.create('dist_sync')"
IMPORT_LINE = "import mxnet as mx"
# default_cpu's row-sparse checks reshape to (num_rows/2, 2): a float, which MXNet's reshape
# passes to ctypes.c_int64, refused since Python 3.10 (3.8-3.9 warned), whatever the store.
FLOAT_SHAPE = "reshape((num_rows/2, 2))"

# MXNet's store names the unit tests create, switched to pslink by the plugin below.
SWITCHED_NAMES = ("local", "device")


def prepare(source: str, name: str, store: str, py310: bool) -> str:
    """The nightly test's text as it runs: for ``store='pslink'`` the one
    ``mx.kv.create('dist_sync')`` renamed and ``import pslink.mxnet`` (which registers the name)
    after ``import mxnet as mx``; with ``py310`` its float shapes made integers (``num_rows//2``)."""
    lines = source.splitlines(keepends=True)
    stores = [i for i, line in enumerate(lines) if STORE_LINE in line]
    imports = [i for i, line in enumerate(lines) if line.strip() == IMPORT_LINE]
    if len(stores) != 1 or not imports:
        raise SystemExit(f"{name}: expected one line with {STORE_LINE} (found {len(stores)}) and a line "
                         f"'{IMPORT_LINE}' (found {len(imports)}); is this MXNet 1.9.1's {NIGHTLY}?")
    if store == "pslink":
        lines[stores[0]] = lines[stores[0]].replace(STORE_LINE, "mx.kv.create('pslink')")
        lines.insert(imports[0] + 1, "import pslink.mxnet\n")
    prepared = "".join(lines)
    if py310:
        if FLOAT_SHAPE not in prepared:
            raise SystemExit(f"{name}: --py310: no {FLOAT_SHAPE} to change")
        prepared = prepared.replace(FLOAT_SHAPE, FLOAT_SHAPE.replace("/", "//"))
    return prepared


def end_processes(procs: list[psutil.Process]) -> None:
    """Kill each process (by its pid) still running and reap it."""
    for proc in procs:
        try:
            proc.kill()
            proc.wait(10)
        except psutil.Error:
            pass


def run_bounded(command: list[str], cwd: Path, env: dict, timeout: float) -> tuple[str, int | None, str]:
    """(outcome, exit status, output) of a command with a deadline: passed (status 0), failed, or
    hung (still running at the deadline: stopped, with all it started, by pid)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env=env, stdin=subprocess.DEVNULL)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return ("passed" if proc.returncode == 0 else "failed"), proc.returncode, output
    except subprocess.TimeoutExpired:
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # pslink launch stops its workers and its service on SIGTERM
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        end_processes(started)  # what the launcher did not stop
        return "hung", None, output + f"\n(stopped after {timeout:g} s)\n"


def run_pslink(script: Path, argv: list[str], workers: int, env: dict,
               timeout: float) -> tuple[str, int | None, str]:
    """``pslink launch -n WORKERS python SCRIPT ARGV``, with the deadline."""
    command = [sys.executable, "-m", "pslink.cli", "launch", "-n", str(workers), sys.executable, str(script), *argv]
    return run_bounded(command, script.parent, env, timeout)


def run_dist_sync(script: Path, argv: list[str], workers: int, env: dict,
                  timeout: float) -> tuple[str, int | None, str]:
    """The same, with MXNet's own dist_sync: a ps-lite scheduler, one server and the workers as
    local processes, as MXNet's ``tools/launch.py --launcher local`` starts them (the scheduler
    and the server serve from ``import mxnet`` and exit when the workers finish). A worker that
    fails ends the run (the others would wait for it at the next barrier)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = dict(env, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER="1",
                DMLC_NUM_WORKER=str(workers))
    logs = tempfile.TemporaryDirectory(prefix="dist-sync-")
    procs, files = [], []
    roles = [("scheduler", [sys.executable, "-c", "import mxnet"]), ("server", [sys.executable, "-c", "import mxnet"])]
    roles += [(f"worker{i}", [sys.executable, str(script), *argv]) for i in range(workers)]
    for name, command in roles:
        log = open(Path(logs.name) / name, "w+")  # noqa: SIM115 - closed below, after the processes
        files.append(log)
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=script.parent,
                                      env=dict(base, DMLC_ROLE=name.rstrip("0123456789")), stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + timeout
    outcome = None
    with logs:
        try:
            while outcome is None:
                codes = [p.poll() for p in procs[2:]]
                if any(c not in (None, 0) for c in codes):
                    outcome = "failed"
                elif all(c == 0 for c in codes):
                    outcome = "passed"
                elif time.monotonic() > deadline:
                    outcome = "hung"
                else:
                    time.sleep(0.2)  # polling the workers' exits; the deadline bounds it
            if outcome == "passed":
                for proc in procs[:2]:
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        pass
        finally:
            end_processes([psutil.Process(p.pid) for p in procs if p.poll() is None])
            for proc in procs:
                proc.wait()
            output = ""
            for (name, _), log in zip(roles, files):
                log.seek(0)
                output += "".join(f"[{name}]: {line}" for line in log)
                log.close()
    status = next((p.returncode for p in procs[2:] if p.returncode), 0) if outcome != "hung" else None
    return outcome, status, output + (f"\n(stopped after {timeout:g} s)\n" if outcome == "hung" else "")


def run_nightly(mxnet: Path, workers: int, timeout: float, only: list[str], out: Path | None,
                store: str, py310: bool) -> dict:
    source = mxnet / NIGHTLY
    original = source.read_text()
    prepared = prepare(original, str(source), store, py310)
    diff = "".join(difflib.unified_diff(original.splitlines(keepends=True), prepared.splitlines(keepends=True),
                                        str(NIGHTLY), f"{NIGHTLY} (run)"))
    print(f"the change to {source}:\n{diff or '(none)'}", flush=True)
    commands = [(name, argv) for name, argv in COMMANDS if not only or name in only]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), str(source.parent), os.environ.get("PYTHONPATH", "")) if p))
    run = run_pslink if store == "pslink" else run_dist_sync
    summary: dict = {"mxnet": str(mxnet), "store": store, "workers": workers, "timeout_s": timeout, "py310": py310,
                     "diff": diff, "commands": {}}
    counts = {"passed": 0, "failed": 0, "hung": 0}
    with tempfile.TemporaryDirectory(prefix="mxnet-nightly-") as tmp:
        script = Path(tmp) / source.name
        script.write_text(prepared)
        for name, argv in commands:
            began = time.monotonic()
            outcome, status, output = run(script, argv, workers, env, timeout)
            seconds = time.monotonic() - began
            counts[outcome] += 1
            first = "" if outcome == "passed" else first_error(output)
            print(f"{outcome:7} {name:38} {seconds:6.1f} s  {first}", flush=True)
            summary["commands"][name] = {"outcome": outcome, "status": status, "seconds": round(seconds, 1),
                                         "error": first}
            if out is not None:
                (out / (re.sub(r"[^\w.-]+", "_", name) + ".log")).write_text(output)
    summary["counts"] = counts
    print(f"{counts['passed']} of {len(commands)} passed, {counts['failed']} failed, {counts['hung']} hung "
          f"({workers} workers, {store})", flush=True)
    return summary


def first_error(output: str) -> str:
    """The line that says why a run failed: the last exception line any worker printed."""
    found = re.findall(r"^(?:\[\w+\]: )?((?:[\w.]+(?:Error|Exception)|AssertionError)\b.*)$", output, re.MULTILINE)
    return found[-1][:200] if found else ""


# -- unit tests -------------------------------------------------------------------------------------

NOSE_STAND_IN = '''"""Stand-in for nose.tools (not installed): what MXNet 1.9.1's unittest/common.py uses."""
import functools
import unittest


def make_decorator(func):
    def decorate(new):
        return functools.wraps(func)(new)
    return decorate


assert_raises = unittest.TestCase().assertRaises
'''


def run_unittest(mxnet: Path, timeout: float, keyword: str | None, out: Path) -> dict:
    from torch_distributed_suite import _gist, outcomes  # this directory's junit reader

    test_file = mxnet / UNITTEST
    paths = [str(REPO), str(Path(__file__).parent)]
    try:
        import nose.tools  # noqa: F401
    except ImportError:
        stand_in = out / "nose-stand-in"
        (stand_in / "nose").mkdir(parents=True, exist_ok=True)
        (stand_in / "nose" / "__init__.py").write_text("")
        (stand_in / "nose" / "tools.py").write_text(NOSE_STAND_IN)
        paths.append(str(stand_in))
        print(f"nose is not installed: a stand-in of nose.tools (make_decorator, assert_raises) is in {stand_in}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (*paths, os.environ.get("PYTHONPATH", "")) if p))
    results = {}
    for store, plugin in (("mxnet", []), ("pslink", ["-p", "mxnet_nightly"])):
        junit = out / f"unittest-{store}.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, f"--junitxml={junit}",
                   f"--timeout={timeout:g}", str(test_file), *(["-k", keyword] if keyword else [])]
        began = time.monotonic()
        outcome, _, output = run_bounded(command, test_file.parent, env, timeout * 10)
        (out / f"unittest-{store}.log").write_text(output)
        made = re.search(r"^pslink stores made for .*$", output, re.MULTILINE)
        if made:
            print(made.group(0))
        results[store] = outcomes(junit) if junit.exists() else {}
        tally = {k: sum(1 for o, _ in results[store].values() if o == k) for k in ("passed", "failed", "skipped")}
        print(f"{store:7} stores: {tally['passed']} passed, {tally['failed']} failed, {tally['skipped']} skipped "
              f"({time.monotonic() - began:.0f} s{'' if outcome != 'hung' else ', hung'})", flush=True)
        if not results[store]:
            print(f"  no results: see {out / f'unittest-{store}.log'}\n{_gist(output)}")
    theirs, ours = results["mxnet"], results["pslink"]
    only_theirs = {name: ours.get(name, ("missing", "")) for name, (o, _) in sorted(theirs.items())
                   if o == "passed" and ours.get(name, ("missing", ""))[0] != "passed"}
    print(f"passed on MXNet's local/device stores, not on pslink's ({len(only_theirs)}):")
    for name, (outcome, message) in only_theirs.items():
        print(f"  {name}: {outcome}: {message}")
    return {"test_file": str(test_file), "mxnet": {n: list(v) for n, v in theirs.items()},
            "pslink": {n: list(v) for n, v in ours.items()}, "mxnet_only": {n: list(v) for n, v in only_theirs.items()}}


# The plugin (pytest -p mxnet_nightly): MXNet's 'local' and 'device' stores become pslink stores.
_service = None
_made: list = []  # the pslink stores the switch made (their count shows that it switched)


def pytest_configure(config):
    global _service
    import mxnet as mx

    import pslink.mxnet
    from pslink.core.service import Service

    _service = Service(aggregators=2)
    _service.__enter__()
    create = mx.kv.create
    jobs = itertools.count()

    def create_switched(name="local"):
        if isinstance(name, str) and name.lower() in SWITCHED_NAMES:
            _made.append(pslink.mxnet.PSLink(job=f"unittest-{os.getpid()}-{next(jobs)}", rank=0, num_workers=1,
                                             master=_service.address, timeout=60))
            return _made[-1]
        return create(name)

    mx.kv.create = create_switched


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"pslink stores made for mx.kv.create('local'/'device'): {len(_made)}")


def pytest_unconfigure(config):
    for store in _made:  # before the service goes: their Agents would try to reconnect to it
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - a store a test broke still must not keep the service up
            print(f"closing {store!r}: {exc}")
    if _service is not None:
        _service.__exit__(None, None, None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mxnet", required=True, type=Path,
                        help="an MXNet checkout (its tests/nightly and tests/python/unittest are read)")
    parser.add_argument("--workers", type=int, default=4, help="workers of each nightly command")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one nightly command (or, with --unittest, one test) may take")
    parser.add_argument("--only", default="", help="nightly commands to run, comma separated (names as printed)")
    parser.add_argument("--py310", action="store_true",
                        help=f"also change the nightly test's {FLOAT_SHAPE} to an integer: Python 3.10+ refuses a "
                             "float shape (every store's default_cpu fails there without it)")
    parser.add_argument("--dist-sync", action="store_true",
                        help="the baseline: the nightly file unchanged, on MXNet's own dist_sync (a ps-lite "
                             "scheduler, one server and the workers, as tools/launch.py --launcher local)")
    parser.add_argument("--unittest", action="store_true", help="run tests/python/unittest/test_kvstore.py instead")
    parser.add_argument("-k", dest="keyword", help="with --unittest: only the tests pytest -k selects")
    parser.add_argument("--out", type=Path, help="a directory for each command's output and summary.json")
    args = parser.parse_args(argv)
    mxnet = args.mxnet.expanduser().resolve()
    needed = [UNITTEST] if args.unittest else [NIGHTLY, NIGHTLY.with_name("test_kvstore.py")]
    missing = [str(p) for p in needed if not (mxnet / p).is_file()]
    if missing:
        parser.error(f"{mxnet} has no {', '.join(missing)}: --mxnet names an MXNet checkout "
                     "(git clone --branch 1.9.1 --depth 1 https://github.com/apache/mxnet)")
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - {name for name, _ in COMMANDS})
    if unknown:
        parser.error(f"--only: no command named {unknown}; the commands: {[name for name, _ in COMMANDS]}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.unittest:
        with tempfile.TemporaryDirectory(prefix="mxnet-unittest-") as tmp:
            summary = run_unittest(mxnet, args.timeout, args.keyword, out or Path(tmp))
    else:
        summary = run_nightly(mxnet, args.workers, args.timeout, only, out,
                              "dist_sync" if args.dist_sync else "pslink", args.py310)
    if out is not None:
        (out / ("unittest.json" if args.unittest else "summary.json")).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

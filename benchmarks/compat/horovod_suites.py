"""Horovod's own parallel test files, unchanged, against pslink's adapters (issue 25), counted.

Horovod's files are not ours to vendor: give the path of a horovod/horovod checkout (v0.28.1's
tests were run). Its ``test/parallel/test_torch.py``, ``test_tensorflow.py``,
``test_tensorflow2_keras.py`` and ``test_mxnet1.py`` (the default files) import ``horovod.torch``
etc.; this directory's ``horovod_shim`` is a package named ``horovod`` that is pslink's adapters
(and the few helpers of Horovod's own that its test utilities import), put first on the path.
Each test runs alone, as 2 ranks under ``pslink launch -n 2`` (an embedded service each time),
with a timeout; a test passes when both ranks pass it.

    python benchmarks/compat/horovod_suites.py --horovod ~/src/horovod                 # every file
    python benchmarks/compat/horovod_suites.py --horovod ~/src/horovod --files test_torch.py -k allreduce

Prints, per file, the tests passed, failed, hung and skipped, and the pass rate among those not
skipped (issue 48's target: >= 95% per file); with ``--out DIR`` a JSON summary and each failed
test's output. Runs by hand, not in CI (our own tests cover each behaviour there).

The baseline, the same tests the same way through real Horovod: ``--horovodrun PYTHON`` names the
python of a virtual environment with Horovod built (over Gloo, e.g. 0.28.1 from its sdist with
HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=GLOO, and torch etc. installed there). That python
collects the tests, without the shim on the path, and each runs under
``PYTHON -m horovod.runner.launch --gloo -np 2 -H localhost:2`` instead of ``pslink launch``:

    python benchmarks/compat/horovod_suites.py --horovod ~/src/horovod --horovodrun ~/hvd-venv/bin/python \
        --files test_torch.py --out results/horovod_baseline_torch
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

SHIM = Path(__file__).with_name("horovod_shim")
REPO = Path(__file__).resolve().parents[2]
FILES = ("test_torch.py", "test_tensorflow.py", "test_tensorflow2_keras.py", "test_mxnet1.py")  # issue 48's four


@dataclass(frozen=True)
class Launcher:
    """What runs the tests: the python that collects them and that each rank runs pytest with, the
    command line that starts 2 ranks (the ranks' own command follows it), their environment, and
    the pattern of a rank's pytest summary line (rank, count and kind) in the launcher's output."""

    name: str
    python: str
    command: list[str]
    env: dict
    summary: re.Pattern


def pslink_launcher() -> Launcher:
    """pslink's adapters: ``pslink launch -n 2`` with the shim (a package named horovod) first on the path."""
    paths = [str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), TF_CPP_MIN_LOG_LEVEL="2")
    return Launcher("pslink", sys.executable, [sys.executable, "-m", "pslink.cli", "launch", "-n", "2"], env,
                    re.compile(r"\[rank(\d+)\]: .*?(\d+ (passed|failed|skipped|error))"))


def horovod_launcher(python: str) -> Launcher:
    """Real Horovod, the baseline: horovodrun over Gloo from the venv of ``python``, no shim on the path.
    horovodrun prefixes each line a rank writes with ``[RANK]<stdout>:`` (or ``<stderr>``)."""
    return Launcher(f"horovodrun ({python})", python,
                    [python, "-m", "horovod.runner.launch", "--gloo", "-np", "2", "-H", "localhost:2"],
                    dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                    re.compile(r"^\[(\d+)\]<stdout>:.*?(\d+ (passed|failed|skipped|error))", re.MULTILINE))


def collect(path: Path, keyword: str | None, launcher: Launcher) -> list[str]:
    """The test ids of one file (collected in one process, with the launcher's python and environment)."""
    command = [launcher.python, "-m", "pytest", "--collect-only", "-q", "--rootdir", str(path.parent), str(path)] + (["-k", keyword] if keyword else [])
    out = subprocess.run(command, check=False, capture_output=True, text=True, env=launcher.env,
                         cwd=path.parent).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def run_one(test_id: str, cwd: Path, timeout: float, launcher: Launcher) -> tuple[str, str]:
    """(outcome, output) of one test as 2 ranks: passed, failed, skipped or hung."""
    command = launcher.command + [launcher.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "--rootdir", str(cwd), test_id]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env=launcher.env, stdin=subprocess.DEVNULL)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stacks_of_ranks(proc.pid)
        # pslink's launcher stops its workers (and its service) on SIGTERM; horovodrun's per-rank
        # middlemen kill their rank when horovodrun exits
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        return "hung", output + stacks
    said = {int(rank): kind for rank, _, kind in launcher.summary.findall(output)}
    if said.get(0) == "passed" and said.get(1) == "passed" and proc.returncode == 0:
        return "passed", output
    if "skipped" in said.values() and not {"failed", "error"} & set(said.values()):
        return "skipped", output
    return "failed", output


def stacks_of_ranks(launcher_pid: int) -> str:
    """Every thread's Python stack in each rank of a hung test (``py-spy dump``, where py-spy is
    installed next to this python or on the PATH): where it hangs, for its log."""
    spy = shutil.which("py-spy", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if spy is None:
        return "\n(no py-spy here: the hung ranks' stacks are not shown)\n"
    dumps = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "pytest" not in " ".join(child.cmdline()):
                continue
        except psutil.Error:
            continue
        done = subprocess.run([spy, "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=60,
                              check=False)
        dumps.append(f"\n=== py-spy dump of pid {child.pid}\n{done.stdout}{done.stderr}")
    return "".join(dumps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod", required=True, help="a horovod/horovod checkout (its test/parallel is read)")
    parser.add_argument("--files", default=",".join(FILES), help="test files of test/parallel, comma separated")
    parser.add_argument("-k", dest="keyword", help="only the tests pytest -k selects")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one test may take")
    parser.add_argument("--out", help="a directory for the JSON summary and the failed tests' output")
    parser.add_argument("--horovodrun", metavar="PYTHON",
                        help="the baseline: run through real Horovod, the python of a venv with it built")
    args = parser.parse_args(argv)
    parallel = Path(args.horovod).expanduser() / "test" / "parallel"
    if not parallel.is_dir():
        parser.error(f"{parallel} is not a directory: --horovod names a horovod/horovod checkout")
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    launcher = horovod_launcher(args.horovodrun) if args.horovodrun else pslink_launcher()
    summary: dict = {"horovod": str(parallel.parent.parent), "launcher": launcher.name, "files": {}}
    for name in args.files.split(","):
        path = parallel / name
        if not path.exists():
            print(f"{name}: not in {parallel}, skipped")
            continue
        counts = {"passed": 0, "failed": 0, "hung": 0, "skipped": 0}
        failed = []
        for test_id in collect(path, args.keyword, launcher):
            outcome, output = run_one(test_id, parallel, args.timeout, launcher)
            counts[outcome] += 1
            print(f"{outcome:8} {test_id}", flush=True)
            if outcome in ("failed", "hung"):
                failed.append(test_id)
                if out is not None:
                    (out / (re.sub(r"[^\w.-]+", "_", test_id) + ".log")).write_text(output)
        ran = counts["passed"] + counts["failed"] + counts["hung"]
        rate = counts["passed"] / ran if ran else 0.0
        print(f"{name}: {counts['passed']} passed, {counts['failed']} failed, {counts['hung']} hung, "
              f"{counts['skipped']} skipped; {rate:.0%} of those not skipped pass (target >= 95%)", flush=True)
        summary["files"][name] = dict(counts, pass_rate=round(rate, 4), not_passed=failed)
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: {c: v[c] for c in ("passed", "failed", "hung", "skipped", "pass_rate")}
                      for k, v in summary["files"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

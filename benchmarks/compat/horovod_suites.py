"""Horovod's own parallel test files, unchanged, against pslink's adapters (issue 25), counted.

Horovod's files are not ours to vendor: give the path of a horovod/horovod checkout. Its
``test/parallel/test_torch.py``, ``test_tensorflow.py``, ``test_tensorflow_keras.py`` and
``test_mxnet1.py`` / ``test_mxnet2.py`` import ``horovod.torch`` etc.; this directory's
``horovod_shim`` is a package named ``horovod`` that is pslink's adapters, put first on the path.
Each test runs alone, as 2 ranks under ``pslink launch -n 2`` (an embedded service each time),
with a timeout; a test passes when both ranks pass it.

    python benchmarks/compat/horovod_suites.py --horovod ~/src/horovod                 # every file
    python benchmarks/compat/horovod_suites.py --horovod ~/src/horovod --files test_torch.py -k allreduce

Prints, per file, the tests passed, failed, hung and skipped, and the pass rate among those not
skipped (the issue's target: >= 90% per file); with ``--out DIR`` a JSON summary and each failed
test's output. Runs by hand, not in CI (our own tests cover each behaviour there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).with_name("horovod_shim")
REPO = Path(__file__).resolve().parents[2]
FILES = ("test_torch.py", "test_tensorflow.py", "test_tensorflow_keras.py", "test_mxnet1.py", "test_mxnet2.py")
SUMMARY = re.compile(r"\[rank(\d+)\]: .*?(\d+ (passed|failed|skipped|error))")


def environment() -> dict:
    paths = [str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), TF_CPP_MIN_LOG_LEVEL="2")


def collect(path: Path, keyword: str | None) -> list[str]:
    """The test ids of one file (collected in one process, with the shim on the path)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "--rootdir", str(path.parent), str(path)] + (["-k", keyword] if keyword else [])
    out = subprocess.run(command, capture_output=True, text=True, env=environment(), cwd=path.parent).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def run_one(test_id: str, cwd: Path, timeout: float) -> tuple[str, str]:
    """(outcome, output) of one test as 2 ranks: passed, failed, skipped or hung."""
    command = [sys.executable, "-m", "pslink.cli", "launch", "-n", "2", sys.executable, "-m", "pytest", "-q",
               "-p", "no:cacheprovider", "--rootdir", str(cwd), test_id]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env=environment(), stdin=subprocess.DEVNULL)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers (and its service) on SIGTERM
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        return "hung", output
    said = {int(rank): kind for rank, _, kind in SUMMARY.findall(output)}
    if said.get(0) == "passed" and said.get(1) == "passed" and proc.returncode == 0:
        return "passed", output
    if "skipped" in said.values() and not {"failed", "error"} & set(said.values()):
        return "skipped", output
    return "failed", output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod", required=True, help="a horovod/horovod checkout (its test/parallel is read)")
    parser.add_argument("--files", default=",".join(FILES), help="test files of test/parallel, comma separated")
    parser.add_argument("-k", dest="keyword", help="only the tests pytest -k selects")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one test may take")
    parser.add_argument("--out", help="a directory for the JSON summary and the failed tests' output")
    args = parser.parse_args(argv)
    parallel = Path(args.horovod).expanduser() / "test" / "parallel"
    if not parallel.is_dir():
        parser.error(f"{parallel} is not a directory: --horovod names a horovod/horovod checkout")
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"horovod": str(parallel.parent.parent), "files": {}}
    for name in args.files.split(","):
        path = parallel / name
        if not path.exists():
            print(f"{name}: not in {parallel}, skipped")
            continue
        counts = {"passed": 0, "failed": 0, "hung": 0, "skipped": 0}
        failed = []
        for test_id in collect(path, args.keyword):
            outcome, output = run_one(test_id, parallel, args.timeout)
            counts[outcome] += 1
            print(f"{outcome:8} {test_id}", flush=True)
            if outcome in ("failed", "hung"):
                failed.append(test_id)
                if out is not None:
                    (out / (re.sub(r"[^\w.-]+", "_", test_id) + ".log")).write_text(output)
        ran = counts["passed"] + counts["failed"] + counts["hung"]
        rate = counts["passed"] / ran if ran else 0.0
        print(f"{name}: {counts['passed']} passed, {counts['failed']} failed, {counts['hung']} hung, "
              f"{counts['skipped']} skipped; {rate:.0%} of those not skipped pass (target >= 90%)", flush=True)
        summary["files"][name] = dict(counts, pass_rate=round(rate, 4), not_passed=failed)
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: {c: v[c] for c in ("passed", "failed", "hung", "skipped", "pass_rate")}
                      for k, v in summary["files"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

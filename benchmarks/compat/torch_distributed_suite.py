"""PyTorch's own distributed suite, with ``BACKEND=pslink`` beside ``BACKEND=gloo``, counted.

The suite is PyTorch's ``DistributedTest._DistTestBase`` (``torch.testing._internal.distributed.
distributed_test``, in every torch wheel, so it is the installed torch's own: nothing is fetched or
vendored), run the way PyTorch's ``test/distributed/test_distributed_spawn.py`` runs it (this
directory's ``torch_distributed_spawn.py``): each test spawns ``WORLD_SIZE`` ranks that call
``init_process_group(backend=BACKEND, init_method="file://...")``. For ``pslink`` a service
(pMaster and 2 Aggregators) runs in this process and the ranks reach it through ``PSLINK_MASTER``.

    python benchmarks/compat/torch_distributed_suite.py                       # both, 3 ranks
    python benchmarks/compat/torch_distributed_suite.py -k all_reduce --backends pslink

Prints, per test class and overall, the tests each backend passes, and every test gloo passes that
pslink does not (with the first line of its error); ``--out DIR`` keeps the junit files and a JSON
summary. Needs ``expecttest`` (which PyTorch's test helpers import): ``pip install expecttest``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SPAWN = Path(__file__).with_name("torch_distributed_spawn.py")


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``{class::test: (outcome, first line of its message)}`` from pytest's junit file."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                message = _gist(found.text or found.get("message") or "")
                break
        results[name] = (outcome, message)
    return results


def _gist(text: str) -> str:
    """The line that says what went wrong: a rank's last exception line, else the first line."""
    lines = [re.sub(r"^E\s+", "", line.strip()) for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)
              and not line.startswith("RuntimeError: Process ")]
    return (errors[-1] if errors else lines[0] if lines else "")[:200]


def run_suite(backend: str, world_size: int, pattern: str | None, out: Path, timeout: int,
              master: str | None) -> dict[str, tuple[str, str]]:
    junit = out / f"{backend}-{world_size}.xml"
    env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world_size), TEMP_DIR=tempfile.mkdtemp(prefix="ptdist-"),
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(timeout))
    if master:
        env["PSLINK_MASTER"] = master
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SPAWN), f"--junitxml={junit}"]
    if pattern:
        command += ["-k", pattern]
    began = time.monotonic()
    with open(out / f"{backend}-{world_size}.log", "w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=6 * 3600, check=False)
    print(f"{backend}: {time.monotonic() - began:.0f} s", flush=True)
    return outcomes(junit)


def counts(results: dict[str, tuple[str, str]]) -> dict[str, int]:
    tally = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome, _ in results.values():
        tally[outcome] += 1
    return tally


def report(by_backend: dict[str, dict[str, tuple[str, str]]]) -> dict:
    gloo, pslink = by_backend.get("gloo", {}), by_backend.get("pslink", {})
    classes = sorted({name.split("::")[0] for results in by_backend.values() for name in results})
    summary = {"classes": {}, "gloo_only": {}}
    print(f"{'class':40} " + " ".join(f"{b + ' passed':>14}" for b in by_backend) + "  pslink / gloo")
    for cls in classes:
        passed = {b: {n for n, (o, _) in r.items() if o == "passed" and n.startswith(cls + "::")}
                  for b, r in by_backend.items()}
        both = passed.get("gloo", set()) & passed.get("pslink", set())
        ratio = len(both) / len(passed["gloo"]) if passed.get("gloo") else float("nan")
        summary["classes"][cls] = {b: len(p) for b, p in passed.items()} | {"pslink_of_gloo": ratio}
        print(f"{cls:40} " + " ".join(f"{len(p):>14}" for p in passed.values()) + f"  {ratio:.1%}")
    for backend, results in by_backend.items():
        print(f"{backend}: {counts(results)}")
    for name, (outcome, _) in sorted(gloo.items()):
        if outcome == "passed" and pslink.get(name, ("missing", ""))[0] != "passed":
            summary["gloo_only"][name] = pslink.get(name, ("missing", ""))
    if gloo and pslink:
        print(f"passed with gloo, not with pslink ({len(summary['gloo_only'])}):")
        for name, (outcome, message) in summary["gloo_only"].items():
            print(f"  {name}: {outcome}: {message}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="gloo,pslink")
    parser.add_argument("--world-size", type=int, default=3, help="PyTorch runs gloo on CPU with 3")
    parser.add_argument("-k", dest="pattern", help="pytest -k expression: a part of the suite")
    parser.add_argument("--timeout", type=int, default=120, help="seconds a test may take (PyTorch's default: 300)")
    parser.add_argument("--out", type=Path, help="keep junit files, logs and summary.json here")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="torch-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"torch {torch.__version__} ({torch.version.git_version}), {args.world_size} ranks, out: {out}", flush=True)
    by_backend = {}
    for backend in args.backends.split(","):
        if backend == "pslink":
            from pslink.core.service import Service

            with Service(aggregators=2, log_dir=str(out / "service")) as service:
                by_backend[backend] = run_suite(backend, args.world_size, args.pattern, out, args.timeout,
                                                service.address)
        else:
            by_backend[backend] = run_suite(backend, args.world_size, args.pattern, out, args.timeout, None)
    summary = report(by_backend)
    summary.update(torch=torch.__version__, commit=torch.version.git_version, world_size=args.world_size,
                   counts={b: counts(r) for b, r in by_backend.items()})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

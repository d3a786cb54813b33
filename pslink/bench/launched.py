"""Benchmarks whose workers are processes under ``pslink launch``, each reporting to a file."""

from __future__ import annotations

import io
import json
import os
import tempfile

from pslink.launch import launch


def launch_and_collect(command: list[str], what: str, service: str, job: str, workers: int = 2) -> list[dict]:
    """Run ``command`` + ``--out DIR`` as ``workers`` processes of ``job`` on ``service``; each
    writes ``DIR/rank<r>.json``. Returns those, in rank order (``what`` names them if they fail)."""
    with tempfile.TemporaryDirectory(prefix="pslink-bench-") as out:
        log = io.StringIO()
        code = launch([*command, "--out", out], workers, service=service, job=job, output=log)
        if code != 0:
            raise SystemExit(f"the {what} workers failed (status {code}):\n{log.getvalue()}")
        results = []
        for rank in range(workers):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results

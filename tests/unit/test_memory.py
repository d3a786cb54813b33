"""pslink.core.memory: an Aggregator's process keeps freed memory (no page faults on reuse)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Two 8 MiB arrays made and freed ten times: glibc's default gives their pages back each time
# (the top of the heap passes its trim threshold), so every round faults them in again.
CHURN = textwrap.dedent("""
    import resource
    import numpy as np
    from pslink.core.memory import keep_freed_memory
    kept = keep_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    n = (8 << 20) // 4
    for _ in range(2):
        a = np.ones(n, np.float32); b = np.ones(n, np.float32); del a, b
    before = faults()
    for _ in range(10):
        a = np.ones(n, np.float32); b = np.ones(n, np.float32); del a, b
    print(kept, faults() - before)
""")


def churn(env_value: str | None) -> tuple[bool, int]:
    import os

    env = dict(os.environ)
    env.pop("PSLINK_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["PSLINK_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kept, faults = out.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_is_reused_without_page_faults_and_the_setting_can_be_turned_off():
    kept, faults = churn(None)
    assert kept and faults < 500, f"{faults} page faults for arrays freed and made again"
    off, faults_off = churn("0")
    assert not off
    # 10 rounds x 16 MiB: ~40,000 pages faulted in again with glibc's defaults
    assert faults_off > 10 * faults + 5000, (faults, faults_off)

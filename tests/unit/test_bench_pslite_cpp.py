"""pslink.bench.pslite_cpp (C++ ps-lite built and run beside pslink) and the figures of
benchmarks/pslite_bench.py, without a ps-lite checkout: a stand-in program plays the roles.

The last two build a real ps-lite (``PSLINK_TEST_PSLITE=/path/to/ps-lite``, else the vendored
source beside the repository) and run the driver over tcp and ipc, then the benchmark's quick form
beside it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from pslink.bench import pslite_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench():
    spec = importlib.util.spec_from_file_location("pslite_bench", os.path.join(ROOT, "benchmarks", "pslite_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_checkout(path, commit=None):
    for part in ("Makefile", "include/ps/ps.h", "src/meta.proto"):
        os.makedirs(os.path.dirname(os.path.join(path, part)), exist_ok=True)
        open(os.path.join(path, part), "w").close()
    if commit:
        with open(os.path.join(path, ".pslite_commit"), "w") as f:
            f.write(commit + "\n")
    return str(path)


def test_a_directory_that_is_not_a_ps_lite_checkout_is_named_with_what_it_lacks(tmp_path):
    with pytest.raises(pslite_cpp.PsliteError, match=r"is not a ps-lite checkout \(no Makefile\)"):
        pslite_cpp.checkout(str(tmp_path))
    assert pslite_cpp.checkout(fake_checkout(tmp_path)) == str(tmp_path)


def test_the_commit_comes_from_git_else_the_commit_file_else_unknown(tmp_path):
    root = fake_checkout(tmp_path / "tarball", commit="15b8adf17e9871ff6112c80e4b290fa38c2b4656")
    assert pslite_cpp.commit(root) == "15b8adf17e9871ff6112c80e4b290fa38c2b4656"
    assert pslite_cpp.commit(fake_checkout(tmp_path / "bare")) == "unknown"
    if subprocess.run(["git", "--version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no git")
    repo = fake_checkout(tmp_path / "clone", commit="not this one")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", repo, *command], check=True, env=env, capture_output=True, timeout=30)
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()
    assert pslite_cpp.commit(repo) == head


def test_missing_headers_name_the_debian_packages(tmp_path):
    with pytest.raises(pslite_cpp.PsliteError) as caught:
        pslite_cpp.check_tools(str(tmp_path))
    message = str(caught.value)
    assert "zmq.h" in message and "apt-get install libzmq3-dev libprotobuf-dev" in message


def test_reap_kills_exactly_the_processes_holding_the_tag():
    tagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=dict(os.environ, PSLINK_TEST_TAG="reap-me"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env=dict(os.environ, PSLINK_TEST_TAG="reap-me-not"))
    try:
        assert pslite_cpp.reap("PSLINK_TEST_TAG", "reap-me") == [tagged.pid]  # Popen returns after exec
        assert tagged.wait(10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in (tagged, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


STAND_IN = """\
#!{python}
# Plays C++ ps-lite's roles: binds its ipc socket as ps-lite does (and leaves it), the worker
# prints a result; MODE=hang makes the worker never finish.
import os, socket, sys, time
role = os.environ["DMLC_ROLE"]
port = os.environ["DMLC_PS_ROOT_PORT"] if role == "scheduler" else os.environ["PORT"]
if os.environ.get("DMLC_LOCAL") == "1":
    s = socket.socket(socket.AF_UNIX)
    s.bind("/tmp/" + port)
if role == "worker":
    if sys.argv[1] == "hang":
        time.sleep(120)
    print("PSLITE_CPP_RESULT " + '{{"MBps": 1.5, "args": "%s"}}' % " ".join(sys.argv[1:]), flush=True)
"""


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "stand_in"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_a_run_returns_every_role_s_output_and_removes_ps_lite_s_ipc_sockets(stand_in):
    before = {n for n in os.listdir("/tmp") if n.isdigit()}
    outputs = pslite_cpp.run(stand_in, ["ok", 4096], transport="ipc", timeout=60)
    assert set(outputs) == {"scheduler", "server0", "worker0"}
    assert json.loads(pslite_cpp.result(outputs["worker0"], "PSLITE_CPP_RESULT ")) == {"MBps": 1.5, "args": "ok 4096"}
    left = {n for n in os.listdir("/tmp") if n.isdigit() and stat.S_ISSOCK(os.lstat("/tmp/" + n).st_mode)}
    assert not (left - before), f"ipc sockets left behind: {left - before}"


def tagged_by_this_process() -> list[int]:
    mine = f"{pslite_cpp.TAG}={os.getpid()}-".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(item.startswith(mine) for item in f.read().split(b"\0")):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_run_past_its_timeout_is_killed_and_says_which_role_hung(stand_in):
    with pytest.raises(pslite_cpp.PsliteError, match="worker0 still running after 3 s"):
        pslite_cpp.run(stand_in, ["hang"], timeout=3)
    assert tagged_by_this_process() == []  # the hung worker and its peers are gone


def test_figures_pair_each_variant_with_its_matching_transport_and_drop_failed_rounds():
    bench = load_bench()
    runs = {("pslink", "uds", "zpush", 4096): [10.0, None, 30.0], ("pslink", "service", "zpush", 4096): [5.0, 6.0, 7.0],
            ("ps-lite", "tcp", "zpush", 4096): [20.0, 20.0, 20.0], ("ps-lite", "ipc", "zpush", 4096): [40.0, 40.0, 50.0]}
    figs = bench.make_figures(runs, ["uds", "service"], ["tcp", "ipc"], [4096], ["zpush"], 4, 3, "abc123")
    uds, service = figs[("zpush", 4096, "uds")], figs[("zpush", 4096, "service")]
    assert uds.anchor.startswith("C++ ps-lite ipc") and uds.values == [10.0, 30.0] and uds.anchor_values == [40.0, 50.0]
    assert service.anchor.startswith("C++ ps-lite tcp") and service.ratio == pytest.approx(6.0 / 20.0)
    alone = bench.make_figures(runs, ["service"], [], [4096], ["zpush"], 4, 3, None)[("zpush", 4096, "service")]
    assert alone.ratio is None and "give --pslite PATH" in alone.missing


def test_the_benchmark_without_ps_lite_prints_unanchored_figures_and_its_json_line():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pslite_bench.py"), "--sizes", "4K",
                           "--ops", "zpushpull", "--variants", "classic", "--rounds", "1", "--seconds", "0.05"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(c["variant"], c["mode"], c["op"]) for c in report["cases"]] == [("classic", "classic", "zpushpull")]
    assert report["cases"][0]["MBps"] > 0
    (figure,) = report["figures"]
    assert figure["ratio"] is None and "give --pslite PATH" in figure["missing"]
    assert "PSLINK_FIGURE " in done.stdout


@pytest.fixture(scope="module")
def real_checkout(tmp_path_factory):
    """A real ps-lite checkout: $PSLINK_TEST_PSLITE, else the source the project measured with,
    ../shared/vendor/ps-lite-*.tar.gz beside the repository, unpacked here. Skips, naming what is
    missing, where there is neither or where the system lacks ZeroMQ's and protobuf's headers."""
    import glob
    import tarfile

    given = os.environ.get("PSLINK_TEST_PSLITE")
    if given:
        return pslite_cpp.checkout(given)
    tarballs = sorted(glob.glob(os.path.join(ROOT, "..", "shared", "vendor", "ps-lite-*.tar.gz")))
    if not tarballs:
        pytest.skip("no ps-lite source: set PSLINK_TEST_PSLITE to a dmlc/ps-lite checkout")
    missing = [path for path in ("/usr/include/zmq.h", "/usr/include/google/protobuf/message.h")
               if not os.path.exists(path)]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: apt-get install libzmq3-dev libprotobuf-dev protobuf-compiler")
    into = tmp_path_factory.mktemp("pslite")
    with tarfile.open(tarballs[-1]) as tar:
        tar.extractall(into, filter="data")
    (top,) = [p for p in into.iterdir() if p.is_dir()]
    return pslite_cpp.checkout(str(top))


def test_a_real_ps_lite_checkout_builds_and_runs_the_driver_over_tcp_and_ipc(real_checkout):
    binary = pslite_cpp.build_driver(real_checkout, os.path.join(ROOT, "benchmarks", "cpp", "pslite_bench.cc"))
    for transport in ("tcp", "ipc"):
        outputs = pslite_cpp.run(binary, [4096, "zpushpull", 4, 0.1], transport=transport, timeout=60)
        got = json.loads(pslite_cpp.result(outputs["worker0"], "PSLITE_CPP_RESULT "))
        assert got["op"] == "zpushpull" and got["size"] == 4096 and got["MBps"] > 0


def test_the_benchmark_given_a_checkout_measures_c_plus_plus_ps_lite_beside_pslink(real_checkout):
    from pslink.bench import figures

    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pslite_bench.py"), "--quick",
                           "--pslite", real_checkout], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = [f for f in figures.parse(done.stdout) if f.anchor and f.anchor.startswith("C++ ps-lite")]
    # zpushpull 4K and 256K, each of the four pslink variants against its matching transport
    assert len(found) == 8, done.stdout[-3000:]
    for f in found:
        assert f.ratio is not None and len(f.anchor_values) == len(f.values) == 2, f

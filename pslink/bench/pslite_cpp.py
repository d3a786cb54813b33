"""C++ ps-lite (dmlc/ps-lite) built and run beside pslink: the anchor of the data-path benchmarks.

A ps-lite checkout (any commit) is built with its own Makefile against the system's ZeroMQ and
protobuf (``make -C PATH ps DEPS_PATH=/usr PROTOC=$(which protoc)``; its default ``DEPS_PATH``
downloads them and fails offline). A driver kept in ``benchmarks/cpp/`` is compiled against
``PATH/build/libps.a``, and a run starts a scheduler, servers and workers of it under ps-lite's
``DMLC_*`` environment, over TCP (ps-lite's default) or ``ipc`` (``DMLC_LOCAL=1``: ZeroMQ on Unix
sockets named ``/tmp/<port>``, which ps-lite leaves behind; they are removed here).

Every process started carries a tag in its environment and runs in a session of its own: a run
that outlives its timeout is killed by process group, and any process still holding the tag
afterwards is killed by pid.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

DEBIAN_PACKAGES = {"zmq": "libzmq3-dev", "protobuf": "libprotobuf-dev", "protoc": "protobuf-compiler",
                   "g++": "g++", "make": "make"}
TAG = "PSLINK_PSLITE_CPP_TAG"  # in the environment of every process a run starts
TRANSPORTS = {"tcp": {}, "ipc": {"DMLC_LOCAL": "1"}}
# What ps-lite's Makefile compiles with (CFLAGS, less -ggdb and -fPIC): the driver is built alike.
CXXFLAGS = ["-std=c++11", "-msse2", "-O3", "-finline-functions"]

_runs = itertools.count()


class PsliteError(RuntimeError):
    """C++ ps-lite could not be built or run; the message says what and how to fix it."""


def checkout(path: str) -> str:
    """``path`` as an absolute path, if it is the root of a ps-lite checkout."""
    root = os.path.abspath(os.path.expanduser(path))
    for part in ("Makefile", os.path.join("include", "ps", "ps.h"), os.path.join("src", "meta.proto")):
        if not os.path.exists(os.path.join(root, part)):
            raise PsliteError(f"{path} is not a ps-lite checkout (no {part}): give the root of a dmlc/ps-lite "
                              "clone or source tree")
    return root


def commit(root: str) -> str:
    """The checkout's commit: ``git rev-parse HEAD`` in a git checkout, else the ``.pslite_commit``
    file a source tarball can carry, else ``unknown``."""
    if os.path.exists(os.path.join(root, ".git")) and shutil.which("git"):
        try:
            done = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                                  timeout=10)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip()
        except subprocess.TimeoutExpired:
            pass
    try:
        with open(os.path.join(root, ".pslite_commit")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def check_tools(deps_path: str = "/usr") -> None:
    """Everything a build needs is installed; else one error naming the Debian packages."""
    missing = []
    if not os.path.exists(os.path.join(deps_path, "include", "zmq.h")):
        missing.append(("zmq", f"{deps_path}/include/zmq.h"))
    if not os.path.exists(os.path.join(deps_path, "include", "google", "protobuf", "message.h")):
        missing.append(("protobuf", f"{deps_path}/include/google/protobuf/message.h"))
    for tool in ("protoc", "g++", "make"):
        if shutil.which(tool) is None:
            missing.append((tool, f"{tool} on PATH"))
    if missing:
        packages = " ".join(dict.fromkeys(DEBIAN_PACKAGES[name] for name, _ in missing))
        raise PsliteError(f"building ps-lite needs {', '.join(what for _, what in missing)}, not found; on Debian "
                          f"or Ubuntu: apt-get install {packages}")


def _make(root: str, target: str, deps_path: str, timeout: float) -> None:
    command = ["make", "-C", root, target, f"DEPS_PATH={deps_path}", f"PROTOC={shutil.which('protoc')}"]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PsliteError(f"{' '.join(command)} did not finish in {timeout:.0f} s") from None
    if done.returncode != 0:
        raise PsliteError(f"{' '.join(command)} failed (exit {done.returncode}):\n"
                          f"{(done.stdout + done.stderr)[-3000:]}")


def build_library(root: str, deps_path: str = "/usr", timeout: float = 900.0) -> str:
    """Build ``root/build/libps.a`` with ps-lite's Makefile (incremental: cheap once built)."""
    check_tools(deps_path)
    _make(root, "ps", deps_path, timeout)
    library = os.path.join(root, "build", "libps.a")
    if not os.path.exists(library):
        raise PsliteError(f"ps-lite's Makefile ran but left no {library}")
    return library


def build_test(root: str, name: str, deps_path: str = "/usr", timeout: float = 600.0) -> str:
    """One of ps-lite's own tests (``tests/<name>.cc``), built unchanged by its Makefile."""
    if not os.path.exists(os.path.join(root, "tests", name + ".cc")):
        raise PsliteError(f"this ps-lite checkout has no tests/{name}.cc")
    build_library(root, deps_path, timeout)
    _make(root, f"tests/{name}", deps_path, timeout)
    return os.path.join(root, "tests", name)


def build_driver(root: str, source: str, deps_path: str = "/usr", timeout: float = 300.0) -> str:
    """``source`` (a driver of ours) compiled and linked against the checkout's libps.a; rebuilt
    when the source or the library is newer than the binary."""
    library = build_library(root, deps_path, timeout)
    name = os.path.splitext(os.path.basename(source))[0]
    binary = os.path.join(root, "build", "pslink", name)
    if os.path.exists(binary) and os.path.getmtime(binary) >= max(os.path.getmtime(source),
                                                                   os.path.getmtime(library)):
        return binary
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    base = ["g++", *CXXFLAGS, f"-I{root}/include", f"-I{root}/src", f"-I{deps_path}/include", source, library,
            f"-L{deps_path}/lib"]
    errors = []
    # ps-lite's meta.proto asks for the lite runtime, as its Makefile links; a full libprotobuf
    # serves too, where only that one is installed.
    for protobuf in ("-lprotobuf-lite", "-lprotobuf"):
        try:
            done = subprocess.run([*base, "-lzmq", protobuf, "-pthread", "-o", binary], check=False, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PsliteError(f"compiling {source} did not finish in {timeout:.0f} s") from None
        if done.returncode == 0:
            return binary
        errors.append(done.stderr[-2000:])
    raise PsliteError(f"compiling {source} against {library} failed:\n{errors[-1]}")


# -- runs -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reap(name: str, value: str) -> list[int]:
    """Kill (SIGKILL, by pid) every process of ours whose environment holds ``name=value``;
    returns their pids."""
    wanted = f"{name}={value}".encode()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile, or not ours to read
    return killed


def _ipc_sockets() -> set[str]:
    try:
        names = os.listdir("/tmp")
    except OSError:
        return set()
    found = set()
    for name in names:
        if name.isdigit():
            path = os.path.join("/tmp", name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.add(path)
            except OSError:
                pass
    return found


def _bound_unix_paths() -> set[str]:
    """Unix socket paths some process still has bound (``/proc/net/unix``)."""
    try:
        with open("/proc/net/unix") as f:
            return {line.split()[-1] for line in f.readlines()[1:] if len(line.split()) >= 8}
    except OSError:
        return set()


def _remove_ipc(known: set[str], before: set[str]) -> None:
    """ps-lite binds ``ipc:///tmp/<port>`` and never unlinks it. Remove this run's (the ports it
    was given), and any other appeared during the run that no process has bound any more (ps-lite
    picks a random port when the one given is taken)."""
    in_use = _bound_unix_paths()
    for path in known | ((_ipc_sockets() - before) - in_use):
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode) and path not in in_use:
                os.unlink(path)
        except OSError:
            pass


def run(binary: str, args, *, transport: str = "tcp", num_servers: int = 1, num_workers: int = 1,
        timeout: float = 180.0, env: dict | None = None) -> dict[str, str]:
    """One deployment of ``binary args``: a scheduler, ``num_servers`` servers and ``num_workers``
    workers. Returns each process's output (``scheduler``, ``server0``, ``worker0``, ...); raises
    PsliteError, with the output, when one fails or the run passes ``timeout`` seconds."""
    if transport not in TRANSPORTS:
        raise PsliteError(f"unknown ps-lite transport {transport!r}; use {', '.join(TRANSPORTS)}")
    tag = f"{os.getpid()}-{next(_runs)}-{time.monotonic_ns()}"
    scheduler_port = free_port()
    common = dict(os.environ if env is None else env, **TRANSPORTS[transport])
    common.update({TAG: tag, "DMLC_NUM_SERVER": str(num_servers), "DMLC_NUM_WORKER": str(num_workers),
                   "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(scheduler_port)})
    roles = [("scheduler", "scheduler")] + [("server", f"server{i}") for i in range(num_servers)] + \
            [("worker", f"worker{i}") for i in range(num_workers)]
    ports = {"scheduler": scheduler_port}
    for _, name in roles[1:]:
        ports[name] = free_port()  # PORT: the ipc socket names are then known, to remove them after
    before = _ipc_sockets()
    logs = tempfile.TemporaryDirectory(prefix="pslink-pslite-cpp-")
    procs: dict[str, subprocess.Popen] = {}
    outputs: dict[str, str] = {}
    failure = None
    try:
        for role, name in roles:
            role_env = dict(common, DMLC_ROLE=role)
            if role != "scheduler":
                role_env["PORT"] = str(ports[name])
            with open(os.path.join(logs.name, name), "wb") as log:
                procs[name] = subprocess.Popen([binary, *map(str, args)], env=role_env, stdin=subprocess.DEVNULL,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        # The workers end the run; the scheduler and servers leave once every worker finalized.
        for _, name in sorted(roles, key=lambda r: r[0] != "worker"):
            left = max(0.1, deadline - time.monotonic()) if name.startswith("worker") else 30.0
            try:
                code = procs[name].wait(left)
            except subprocess.TimeoutExpired:
                failure = failure or f"{name} still running after {timeout if name.startswith('worker') else 30:.0f} s"
                break
            if code != 0:
                failure = failure or f"{name} exited with status {code}"
                break
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing it started survives
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait(10)
        reap(TAG, tag)
        if transport == "ipc":
            _remove_ipc({f"/tmp/{port}" for port in ports.values()}, before)
        for name in procs:
            with open(os.path.join(logs.name, name), errors="replace") as f:
                outputs[name] = f.read()
        logs.cleanup()
    if failure:
        tails = "\n".join(f"--- {name}:\n{text[-1500:]}" for name, text in outputs.items() if text.strip())
        raise PsliteError(f"C++ ps-lite ({os.path.basename(binary)}, {transport}): {failure}\n{tails}")
    return outputs


def result(output: str, mark: str) -> str:
    """The text after the last ``mark`` in ``output`` (a driver's result line)."""
    found = re.findall(re.escape(mark) + r"(.*)", output)
    if not found:
        raise PsliteError(f"no {mark.strip()} line in the output:\n{output[-1500:]}")
    return found[-1]

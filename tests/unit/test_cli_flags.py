"""`pslink service up`, `pslink master` and `pslink aggregator` refuse a wrong flag before anything starts, with an
error that names the flag and the choices (a wrong flag used to start the service on defaults, or
end in logging's traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "pslink.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    # A flag that is not refused starts a service that never returns: the timeout fails the test.
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, says", [
    (["service", "up", "--port", "0", "--provider", "bogus"], "unknown --provider 'bogus': choose local or ray"),
    (["service", "up", "--port", "0", "--ray-address", "auto"],
     "--ray-address auto joins a Ray cluster: it goes with --provider ray (this is --provider local)"),
    (["service", "up", "--port", "0", "--log-level", "LOUD"],
     "unknown --log-level 'LOUD': choose DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    (["service", "up", "--port", "0", "--transport", "udp"], "unknown --transport 'udp': use tcp or zmq"),
    (["aggregator", "--master", "tcp://127.0.0.1:9", "--log-level", "verbose"], "unknown --log-level 'verbose'"),
    # pMaster's state off its host, and its standby
    (["master", "--state", "redis://127.0.0.1:9/0"], "--state redis://127.0.0.1:9/0 is shared by every pMaster of "
     "the service: give each the same --secret-file"),
    (["service", "up", "--port", "0", "--state", "redis://127.0.0.1:9/0"], "give each the same --secret-file"),
    (["master", "--standby", "--state", "/tmp/pslink-no-such-state"], "--standby takes over a state the leader "
     "keeps off its host: give --state redis://..., not the directory /tmp/pslink-no-such-state"),
    (["aggregator", "--master", "tcp://127.0.0.1:9,,tcp://127.0.0.1:10"], "entry 2 is empty"),
    (["service", "up", "--port", "0", "--standbys", "tcp://b:7770,nowhere"], "--standbys"),
])
def test_a_wrong_flag_is_refused_by_name_before_anything_starts(args, says):
    done = run(*args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert says in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr
    assert "pMaster" not in done.stdout  # no service was started


def test_a_log_level_in_any_case_is_taken(tmp_path):
    # Lower case is what users type; it is refused only if it is no level at all. The command
    # then fails for another reason (nothing listens at the master address), past the check.
    done = run("aggregator", "--master", "tcp://127.0.0.1:9", "--log-level", "debug", "--timeout", "1")
    assert "--log-level" not in done.stderr


def test_an_unreachable_state_store_at_start_is_an_error_naming_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o600)
    for command in (["master"], ["service", "up", "--port", "0"]):
        done = run(*command, "--state", "redis://127.0.0.1:9/0", "--secret-file", str(secret))
        assert done.returncode == 1, done.stdout + done.stderr
        assert "the state store redis://127.0.0.1:9/0 is unreachable" in " ".join(done.stderr.split()), done.stderr
        assert "Traceback" not in done.stderr

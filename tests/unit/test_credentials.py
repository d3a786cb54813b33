"""The credential model's pure parts: roles, pMaster's door, job names, and the files."""

from __future__ import annotations

import logging
import os
import stat
import types

import pytest

from pslink.core.credentials import AGGREGATOR, OPERATOR, ServiceCredentials, derive, new_secret
from pslink.core.master.gate import Gate, from_this_host
from pslink.core.master.state import MasterState
from pslink.core.names import check_job_name
from pslink.core.ratelog import Throttled
from pslink.core import credential_files
from pslink.core.wire.protocol import Op
from pslink.errors import AuthError, ConfigError


def peer(address: str):
    return types.SimpleNamespace(conn=types.SimpleNamespace(peer=address), info={})


def test_each_role_has_its_own_credential_and_the_operators_grants_more():
    secret = new_secret()
    creds = ServiceCredentials(secret)
    operator, aggregator = derive(secret, OPERATOR), derive(secret, AGGREGATOR)
    assert operator != aggregator and len(operator) == 64
    assert creds.role_of(operator) == OPERATOR and creds.role_of(aggregator) == AGGREGATOR
    assert creds.grants(operator, AGGREGATOR) and not creds.grants(aggregator, OPERATOR)
    assert not creds.grants(derive(new_secret(), OPERATOR), OPERATOR)  # another service's
    assert not creds.grants(None, AGGREGATOR) and not creds.grants(123, AGGREGATOR)
    with pytest.raises(AuthError, match="POOL add needs the service's operator credential; no credential"):
        creds.require(None, OPERATOR, "POOL add")


def test_the_gate_opens_status_and_first_joins_only_on_this_host():
    secret = new_secret()
    gate = Gate(ServiceCredentials(secret))
    here, loop6, far = peer("local://127.0.0.1:7770#3"), peer("tcp://[::1]:5000"), peer("tcp://10.77.0.2:40000")
    assert from_this_host(here) and from_this_host(loop6) and from_this_host(peer("tcp://127.0.0.1:1"))
    assert not from_this_host(far)
    gate.check(here, {"op": Op.STATUS})
    with pytest.raises(AuthError, match="the status, asked from tcp://10.77.0.2:40000"):
        gate.check(far, {"op": Op.STATUS})
    gate.check(far, {"op": Op.STATUS, "cred": derive(secret, OPERATOR)})
    assert gate.first_join(here) and not gate.first_join(far)
    assert Gate(ServiceCredentials(secret, allow_first_join=True)).first_join(far)
    # Re-creating a job with its token passes the door; the state checks the token.
    gate.check(far, {"op": Op.REGISTER_JOB, "job": "j", "tok": b"x"})
    with pytest.raises(AuthError):
        good = derive(secret, OPERATOR)
        # Change the last character to one it is not (a fixed "0" left 1 credential in 16 intact).
        gate.check(here, {"op": Op.REGISTER_AGGREGATOR, "cred": good[:-1] + ("1" if good[-1] == "0" else "0")})
    assert gate.refused == 2
    open_gate = Gate(None)
    open_gate.check(far, {"op": Op.POOL, "action": "add"})
    assert open_gate.first_join(far) and open_gate.is_operator({})


def test_a_worker_from_another_host_cannot_create_a_job_by_joining():
    state = MasterState(lambda: 0.0)
    with pytest.raises(AuthError, match="job 'far' is not registered.*pslink job create"):
        state.register_worker("far", 0, 1, None, first_join=False)
    record = state.register_worker("near", 0, 2, None)  # on pMaster's host: trust on first use
    with pytest.raises(AuthError, match="needs its token"):
        state.register_worker("near", 1, 2, None, first_join=False)
    state.register_worker("near", 1, 2, record.token, first_join=False)


def test_job_names_are_checked_with_a_clear_error():
    assert check_job_name("digits-1.run_2") == "digits-1.run_2"
    for bad, said in (("", "must not be empty"), ("x" * 129, "129 characters long"), ("a b", "may hold only"),
                      ("-x", "start with a letter"), (None, "must be a string"), ("j\x00b", "may hold only")):
        with pytest.raises(ConfigError, match=said):
            check_job_name(bad)
    state = MasterState(lambda: 0.0)
    with pytest.raises(ConfigError, match="must not be empty"):
        state.register_job("", 1)


def test_the_secret_file_is_made_private_and_refused_when_others_can_read_it(tmp_path):
    secret = credential_files.load_or_create_secret(str(tmp_path))
    path = tmp_path / "secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert credential_files.load_or_create_secret(str(tmp_path)) == secret  # kept across restarts
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        credential_files.load_or_create_secret(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        credential_files.load_or_create_secret(None, str(tmp_path / "missing"))
    assert len(credential_files.load_or_create_secret(None)) == 32  # in memory


def test_clients_find_the_credentials_file_for_a_service_on_their_host(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(credential_files.ENV_CREDENTIALS, raising=False)
    monkeypatch.delenv(credential_files.ENV_AGGREGATOR_CREDENTIAL, raising=False)
    secret = new_secret()
    master = "tcp://127.0.0.1:7799"
    assert credential_files.credential_for(master, OPERATOR) is None
    path = credential_files.write_client_file(credential_files.client_file_for(7799), master, secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert credential_files.credential_for(master, OPERATOR) == derive(secret, OPERATOR)
    assert credential_files.credential_for(master, AGGREGATOR) == derive(secret, AGGREGATOR)
    assert credential_files.credential_for("tcp://10.1.2.3:7799", OPERATOR) is None  # not this host's
    credential_files.write_client_file(credential_files.client_file_for(7799), "tcp://10.1.2.3:7799", secret)
    assert credential_files.credential_for("tcp://10.1.2.3:7799", OPERATOR) == derive(secret, OPERATOR)  # it names it
    only = tmp_path / "agg.json"
    credential_files.write_client_file(str(only), master, secret, roles=(AGGREGATOR,))
    assert credential_files.credential_for(master, OPERATOR, str(only)) is None
    assert credential_files.credential_for(master, AGGREGATOR, str(only)) == derive(secret, AGGREGATOR)
    monkeypatch.setenv(credential_files.ENV_AGGREGATOR_CREDENTIAL, "abc")
    assert credential_files.credential_for(master, AGGREGATOR) == "abc"
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot be read as JSON"):
        credential_files.credential_for(master, OPERATOR, str(tmp_path / "bad.json"))


def test_a_flood_of_bad_input_writes_a_line_per_peer_host_and_interval(caplog):
    now = [0.0]
    throttled = Throttled(logging.getLogger("test.flood"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        for i in range(10_000):
            throttled.warning(f"tcp://10.0.0.9:{1000 + i}", "bad", "bad message %d", i)
            now[0] += 0.0015  # 15 s in all
        throttled.warning("local://127.0.0.1:7770#5", "bad", "bad local message")
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 3
    assert lines[0] == "bad message 0" and "more like it from tcp://10.0.0.9 not logged" in lines[1]
    assert lines[-1] == "bad local message"

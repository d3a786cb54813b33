"""TLS on the native TCP transport: a job over TLS gives the same weights as without, nothing of a
job's token crosses the link in clear text, and peers without TLS (or with another CA) are
refused at once with an error naming the settings."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading

import numpy as np
import pytest

import pslink
from pslink.core.service.client import ControlClient
from pslink.core.transport import Transports, TransportOptions
from pslink.core.transport.tls import TlsSettings
from pslink.errors import ConfigError, PeerError
from tests.helpers import start_cluster
from tests.integration.test_pool_changes import assert_same, train

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl (to make test certificates) missing")]


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory, name: str = "ca") -> dict:
    """A CA and one certificate it signed (for every process of the test)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=pslink", "-keyout", f"{name}-peer.key",
             "-out", f"{name}-peer.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}-peer.csr", "-CA", f"{name}.pem", "-CAkey", f"{name}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}-peer.pem", cwd=directory)
    return {"cert": str(directory / f"{name}-peer.pem"), "key": str(directory / f"{name}-peer.key"),
            "ca": str(directory / f"{name}.pem")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    return make_pki(directory), make_pki(directory, "other")


def tcp_only(tls=None) -> Transports:
    """Every connection over TCP (same-host peers would take the Unix socket, which TLS leaves alone)."""
    return Transports(TransportOptions(local_sockets=False, tls=TlsSettings(**tls) if tls else None))


class Recorder:
    """A TCP proxy in front of an address that keeps every byte that crosses it."""

    def __init__(self, target: str):
        self.target = target[len("tcp://"):].rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.target[0], int(self.target[1])))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source, sink):
        try:
            while data := source.recv(65536):
                with self._lock:
                    self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_a_two_worker_job_over_tls_gives_the_weights_it_gives_without(pki):
    ours, _ = pki
    results = []
    for tls in (None, ours):
        transports = tcp_only(tls)
        service = start_cluster("tcp", aggregators=2, transports=transports, control={"profile_iterations": 0})
        try:
            results.append(train(service.address, f"tls-{bool(tls)}", 12, transports=transports)[0])
        finally:
            service.stop()
            transports.close()
    assert_same(results[1], results[0])


@pytest.mark.parametrize("tls", [False, True])
def test_with_tls_a_jobs_token_never_crosses_the_link_in_clear_text(pki, tls):
    ours, _ = pki
    transports = tcp_only(ours if tls else None)
    service = start_cluster("tcp", aggregators=1, transports=transports)
    recorder = Recorder(service.address)
    try:
        with ControlClient(recorder.address, transports=transports) as client:
            token = client.register_job("secret-job", 1)["token"]
        with pslink.connect("secret-job", 0, 1, master=recorder.address, transports=transports, token=token,
                            timeout=20) as agent:
            np.testing.assert_array_equal(agent.pushpull("w", np.ones(8, np.float32)).wait(), np.ones(8))
        assert len(recorder.seen) > 1000
        assert (token in recorder.seen) is not tls  # the control: without TLS it is there to read
        assert (b"secret-job" in recorder.seen) is not tls
    finally:
        recorder.close()
        service.stop()
        transports.close()


def test_peers_without_tls_or_with_another_ca_are_refused_naming_the_settings(pki):
    ours, theirs = pki
    transports = tcp_only(ours)
    service = start_cluster("tcp", aggregators=1, transports=transports)
    try:
        plain = tcp_only()
        try:
            with pytest.raises(ConfigError, match="accepts only TLS connections; set PSLINK_TLS_CERT"):
                with ControlClient(service.address, transports=plain, timeout=5) as client:
                    client.status()
        finally:
            plain.close()
        other = tcp_only(theirs)
        try:
            with pytest.raises(PeerError, match="TLS handshake failed"):
                ControlClient(service.address, transports=other, timeout=5)
        finally:
            other.close()
        with ControlClient(service.address, transports=transports) as client:  # the service is fine
            assert client.status()["aggregators"]
    finally:
        service.stop()
        transports.close()
    # And a TLS client meeting a service in clear text says what it met.
    plain = tcp_only()
    service = start_cluster("tcp", aggregators=1, transports=plain)
    client_side = tcp_only(ours)
    try:
        with pytest.raises(PeerError, match="TLS handshake failed .*does .* run with TLS"):
            ControlClient(service.address, transports=client_side, timeout=5)
    finally:
        client_side.close()
        service.stop()
        plain.close()


def test_partial_tls_settings_are_an_error_naming_what_is_missing(tmp_path, pki):
    from pslink.core.transport.options import transport_options

    ours, _ = pki
    with pytest.raises(ConfigError, match="TLS needs PSLINK_TLS_KEY, PSLINK_TLS_CA too"):
        transport_options({"PSLINK_TLS_CERT": ours["cert"]})
    with pytest.raises(ConfigError, match="TLS CA file .* does not exist"):
        transport_options({"PSLINK_TLS_CERT": ours["cert"], "PSLINK_TLS_KEY": ours["key"],
                           "PSLINK_TLS_CA": str(tmp_path / "nope.pem")})
    assert transport_options({"PSLINK_TLS_CERT": ours["cert"], "PSLINK_TLS_KEY": ours["key"],
                              "PSLINK_TLS_CA": ours["ca"]}).tls == TlsSettings(**ours)

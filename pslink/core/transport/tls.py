"""TLS for the native TCP transport (stdlib ``ssl``), mutual: every peer shows a certificate signed
by the service's CA, and checks the other's.

Only TCP is encrypted: a peer on the same host (and network namespace) reaches a listener over
its Unix socket, which only the same user may use (``tcp.py``), and large payloads cross through
shared memory as before. With TLS on, tokens and credentials never cross a link between hosts in
clear text.

The stream (``stream.py``) reads and writes through :class:`TlsSocket`, which gives an
``SSLSocket`` the calls it makes on a plain one: ``sendmsg`` of several buffers (TLS has no
vectored write: each goes as records of its own, no copy) and non-blocking reads and writes that
raise ``BlockingIOError`` when OpenSSL wants the socket. Decrypted bytes OpenSSL holds back are
not seen by the reactor's poll: the stream asks :meth:`TlsSocket.pending` after each burst.

Handshakes: a connecting peer makes its own (blocking, within its connect timeout); a listener
makes them on a thread each, at most :data:`MAX_HANDSHAKES` at a time, so a peer that connects
and says nothing stalls no one. A plain pslink peer (its first bytes are the frame magic) gets an
error naming the settings, with the id of its first request, so its call fails at once.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
import threading

from pslink.errors import ConfigError

ENV_CERT, ENV_KEY, ENV_CA = "PSLINK_TLS_CERT", "PSLINK_TLS_KEY", "PSLINK_TLS_CA"
HANDSHAKE_TIMEOUT = 5.0
MAX_HANDSHAKES = 64  # listener handshakes under way at once; more connections are closed
SETTINGS_HINT = (f"set {ENV_CERT}, {ENV_KEY} and {ENV_CA} (or `--tls-cert`, `--tls-key`, `--tls-ca`) on "
                 "every process of the service and its jobs")


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    """PEM files: this process's certificate and key, and the CA that signs every peer's."""

    cert: str
    key: str
    ca: str

    def __post_init__(self):
        for name, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            if not os.path.isfile(path):
                raise ConfigError(f"TLS {name} file {path} does not exist; {SETTINGS_HINT}", path=path)

    def context(self, server: bool) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert, self.key)
            context.load_verify_locations(self.ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"TLS files {self.cert}, {self.key}, {self.ca} cannot be loaded: {exc}") from None
        # Peers dial addresses, not names (they advertise IPs): the CA's signature is the check.
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        return context


def settings_from_env(environ=os.environ) -> TlsSettings | None:
    """TLS settings from ``PSLINK_TLS_CERT``, ``PSLINK_TLS_KEY``, ``PSLINK_TLS_CA``: all three or
    none (a part of them is an error: a service meant to encrypt must not run in clear text)."""
    values = {name: (environ.get(name) or "").strip() for name in (ENV_CERT, ENV_KEY, ENV_CA)}
    given = [name for name, value in values.items() if value]
    if not given:
        return None
    if len(given) < 3:
        missing = [name for name in values if name not in given]
        raise ConfigError(f"TLS needs {', '.join(missing)} too ({', '.join(given)} given); {SETTINGS_HINT}")
    return TlsSettings(values[ENV_CERT], values[ENV_KEY], values[ENV_CA])


class TlsSocket:
    """An ``SSLSocket`` as the stream uses a socket (see the module's notes)."""

    def __init__(self, sock: ssl.SSLSocket):
        self.sock = sock
        self.family = sock.family

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def pending(self) -> int:
        return self.sock.pending()

    def sendmsg(self, parts) -> int:
        sent = 0
        for part in parts:
            try:
                n = self.sock.send(part)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                if sent:
                    return sent
                raise BlockingIOError from None
            sent += n
            if n < len(part):
                return sent
        return sent

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        try:
            return self.sock.recv_into(buffer, nbytes)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLError as exc:
            raise ConnectionError(f"TLS: {exc}") from None

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()


def client_handshake(sock: socket.socket, context: ssl.SSLContext, address: str, timeout: float) -> TlsSocket:
    """Wrap a connected socket (blocking, within ``timeout``); raises ``OSError`` saying why not."""
    sock.settimeout(timeout)
    try:
        wrapped = context.wrap_socket(sock, server_side=False, do_handshake_on_connect=True)
    except ssl.SSLError as exc:
        sock.close()
        raise OSError(f"TLS handshake failed ({exc.reason or exc}): does {address} run with TLS, with a "
                      f"certificate signed by this process's CA? {SETTINGS_HINT}") from None
    return TlsSocket(wrapped)


class Handshakes:
    """A listener's handshakes, each on a thread (at most :data:`MAX_HANDSHAKES` at a time).
    ``done(tls_socket, peer)`` runs on the reactor for each peer that completes one."""

    def __init__(self, context: ssl.SSLContext, reactor, done, refuse_plain):
        self.context, self.reactor, self.done, self.refuse_plain = context, reactor, done, refuse_plain
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.failed = 0

    def start(self, sock: socket.socket, peer: str) -> None:
        if not self._slots.acquire(blocking=False):
            self.failed += 1
            sock.close()  # too many peers mid-handshake: a flood, or a stall
            return
        threading.Thread(target=self._run, args=(sock, peer), name="pslink-tls-handshake", daemon=True).start()

    def _run(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            first = sock.recv(65536, socket.MSG_PEEK)
            if first[:2] == b"PL":  # a pslink peer without TLS: tell it which settings it lacks
                self.failed += 1
                self.refuse_plain(sock, first)
                sock.close()
                return
            wrapped = self.context.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError):
            self.failed += 1
            sock.close()
            return
        finally:
            self._slots.release()
        self.reactor.post(self.done, TlsSocket(wrapped), peer)

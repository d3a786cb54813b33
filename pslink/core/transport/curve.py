"""CURVE, ZeroMQ's own encryption and authentication, for the ``zmq+tcp://`` transport (the native
``tcp://`` transport has TLS: ``tls.py``).

Every process of a service and its jobs is given one key file (``PSLINK_CURVE_KEY``, or
``--curve-key`` on ``pslink service up`` and ``pslink aggregator``; ``pslink service curve-key
PATH`` makes one): a Curve25519 secret key, Z85-encoded, mode 0600. Listeners serve with it;
connecting sockets present it and expect a listener that has it; a ZAP handler on each
process's context lets in only clients that present it. So, as with TLS, a process without the
file can neither read the traffic nor connect. A peer whose handshake fails (no CURVE, another key)
is told so by its connection failing with an error that names the setting.
"""

from __future__ import annotations

import dataclasses
import os

from pslink.errors import ConfigError

ENV_CURVE_KEY = "PSLINK_CURVE_KEY"
CURVE_HINT = (f"set {ENV_CURVE_KEY} to the service's key file on every process (`pslink service curve-key PATH` "
              "makes one)")


@dataclasses.dataclass(frozen=True)
class CurveSettings:
    """The service's CURVE key file."""

    key_file: str

    def __post_init__(self):
        try:
            text = open(self.key_file, "rb").read().strip()
        except OSError as exc:
            raise ConfigError(f"CURVE key file {self.key_file} cannot be read ({exc.strerror or exc}); {CURVE_HINT}",
                              path=self.key_file) from None
        if len(text) != 40:
            raise ConfigError(f"CURVE key file {self.key_file} does not hold a Z85 secret key (40 characters); "
                              f"{CURVE_HINT}", path=self.key_file)
        object.__setattr__(self, "_secret", text)

    @property
    def secret(self) -> bytes:
        return self._secret  # type: ignore[attr-defined]

    @property
    def public(self) -> bytes:
        import zmq

        return zmq.curve_public(self.secret)


def make_key_file(path: str) -> str:
    """Write a new secret key to ``path`` (0600) and return the path."""
    import zmq

    _, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret + b"\n")
    finally:
        os.close(fd)
    return path


def settings_from_env(environ=os.environ) -> CurveSettings | None:
    path = (environ.get(ENV_CURVE_KEY) or "").strip()
    return CurveSettings(path) if path else None


def serve(sock, settings: CurveSettings) -> None:
    """Make a listening socket a CURVE server with the service's key."""
    sock.curve_secretkey = settings.secret
    sock.curve_publickey = settings.public
    sock.curve_server = True


def dial(sock, settings: CurveSettings) -> None:
    """Make a connecting socket present the service's key and expect a server that has it."""
    sock.curve_serverkey = settings.public
    sock.curve_publickey = settings.public
    sock.curve_secretkey = settings.secret


class _OnlyOurs:
    """ZAP: a client is let in only if it presents the service's own public key."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain, key) -> bool:
        from zmq.utils import z85

        return key == self.public or (len(key) == 32 and z85.encode(key) == self.public)


def authenticator(ctx, settings: CurveSettings):
    """Start a ZAP handler on ``ctx`` that admits only holders of the service's key."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyOurs(settings.public))
    return auth

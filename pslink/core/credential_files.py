"""Where credentials live on disk, and how clients find them (see :mod:`pslink.core.credentials`).

- The service secret: ``<state>/secret`` (hex, mode 0600), made by the first ``service up`` with
  that state directory and read by later ones; or a file given with ``--secret-file``
  (``PSLINK_SECRET_FILE``); without either, a fresh secret lives in the service's memory.
- The credentials file a client reads: JSON ``{"master": ..., "operator": ..., "aggregator":
  ...}`` (any subset of the roles). ``service up`` writes one to ``~/.pslink/services/PORT.json``
  (directory 0700, file 0600: the user who started the service, and root, read it) and removes it
  when it stops. A client takes ``--credentials FILE`` or ``PSLINK_CREDENTIALS``; without either,
  that file, for the pMaster it names or one on this host (the same port). Copy it (or a subset of
  its roles) to other hosts.
- An Aggregator a provider starts gets its credential in ``PSLINK_AGGREGATOR_CREDENTIAL``.
"""

from __future__ import annotations

import json
import os
import stat

from pslink.core import hosts
from pslink.core.credentials import AGGREGATOR, ROLES, derive, new_secret
from pslink.errors import ConfigError

ENV_CREDENTIALS = "PSLINK_CREDENTIALS"
ENV_SECRET_FILE = "PSLINK_SECRET_FILE"
ENV_AGGREGATOR_CREDENTIAL = "PSLINK_AGGREGATOR_CREDENTIAL"
SECRET_NAME = "secret"


def services_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".pslink", "services")


def client_file_for(port: int) -> str:
    return os.path.join(services_dir(), f"{port}.json")


def _write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (made 0600 before a byte is in it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_or_create_secret(state_dir: str | None = None, secret_file: str | None = None) -> bytes:
    """The service secret: from ``secret_file``, else ``<state_dir>/secret`` (made if missing),
    else a new one kept in memory only."""
    secret_file = secret_file or os.environ.get(ENV_SECRET_FILE) or None
    path = secret_file or (os.path.join(state_dir, SECRET_NAME) if state_dir else None)
    if path is None:
        return new_secret()
    if os.path.exists(path):
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"the service secret {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                              f"make it private: chmod 600 {path}")
        try:
            with open(path) as f:
                secret = bytes.fromhex(f.read().strip())
        except ValueError:
            raise ConfigError(f"the service secret {path} is not hex") from None
        if len(secret) < 16:
            raise ConfigError(f"the service secret {path} is too short ({len(secret)} bytes; at least 16)")
        return secret
    if secret_file:
        raise ConfigError(f"the service secret file {path} does not exist")
    secret = new_secret()
    _write_private(path, secret.hex() + "\n")
    return secret


def write_client_file(path: str, master: str, secret: bytes, roles=ROLES) -> str:
    """Write the credentials of ``roles`` for the service at ``master`` to ``path`` (0600, in a
    directory made 0700)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    body = {"master": master, **{role: derive(secret, role) for role in roles}}
    _write_private(path, json.dumps(body, indent=1) + "\n")
    return path


def read_client_file(path: str) -> dict:
    try:
        with open(path) as f:
            body = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"the credentials file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the credentials file {path} cannot be read as JSON: {exc}") from None
    if not isinstance(body, dict) or not any(isinstance(body.get(role), str) for role in ROLES):
        raise ConfigError(f"the credentials file {path} holds none of the roles {', '.join(ROLES)}")
    return body


def credential_for(master: str, role: str, path: str | None = None, environ=os.environ) -> str | None:
    """The credential of ``role`` (or one that grants it) for pMaster at ``master``: from
    ``path``, ``PSLINK_CREDENTIALS``, (for an Aggregator) ``PSLINK_AGGREGATOR_CREDENTIAL``, or the
    file ``service up`` wrote on this host. None when there is none (an open service needs none).
    ``master`` may be a comma list (a pMaster and its standby, which share the service's secret):
    the credential of the first address that has one."""
    if isinstance(master, str) and "," in master:
        for address in (entry.strip() for entry in master.split(",")):
            credential = credential_for(address, role, path, environ) if address else None
            if credential is not None:
                return credential
        return None
    if role == AGGREGATOR and not path and environ.get(ENV_AGGREGATOR_CREDENTIAL):
        return environ[ENV_AGGREGATOR_CREDENTIAL].strip()
    path = path or environ.get(ENV_CREDENTIALS) or None
    if path is None:
        try:
            host, port = master.split("://", 1)[-1].rsplit(":", 1)
            path = client_file_for(int(port))
        except ValueError:
            return None
        if not os.path.exists(path):
            return None
        body = read_client_file(path)
        # The file is this user's: it serves the pMaster it names, or one on this host by that port.
        if body.get("master") != master and not hosts.is_local(host.strip("[]")):
            return None
    else:
        body = read_client_file(path)
    for granting in (role, "operator"):
        if isinstance(body.get(granting), str):
            return body[granting]
    return None

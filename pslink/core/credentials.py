"""Who may do what on a service: the roles, their credentials, and what a request must carry.

One service secret (32 random bytes, made at ``pslink service up`` and kept 0600 in its state
directory, or given by file) derives one credential per role with HMAC-SHA256, so a role's
credential can be handed out without the secret and without the other roles':

- **operator**: add and remove Aggregators, create (and re-create) jobs, read the status from
  beyond pMaster's host; it also grants what the Aggregator credential grants;
- **aggregator**: register an Aggregator (which is then trusted with the gradients and tokens of
  the jobs it serves);
- a job's **token** (made per job by pMaster, not derived): its workers' every request.

A service made without credentials (``Master(credentials=None)``: the in-process clusters of the
tests and of library use) is open: every caller is an operator. Pure: no I/O (the files are
:mod:`pslink.core.service.secrets`'s).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from pslink.errors import AuthError

OPERATOR = "operator"
AGGREGATOR = "aggregator"
ROLES = (OPERATOR, AGGREGATOR)
SECRET_BYTES = 32
# What each role's credential also grants (the operator starts Aggregators, so it may register them).
_GRANTS = {OPERATOR: (OPERATOR, AGGREGATOR), AGGREGATOR: (AGGREGATOR,)}


def derive(secret: bytes, role: str) -> str:
    """The credential of ``role`` under the service ``secret`` (64 hex characters)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return hmac.new(secret, f"pslink/{role}".encode(), hashlib.sha256).hexdigest()


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


class ServiceCredentials:
    """What pMaster checks. ``allow_first_join``: a worker may join a job it names without its
    token from anywhere (trust on first use); otherwise only from pMaster's own host."""

    def __init__(self, secret: bytes, allow_first_join: bool = False):
        if len(secret) < 16:
            raise ValueError("a service secret needs at least 16 bytes")
        self._by_credential = {derive(secret, role): role for role in ROLES}
        self.allow_first_join = allow_first_join

    def role_of(self, presented) -> str | None:
        """The role a presented credential proves, or None."""
        if not isinstance(presented, str):
            return None
        for credential, role in self._by_credential.items():
            if hmac.compare_digest(credential, presented):
                return role
        return None

    def grants(self, presented, role: str) -> bool:
        proven = self.role_of(presented)
        return proven is not None and role in _GRANTS[proven]

    def require(self, presented, role: str, what: str) -> None:
        """Raise :class:`AuthError` naming ``what`` was refused unless ``presented`` grants ``role``."""
        if self.grants(presented, role):
            return
        how = "no credential was given" if presented is None else "the credential given is not valid for it"
        raise AuthError(f"{what} needs the service's {role} credential; {how} (pass --credentials FILE or set "
                        f"PSLINK_CREDENTIALS; `pslink service up` wrote the file and printed its path)",
                        role=role)

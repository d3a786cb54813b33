"""The names users give: what a job name may be, checked where it is given (a clear error at
once) and again where it is used (pMaster, for requests that bypass the client)."""

from __future__ import annotations

import re

from pslink.errors import ConfigError

MAX_JOB_NAME = 128
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]*")


def check_job_name(job) -> str:
    """``job`` if it is a valid job name: 1 to 128 characters, letters, digits and ``. _ : @ + = -``,
    starting with a letter or digit (names appear in logs, metrics labels and file names)."""
    if not isinstance(job, str):
        raise ConfigError(f"a job name must be a string, got {type(job).__name__}", job=repr(job))
    if not job:
        raise ConfigError("a job name must not be empty", job=job)
    if len(job) > MAX_JOB_NAME:
        raise ConfigError(f"job name {job[:40]!r}... is {len(job)} characters long; at most {MAX_JOB_NAME}",
                          job=job[:MAX_JOB_NAME])
    if not _JOB_NAME.fullmatch(job):
        raise ConfigError(f"job name {job!r} may hold only letters, digits and . _ : @ + = -, and must start "
                          "with a letter or digit", job=job)
    return job

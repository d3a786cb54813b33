"""This process's connection to the parameter service, as Horovod's ``hvd.init()`` gives one.

The strategy, the gradient tape and optimizer wrappers, the Keras callbacks and
``broadcast_variables`` all use the process's Agent: a rank may join its job only once, so they
must share it. ``init()`` makes it (from ``PSLINK_*`` variables, as ``pslink launch`` sets them,
or from arguments); the first of those APIs to need it calls ``init()`` if you did not.
"""

from __future__ import annotations

import atexit
import os
import threading

import tensorflow as tf

from pslink.core.worker import collectives
from pslink.core.worker.connect import connect as connect_agent
from pslink.core.agent import Agent
from pslink.errors import ConfigError, PeerError
from pslink.tf.exchange import Exchange


class _Process:
    """The Agent this process uses (at most one at a time) and whether we made it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.exchange: Exchange | None = None
        self.owned = False
        self.exit_hook = False


_process = _Process()


def connect(what: str, **options) -> Agent:
    """``pslink.connect(**options)`` with errors that say what to do about them."""
    try:
        return connect_agent(**options)
    except ConfigError as exc:
        raise ConfigError(
            f"{what}: {exc.message}. Run the script with `pslink launch -n N python script.py`, or pass "
            "job=, rank=, num_workers= and master=", **exc.details,
        ) from None
    except PeerError as exc:
        raise PeerError(
            f"{what}: cannot reach the parameter service: {exc.message}. Start one with `pslink service up` "
            "(and set PSLINK_MASTER), or run the script with `pslink launch -n N`, which starts one",
            **exc.details,
        ) from None


def check_agent(agent: Agent, what: str) -> Agent:
    """The adapter sums gradients in BSP rounds: refuse an Agent of a job set up otherwise."""
    if not isinstance(agent, Agent):
        raise ConfigError(f"{what}: agent must be a pslink Agent (pslink.connect(...)), got {type(agent).__name__}")
    if agent.closed:
        raise ConfigError(f"{what}: the agent of job {agent.job!r} rank {agent.rank} is closed")
    if agent.mode != "sum" or agent.sync != "bsp":
        raise ConfigError(
            f"{what}: job {agent.job!r} runs in {agent.mode!r} mode with {agent.sync!r} rounds; TensorFlow "
            "workers need 'sum' mode with 'bsp' rounds (the job's first worker chose its settings)"
        )
    return agent


def init(agent: Agent | None = None, **options) -> Agent:
    """Connect this process to the parameter service, once; return its Agent.

    ``options`` go to :func:`pslink.connect` (``job``, ``rank``, ``num_workers``, ``master``,
    ``timeout``, ...; each falls back to its ``PSLINK_*`` variable). Or pass an ``agent`` you made.
    Calling it again returns the same Agent; to change it, call :func:`shutdown` first."""
    return init_for("pslink.tf.init()", agent, options)


def init_for(what: str, agent: Agent | None, options: dict) -> Agent:
    """:func:`init` on behalf of ``what`` (named in its errors)."""
    with _process.lock:
        current = _process.exchange
        if current is not None and not current.agent.closed:
            if (agent is not None and agent is not current.agent) or options:
                raise ConfigError(
                    f"{what}: pslink.tf is already connected (job {current.agent.job!r}, rank "
                    f"{current.agent.rank}); call pslink.tf.shutdown() before connecting again"
                )
            return current.agent
        owned = agent is None
        if owned:
            agent = connect(what, **options)
        try:
            check_agent(agent, what)
        except ConfigError:
            if owned:
                agent.close()  # leave the job we just joined
            raise
        # Elastic recovery registers this rank again the same way (pslink.core.worker.elastic.register_again).
        again = (lambda token, rejoin=False: connect(what, **dict(options, token=token, rejoin=rejoin))) if owned \
            else None
        _process.exchange = Exchange(agent, again)
        _process.owned = owned
        if owned and not _process.exit_hook:
            atexit.register(shutdown)  # leave the job cleanly, so that it ends at once
            _process.exit_hook = True
        return agent


def shutdown() -> None:
    """Leave the job (closing the Agent if ``init`` made it); ``init`` may connect again later."""
    with _process.lock:
        exchange, owned = _process.exchange, _process.owned
        _process.exchange, _process.owned = None, False
    if exchange is not None and exchange.process_sets is not None:
        exchange.process_sets.close()  # the sets' jobs are this process's own, whoever made the Agent
    if exchange is not None and owned:
        exchange.agent.close()


def exchange() -> Exchange:
    """The process's :class:`Exchange`, connecting first if needed."""
    current = _process.exchange
    if current is None or current.agent.closed:
        init()
        current = _process.exchange
    return current  # type: ignore[return-value]


def is_initialized() -> bool:
    return _process.exchange is not None and not _process.exchange.agent.closed


def rank() -> int:
    """This worker's rank in its job."""
    return exchange().rank


def size() -> int:
    """The number of workers in the job."""
    return exchange().num_workers


def local_rank() -> int:
    """This worker's rank among the workers on its machine (``PSLINK_LOCAL_RANK``, else 0)."""
    exchange()
    return int(os.environ.get("PSLINK_LOCAL_RANK", "0"))


def local_size() -> int:
    """The number of workers on this machine (``PSLINK_LOCAL_SIZE``, else 1)."""
    exchange()
    return int(os.environ.get("PSLINK_LOCAL_SIZE", "1"))


def cross_rank() -> int:
    """The index of this worker's machine, as Horovod numbers them."""
    return collectives.cross_rank(rank(), local_size())


def cross_size() -> int:
    """The number of machines, as Horovod counts them."""
    return collectives.cross_size(size(), local_size())


def cuda_built() -> bool:
    """Whether this TensorFlow was built with CUDA (as Horovod reports it)."""
    return tf.test.is_built_with_cuda()

"""Point-to-point messages of the ``pslink`` torch.distributed backend (``send`` / ``recv``):
each pair of ranks is a 2-worker job of its own, so a send and its receive are one round of two
pushes and involve no other rank."""

from __future__ import annotations

import concurrent.futures
import time
import zlib
import threading

import numpy as np
import torch

from pslink.core.agent import Agent
from pslink.core.worker.collectives import bits_of
from pslink.core.worker.connect import connect as connect_agent
from pslink.errors import PslinkError
from pslink.torch.works import Collective, Deadlines, PslinkBackendError, Work, single


def dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0xFFFF  # the same in every process (hash() is not)


_DTYPE_NAMES = {dtype_code(value): str(value).replace("torch.", "") for value in vars(torch).values()
                if isinstance(value, torch.dtype)}


def dtype_name(code: int) -> str:
    """The dtype a :func:`dtype_code` stands for."""
    return _DTYPE_NAMES.get(code, f"dtype #{code}")


def numpy_of(host: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy (bfloat16 and bool as integers of their width)."""
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy()
    if host.dtype == torch.bool:
        return host.view(torch.uint8).numpy()
    return host.numpy()


def tensor_of(bits: np.ndarray, like: torch.Tensor, shape=None) -> torch.Tensor:
    """``bits`` (integers of ``like``'s element width) as a tensor of ``like``'s dtype and
    ``shape`` (default ``like``'s)."""
    raw = torch.from_numpy(np.ascontiguousarray(bits))
    return raw.view(like.dtype).reshape(like.shape if shape is None else shape)


class Pairs:
    """Point to point for one group (``job``, this ``rank`` of ``size``): send, recv, each pair
    of ranks its own 2-worker job; ``deadlines`` fail what is not matched within ``timeout``."""

    def __init__(self, job: str, rank: int, size: int, timeout: float, deadlines: Deadlines):
        self.job, self.rank, self.size, self.timeout, self.deadlines = job, rank, size, timeout, deadlines
        self._lock = threading.Lock()
        self.agents: dict[int, Agent] = {}  # peer rank -> the Agent of our pair's job
        self.sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pslink-p2p")  # in order

    def close(self) -> None:
        self.sender.shutdown(wait=False, cancel_futures=True)
        for agent in self.agents.values():
            agent.close()

    def _pair(self, peer: int, what: str) -> Agent:
        """The Agent of this rank's pair job with ``peer``: a 2-worker job of its own (the lower
        rank is its rank 0), made on first use by either side, so that a send and its receive
        are one round of two pushes and involve no other rank."""
        if not 0 <= peer < self.size or peer == self.rank:
            raise PslinkBackendError(f"{what}: peer rank {peer} is not another rank of [0, {self.size})")
        with self._lock:
            agent = self.agents.get(peer)
            if agent is None:
                low, high = sorted((self.rank, peer))
                try:
                    agent = connect_agent(f"{self.job}.p2p-{low}-{high}", 0 if self.rank == low else 1, 2, mode="sum",
                                          timeout=self.timeout)
                except PslinkError as exc:
                    raise PslinkBackendError(f"{what}: joining the pair's job: {exc.message}") from None
                self.agents[peer] = agent
        return agent

    def _p2p(self, tensor: torch.Tensor, peer: int, tag: int, sending: bool, what: str):
        """A send or a receive, in two exchanges of the pair's job. First the signature: the n-th
        send of (direction, tag) meets the n-th receive of it, each putting its (elements, dtype)
        in a row of its own; if they differ, both fail at once naming both. Then the data: the
        sender pushes the tensor's integer bits, the receiver zeros, both get the sender's. The
        data goes only after the signatures matched (a lone push would pair with a later
        exchange's), from a thread of the group's, since the signature's answer arrives on the
        Agent's I/O thread, which must not block."""
        agent = self._pair(peer, what)
        source, target = (self.rank, peer) if sending else (peer, self.rank)
        host = tensor.detach().to("cpu").contiguous()
        bits = bits_of(numpy_of(host))
        bits = bits.copy() if sending else np.zeros(bits.shape, bits.dtype)
        future = torch.futures.Future()
        pending = Collective(future, f"{what} not matched within {self.timeout:g} s (job {self.job!r}): did rank "
                                     f"{peer} {'receive' if sending else 'send'} with tag {tag}?")
        mine = np.array([tensor.numel(), dtype_code(tensor.dtype)], np.int64)
        table = np.zeros((2, 2), np.int64)
        table[0 if sending else 1] = mine
        direction = f"p2p/{source}>{target}/{tag}"

        def failed(handle) -> bool:
            error = handle.exception()
            if error is not None:
                pending.fail(PslinkBackendError(f"{what}: {error.message}"))
            return error is not None

        def received(handle) -> None:
            if failed(handle):
                return
            try:
                if not sending:
                    tensor.copy_(tensor_of(bits, host))
                pending.succeed([tensor])
            except Exception as exc:
                pending.fail(exc if isinstance(exc, RuntimeError) else PslinkBackendError(f"{what}: {exc!r}"))

        def exchange() -> None:
            try:
                agent.pushpull(f"{direction}/{bits.dtype}/{bits.size}", bits, out=bits).add_done_callback(received)
            except PslinkError as exc:
                pending.fail(PslinkBackendError(f"{what}: {exc.message}"))

        def matched(handle) -> None:
            if failed(handle):
                return
            if not np.array_equal(table[0], table[1]):
                (sent, sent_dtype), (room, room_dtype) = table.tolist()
                pending.fail(PslinkBackendError(
                    f"{what}: rank {source} sends {sent} elements of {dtype_name(sent_dtype)} with tag {tag}, rank "
                    f"{target} receives {room} elements of {dtype_name(room_dtype)}: a send and its receive must "
                    "have the same size and dtype"))
                return
            self.sender.submit(exchange)

        self.deadlines.add(time.monotonic() + self.timeout, pending)
        agent.pushpull(f"{direction}/signature", table, out=table).add_done_callback(matched)
        return Work(future)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0):
        tensor = single(tensors, "send")
        return self._p2p(tensor, dst, tag, True, f"send to rank {dst} (tag {tag}) of {tuple(tensor.shape)} "
                                                 f"{tensor.dtype}")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0):
        tensor = single(tensors, "recv")
        return self._p2p(tensor, src, tag, False, f"recv from rank {src} (tag {tag}) of {tuple(tensor.shape)} "
                                                  f"{tensor.dtype}")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0):
        raise PslinkBackendError("recv from any source is not supported by the pslink backend: name the source rank")

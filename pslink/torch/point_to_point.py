"""Point-to-point messages of the ``pslink`` torch.distributed backend (``send`` / ``recv``):
each pair of ranks is a 2-worker job of its own, so a send and its receive are one round of two
pushes and involve no other rank.

A receive from any source (``recv(src=None)``) cannot name the pair whose round it joins, and a
push once made cannot be taken back. So it *offers* a receive to every other rank: a round of
each pair, posted ahead, that takes any size and dtype and is met by that rank's next send with
the tag. The first offer met completes it; the others stay, each holding its rank's next message
once it is sent, for the receives after it (from any source or from that rank): every receive,
named or not, takes a rank's messages in the order they were sent, as gloo does."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from pslink.core.agent import Agent
from pslink.core.worker.collectives import bits_of
from pslink.core.worker.connect import connect as connect_agent
from pslink.errors import PslinkError
from pslink.torch.works import Collective, Deadlines, PslinkBackendError, Received, single


def dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0xFFFF  # the same in every process (hash() is not)


_DTYPES = {dtype_code(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)}
_DTYPE_NAMES = {code: str(value).replace("torch.", "") for code, value in _DTYPES.items()}
# A receive offered to a rank (from any source) puts this in its row of the signature: any size and dtype.
ANY = -1


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


# The keys of a pair's job: a send and the receive it meets (named or offered) push the same ones.
def _direction(source: int, target: int, tag) -> str:
    return f"p2p/{source}>{target}/{tag}"


def _signature_key(direction: str) -> str:
    return f"{direction}/signature"


def _data_key(direction: str, bits: np.ndarray) -> str:
    return f"{direction}/{bits.dtype}/{bits.size}"


@dataclass(eq=False)
class Message:
    """A rank's message, taken by a receive offered to it ahead (from any source): pending until
    the rank's send met the offer, then its tensor (or the error), until a receive claims it."""

    source: int
    tag: object
    tensor: torch.Tensor | None = None
    error: BaseException | None = None
    arrived: bool = False
    order: int = 0  # when it arrived: a receive from any source takes the earliest
    claimant: Receive | None = None  # a receive from this rank that came for it while it was pending


@dataclass(eq=False)
class Receive:
    """A receive waiting for a message that an offer takes."""

    tensor: torch.Tensor
    work: Received
    pending: Collective
    what: str


class Pairs:
    """Point to point for one group (``job``, this ``rank`` of ``size``): send, recv, each pair
    of ranks its own 2-worker job; ``deadlines`` fail what is not matched within ``timeout``."""

    def __init__(self, job: str, rank: int, size: int, timeout: float, deadlines: Deadlines):
        self.job, self.rank, self.size, self.timeout, self.deadlines = job, rank, size, timeout, deadlines
        self._lock = threading.Lock()
        self.agents: dict[int, Agent] = {}  # peer rank -> the Agent of our pair's job
        self.sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pslink-p2p")  # in order
        # A receive's round goes to its pair in the order the receives were called, deciding
        # first whether an offer made before takes it: one receive at a time decides and posts.
        self._posting = threading.Lock()
        self._state = threading.Lock()  # what follows: changed by receives and by arriving messages
        self._offered: dict[object, dict[int, collections.deque[Message]]] = {}  # tag -> rank -> unclaimed
        self._waiting: dict[object, collections.deque[Receive]] = {}  # tag -> receives from any source
        self._arrivals = itertools.count()

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

    def _p2p(self, tensor: torch.Tensor, peer: int, tag, sending: bool, what: str) -> Received:
        """A send or a receive, in two exchanges of the pair's job. First the signature: the n-th
        send of (direction, tag) meets the n-th receive of it, each putting its (elements, dtype)
        in a row of its own; if they differ, both fail at once naming both (a receive offered
        from any source takes any). Then the data: the sender pushes the tensor's integer bits,
        the receiver zeros, both get the sender's. The data goes only after the signatures
        matched (a lone push would pair with a later exchange's), from a thread of the group's,
        since the signature's answer arrives on the Agent's I/O thread, which must not block."""
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
        direction = _direction(source, target, tag)

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
                agent.pushpull(_data_key(direction, bits), bits, out=bits).add_done_callback(received)
            except PslinkError as exc:
                pending.fail(PslinkBackendError(f"{what}: {exc.message}"))

        def matched(handle) -> None:
            if failed(handle):
                return
            if not table[1 if sending else 0].any():
                pending.fail(PslinkBackendError(f"{what}: rank {peer} left the pair's job (job {self.job!r}) before "
                                                f"it {'received' if sending else 'sent'} with tag {tag}"))
                return
            if table[1, 0] != ANY and not np.array_equal(table[0], table[1]):
                (sent, sent_dtype), (room, room_dtype) = table.tolist()
                pending.fail(PslinkBackendError(
                    f"{what}: rank {source} sends {sent} elements of {dtype_name(sent_dtype)} with tag {tag}, rank "
                    f"{target} receives {room} elements of {dtype_name(room_dtype)}: a send and its receive must "
                    "have the same size and dtype"))
                return
            self.sender.submit(exchange)

        self.deadlines.add(time.monotonic() + self.timeout, pending)
        agent.pushpull(_signature_key(direction), table, out=table).add_done_callback(matched)
        return Received(future, None if sending else peer)

    def send(self, tensors: list[torch.Tensor], dst: int, tag=0) -> Received:
        tensor = single(tensors, "send")
        return self._p2p(tensor, dst, tag, True, f"send to rank {dst} (tag {tag}) of {tuple(tensor.shape)} "
                                                 f"{tensor.dtype}")

    def recv(self, tensors: list[torch.Tensor], src: int, tag=0) -> Received:
        """A receive from ``src``: the message an offer took from it before, if one is left
        unclaimed (an earlier receive from any source offered to it), else a round of its own."""
        tensor = single(tensors, "recv")
        what = f"recv from rank {src} (tag {tag}) of {tuple(tensor.shape)} {tensor.dtype}"
        with self._posting:
            with self._state:
                offered = self._offered.get(tag, {}).get(src)
                message = offered.popleft() if offered else None
                if message is not None:
                    receive = self._receive(tensor, what, f"did rank {src} send with tag {tag}?")
                    if not message.arrived:
                        message.claimant = receive
                        return receive.work
            if message is None:
                return self._p2p(tensor, src, tag, False, what)
        self._deliver([(receive, message)])
        return receive.work

    def recv_anysource(self, tensors: list[torch.Tensor], tag=0) -> Received:
        """A receive of the first message any other rank sends with ``tag``: the earliest one an
        offer took and no receive claimed yet, else the first to meet one of the offers this
        makes, so that every other rank has one for each receive from any source waiting."""
        tensor = single(tensors, "recv")
        what = f"recv from any source (tag {tag}) of {tuple(tensor.shape)} {tensor.dtype}"
        if self.size < 2:
            raise PslinkBackendError(f"{what}: the group has no other rank to receive from")
        receive = self._receive(tensor, what, f"did another rank send to rank {self.rank} with tag {tag}?")
        with self._posting:
            with self._state:
                waiting = self._waiting.setdefault(tag, collections.deque())
                waiting.append(receive)
                deliveries = self._match(tag)
                wanted = sum(not r.pending.done for r in waiting)
                offered = self._offered.setdefault(tag, {})
                short = {peer: wanted - len(offered.get(peer, ())) for peer in range(self.size) if peer != self.rank}
            for peer, count in short.items():
                for _ in range(count):
                    self._offer(peer, tag)
        self._deliver(deliveries)
        return receive.work

    def _receive(self, tensor: torch.Tensor, what: str, hint: str) -> Receive:
        future = torch.futures.Future()
        pending = Collective(future, f"{what} not matched within {self.timeout:g} s (job {self.job!r}): {hint}")
        self.deadlines.add(time.monotonic() + self.timeout, pending)
        return Receive(tensor, Received(future), pending, what)

    def _offer(self, peer: int, tag) -> None:
        """A receive offered to ``peer`` (its next message with ``tag``, of any size and dtype),
        kept unclaimed until a receive takes it. Called with ``_posting`` held."""
        message = Message(peer, tag)
        with self._state:
            self._offered.setdefault(tag, {}).setdefault(peer, collections.deque()).append(message)
        what = f"recv from any source (tag {tag}), offered to rank {peer}"
        try:
            agent = self._pair(peer, what)
        except PslinkBackendError as exc:
            self._arrived(message, error=exc)
            return
        direction = _direction(peer, self.rank, tag)
        table = np.zeros((2, 2), np.int64)
        table[1] = ANY

        def failed(handle) -> bool:
            error = handle.exception()
            if error is not None:
                self._arrived(message, error=PslinkBackendError(f"{what}: {error.message}"))
            return error is not None

        def matched(handle) -> None:
            if failed(handle):
                return
            count, code = table[0].tolist()
            if not table[0].any():  # its round closed without it: the rank left its pair's job
                self._arrived(message, error=PslinkBackendError(f"{what}: rank {peer} left the pair's job before "
                                                                f"it sent with tag {tag}"))
                return
            dtype = _DTYPES.get(code)
            if dtype is None:
                self._arrived(message, error=PslinkBackendError(f"{what}: rank {peer} sends {dtype_name(code)}, "
                                                                "a dtype this process does not know"))
                return
            host = torch.zeros(count, dtype=dtype)
            bits = bits_of(numpy_of(host))  # zeros, received into: the sender's

            def received(handle) -> None:
                if not failed(handle):
                    self._arrived(message, tensor=host)

            def exchange() -> None:
                try:
                    agent.pushpull(_data_key(direction, bits), bits, out=bits).add_done_callback(received)
                except PslinkError as exc:
                    self._arrived(message, error=PslinkBackendError(f"{what}: {exc.message}"))

            self.sender.submit(exchange)

        try:
            agent.pushpull(_signature_key(direction), table, out=table).add_done_callback(matched)
        except PslinkError as exc:
            self._arrived(message, error=PslinkBackendError(f"{what}: {exc.message}"))

    def _arrived(self, message: Message, tensor: torch.Tensor | None = None, error: BaseException | None = None):
        with self._state:
            message.tensor, message.error, message.arrived = tensor, error, True
            message.order = next(self._arrivals)
            claimant, message.claimant = message.claimant, None
            deliveries = [(claimant, message)] if claimant is not None else self._match(message.tag)
        self._deliver(deliveries)

    def _match(self, tag) -> list[tuple[Receive, Message]]:
        """Pairs the receives from any source waiting for ``tag`` with the messages that arrived
        unclaimed, earliest first (each rank's in the order it sent them). Called with ``_state``."""
        waiting, offered = self._waiting.get(tag), self._offered.get(tag, {})
        pairs = []
        while waiting:
            if waiting[0].pending.done:  # its deadline passed
                waiting.popleft()
                continue
            # A rank whose offer failed (it left, its pair's job failed) fails only a receive that
            # names it: another rank may still send to a receive from any source.
            firsts = [queue for queue in offered.values() if queue and queue[0].arrived and queue[0].error is None]
            if not firsts:
                break
            pairs.append((waiting.popleft(), min(firsts, key=lambda q: q[0].order).popleft()))
        return pairs

    def _deliver(self, deliveries: list[tuple[Receive, Message]]) -> None:
        """Completes each receive with its message. A receive whose deadline passed meanwhile
        leaves the message, unclaimed again, to the next receive."""
        while deliveries:
            receive, message = deliveries.pop(0)
            if not receive.pending.done and self._complete(receive, message):
                continue
            with self._state:
                self._offered[message.tag][message.source].appendleft(message)
                deliveries += self._match(message.tag)

    @staticmethod
    def _complete(receive: Receive, message: Message) -> bool:
        """``receive`` completed with ``message`` (its error, or a size or dtype it cannot take);
        False if its deadline passed first."""
        if message.error is not None:
            receive.pending.fail(message.error)
            return True
        sent, room = message.tensor, receive.tensor
        if sent.numel() != room.numel() or sent.dtype != room.dtype:
            receive.pending.fail(PslinkBackendError(
                f"{receive.what}: rank {message.source} sent {sent.numel()} elements of "
                f"{str(sent.dtype).replace('torch.', '')} with tag {message.tag}: a send and its receive must "
                "have the same size and dtype"))
            return True
        try:
            room.copy_(sent.reshape(room.shape))
        except Exception as exc:
            receive.pending.fail(exc if isinstance(exc, RuntimeError) else PslinkBackendError(f"{receive.what}: "
                                                                                              f"{exc!r}"))
            return True
        receive.work.source = message.source
        return receive.pending.succeed([room])

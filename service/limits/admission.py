"""The server-wide budget for request bodies: memory follows what the server holds, not what
clients send.

Each request's body limit (``max_body_bytes``) bounds one request; this bounds them all
together. A body is counted as its bytes arrive, never as declared: a ``Content-Length`` is a
promise, and heads promising the whole budget with no body behind them would otherwise refuse
everyone else for as long as the body timeout (#28 finding 4). Once the bytes held would pass
``max_inflight_bytes``, the request is answered 503 with ``Retry-After`` and the rest of its
body is discarded as it arrives (closing at once would reset the connection under a client
that is still sending, before it could read the answer). A compressed body holds what it
inflates to as well, counted as it inflates (:data:`RESERVE`): past the budget, 503 before it
is inflated further. Bytes stay counted until the request's answer has been sent, since
decoding and inference hold them until then. gRPC inference requests hold their message's size
in the same budget while they are answered (:mod:`service.grpc.servicer`): gRPC has received the
message by then, so past the budget it is answered UNAVAILABLE at once and let go, instead of
held through decoding and the queue. What the server makes for requests counts too, as made:
a batch's outputs while they live, a REST answer until it is sent
(:meth:`BytesBudget.hold_while_alive`, :meth:`BytesBudget.hold_for_request`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, ServerBusy
from service.telemetry.counters import REFUSED, REQUEST_HELD, register_budget
from service.telemetry.logs import REQUEST_ID

RESERVE = "tensorgate.reserve"
"""The ASGI scope key of a request's ``reserve(size)``: hold ``size`` more bytes for this request
(its body inflating), or raise :class:`ServerBusy`. Callable from any thread."""


HELD_MADE_BYTES = 64 << 10
"""What the server made for requests, a batch's outputs (:meth:`BytesBudget.hold_while_alive`)
or an answer (:meth:`BytesBudget.hold_for_request`), is counted from this size; smaller ones
are not worth the bookkeeping."""


MAX_ERROR_CHARS = 4096
"""The most of an error's message a client is answered (the log keeps it whole): messages
name what was sent, and a 1 MB input name was answered 1 MB of error."""


def shortened(message: str) -> str:
    """``message`` as a client is told it: at most :data:`MAX_ERROR_CHARS` characters."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    left = len(message) - MAX_ERROR_CHARS
    return f"{message[:MAX_ERROR_CHARS]}… ({left} more characters left out)"


def error_body(message: str) -> bytes:
    """``{"error": ...}`` as the protocol says, plus the request id to find it in the logs."""
    return orjson.dumps({"error": shortened(message), "request_id": REQUEST_ID.get()})


def reserve_of(scope: Scope) -> Callable[[int], None] | None:
    """The request's ``reserve`` (None outside a budget, as in process)."""
    reserve: Callable[[int], None] | None = scope.get(RESERVE)
    return reserve


class BytesBudget:
    """The bytes of request bodies (and gRPC messages) this server holds, under ``limit``,
    and what it made for them and still holds (a batch's outputs, answers not yet sent). Made
    with the app and handed to what takes from it: :class:`BodyBudget` for REST, the gRPC
    servicer for its messages, the schedulers for their batches.

    What was made cannot be refused (the work is done); it makes the next large request wait
    its turn. A small request (holding at most :attr:`small` bytes) is judged by what was not
    made (bodies, messages) against the limit: refusing it would spare next to nothing, and a
    normal client must go on being answered while an attack's answers are made (a REST request
    of 14 KB was refused 503 when 16 identity answers of 61 MiB were counted against it, and
    with an eighth of the limit to spare, 1 of 110 still was). And by everything held against
    twice the limit: a model whose outputs far outgrow its inputs cannot have small requests
    make more without end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.small = limit >> 8
        """A request holding at most this many bytes is judged by what was not made."""
        self._held = 0
        self._made = 0
        """Of ``_held``, what was made for requests."""
        self.high = 0
        """The most held since :class:`service.limits.memory.Trimmer` last looked."""
        self._lock = threading.Lock()  # bodies inflate on the thread pool
        self._let_go: deque[int] = deque()
        """Sizes of arrays counted by :meth:`hold_while_alive` that have since been freed: a
        finalizer appends (it may run in any thread, in a garbage collection that began with
        the lock held), the next holder of the lock takes them off."""
        register_budget(self)

    @property
    def held(self) -> int:
        """Bytes held now: the requests' (read so far, what compressed ones inflated to, ...)
        and what was made for them."""
        if self._let_go:
            with self._lock:
                self._settle()
        return self._held

    @property
    def made(self) -> int:
        """Of :attr:`held`, what was made for requests."""
        if self._let_go:
            with self._lock:
                self._settle()
        return self._made

    def _settle(self) -> None:
        """Take off what was let go (the lock held): all of it made."""
        let_go = self._let_go
        while let_go:
            size = let_go.popleft()
            self._held -= size
            self._made -= size

    def _count(self, size: int, made: bool = False) -> None:
        """Count ``size`` more bytes, made for requests or not (the lock held)."""
        self._held += size
        if made:
            self._made += size
        if self._held > self.high:
            self.high = self._held

    def take(self, size: int, already: int = 0) -> None:
        """Hold ``size`` more bytes for a request that holds ``already``, or raise
        :class:`ServerBusy` (503, gRPC's UNAVAILABLE) when that would pass the limit. Callable
        from any thread. A request that would hold more than the whole limit can never be
        served: :class:`PayloadTooLarge` (413), not a 503 to retry for ever (its body, then 20
        times its JSON, or what it inflates to, each fitting alone, had been a 503)."""
        if already + size > self.limit:
            REFUSED["body_budget"] += 1
            raise PayloadTooLarge(
                f"this request needs {already + size} bytes held at once while it is read and "
                "decoded; "
                f"the server holds at most {self.limit} for every request together "
                "(TG_MAX_INFLIGHT_BYTES): send it in smaller requests, or its tensors in "
                "binary (a JSON body holds about 20 times its size while it is decoded)"
            )
        small = already + size <= self.small
        with self._lock:
            self._settle()
            held = self._held
            if small:
                busy = held - self._made + size > self.limit or held + size > 2 * self.limit
            else:
                busy = held + size > self.limit
            if not busy:
                self._count(size)
        if busy:
            REFUSED["body_budget"] += 1
            raise ServerBusy(
                f"the server holds {held} bytes for requests in flight and this one needs "
                f"{size} more; its limit is {self.limit} (TG_MAX_INFLIGHT_BYTES): retry shortly"
            )

    def try_take(self, size: int, spare: int = 0) -> bool:
        """Hold ``size`` more bytes if they fit with ``spare`` still free; False (nothing
        refused, nothing counted) if not: for what the server can do another way, such as a
        batch run a request at a time."""
        with self._lock:
            self._settle()
            if self._held + size + spare > self.limit:
                return False
            self._count(size)
            return True

    def hold(self, size: int, made: bool = False) -> None:
        """Count ``size`` more bytes (fewer when negative) that are already held and cannot be
        refused: answers written and not yet taken by their clients
        (:mod:`service.limits.connections`), gRPC answers until their calls are over
        (``made``). They make the next bodies wait their turn."""
        with self._lock:
            self._settle()
            self._count(size, made)

    def hold_while_alive(self, arrays: Iterable[np.ndarray]) -> None:
        """Count ``arrays`` (a batch's outputs: the work is done, they cannot be refused) as
        made, for as long as their memory lives, which is until the answers made from them are
        encoded, views and all. Before, a model's outputs were counted nowhere: an identity
        model's answers held as much again as the bodies the budget admitted, and gRPC's heap
        rule (:mod:`service.grpc.arriving`) took them for messages arriving and ended idle
        streams."""
        owners: dict[int, np.ndarray] = {}
        for array in arrays:
            if not isinstance(array, np.ndarray):  # a runtime's own kind: not counted
                continue
            owner = array
            while isinstance(owner.base, np.ndarray):  # a view: its memory is its base's
                owner = owner.base
            if owner.nbytes >= HELD_MADE_BYTES:
                owners[id(owner)] = owner
        for owner in owners.values():
            size = owner.nbytes
            self.hold(size, made=True)
            weakref.finalize(owner, self._let_go.append, size)

    def hold_for_request(self, size: int) -> int:
        """Count ``size`` bytes as made for the REST request being handled (its answer: as
        estimated while it is being made, then as made until it is sent), in place of what was
        counted as made for it before, until :class:`BodyBudget` lets go of it once the answer
        is sent; return what is counted: 0 for less than :data:`HELD_MADE_BYTES`, or outside
        such a request."""
        held = REQUEST_HELD.get()
        if held is None or len(held) < 2:
            return 0
        size = size if size >= HELD_MADE_BYTES else 0
        if size != held[1]:
            self.hold(size - held[1], made=True)
            held[1] = size
        return size

    def release(self, size: int, made: int = 0) -> None:
        """Give back ``size`` bytes, and ``made`` bytes made for it, once the request that
        held them has been answered."""
        with self._lock:
            self._settle()
            self._held -= size + made
            self._made -= made


class DecodeGate:
    """What images being decoded hold at their peak, together, in this process: a decode
    waits its turn while the others hold ``capacity`` bytes, and runs at once when it is alone,
    whatever its size. Never a refusal (an image within the pixel limit is always decoded), and
    what decoding holds stays within ``capacity`` or one image. Before, it was counted nowhere:
    an 8192² RGBA PNG of 261 KB held 1.28 GiB while it decoded, and eight at once took a server
    from 1.5 to 4.8 GiB. Counted in the request budget instead, a large photo was refused 413
    (its pixels past what the budget holds) or 503 for ever (its body and JSON held beside it),
    and a small budget refused a model's own warmup image."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.waited = 0
        """Decodes that have waited their turn (tests and metrics read it)."""
        self._turn = threading.Condition()

    @contextlib.contextmanager
    def holding(self, size: int) -> Iterator[None]:
        """Hold ``size`` bytes for as long as the block runs, once they fit (or nothing else
        is held). Blocks the calling thread (a pool thread, never the event loop) meanwhile."""
        with self._turn:
            if self.held and self.held + size > self.capacity:
                self.waited += 1
                while self.held and self.held + size > self.capacity:
                    self._turn.wait()
            self.held += size
        try:
            yield
        finally:
            with self._turn:
                self.held -= size
                self._turn.notify_all()


class BodyBudget:
    """ASGI middleware holding REST request bodies in flight in ``budget``."""

    def __init__(self, app: ASGIApp, budget: BytesBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = [0, 0]  # the request's bytes, and what was made for it (its answer)

        def reserve(size: int) -> None:
            self.budget.take(size, held[0])
            held[0] += size

        async def counting_receive() -> Message:
            message = await receive()
            reserve(len(message.get("body", b"")))
            return message

        scope[RESERVE] = reserve
        REQUEST_HELD.set(held)  # this request's task (and those it starts) see what it holds
        try:
            await self.app(scope, counting_receive, send)
        finally:
            self.budget.release(held[0], held[1])

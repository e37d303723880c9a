"""uvicorn's httptools protocol, with a response's writes sent to the socket together.

uvicorn writes a response's head on ``http.response.start`` and its body on
``http.response.body``: two ``send`` syscalls, two TCP segments and, on loopback, two wakeups of
the client for one small response. Here a write is held until the next write or the end of the
loop turn, whichever comes first, and the two go to the real transport as one ``writelines``
(one ``writev`` under uvloop; no bytes are copied): a head and its body leave together, at
once, and a head alone (HEAD, 204) leaves at the end of the turn. Everything else goes
straight to the real transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport(asyncio.Transport):
    """A transport that sends a write together with the next one (or at the end of the loop
    turn); the rest of the transport interface is the real transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._held.append(data if isinstance(data, bytes) else bytes(data))  # a buffer may change
        if len(self._held) == 1:
            self._loop.call_soon(self.flush)  # alone, it goes out at the end of this turn
        else:
            self.flush()  # a head and its body: out now, together

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Hand what is held to the real transport (dropped if the connection is gone)."""
        if not self._held:
            return
        held, self._held = self._held, []
        if self._transport.is_closing():
            return
        if len(held) == 1:
            self._transport.write(held[0])
        else:
            self._transport.writelines(held)

    def close(self) -> None:
        self.flush()  # what was written before close() still goes out, as with any transport
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._held)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # narrower than BaseTransport, as uvicorn's own
        super().connection_made(CoalescingTransport(transport, self.loop))

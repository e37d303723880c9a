"""The app in this process: its lifespan run on an event loop of its own thread, and plain ASGI
calls to it that can stand for anything a client does (disconnect included)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.types import ASGIApp, Message

from service.app import create_app, serving_app
from service.core.dataplane import DataPlane
from service.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

T = TypeVar("T")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


class InProcess:
    """``create_app(settings)`` with its lifespan started (models loaded), and the ASGI app
    uvicorn would run (``serving``) beside the bare FastAPI app (``app``)."""

    def __init__(self, settings: Settings, span_exporter: SpanExporter | None = None) -> None:
        if "grpc_port" not in settings.model_fields_set:  # no port 8001 taken by a unit test
            settings = settings.model_copy(update={"grpc_port": 0})
        self.app = create_app(settings, span_exporter)
        self.serving = serving_app(self.app, settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._lifespan = self.app.router.lifespan_context(self.app)
        self.run(self._lifespan.__aenter__())
        self.run(self._until_loaded())

    @property
    def dataplane(self) -> DataPlane:
        dataplane: DataPlane = self.app.state.dataplane
        return dataplane

    def run(self, work: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    async def _until_loaded(self) -> None:
        # loading_done is a threading.Event set by the loading thread: wait for it off the loop
        done = self.dataplane.repository.loading_done
        await asyncio.to_thread(done.wait, 120)

    def request(
        self,
        app: ASGIApp,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        disconnect: bool = False,
        on_send: Callable[[Message], None] | None = None,
    ) -> Reply:
        return self.run(call(app, method, path, body, headers or [], disconnect, on_send))

    def close(self) -> None:
        self.run(self._lifespan.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


async def call(
    app: ASGIApp,
    method: str,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
    disconnect: bool,
    on_send: Callable[[Message], None] | None = None,
) -> Reply:
    """One request straight to ``app``; with ``disconnect`` the client leaves once it has sent
    the body; ``on_send`` is called with each message the app sends, as it sends it."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    never = asyncio.Event()

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if not disconnect:
            await never.wait()
        return {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)
        if on_send is not None:
            on_send(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Reply(start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, content)

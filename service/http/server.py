"""uvicorn with a Kubernetes-style drain on SIGTERM.

1. Readiness turns false at once (load balancers start to take the pod out);
2. requests are still accepted and served for ``drain_pre_stop_s`` (until they have);
3. then new inference requests get 503 while every accepted one finishes, for up to
   ``drain_grace_s``;
4. then the server stops and the process exits 0.
A second SIGTERM, or the end of the grace period, ends it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.core.dataplane import DataPlane
from service.limits.balance import BALANCE, TakeTurns
from service.settings import Settings

log = logging.getLogger("tensorgate.server")
QUIET_S = 0.5
ANSWER_S = 1.0
"""How long the requests still in flight when the grace period ends have to be answered 503
before the exit closes their connections."""


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains instead of stopping."""

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, settings: Settings, shared: bool = False
    ) -> None:
        """``shared``: its listening socket is the supervisor's, shared with other workers."""
        super().__init__(config)
        self._app = app
        self._settings = settings
        self._shared = shared
        self._draining = False
        self._now = threading.Event()
        self._turns: list[TakeTurns] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """As uvicorn's; a worker's listening socket (shared with the others) it accepts from
        one connection a wake-up (:class:`TakeTurns`), not uvicorn's way."""
        self._loop = asyncio.get_running_loop()  # the drain's thread hands work back to it
        if not self._shared or sockets is None:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])
        if not self.started:
            return
        config, loop = self.config, asyncio.get_running_loop()

        # uvicorn's startup makes this in a closure of its own, which nothing can call.
        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]  # typed type[Protocol]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
            )

        self._turns = [TakeTurns(loop, sock, protocol, BALANCE) for sock in sockets]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for turns in self._turns:
            turns.stop()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
            return
        if self._draining:
            log.warning("second SIGTERM: stopping now")
            self._now.set()
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        dataplane = getattr(self._app.state, "dataplane", None)
        if dataplane is None:  # still starting: nothing accepted yet, nothing to drain
            self.should_exit = True
            return
        dataplane.drain.draining = True
        log.info(
            "SIGTERM: readiness is now false; serving for %.1f s more, then finishing accepted "
            "requests (up to %.1f s)",
            self._settings.drain_pre_stop_s,
            self._settings.drain_grace_s,
        )
        threading.Thread(target=self._drain, args=(dataplane,), daemon=True).start()

    def _drain(self, dataplane: DataPlane) -> None:
        # A timed delay by design: load balancers need this long to stop sending.
        if self._now.wait(self._settings.drain_pre_stop_s):
            return
        dataplane.drain.refusing = True
        deadline = time.monotonic() + self._settings.drain_grace_s
        quiet_since: float | None = None
        # Stop once nothing has been in flight for QUIET_S: a request still between the socket
        # and the app when in_flight first reads 0 gets its 503 instead of a closed connection.
        while time.monotonic() < deadline:
            now = time.monotonic()
            if dataplane.drain.in_flight > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= QUIET_S:
                break
            if self._now.wait(0.01):
                return
        left = dataplane.drain.in_flight
        if left:
            log.warning(
                "grace period over with %d requests in flight: answering them 503 and stopping",
                left,
            )
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self._loop.call_soon_threadsafe(dataplane.drain.expire)
            answered_by = time.monotonic() + ANSWER_S
            while dataplane.drain.in_flight and time.monotonic() < answered_by:
                if self._now.wait(0.01):
                    return
            self.force_exit = True
        else:
            log.info("drained: every accepted request was answered; stopping")
        self.should_exit = True

"""Logging: one JSON object per line, so that log pipelines need no parsing rules.

Lines are written by a thread of their own: a log pipe that stops reading (a stalled collector,
a full terminal) blocks that thread, never the event loop that serves requests. Records wait
in an unbounded queue meanwhile and none is lost once the pipe drains.
"""

from __future__ import annotations

import atexit
import contextvars
import itertools
import logging
import logging.handlers
import queue
import re
import sys
import time
import uuid
from typing import Any

import orjson

from service.telemetry import tracing

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
"""The id of the request being handled, for every log line written while handling it."""

_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_for(given: str) -> str:
    """The client's ``X-Request-ID`` when it is a sane one, else a new id: unique per process
    start and request, made without a syscall (uuid4 reads os.urandom)."""
    if given and _VALID_ID.fullmatch(given):
        return given
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's ANSI-coloured copy of msg
}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}``, plus ``exc`` with the traceback, and
    ``worker`` (its index) in a server of several worker processes."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.worker is not None:
            entry["worker"] = self.worker
        request_id = REQUEST_ID.get()  # set on the record instead when it was queued
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class _Enqueue(logging.handlers.QueueHandler):
    """Queues the record itself; the writer thread formats it. Only what belongs to the
    writing thread (the request id) is read here."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        request_id = REQUEST_ID.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        trace = tracing.CURRENT.get()
        if trace is not None and not hasattr(record, "trace_id"):
            record.trace_id, record.span_id = trace.ids
        return record


_listener: logging.handlers.QueueListener | None = None


def configure(level: str, worker: int | None = None) -> None:
    """Route every logger, uvicorn's included, through one JSON writer thread on stderr."""
    global _listener
    stop()
    writer = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter(worker)
    formatter.converter = time.gmtime
    writer.setFormatter(formatter)
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(records, writer)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [_Enqueue(records)]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


@atexit.register
def stop() -> None:
    """Write every queued line, then end the writer thread (at exit: nothing is dropped)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None

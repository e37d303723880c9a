"""Logging: one JSON object per line, so that log pipelines need no parsing rules."""

from __future__ import annotations

import contextvars
import itertools
import logging
import re
import sys
import time
import uuid
from typing import Any

import orjson

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
    """``{"ts", "level", "logger", "msg", ...extra}``, plus ``exc`` with the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure(level: str) -> None:
    """Route every logger, uvicorn's included, through one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter()
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True

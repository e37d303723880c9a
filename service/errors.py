"""One error type per cause, each mapped once to its HTTP status.

Every error a client can see is a :class:`TensorgateError`. REST answers it in one place,
:func:`service.http.answer.error_answer` (``{"error": "...", "request_id": "..."}`` with its
status and headers; the app's exception handlers, for the routes FastAPI serves, call it too),
and gRPC in one, :func:`service.grpc.servicer.grpc_status` (its code and message).
"""

from __future__ import annotations


class TensorgateError(Exception):
    """Base of every error a client may see. ``status`` is the HTTP status code."""

    status = 500

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class InvalidInput(TensorgateError):
    """The request is malformed or does not fit the model's signature."""

    status = 400


class Unauthorized(TensorgateError):
    """A protected route was called without the right bearer token."""

    status = 401


class ModelNotFound(TensorgateError):
    """No such model, or no such version of it."""

    status = 404


class PayloadTooLarge(TensorgateError):
    """The body, a tensor or a batch is larger than the server accepts."""

    status = 413


class UnsupportedMediaType(TensorgateError):
    """The Content-Type names a format this route does not take."""

    status = 415


class ModelNotReady(TensorgateError):
    """The model exists but is loading, unavailable or unloading; try again later."""

    status = 503

    def __init__(self, message: str, *, retry_after_s: int = 1, version: int | None = None) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.version = version
        """The version that cannot serve, where one was found (its requests are counted by
        it: the series the error-ratio alert reads from 0 on)."""


class ServerBusy(TensorgateError):
    """The queue is full or the server is draining; try again later."""

    status = 503

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class MessageTimeout(TensorgateError):
    """A gRPC inference message did not arrive in full within TG_BODY_TIMEOUT_S of its call
    (REST's slow bodies get 408 from the connection itself, service/limits/connections.py)."""

    status = 408


class DeadlineExceeded(TensorgateError):
    """The request waited past its deadline before it could run."""

    status = 504


class StepCancelled(TensorgateError):
    """A pipeline's code called a model after its request was cancelled or answered."""

    status = 499


class ModelLoadRefused(TensorgateError):
    """A load asked for (the repository API, ``--poll``) was refused; what served goes on."""

    status = 400


class ModelLoadStopped(ModelLoadRefused):
    """A load stopped before its end by an unload of its model asked meanwhile, or by the
    server stopping: nothing in the model was wrong, so not the 400 of a model refused.
    (gRPC: ABORTED, its code for a change that crossed another.)"""

    status = 409


class ModelLoadError(Exception):
    """A model version cannot be served; the message is its UNAVAILABLE reason. Never sent raw."""


class LoadStopped(ModelLoadError):
    """A version's load stopped by an unload of its model or by SIGTERM (:class:`LoadBound`)."""


class StepNotReady(ModelLoadError):
    """A pipeline's end-to-end replay called a model that is not ready yet: load it after."""


class ModelExecutionError(TensorgateError):
    """The model itself failed or broke its contract (e.g. returned the wrong number of rows)."""

    status = 500

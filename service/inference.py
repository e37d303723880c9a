"""The core's request and result: what every protocol (v1 and v2 REST, gRPC) decodes a request
into, and encodes its answer from. No protocol's wire format appears here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Postprocess = Callable[[Mapping[str, np.ndarray]], Any]
"""One row of the model's outputs → the answer for it (a classifier's top-k labels)."""


@dataclass(slots=True)
class InputTensor:
    """One decoded input: ``data`` already has ``shape`` and the numpy dtype of ``datatype``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for, with its parameters (e.g. ``classification``: top k)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceRequest:
    """One request to one model, decoded. Its inputs come in one of three forms:

    - ``inputs``: named tensors, checked against the model's signature; a BYTES tensor named
      after the model's raw input (``<input>_bytes`` for images, ``text``) feeds its pipeline;
    - ``raw``: items for the model's pipeline as they are (encoded images, UTF-8 texts);
    - ``rows``: JSON rows read against the model's inputs (v1 ``instances`` of numbers), or
      JSON values for a pipeline that takes them (v1 texts come as both ``raw`` and ``rows``).
    """

    model: str
    version: str | None = None
    inputs: list[InputTensor] = field(default_factory=list)
    raw: list[bytes] | None = None
    rows: list[Any] | None = None
    rows_bytes: int = 0
    """The JSON bytes ``rows`` came in: what reading them into arrays goes through."""
    raw_in_json: bool = False
    """``raw`` came inside a JSON body (v1 ``{"b64": ...}`` instances), not as the body itself:
    for a model with no pipeline, JSON that does not fit it (400), not a media type (415).
    Also set for ``rows`` that mix ``{"b64": ...}`` instances (decoded: bytes) with JSON
    values."""
    raw_type: str | None = None
    """The media type ``raw`` came as (v1's body: its ``Content-Type``), for its items'
    ``content_type``."""
    outputs: list[RequestedOutput] | None = None
    """The outputs asked for, in order; None: every output the model offers."""
    parameters: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    timeout_s: float | None = None
    """How long it may wait to start running; None: the request parameter ``timeout``
    (microseconds, as Triton reads it), else the server's default."""


@dataclass(slots=True)
class OutputTensor:
    """One output to send, with the parameters the client asked for (echoed)."""

    name: str
    datatype: str
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceResult:
    """What the model answered: the outputs asked for, and the model's own outputs whole (for
    protocols that postprocess them themselves, with ``classifier``: v1 predict)."""

    model: str
    version: str
    id: str | None
    outputs: list[OutputTensor]
    raw: dict[str, np.ndarray]
    parameters: dict[str, Any]
    classifier: Postprocess | None
    batched: bool
    """Whether the outputs have a batch dimension (rows) first."""
    answers: list[Any] | None = None
    """The model's pipeline's answer for each raw item, where its code postprocesses."""
    size: int | None = None
    """What its outputs hold, once asked (``service.core.dataplane.answer_bytes``)."""
    row_crops: list[dict[str, tuple[slice, ...]]] | None = None
    """Each row's region of each output (its batch dim's slice first), where rows of their
    own sizes were padded into one batch: v1 answers each row cropped to it."""

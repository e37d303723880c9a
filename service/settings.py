"""Server settings: one pydantic-settings class, env vars ``TG_*``; CLI flags override them."""

from __future__ import annotations

import difflib
import os
import resource
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import orjson
from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.resources import (
    WORKER_BASE_BYTES,
    available_cpus,
    cuda_visible,
    memory_limit_bytes,
    repository_model_bytes,
    workers_that_fit,
)

ENV_PREFIX = "TG_"
CPUS_PER_WORKER = 1
"""The default of TG_WORKERS is one worker per this many CPUs, on CPU (docs/performance.md,
"Defaults that win")."""
MIN_TOKEN_LENGTH = 16
"""A bearer token shorter than this is refused at start: short tokens are guessed."""


def _default_max_connections() -> int:
    """4096, or a quarter of the open-file limit when that is lower: HTTP and gRPC may each
    hold that many, and the other half stays for models, logs and the connections refused
    politely (a refusal needs a descriptor too)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, min(4096, soft // 4)) if soft != resource.RLIM_INFINITY else 4096


class Settings(BaseSettings):
    """Everything the server reads from its environment. Each field is ``TG_<NAME>``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=()
    )

    host: str = "127.0.0.1"
    """Address to listen on. Use 0.0.0.0 in a container."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """Port of the Open Inference Protocol over gRPC (Triton's ``grpc_service.proto`` and
    ``grpc.health.v1``), on the same host and models as HTTP; 8001 as Triton. 0: no gRPC."""
    model_repository: Path = Path("models")
    """The model repository: one folder a model, each with config.yaml and version folders."""
    models: Annotated[list[str] | None, NoDecode] = None
    """Load only these models from the repository (default: every model in it): names
    separated by commas (``digits,minilm``) or a JSON list (``["digits"]``)."""
    model_name: str | None = None
    """Serve the repository's one model under this name (KServe passes the InferenceService's
    name, ``{{.Name}}``). The repository is then that model's own folder (``config.yaml`` at
    its root, as KServe's storageUri gives it) or holds exactly one model folder."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the server's own logs."""
    access_log: bool = True
    """Write one JSON line per inference request (REST or gRPC; health, metadata and metrics
    requests are not logged)."""
    tracing: bool | None = None
    """Trace inference requests with OpenTelemetry (docs/deploy.md, "Observing it"). Unset: on
    when ``OTEL_TRACES_EXPORTER`` names an exporter; the ``OTEL_*`` variables configure it."""
    cpus: int = Field(default_factory=available_cpus, ge=1)
    """CPUs the server may use: the defaults of workers and threads are sized by it. Default:
    the affinity mask, capped by the cgroup's CPU quota (a Kubernetes ``limits.cpu``)."""
    workers: int = Field(default=0, ge=0)
    """Server processes on the same ports, each with its own event loop, models and batcher
    (docs/architecture.md). 0: one per CPU (one when a GPU is visible), as many as fit in the
    memory limit (docs/performance.md, "Defaults that win")."""
    intra_op_threads: int = Field(default=0, ge=0)
    """Threads each model instance's runtime uses inside one operator (torch / onnxruntime).
    0: every CPU the server may use (TG_CPUS), in each worker."""
    preprocess_threads: int = Field(default=0, ge=0)
    """Threads that decode and preprocess request payloads, off the event loop. 0: the CPUs
    divided among the workers (a request alone is preprocessed on its model's thread)."""
    resize_halves: bool = True
    """Resize an image in two halves on two threads while no batch runs (a request alone, with
    two CPUs or more): the same pixels as one resize, sooner (``preprocessing.halves``)."""
    inline_batch_us: int = Field(default=200, ge=0)
    """A batch whose model run is expected (from the last runs of batches of its shape) to take
    at most this many microseconds runs on the event loop's thread, not handed to its instance's
    thread and back: for a small model the two hand-offs cost more than the run
    (docs/performance.md, "Small batches on the loop"). Never for string inputs, models with
    several instances, or a shape that once ran ten times past it. 0: every batch on its
    instance's thread."""
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Largest request body accepted; larger ones get 413 before they are read in full."""
    max_tensor_elements: int = Field(default=64 * 1024 * 1024, ge=1)
    """Most elements one input tensor may hold; more is a 413."""
    max_inflight_bytes: int = Field(default=0, ge=0)
    """Request body bytes (and gRPC inference messages) one worker holds at once over all its
    connections; a request whose body would pass it gets 503 + Retry-After before its body is
    read (a gRPC call: UNAVAILABLE). 0: sized to the machine,
    a sixteenth of the memory limit (cgroup, else physical) shared among the workers, up to
    1 GiB, and at least max_body_bytes."""
    max_connections: int = Field(default_factory=_default_max_connections, ge=1)
    """Open connections at most, on HTTP and on gRPC each; one more is answered 503 +
    Retry-After and closed (gRPC: closed before it is read). Default: 4096, or a quarter of
    the open-file limit when that is lower."""
    max_connections_per_client: int = Field(default=0, ge=0)
    """Open HTTP connections from one client address at most; one more is answered 503 +
    Retry-After and closed. Default (0): half of TG_MAX_CONNECTIONS, so that one client never
    holds every connection. Behind a proxy every connection has the proxy's address: set it to
    TG_MAX_CONNECTIONS there."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """Largest request head (request line and headers); a larger one gets 431, closed."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's head must arrive within this long of the connection opening (or of the
    request's first byte, on a kept-alive connection): silent or slow senders get 408, closed."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """A request's body must arrive within this long of its head; else 408, closed. A gRPC
    ModelInfer message, within this long of its call's headers; else DEADLINE_EXCEEDED."""
    write_timeout_s: float = Field(default=60.0, gt=0)
    """An answer written must be taken by its client within this long (the connection's send
    buffer empty again); else the connection is aborted and what it held let go. While unsent,
    an answer's bytes count in TG_MAX_INFLIGHT_BYTES."""
    keep_alive_timeout_s: float = Field(default=5.0, gt=0)
    """An idle connection between two requests is closed after this long."""
    drain_pre_stop_s: float = Field(default=5.0, ge=0)
    """After SIGTERM: how long readiness is false while requests are still served, so that
    load balancers stop sending before the server stops accepting."""
    drain_grace_s: float = Field(default=30.0, gt=0)
    """After SIGTERM: how long accepted requests get to finish before the process exits anyway."""
    poll_interval_s: float | None = Field(default=None, gt=0)
    """Watch the repository and load changed models every this many seconds (off: None)."""
    request_timeout_s: float = Field(default=60.0, gt=0)
    """A request that has not started running this long after it arrived is answered 504.
    Per request: header ``X-Request-Timeout`` (seconds) or OIP ``parameters.timeout`` (µs)."""
    load_timeout_s: float = Field(default=600.0, gt=0)
    """How long loading one model version may take, its gates and warmup included: past it
    the load ends at its next warmup batch and is refused (the versions serving go on)."""
    stuck_instance_s: float = Field(default=60.0, gt=0)
    """/v2/health/live fails when one batch has run longer than this (a wedged instance); with
    several workers, a worker that has not answered its supervisor for this long (stopped, or
    its event loop blocked) is killed and replaced."""
    strict_readiness: bool = True
    """Ready only when every model meant to load is READY; false: when any model is READY."""
    api_token: str | None = None
    """Bearer token for inference and model routes (health and metrics stay open unless
    protect_health_and_metrics). Unset: those routes are open. At least 16 characters."""
    api_token_file: Path | None = None
    """Read the API token from this file instead (a mounted Kubernetes or Docker secret);
    surrounding whitespace is dropped. Not together with api_token."""
    protect_health_and_metrics: bool = False
    """Ask for the API token on /v2/health/* and /metrics too."""
    admin_token: str | None = None
    """Bearer token for the model repository routes (load/unload/index); they exist only if set.
    At least 16 characters."""
    admin_token_file: Path | None = None
    """Read the admin token from this file instead (a mounted secret). Not with admin_token."""
    expect_torch: str | None = None
    """Refuse to start unless this is the torch version running (set by the image)."""
    expect_onnxruntime: str | None = None
    """Refuse to start unless this is the onnxruntime version running (set by the image)."""
    expect_cuda: str | None = None
    """Refuse to start unless torch is built for this CUDA, e.g. 12.8 (set by the GPU image)."""
    server_name: str = "tensorgate"
    """The name reported in server metadata."""

    _sizing_warning: str | None = PrivateAttr(default=None)
    _threads_defaulted: bool = PrivateAttr(default=False)

    @property
    def shared_threads(self) -> int:
        """Threads a model's batch runs with beside another batch: this worker's share of the
        CPUs, when the intra-op threads are the default (every CPU, for a batch alone); else
        the threads set, always."""
        if not self._threads_defaulted:
            return self.intra_op_threads
        return max(1, self.cpus // self.workers)

    @property
    def sizing_warning(self) -> str | None:
        """Why fewer workers start than asked (the memory limit), for the log at start."""
        return self._sizing_warning

    @field_validator("models", mode="before")
    @classmethod
    def _model_names(cls, value: Any) -> Any:
        """``TG_MODELS`` as names separated by commas, or as a JSON list (the form it took
        first: ``digits`` alone was refused as "Input should be a valid list"); empty: every
        model."""
        if not isinstance(value, str):
            return value
        if not value.strip():  # set but empty, as a compose file's ${TG_MODELS:-} leaves it
            return None
        if value.lstrip().startswith("["):
            try:
                return orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list of model names: {exc}") from None
        names = [name.strip() for name in value.split(",")]
        if not all(names):
            raise ValueError(f"an empty model name in {value!r}: name them separated by commas")
        return names

    @model_validator(mode="after")
    def _size_workers(self) -> Self:
        self.workers, self._sizing_warning = worker_sizing(self)
        # Each worker's runtimes and pool may use every CPU of the process: a lone request runs
        # as fast as on one worker, and under load the workers' threads take turns (ONNX
        # Runtime's threads spin only while a batch alone runs; docs/performance.md,
        # "Defaults that win").
        self._threads_defaulted = not self.intra_op_threads
        self.intra_op_threads = self.intra_op_threads or self.cpus
        # The pool works only when several requests are in flight (a lone one is preprocessed
        # on its instance's thread): its share of the CPUs, as a loaded machine has.
        self.preprocess_threads = self.preprocess_threads or max(1, self.cpus // self.workers)
        return self

    @model_validator(mode="after")
    def _size_connections_per_client(self) -> Self:
        if self.max_connections_per_client == 0:
            self.max_connections_per_client = max(1, self.max_connections // 2)
        self.max_connections_per_client = min(self.max_connections_per_client, self.max_connections)
        return self

    @model_validator(mode="after")
    def _size_inflight_bytes(self) -> Self:
        if self.max_inflight_bytes == 0:
            machine = min(1 << 30, memory_limit_bytes() // 16 // self.workers)
            self.max_inflight_bytes = max(self.max_body_bytes, machine)
        elif self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(
                f"TG_MAX_INFLIGHT_BYTES ({self.max_inflight_bytes}) is below TG_MAX_BODY_BYTES "
                f"({self.max_body_bytes}): no request of the largest size could ever be read"
            )
        return self

    @model_validator(mode="after")
    def _read_tokens(self) -> Self:
        for kind in ("api", "admin"):
            token, file = getattr(self, f"{kind}_token"), getattr(self, f"{kind}_token_file")
            variable = f"{ENV_PREFIX}{kind.upper()}_TOKEN"
            if file is not None:
                if token is not None:
                    raise ValueError(f"set {variable} or {variable}_FILE, not both")
                try:
                    token = file.read_text().strip()
                except OSError as exc:
                    message = f"{variable}_FILE: cannot read {file}: {exc.strerror}"
                    raise ValueError(message) from exc
                variable += f"_FILE ({file})"
                setattr(self, f"{kind}_token", token)
            if token is not None and len(token) < MIN_TOKEN_LENGTH:
                raise ValueError(
                    f"{variable} is {len(token)} characters long; a token needs at least "
                    f"{MIN_TOKEN_LENGTH} (unset it to leave the routes open)"
                )
        return self


def worker_sizing(
    settings: Settings, gpu: bool | None = None, limit_bytes: int | None = None
) -> tuple[int, str | None]:
    """How many workers ``settings`` start, and a warning when that is fewer than asked.

    Asked: ``TG_WORKERS``, else one per CPU on a CPU-only machine, and one on a machine with a
    visible GPU (one process owns every GPU, spreads its instances over them and batches all
    the requests: a worker per process would hold its own CUDA context and model copies on the
    same device, and batch only its own requests). Then lowered until every worker's copy of
    the repository's models fits the memory limit (:func:`service.resources.workers_that_fit`).
    """
    asked = settings.workers
    if asked == 0:
        on_gpu = cuda_visible() if gpu is None else gpu
        asked = 1 if on_gpu else max(1, settings.cpus // CPUS_PER_WORKER)
    limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
    model_bytes = repository_model_bytes(settings.model_repository, settings.models)
    fits = workers_that_fit(asked, model_bytes, limit)
    if fits == asked:
        return asked, None
    setting = f"TG_WORKERS={settings.workers}" if settings.workers else "the default"
    mib = 2**20
    each = (WORKER_BASE_BYTES + model_bytes) / mib
    return fits, (
        f"starting {fits} workers, not {asked} ({setting}): each worker holds its own copy of "
        f"every model (estimated {each:.0f} MiB a worker) and {asked} would not fit in the "
        f"memory limit of {limit / mib:.0f} MiB"
    )


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """A warning for each ``TG_*`` variable the server does not read, naming the closest one
    it does: a misspelt setting would otherwise be ignored in silence."""
    known = [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields]
    warnings = []
    for variable in sorted(environ if environ is not None else os.environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"{variable} is not a tensorgate setting and is ignored{hint}")
    return warnings

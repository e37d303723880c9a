"""The ``tensorgate`` command: ``serve``, ``health``, ``export`` and ``schema``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service import __version__
from service.artifacts import cpu_targets

if TYPE_CHECKING:
    from service.settings import Settings

log = logging.getLogger("tensorgate.cli")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tensorgate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model repository over HTTP and gRPC")
    serve.add_argument("--host", help="address to listen on (TG_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (TG_PORT, default 8000)")
    serve.add_argument(
        "--grpc-port", type=int, help="gRPC port (TG_GRPC_PORT, default 8001; 0: no gRPC)"
    )
    serve.add_argument(
        "--model-repository", type=Path, help="model repository (TG_MODEL_REPOSITORY, ./models)"
    )
    serve.add_argument(
        "--workers",
        type=int,
        help="server processes on the same ports (TG_WORKERS; default: one per CPU the "
        "process may use, one with a GPU, fewer where their models would not fit in memory)",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="log level (TG_LOG_LEVEL, default info)",
    )
    serve.add_argument(
        "--poll",
        type=float,
        metavar="SECONDS",
        dest="poll_interval_s",
        help="watch the repository and load changed models every SECONDS (TG_POLL_INTERVAL_S)",
    )
    serve.add_argument(
        "--model-name",
        help="serve the repository's one model under this name; the repository "
        "may then be that model's own folder, as KServe's storageUri gives it (TG_MODEL_NAME)",
    )

    health = commands.add_parser(
        "health",
        help="probe the server this environment configures (a container HEALTHCHECK): "
        "exit 0 when it answers 200, 1 otherwise; sends the API token when the routes need it",
    )
    health.add_argument(
        "probe",
        nargs="?",
        default="ready",
        choices=["live", "ready", "startup"],
        help="which health route to ask (default: ready)",
    )

    export = commands.add_parser("export", help="export a PyTorch module into a model repository")
    export.add_argument("factory", help="module:callable returning the torch.nn.Module")
    export.add_argument("--name", required=True, help="model name (its folder in the repository)")
    export.add_argument(
        "--repository",
        type=Path,
        default=Path("models"),
        help="the model repository the model's folder is written into (default: models)",
    )
    export.add_argument(
        "--version",
        type=int,
        default=1,
        dest="model_version",
        help="the version folder written (default: 1)",
    )
    export.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="NAME:DTYPE:D1,D2,...[:LOW..HIGH]",
        help="an input without the batch dim, e.g. input:FP32:3,224,224 (-1 = dynamic; "
        "x:FP32 is one value a row); ids:INT64:1:0..999 declares the values it may take "
        "(a 400 outside)",
    )
    export.add_argument(
        "--output",
        action="append",
        required=True,
        metavar="NAME:DTYPE:D1,...",
        help="an output without the batch dim, e.g. logits:FP32:1000 (cls:INT64 is one value "
        "a row)",
    )
    export.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="most rows in one batch, the exported batch dim's upper bound (default: 32; 0: the "
        "model has no batch dim)",
    )
    export.add_argument(
        "--formats",
        default="onnx,pt2",
        help="artifacts to write, of onnx, pt2 and torchscript "
        "(default onnx,pt2: portable ONNX and torch.export's compiled package; TorchScript is "
        "deprecated upstream)",
    )
    export.add_argument(
        "--backend",
        choices=["onnx", "pt2", "torchscript"],
        default=None,
        help="the backend the written config.yaml serves; export fails if it does not export "
        "(default: the first of onnx, pt2, torchscript that did)",
    )
    export.add_argument(
        "--buckets",
        default="",
        metavar="L1,L2,...",
        help="sizes of the dynamic (-1) dims, e.g. 16,32,64,128 (needed when an input has one): "
        "the server warms every combination, pads to them where export measured that padding "
        "leaves the answer unchanged, and refuses larger sizes",
    )
    export.add_argument(
        "--preprocessing",
        type=Path,
        help="a YAML/JSON file with the image, text or python spec (a text spec's tokenizer "
        "is read beside it and copied into the version folder; a python spec's module and the "
        "local modules it imports, into the model's folder)",
    )
    export.add_argument(
        "--answer-items",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="raw items (a JSON record, an image...) a python spec's pipeline is run on end to "
        "end at export; the server replays their answers at load (needed with a python spec)",
    )
    export.add_argument("--opset", type=int, default=None)
    export.add_argument(
        "--pt2-cpu",
        choices=cpu_targets.TARGETS,
        default=None,
        help="the CPU model.pt2 is compiled for (default x86-64-v3 on x86-64: AVX2, which every "
        "x86-64 server CPU since 2013-2015 has; native: this machine's, refused on other CPUs)",
    )

    commands.add_parser("schema", help="print the JSON Schema of config.yaml")

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, sys.argv[1:] if argv is None else list(argv))
    if args.command == "health":
        return _health(args.probe)
    if args.command == "export":
        from service.export.cli import run_export

        return run_export(args)
    from service.model_config import ModelConfig

    try:
        sys.stdout.write(json.dumps(ModelConfig.model_json_schema(), indent=2) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `tensorgate schema | head`: the reader had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0


def _serve(args: argparse.Namespace, argv: list[str]) -> int:
    from service.limits.memory import fix_mmap_threshold, fix_trim_threshold, limit_arenas

    limit_arenas()  # before anything imported starts a thread that allocates
    fix_mmap_threshold()
    fix_trim_threshold()
    import uvicorn

    from service.app import create_app, serving_app
    from service.cluster.supervisor import (
        Supervisor,
        Worker,
        die_with_supervisor,
        inherited_listener,
        listen,
    )
    from service.http.server import DrainingServer
    from service.http.writes import OneWrite
    from service.limits.balance import BALANCE
    from service.limits.connections import ConnectionLimits, guarded_protocol
    from service.resources import CPU_USE, raise_open_file_limit
    from service.settings import unknown_variables
    from service.telemetry import logs

    overrides: dict[str, Any] = {
        key: value
        for key, value in {
            "host": args.host,
            "port": args.port,
            "grpc_port": args.grpc_port,
            "model_repository": args.model_repository,
            "log_level": args.log_level,
            "poll_interval_s": args.poll_interval_s,
            "model_name": args.model_name,
            "workers": args.workers,
        }.items()
        if value is not None
    }
    raise_open_file_limit()  # before the settings: the connection limit's default reads it
    settings = _settings(**overrides)
    if settings is None:
        return 2
    if not settings.model_repository.is_dir():  # one line, not every worker's traceback
        named = _named(overrides, "model_repository")
        sys.stderr.write(
            f"tensorgate: invalid setting: {named}: {settings.model_repository} is not a "
            "directory (the folder of model folders; `make models` builds the bundled one)\n"
        )
        return 2
    if settings.model_name is None and (empty := _not_a_repository(settings, overrides)):
        sys.stderr.write(f"tensorgate: invalid setting: {empty}\n")  # one line, not a traceback
        return 2
    if settings.models and settings.model_name is None:
        root = settings.model_repository  # a model's folder: one holding its config.yaml
        folders = {p.name for p in root.iterdir() if (p / "config.yaml").is_file()}
        if missing := [name for name in settings.models if name not in folders]:
            sys.stderr.write(  # one line, not every worker's traceback
                f"tensorgate: invalid setting: TG_MODELS: {', '.join(map(repr, missing))} not "
                f"in {root} (its model folders, each with a config.yaml: "
                f"{', '.join(sorted(folders))})\n"
            )
            return 2
    if settings.model_name is not None:
        from service.errors import ModelLoadError
        from service.repository.models import single_model_folder

        named = _named(overrides, "model_name")
        try:
            single_model_folder(settings.model_repository, settings.model_name, named)
        except ModelLoadError as exc:  # one line, not every worker's traceback
            sys.stderr.write(f"tensorgate: invalid setting: {exc}\n")
            return 2
    worker = Worker.from_environment()
    logs.configure(settings.log_level, None if worker is None else worker.index)
    if worker is None:
        for warning in unknown_variables():
            log.warning(warning)
        if settings.sizing_warning is not None:
            log.warning(settings.sizing_warning)
        if settings.workers > 1:
            return Supervisor(settings, argv).run()
        # Both ports up front, a line each: uvicorn found a port taken after loading every
        # model, grpcio as a startup traceback. HTTP's socket is bound here, as the
        # supervisor's is (for "::" dual-stack, as gRPC's; uvicorn would bind it IPv6 only).
        listener = listen("HTTP", settings.host, settings.port, inheritable=False)
        if listener is None:
            return 1
        sockets = [listener]
        if settings.grpc_port:  # grpcio binds its own: checked here, and let go
            probe = listen("gRPC", settings.host, settings.grpc_port, inheritable=False)
            if probe is None:
                listener.close()
                return 1
            probe.close()
        log.info(
            "serving on %s:%d with one worker of %d threads (TG_WORKERS, TG_CPUS %d)",
            settings.host,
            listener.getsockname()[1],
            settings.intra_op_threads,
            settings.cpus,
        )
    else:  # one of several processes: each accepts from the supervisor's listening socket
        sockets = [inherited_listener()]
        die_with_supervisor(worker)
        if worker.cpu_use_path.is_file():  # the other workers' batches, for the runtimes
            CPU_USE.attach(worker.cpu_use_path, worker.index)
        if worker.connections_path.is_file():  # the others' connections: an even spread
            BALANCE.attach(worker.connections_path, worker.index)
    app = create_app(settings)
    config = uvicorn.Config(
        serving_app(app, settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,  # tensorgate writes its own structured line per inference request
        loop="auto",
        ws="none",  # no websockets are served: an upgrade to one is ignored, as h2c's is
        http=guarded_protocol(
            ConnectionLimits(
                max_connections=settings.max_connections,
                max_connections_per_client=settings.max_connections_per_client,
                max_header_bytes=settings.max_header_bytes,
                header_timeout_s=settings.header_timeout_s,
                body_timeout_s=settings.body_timeout_s,
                write_timeout_s=settings.write_timeout_s,
            ),
            app.state.body_budget,
            OneWrite,  # a response's head and body in one write
        ),
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn says int; it takes seconds as a float (loop.call_later)
        timeout_graceful_shutdown=max(1, int(settings.drain_grace_s)),
    )
    DrainingServer(config, app, settings, shared=worker is not None).run(sockets=sockets)
    _leave_hung_code()
    return 0


def _not_a_repository(settings: Settings, overrides: dict[str, Any]) -> str | None:
    """Why the model repository would serve nothing, where nothing could come later: it is
    one model's own folder, or holds no model folder while neither the repository API nor
    ``--poll`` can bring one (a server that said ready serving nothing)."""
    root = settings.model_repository
    named = _named(overrides, "model_repository")
    if (root / "config.yaml").is_file():
        return (
            f"{named}: {root} is one model's folder (it holds config.yaml): serve the folder "
            f"that holds it ({named} {root.parent if root.name else root.resolve().parent}), "
            "or this model alone with --model-name <name>"
        )
    if settings.admin_token is not None or settings.poll_interval_s is not None:
        return None  # models may be loaded, or appear, later
    if any((p / "config.yaml").is_file() for p in root.iterdir()):
        return None
    from service.repository.models import configless_folders

    nearly = "".join(f"; {folder} {why}" for folder, why in configless_folders(root)[:3])
    return (
        f"{named}: {root} holds no model folder (a folder with config.yaml and a version "
        "folder, 1/, holding the model), so nothing would be served: export one with "
        f"`tensorgate export`, or `make models` for the bundled ones{nearly}"
    )


def _leave_hung_code(wait_s: float = 1.0) -> None:
    """Once the server has stopped: end the process even where a model's own code still runs
    on a thread that will not return. Python joins every pool thread at exit, so a
    ``postprocess`` sleeping 45 s (its request long answered 504) kept a drained server alive
    40 s past its grace; threads idle or ending are given ``wait_s``."""
    import threading

    from service.telemetry import logs

    others = [
        t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon
    ]
    until = time.monotonic() + wait_s
    for thread in others:
        thread.join(max(0.0, until - time.monotonic()))
    hung = [t.name for t in others if t.is_alive()]
    if hung:
        log.warning(
            "exiting while %d threads still run a model's own code (%s): Python cannot stop "
            "them, and their requests were answered",
            len(hung),
            ", ".join(hung[:8]),
        )
        logs.stop()
        os._exit(0)


def _settings(**overrides: Any) -> Settings | None:
    """The settings, or None after one line per problem on stderr (not a traceback)."""
    from pydantic import ValidationError

    from service.settings import Settings

    try:
        return Settings(**overrides)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            field = f"{_named(overrides, where)}: " if where else ""
            said = error["msg"].removeprefix("Value error, ")  # pydantic's, for a ValueError
            sys.stderr.write(f"tensorgate: invalid setting: {field}{said}\n")
        return None


def _named(overrides: dict[str, Any], setting: str) -> str:
    """How the user gave ``setting``: its flag (``--poll``) when on the command line, else
    its variable (``TG_POLL_INTERVAL_S``)."""
    if setting in overrides:
        return "--" + ("poll" if setting == "poll_interval_s" else setting.replace("_", "-"))
    return f"TG_{setting.upper()}"


def _health(probe: str) -> int:
    """One request to this server's own health route, as a container HEALTHCHECK runs it."""
    import http.client

    settings = _settings()
    if settings is None:
        return 2
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    headers = {}
    if settings.protect_health_and_metrics and settings.api_token is not None:
        headers["Authorization"] = f"Bearer {settings.api_token}"
    connection = http.client.HTTPConnection(host, settings.port, timeout=2)
    try:
        connection.request("GET", f"/v2/health/{probe}", headers=headers)
        response = connection.getresponse()
        if response.status == 200:  # healthy: its body is not awaited
            return 0
        status, body = response.status, response.read(2048)
    except (OSError, http.client.HTTPException) as exc:  # no answer, or not HTTP
        sys.stderr.write(
            f"tensorgate health: {host}:{settings.port}: {str(exc) or type(exc).__name__}\n"
        )
        return 1
    finally:
        connection.close()
    said = " ".join(body.decode("utf-8", "replace").split())[:500]  # one line, bounded
    sys.stderr.write(
        f"tensorgate health {probe}: {host}:{settings.port} answered {status} {said}\n"
    )
    return 1

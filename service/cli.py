"""The ``tensorgate`` command: ``serve``, ``export`` and ``schema``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tensorgate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model repository over HTTP")
    serve.add_argument("--host", help="address to listen on (TG_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (TG_PORT, default 8000)")
    serve.add_argument(
        "--model-repository", type=Path, help="model repository (TG_MODEL_REPOSITORY, ./models)"
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--poll", type=float, metavar="SECONDS", dest="poll_interval_s",
        help="watch the repository and load changed models every SECONDS (TG_POLL_INTERVAL_S)",
    )  # fmt: skip

    export = commands.add_parser("export", help="export a PyTorch module into a model repository")
    export.add_argument("factory", help="module:callable returning the torch.nn.Module")
    export.add_argument("--name", required=True, help="model name (its folder in the repository)")
    export.add_argument("--repository", type=Path, default=Path("models"))
    export.add_argument("--version", type=int, default=1, dest="model_version")
    export.add_argument(
        "--input", action="append", required=True, metavar="NAME:DTYPE:D1,D2,...",
        help="an input without the batch dim, e.g. input:FP32:3,224,224 (-1 = dynamic)",
    )  # fmt: skip
    export.add_argument("--output", action="append", required=True, metavar="NAME:DTYPE:D1,...")
    export.add_argument("--max-batch-size", type=int, default=32)
    export.add_argument("--backend", choices=["onnx", "torchscript"], default="onnx")
    export.add_argument("--preprocessing", type=Path, help="a YAML/JSON file with the spec")
    export.add_argument("--opset", type=int, default=None)

    commands.add_parser("schema", help="print the JSON Schema of config.yaml")

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "export":
        from service.export_cli import run_export

        return run_export(args)
    from service.model_config import ModelConfig

    json.dump(ModelConfig.model_json_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service import logs
    from service.app import create_app, serving_app
    from service.server import DrainingServer
    from service.settings import Settings
    from service.transport import CoalescingHttpToolsProtocol

    overrides: dict[str, Any] = {
        key: value
        for key, value in {
            "host": args.host,
            "port": args.port,
            "model_repository": args.model_repository,
            "log_level": args.log_level,
            "poll_interval_s": args.poll_interval_s,
        }.items()
        if value is not None
    }
    settings = Settings(**overrides)
    logs.configure(settings.log_level)
    app = create_app(settings)
    config = uvicorn.Config(
        serving_app(app, settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,  # tensorgate writes its own structured line per inference request
        loop="auto",
        http=CoalescingHttpToolsProtocol,
        timeout_graceful_shutdown=max(1, int(settings.drain_grace_s)),
    )
    DrainingServer(config, app, settings).run()
    return 0

"""The committed gRPC modules are what protos/generate.py makes from the vendored .proto files,
and they live in tensorgate's own descriptor pool (clients' stubs can share the process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_generated_modules_match_the_vendored_protos() -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.main(["--check"]) == 0, "run `make protos`"


def test_stubs_load_beside_tritonclients_own() -> None:
    pytest.importorskip("tritonclient.grpc")
    import tritonclient.grpc.service_pb2 as theirs

    from service.protocol.pb import grpc_service_pb2 as ours

    message = ours.ModelInferRequest(model_name="m", id="7")
    message.inputs.add(name="x", datatype="FP32", shape=[1])
    decoded = theirs.ModelInferRequest.FromString(message.SerializeToString())
    assert (decoded.model_name, decoded.id, decoded.inputs[0].name) == ("m", "7", "x")
    assert "service.protocol.pb" in sys.modules

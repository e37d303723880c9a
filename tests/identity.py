"""An ONNX model that returns each of its inputs unchanged, one per Open Inference datatype."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from service.protocol.pb import grpc_service_pb2 as pb

ONNX_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}
"""The datatypes of the every-datatype identity model: those numpy has."""
BF16_TYPE = TensorProto.BFLOAT16
"""BF16 is in a model only when asked for: numpy has no bfloat16 (clients use ml_dtypes), and
onnxruntime cannot return bfloat16 from a session that takes strings."""


def write_identity_model(
    folder: Path,
    max_batch_size: int = 8,
    datatypes: tuple[str, ...] = (),
    width: int | str = 3,
    **config: object,
) -> None:
    """``folder/config.yaml`` and ``folder/1/model.onnx``: ``in_<T>`` → ``out_<T>`` for each T
    (of ``datatypes``, or every one of ONNX_TYPES), of shape ``[batch, width]`` (a name: a
    dynamic dim)."""
    nodes, inputs, outputs = [], [], []
    for datatype in datatypes or tuple(ONNX_TYPES):
        onnx_type = BF16_TYPE if datatype == "BF16" else ONNX_TYPES[datatype]
        shape = ["batch", width]
        nodes.append(helper.make_node("Identity", [f"in_{datatype}"], [f"out_{datatype}"]))
        inputs.append(helper.make_tensor_value_info(f"in_{datatype}", onnx_type, shape))
        outputs.append(helper.make_tensor_value_info(f"out_{datatype}", onnx_type, shape))
    graph = helper.make_graph(nodes, "identity", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "1").mkdir(parents=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    lines = ["backend: onnx", f"max_batch_size: {max_batch_size}"]
    lines += [f"{key}: {value}" for key, value in config.items()]
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")


def binary_request(values: int, fill: float = 1.0) -> tuple[bytes, int]:
    """A v2 infer body for the FP32 identity model: ``values`` values of ``fill`` as one
    binary tensor, the answer asked for in binary; and its JSON header's length (for
    ``Inference-Header-Content-Length``)."""
    data = np.full((1, values), fill, np.float32).tobytes()
    tensor = {"name": "in_FP32", "datatype": "FP32", "shape": [1, values]}
    header = json.dumps(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": len(data)}}],
            "outputs": [{"name": "out_FP32", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + data, len(header)


def identity_message(values: int, model: str = "identity") -> pb.ModelInferRequest:
    """A gRPC ModelInferRequest for the FP32 identity model (as :func:`write_identity_model`
    writes it with ``width``): ``values`` zeros, as raw contents."""
    return pb.ModelInferRequest(
        model_name=model,
        inputs=[{"name": "in_FP32", "datatype": "FP32", "shape": [1, values]}],
        raw_input_contents=[bytes(4 * values)],
    )

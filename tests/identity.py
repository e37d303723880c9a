"""An ONNX model that returns each of its inputs unchanged, one per Open Inference datatype."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

ONNX_TYPES = {
    "BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8, "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32, "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16, "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}  # fmt: skip


def write_identity_model(
    folder: Path, max_batch_size: int = 8, datatypes: tuple[str, ...] = (), **config: object
) -> None:
    """``folder/config.yaml`` and ``folder/1/model.onnx``: ``in_<T>`` → ``out_<T>`` for each T
    (of ``datatypes``, or every one)."""
    nodes, inputs, outputs = [], [], []
    for datatype in datatypes or tuple(ONNX_TYPES):
        onnx_type = ONNX_TYPES[datatype]
        nodes.append(helper.make_node("Identity", [f"in_{datatype}"], [f"out_{datatype}"]))
        inputs.append(helper.make_tensor_value_info(f"in_{datatype}", onnx_type, ["batch", 3]))
        outputs.append(helper.make_tensor_value_info(f"out_{datatype}", onnx_type, ["batch", 3]))
    graph = helper.make_graph(nodes, "identity", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "1").mkdir(parents=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    lines = ["backend: onnx", f"max_batch_size: {max_batch_size}"]
    lines += [f"{key}: {value}" for key, value in config.items()]
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")

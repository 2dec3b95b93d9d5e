"""The one onnxruntime session factory: quiet CPU sessions at a chosen optimisation level, for models of any size.

Calibration, the saturation check and the QOperator export all get their sessions here, so logging, providers and
the >2 GB path (the model goes through a temporary file with external data) are decided once.
"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from . import ir

LEVELS = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
PROVIDERS = ["CPUExecutionProvider"]


def options(level: str = "all", *, mem_pattern: bool = True, optimized_path: "str | Path | None" = None
            ) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = LEVELS[level]
    so.enable_mem_pattern = mem_pattern
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    return so


def session(model: "onnx.ModelProto | str | Path", level: str = "all", *, mem_pattern: bool = True,
            optimized_path: "str | Path | None" = None) -> ort.InferenceSession:
    """A CPU InferenceSession. A ModelProto past the protobuf limit is written with external data to a temporary
    folder first (onnxruntime has read it all by the time the session exists)."""
    so = options(level, mem_pattern=mem_pattern, optimized_path=optimized_path)
    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), so, providers=PROVIDERS)
    if ir.model_size(model) > ir.EXTERNAL_DATA_THRESHOLD:
        with tempfile.TemporaryDirectory(prefix="oq-session-") as tmp:
            path = ir.save_model(model, Path(tmp) / "model.onnx", external_data=True)
            return ort.InferenceSession(str(path), so, providers=PROVIDERS)
    return ort.InferenceSession(model.SerializeToString(), so, providers=PROVIDERS)


def optimized(model: onnx.ModelProto, level: str = "extended") -> onnx.ModelProto:
    """The model as onnxruntime's graph optimizer rewrites it at `level` (what its CPU provider would run)."""
    with tempfile.TemporaryDirectory(prefix="oq-optimized-") as tmp:
        out = Path(tmp) / "optimized.onnx"
        session(model, level, optimized_path=out)
        return onnx.load(str(out))


@functools.lru_cache(maxsize=None)
def max_qdq_opset() -> int:
    """The newest ai.onnx opset at which the installed onnxruntime runs QuantizeLinear/DequantizeLinear (found by
    trying, newest first: onnx may know opsets the runtime has no kernels for yet)."""
    import numpy as np
    from onnx import TensorProto, helper

    for opset in range(onnx.defs.onnx_opset_version(), 13, -1):
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                 helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
        graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor("s", TensorProto.FLOAT, [], [1.0]),
                                   helper.make_tensor("z", TensorProto.INT8, [], [0])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = min(model.ir_version, onnx.IR_VERSION)
        try:
            session(model, "disable").run(None, {"x": np.ones(1, np.float32)})
            return opset
        except Exception:  # noqa: BLE001 - no kernel at this opset: try the previous one
            continue
    return 13

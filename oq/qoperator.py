"""QOperator export for the onnxruntime target: QLinearConv, QLinearMatMul, ... instead of Q/DQ pairs.

onnxruntime's own graph optimizer performs exactly the fusions its CPU provider would do at load time, so the
conversion asks it (extended level: hardware-independent rewrites only, no NCHWc layouts) and keeps the result.
QLinearConv and QLinearMatMul are standard ONNX ops; some fused kernels (QGemm, QLinearAdd,
QLinearGlobalAveragePool) live in onnxruntime's com.microsoft domain, so the result is meant for onnxruntime.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from .errors import OqError


def to_qoperator(model: onnx.ModelProto) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory(prefix="oq-qop-") as tmp:
        out = Path(tmp) / "qop.onnx"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(out)
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            converted = onnx.load(str(out))
        except Exception as exc:
            raise OqError(f"onnxruntime could not convert the model to QOperator form: {str(exc)[:200]}") from None
    fused = sum(1 for n in converted.graph.node if n.op_type.startswith("QLinear") or n.op_type == "QGemm")
    if fused == 0:
        raise OqError("QOperator export: onnxruntime fused no Q/DQ pattern into integer operators")
    return converted

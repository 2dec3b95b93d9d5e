"""QOperator export for the onnxruntime target: QLinearConv, QLinearMatMul, ... instead of Q/DQ pairs.

onnxruntime's own graph optimizer performs exactly the fusions its CPU provider would do at load time, so the
conversion asks it (extended level: hardware-independent rewrites only, no NCHWc layouts) and keeps the result.
QLinearConv and QLinearMatMul are standard ONNX ops; some fused kernels (QGemm, QLinearAdd,
QLinearGlobalAveragePool) live in onnxruntime's com.microsoft domain, so the result is meant for onnxruntime.
"""
from __future__ import annotations

import onnx

from .errors import OqError
from .runtime import optimized


def to_qoperator(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        converted = optimized(model, "extended")
    except Exception as exc:
        raise OqError(f"onnxruntime could not convert the model to QOperator form: {str(exc)[:200]}") from None
    fused = sum(1 for n in converted.graph.node if n.op_type.startswith("QLinear") or n.op_type == "QGemm")
    if fused == 0:
        raise OqError("QOperator export: onnxruntime fused no Q/DQ pattern into integer operators")
    return converted

"""oq.FakeQuant: quantize-dequantize at any bit width, as an ONNX model-local function of standard ops.

    FakeQuant(x, scale, zero_point, qmin, qmax) = (Clip(Round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale

All inputs are float tensors broadcasting against x (per-channel scales are shaped [1, C, 1, ...]). Round is half to
even, like QuantizeLinear, so for 8-bit grids FakeQuant equals Q followed by DQ. onnxruntime inlines the function,
so the model runs anywhere without a custom kernel.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

DOMAIN = "oq"
NAME = "FakeQuant"


def function_proto(opset: int) -> onnx.FunctionProto:
    nodes = [
        helper.make_node("Div", ["x", "scale"], ["scaled"]),
        helper.make_node("Round", ["scaled"], ["rounded"]),
        helper.make_node("Add", ["rounded", "zero_point"], ["shifted"]),
        helper.make_node("Clip", ["shifted", "qmin", "qmax"], ["clipped"]),
        helper.make_node("Sub", ["clipped", "zero_point"], ["centred"]),
        helper.make_node("Mul", ["centred", "scale"], ["y"]),
    ]
    return helper.make_function(DOMAIN, NAME, ["x", "scale", "zero_point", "qmin", "qmax"], ["y"], nodes,
                                [helper.make_opsetid("", opset)],
                                doc_string="quantize-dequantize on the integer grid [qmin, qmax]")


def attach(model: onnx.ModelProto) -> None:
    """Add the function definition and its domain to a model that uses oq.FakeQuant nodes."""
    if not any(n.domain == DOMAIN and n.op_type == NAME for n in model.graph.node):
        return
    if not any(f.domain == DOMAIN and f.name == NAME for f in model.functions):
        opset = next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))
        model.functions.append(function_proto(opset))
    if not any(i.domain == DOMAIN for i in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def reference(x, scale, zero_point, qmin, qmax) -> np.ndarray:
    """numpy twin of the function, for tests."""
    return ((np.clip(np.rint(x / scale) + zero_point, qmin, qmax) - zero_point) * scale).astype(np.float32)

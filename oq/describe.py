"""`oq inspect`: what a model holds, and which of its nodes already run on quantized data."""
from __future__ import annotations

from collections import Counter

import onnx


QDQ = ("QuantizeLinear", "DequantizeLinear")


def _shape(vi: onnx.ValueInfoProto) -> str:
    tt = vi.type.tensor_type
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return f"{onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else '?'}[{', '.join(dims)}]"


# onnxruntime's integer kernels (QOperator format): they take quantized tensors directly, with no DequantizeLinear
INTEGER_KERNELS = ("QGemm", "ConvInteger", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
                   "QAttention", "QEmbedLayerNormalization")


def integer_kernel(node: onnx.NodeProto) -> bool:
    return node.op_type.startswith("QLinear") or node.op_type in INTEGER_KERNELS


def dq_readers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes (other than Q/DQ and integer kernels) that read at least one DequantizeLinear output: where a backend
    that fuses Q/DQ runs on quantized data. Ops fused into such a node in the backend (the ReLU after a Conv) read a
    float tensor in the graph, so they are not counted here, though `oq run` counts them as quantized."""
    dq_outputs = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n for n in model.graph.node if n.op_type not in QDQ and not integer_kernel(n)
            and any(i in dq_outputs for i in n.input)]


def quantized_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes (other than Q/DQ) that read at least one DequantizeLinear output, or integer-kernel ops."""
    readers = {id(n) for n in dq_readers(model)}
    return [n for n in model.graph.node if id(n) in readers or integer_kernel(n)]


def describe(model: onnx.ModelProto, path: str = "") -> str:
    g = model.graph
    opsets = ", ".join(f"{i.domain or 'ai.onnx'} {i.version}" for i in model.opset_import)
    lines = [f"model {path}", f"  ir_version {model.ir_version}; opsets: {opsets}; producer: "
             f"{model.producer_name or '?'} {model.producer_version}",
             f"  {len(g.node)} nodes, {len(g.initializer)} initializers "
             f"({sum(len(t.raw_data) or t.ByteSize() for t in g.initializer) / 1e6:.2f} MB)",
             "", "inputs:"]
    inits = {i.name for i in g.initializer}
    for vi in g.input:
        if vi.name not in inits:
            lines.append(f"  {vi.name:<30} {_shape(vi)}")
    lines.append("outputs:")
    for vi in g.output:
        lines.append(f"  {vi.name:<30} {_shape(vi)}")
    lines += ["", "ops:"]
    for op, k in Counter(n.op_type for n in g.node).most_common():
        lines.append(f"  {op:<28} {k}")
    readers = dq_readers(model)
    kernels = [n for n in g.node if integer_kernel(n)]
    n_qdq = sum(1 for n in g.node if n.op_type in QDQ)
    lines += ["", f"quantized: {len(readers)} nodes read a DequantizeLinear output ({n_qdq} Q/DQ nodes)"]
    for op, k in Counter(n.op_type for n in readers).most_common():
        lines.append(f"  {op:<28} {k}")
    if kernels:
        lines.append(f"quantized: {len(kernels)} nodes are integer kernels (QLinear*, QGemm, ...)")
        for op, k in Counter(n.op_type for n in kernels).most_common():
            lines.append(f"  {op:<28} {k}")
    if readers or kernels:
        lines.append("(`oq run` also counts the ops the backend fuses into these, such as a Conv's ReLU, as quantized)")
    return "\n".join(lines)

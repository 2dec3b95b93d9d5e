"""Find the quantizers of a Q/DQ model: each dequantized tensor a layer reads, and what produced it.

A quantizer is a DequantizeLinear (fed by a QuantizeLinear for activations, by stored codes for weights and biases)
or an oq.FakeQuant node. Its output is the tensor as the next layer sees it; its `source` is the float tensor it
stands for. The analysis bypasses, copies and measures quantizers, so this is the one place that reads their shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import OqError
from ..fakequant import DOMAIN as FQ_DOMAIN, NAME as FQ_NAME
from ..spec import DTYPES

_DTYPE_OF_ELEM = {elem: (name, lo, hi) for name, (lo, hi, _, elem) in DTYPES.items()}
_DTYPE_OF_ELEM[onnx.TensorProto.FLOAT8E5M2] = ("float8e5m2", -57344, 57344)


@dataclass
class Quantizer:
    output: str  # the dequantized tensor, as consumers read it
    source: str  # activation: the float tensor quantized; constant: the initializer holding codes (or floats)
    constant: bool  # weight or bias (stored codes) rather than an activation
    nodes: list[onnx.NodeProto]  # Q and DQ, or the FakeQuant node, in graph order
    scale: np.ndarray
    zero_point: np.ndarray
    dtype: str
    qmin: float
    qmax: float
    axis: int | None  # the axis per-channel scales run along (None: one scale)
    order: int  # index of the node producing `output` in the (topologically sorted) graph
    elem_type: int  # onnx element type of `output` (the scale's for DequantizeLinear)
    consumers: list[tuple[str, int]] = field(default_factory=list)  # (node name, input index)

    def bounds(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The representable range [(qmin - zp) * scale, (qmax - zp) * scale], broadcastable to a rank-`rank`
        tensor."""
        lo = (self.qmin - self.zero_point) * self.scale
        hi = (self.qmax - self.zero_point) * self.scale
        if lo.ndim == 1 and lo.size > 1 and self.axis is not None:
            shape = [1] * rank
            shape[self.axis % rank] = lo.size
            lo, hi = lo.reshape(shape), hi.reshape(shape)
        return lo, hi


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _qparams(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], fake: bool):
    """(scale, zero point, dtype name, qmin, qmax, axis) of a DequantizeLinear or FakeQuant node."""
    def value(i: int):
        if len(node.input) <= i or not node.input[i]:
            return None
        if node.input[i] not in inits:
            raise OqError(f"{node.name or node.op_type}: quantization parameter {node.input[i]} is not a constant; "
                          f"oq analyze needs a model with constant scales")
        return inits[node.input[i]]

    scale = numpy_helper.to_array(value(1)).astype(np.float64)
    zp_t = value(2)
    zp = np.zeros_like(scale) if zp_t is None else numpy_helper.to_array(zp_t).astype(np.float64)
    if fake:
        qmin, qmax = (float(numpy_helper.to_array(value(i))) for i in (3, 4))
        return scale, zp, f"fakequant[{int(qmin)},{int(qmax)}]", qmin, qmax, None
    elem = zp_t.data_type if zp_t is not None else _attr(node, "output_dtype", onnx.TensorProto.UINT8)
    name, lo, hi = _DTYPE_OF_ELEM.get(elem, (str(elem), -np.inf, np.inf))
    axis = _attr(node, "axis", 1) if scale.size > 1 else None
    return scale, zp, name, float(lo), float(hi), axis


def find_quantizers(model: onnx.ModelProto) -> list[Quantizer]:
    """Every quantizer of the model, in graph order."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    found: list[Quantizer] = []
    for order, node in enumerate(g.node):
        fake = node.op_type == FQ_NAME and node.domain == FQ_DOMAIN
        if node.op_type != "DequantizeLinear" and not fake:
            continue
        x = node.input[0]
        q = producer.get(x)
        if fake or x in inits:
            nodes, source = [node], x
        elif q is not None and q.op_type == "QuantizeLinear":
            nodes, source = [q, node], q.input[0]
        else:
            continue  # a DequantizeLinear of something computed: not a quantizer oq makes
        scale, zp, dtype, qmin, qmax, axis = _qparams(node, inits, fake)
        elem = inits[node.input[1]].data_type
        found.append(Quantizer(node.output[0], source, source in inits, nodes, scale, zp, dtype, qmin, qmax,
                               axis, order, elem))
    by_output = {qz.output: qz for qz in found}
    quantizer_nodes = {id(n) for qz in found for n in qz.nodes}
    for node in g.node:
        if id(node) in quantizer_nodes:
            continue
        for idx, name in enumerate(node.input):
            if name in by_output:
                by_output[name].consumers.append((node.name, idx))
    return found


def refuse_unsupported(model: onnx.ModelProto) -> None:
    """The analysis compares Q/DQ (or FakeQuant) graphs; QOperator models compute in integers inside fused ops."""
    fused = sorted({n.op_type for n in model.graph.node
                    if n.op_type.startswith("QLinear") or n.op_type in ("MatMulInteger", "ConvInteger")})
    if fused:
        raise OqError(f"oq analyze measures Q/DQ models; this one has fused integer ops ({', '.join(fused)}): "
                      f"leave --format at qdq")

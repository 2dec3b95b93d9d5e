"""Per output channel weight ranges of the worst weighted nodes: where one channel's outliers set a shared scale."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from ..opinfo import weighted_op
from .quantizers import Quantizer
from .records import Analysis


def _output_axis(node: onnx.NodeProto, qz: Quantizer, rank: int) -> int:
    if qz.axis is not None:
        return qz.axis % rank
    info = weighted_op(node.op_type)
    if info is None:
        return 0
    view = gs.Node(op=node.op_type, attrs={a.name: helper.get_attribute_value(a) for a in node.attribute})
    return info.output_axis(view, rank) % rank


def channel_ranges(node: onnx.NodeProto, qz: Quantizer, weight: np.ndarray) -> dict:
    """min/max of the float weight per output channel, and the grid's representable range (per channel or one)."""
    w = np.asarray(weight, np.float64)
    axis = _output_axis(node, qz, w.ndim) if w.ndim else 0
    flat = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1) if w.ndim else w.reshape(1, 1)
    lo, hi = qz.bounds(1)
    per_channel = lo.size == flat.shape[0] and lo.size > 1
    return {"axis": int(axis), "min": flat.min(axis=1).tolist(), "max": flat.max(axis=1).tolist(),
            "grid_min": lo.ravel().tolist() if per_channel else [float(np.min(lo))],
            "grid_max": hi.ravel().tolist() if per_channel else [float(np.max(hi))]}


def attach_channel_ranges(analysis: Analysis, quantized: onnx.ModelProto, weight_of: dict[str, Quantizer],
                          weights: dict[str, np.ndarray], count: int) -> None:
    """Fill NodeRecord.channel_ranges for the `count` worst nodes that have a weight (`weight_of`: node name ->
    its weight quantizer)."""
    nodes = {n.name: n for n in quantized.graph.node}
    done = 0
    for record in analysis.nodes:
        qz = weight_of.get(record.name)
        if qz is None or qz.scale.ndim > 1:  # blocked grids: no single range per channel
            continue
        record.channel_ranges = channel_ranges(nodes[record.name], qz, weights[qz.output])
        done += 1
        if done == count:
            break

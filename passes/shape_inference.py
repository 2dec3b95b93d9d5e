"""onnx shape inference, with large initializers stripped so models past the protobuf limit work too."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, shape_inference

from oq import ir
from oq.passmanager import Context, Pass, PassResult

# Initializers bigger than this are replaced by typed graph inputs while inferring: shape-carrying constants are
# tiny, weights are not needed for shapes.
STRIP_ELEMENTS = 1024


def _strip_large_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model without big tensor payloads: large initializers become typed graph inputs."""
    stripped = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "domain"):
        setattr(stripped, field, getattr(model, field))
    stripped.opset_import.extend(model.opset_import)
    stripped.functions.extend(model.functions)
    g, src = stripped.graph, model.graph
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    for init in src.initializer:
        if int(np.prod(init.dims)) > STRIP_ELEMENTS:
            g.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            g.initializer.append(init)
    return stripped


def infer_shapes(graph: gs.Graph) -> int:
    """Fill dtype and shape of every variable tensor onnx can infer; returns how many tensors gained information."""
    model = ir.to_model(graph)
    stripped = _strip_large_initializers(model)
    inferred = shape_inference.infer_shapes(stripped, check_type=False, strict_mode=False, data_prop=True)
    infos = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    gained = 0
    for name, tensor in graph.tensors().items():
        if not isinstance(tensor, gs.Variable) or name not in infos:
            continue
        ttype = infos[name].type
        if not ttype.HasField("tensor_type"):
            continue
        tt = ttype.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else None
        shape = None
        if tt.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        if (tensor.dtype is None and dtype is not None) or (tensor.shape is None and shape is not None):
            gained += 1
        if dtype is not None:
            tensor.dtype = dtype
        if shape is not None:
            tensor.shape = shape
    return gained


class InferShapes(Pass):
    name = "shape-inference"

    def run(self, ctx: Context) -> PassResult:
        try:
            gained = infer_shapes(ctx.graph)
        except Exception as exc:  # onnx raises InferenceError on malformed graphs
            return PassResult(False, [f"shape inference incomplete: {str(exc).splitlines()[0][:160]}"])
        return PassResult(gained > 0, [f"{gained} tensors gained dtype/shape"] if gained else [])

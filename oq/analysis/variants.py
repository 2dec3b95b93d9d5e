"""Models derived from a quantized one, each computed as written (no graph optimisation) by onnxruntime.

- the float twin: every quantizer replaced by an Identity of its float source (weights: their float values), so the
  twin computes the float model on the quantized model's own graph and tensor names;
- a single-node variant: the twin with only one node's quantizers put back, on copies feeding that node alone
  (a quantizer shared with other nodes stays float for them);
- probes: copies returning intermediate tensors as extra graph outputs.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import ir
from .quantizers import Quantizer


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    g = model.graph
    used = {name for n in g.node for name in n.input} | {o.name for o in g.output}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


def float_twin(model: onnx.ModelProto, quantizers: list[Quantizer], floats: dict[str, np.ndarray]
               ) -> onnx.ModelProto:
    """`floats`: quantizer output -> float value, for the constant quantizers whose source holds codes."""
    twin = _copy(model)
    g = twin.graph
    namer = ir.Namer.of_model(model)
    by_output = {qz.output: qz for qz in quantizers}
    dropped = {id(n) for qz in quantizers for n in qz.nodes}
    nodes = []
    for node in model.graph.node:
        qz = next((by_output[o] for o in node.output if o in by_output), None)
        if qz is not None:
            source = qz.source
            if qz.output in floats:
                source = namer(f"{qz.output}_float")
                g.initializer.append(numpy_helper.from_array(floats[qz.output], source))
            nodes.append(helper.make_node("Identity", [source], [qz.output], name=node.name))
        elif id(node) not in dropped:
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    _drop_unused_initializers(twin)
    return twin


def single_node(twin: onnx.ModelProto, quantized: onnx.ModelProto, node_name: str, quantizers: list[Quantizer]
                ) -> onnx.ModelProto:
    """The twin with the quantizers feeding `node_name` (found in `quantizers`) computed as in `quantized`."""
    variant = _copy(twin)
    g = variant.graph
    namer = ir.Namer.of_model(twin)
    inits = {i.name: i for i in quantized.graph.initializer}
    present = {i.name for i in g.initializer}
    target = next(n for n in g.node if n.name == node_name)
    position = list(g.node).index(target)
    added = []
    for qz in quantizers:
        for consumer, idx in qz.consumers:
            if consumer != node_name:
                continue
            renamed = {}
            for q_node in qz.nodes:
                copy = onnx.NodeProto()
                copy.CopyFrom(q_node)
                copy.name = namer(f"{q_node.name}_only")
                for k, name in enumerate(copy.input):
                    if name in renamed:
                        copy.input[k] = renamed[name]
                    elif name in inits and name not in present:
                        g.initializer.append(inits[name])
                        present.add(name)
                for k, name in enumerate(copy.output):
                    renamed[name] = copy.output[k] = namer(f"{name}_only")
                added.append(copy)
            target.input[idx] = renamed[qz.output]
    for offset, node in enumerate(added):  # just before the node: the float sources are computed by then
        g.node.insert(position + offset, node)
    return variant


def with_outputs(model: onnx.ModelProto, names: list[str], types: dict[str, int]) -> onnx.ModelProto:
    """A copy that also returns the named tensors, of the given element types (float when not given)."""
    out = _copy(model)
    g = out.graph
    present = {o.name for o in g.output}
    for name in names:
        if name not in present:
            g.output.append(helper.make_tensor_value_info(name, types.get(name) or onnx.TensorProto.FLOAT, None))
            present.add(name)
    return out


def constant_values(model: onnx.ModelProto, quantizers: list[Quantizer]) -> dict[str, np.ndarray]:
    """The dequantized value of every constant quantizer, computed by onnxruntime from the model's own nodes."""
    from ..runtime import session

    consts = [qz for qz in quantizers if qz.constant]
    if not consts:
        return {}
    sub = _copy(model)
    g = sub.graph
    wanted = {id(n) for qz in consts for n in qz.nodes}
    nodes = [n for n in model.graph.node if id(n) in wanted]
    del g.node[:]
    g.node.extend(nodes)
    del g.input[:]
    del g.output[:]
    del g.value_info[:]
    for qz in consts:
        g.output.append(helper.make_tensor_value_info(qz.output, qz.elem_type, None))
    _drop_unused_initializers(sub)
    names = [qz.output for qz in consts]
    values = session(sub, "disable").run(names, {})
    return dict(zip(names, values))

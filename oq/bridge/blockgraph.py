"""One reconstruction block (oq.blocks.Block) of a float model as a standalone ONNX model with quantization points.

Where the plan quantizes an activation for a node's input, the block model reads it through
`oq.recon.ActQuant(x)`; where it quantizes a weight, through `oq.recon.WeightQuant(w)`; each carries a `key`
attribute naming the quantizer (the activation's scale-sharing group, the weight tensor). Nothing else changes, so
with those two ops as the identity the block computes exactly the float model's values. The torch bridge runs the
block with the two ops bound to learnable fake quantizers (oq.bridge.blockrecon).

Every activation point gets its own node right before the node reading it, so quantization happens inside the
block that reads the tensor and block inputs and outputs are always float values.
"""
from __future__ import annotations

import onnx
from onnx import helper

DOMAIN = "oq.recon"


def _names_read(node: onnx.NodeProto) -> list[str]:
    out = [n for n in node.input if n]
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            for inner in g.node:
                out += _names_read(inner)
    return out


def block_model(model: onnx.ModelProto, node_names: list[str], inputs: list[str], outputs: list[str],
                acts: dict[tuple[str, int], str], weights: dict[tuple[str, int], str]) -> onnx.ModelProto:
    """The nodes `node_names` of `model` (in that order) as a model from `inputs` to `outputs`; `acts` and
    `weights` map (node name, input index) to a quantizer key."""
    graph = model.graph
    by_name = {n.name: n for n in graph.node}
    inits = {t.name: t for t in graph.initializer}
    infos = {vi.name: vi for vi in (*graph.input, *graph.value_info, *graph.output)}
    nodes: list[onnx.NodeProto] = []
    used: dict[str, None] = {}
    weight_out: dict[str, str] = {}
    for name in node_names:
        node = onnx.NodeProto()
        node.CopyFrom(by_name[name])
        for read in _names_read(node):
            if read in inits:
                used[read] = None
        for i, tensor in enumerate(node.input):
            if not tensor:
                continue
            wkey = weights.get((name, i))
            if wkey is not None:
                if tensor not in weight_out:
                    weight_out[tensor] = f"{tensor}::wq"
                    nodes.append(helper.make_node("WeightQuant", [tensor], [weight_out[tensor]],
                                                  name=f"{tensor}::wq", domain=DOMAIN, key=wkey))
                node.input[i] = weight_out[tensor]
                continue
            akey = acts.get((name, i))
            if akey is not None:
                out = f"{tensor}::aq::{name}::{i}"
                nodes.append(helper.make_node("ActQuant", [tensor], [out], name=out, domain=DOMAIN, key=akey))
                node.input[i] = out
        nodes.append(node)

    def info(name: str) -> onnx.ValueInfoProto:
        if name in infos:
            return infos[name]
        return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)

    body = helper.make_graph(nodes, "block", [info(n) for n in inputs], [info(n) for n in outputs],
                             [inits[n] for n in used])
    opsets = [o for o in model.opset_import if o.domain != DOMAIN] + [helper.make_opsetid(DOMAIN, 1)]
    out = helper.make_model(body, opset_imports=opsets, ir_version=model.ir_version)
    out.functions.extend(model.functions)
    return out


__all__ = ["block_model", "DOMAIN"]

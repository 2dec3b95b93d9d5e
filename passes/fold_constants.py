"""Evaluate nodes whose inputs are all known, and Shape nodes whose input shape is static."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx.reference import ReferenceEvaluator

from oq import ir
from oq.passmanager import Context, Pass, PassResult

# Folding these would change meaning (randomness) or undo quantization the model already has.
NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
              "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
# Results bigger than this stay computed at run time instead of bloating the file.
MAX_FOLDED_ELEMENTS = 1 << 24


def _evaluate(node: gs.Node, values: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    in_names = [f"i{k}" if v is not None else "" for k, v in enumerate(values)]
    out_names = [f"o{k}" for k in range(len(node.outputs))]
    attrs = {}
    for k, v in node.attrs.items():
        attrs[k] = helper.make_tensor(k, helper.np_dtype_to_tensor_dtype(v.values.dtype), v.values.shape,
                                      v.values.flatten().tolist()) if isinstance(v, gs.Constant) else v
    onnx_node = helper.make_node(node.op, in_names, out_names, domain=node.domain or "", **attrs)
    graph = helper.make_graph(
        [onnx_node], "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(in_names, values) if v is not None],
        [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in out_names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: v for n, v in zip(in_names, values) if v is not None}
    return ReferenceEvaluator(model).run(None, feeds)


def _replace_with_constant(tensor: gs.Variable, value: np.ndarray) -> None:
    ir.replace_all_uses(tensor, gs.Constant(tensor.name, np.asarray(value)))


class FoldConstants(Pass):
    name = "fold-constants"

    def run(self, ctx: Context) -> PassResult:
        graph = ctx.graph
        graph_outputs = {t.name for t in graph.outputs}
        folded, notes = [], []
        for node in graph.nodes:
            if node.op in NEVER_FOLD or (node.domain or "") not in ("", "ai.onnx") or ir.has_subgraph(node):
                continue
            if any(t.name in graph_outputs for t in node.outputs):
                continue
            results = self._static_shape(node)
            if results is None:
                values = self._known_inputs(node)
                if values is None:
                    continue
                try:
                    results = _evaluate(node, values, graph.opset)
                except Exception as exc:  # an op the reference runtime lacks: leave it for onnxruntime
                    notes.append(f"{node.name} ({node.op}) not folded: {type(exc).__name__}")
                    continue
            if any(np.asarray(r).size > MAX_FOLDED_ELEMENTS for r in results):
                continue
            for tensor, value in zip(list(node.outputs), results):
                _replace_with_constant(tensor, value)
            node.inputs.clear()
            node.outputs.clear()
            folded.append(node.name)
        if folded:
            graph.nodes = [n for n in graph.nodes if n.outputs]
            notes.insert(0, f"folded {len(folded)} nodes")
        return PassResult(bool(folded), notes)

    @staticmethod
    def _static_shape(node: gs.Node) -> list | None:
        if node.op != "Shape":
            return None
        shape = node.inputs[0].shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return [np.array(shape, dtype=np.int64)[node.attrs.get("start", 0):node.attrs.get("end", None)]]

    @staticmethod
    def _known_inputs(node: gs.Node) -> list | None:
        if node.op == "Shape":
            return None
        values = []
        for t in node.inputs:
            if not t.name:
                values.append(None)
                continue
            v = ir.constant_value(t)
            if v is None:
                return None
            values.append(v)
        return values

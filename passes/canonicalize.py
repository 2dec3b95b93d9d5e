"""Bring any model into the form later passes expect: opset >= 13, unique node names, constants as initializers."""
from __future__ import annotations

from collections import Counter

import onnx
import onnx_graphsurgeon as gs
from onnx import version_converter

from oq import ir
from oq.errors import OqError
from oq.passmanager import Context, Pass, PassResult, unique_node_names

MIN_OPSET = 13


class Canonicalize(Pass):
    name = "canonicalize"
    ensures = (unique_node_names,)

    def __init__(self, min_opset: int = MIN_OPSET, max_opset: int | None = None):
        """max_opset: the newest opset the runtime that checks and runs the output has Q/DQ kernels for; a newer
        model is converted down to it (or refused when onnx's converter cannot)."""
        self.min_opset = min_opset
        self.max_opset = max_opset

    def run(self, ctx: Context) -> PassResult:
        notes = []
        modified = self._upgrade_opset(ctx, notes)
        graph = ctx.graph
        modified |= self._constants_to_initializers(graph)
        modified |= self._drop_identities(graph)
        modified |= self._name_nodes(graph)
        return PassResult(modified, notes)

    def _upgrade_opset(self, ctx: Context, notes: list[str]) -> bool:
        opset = ctx.graph.opset
        if self.max_opset is not None and opset > self.max_opset:
            return self._downgrade_opset(ctx, notes, opset)
        if opset >= self.min_opset:
            return False
        model = ir.to_model(ctx.graph)
        try:
            upgraded = version_converter.convert_version(model, self.min_opset)
            onnx.checker.check_model(upgraded)
        except Exception as exc:
            raise OqError(f"model uses opset {opset}; oq needs opset >= {self.min_opset} and onnx's version "
                          f"converter could not upgrade it ({str(exc).splitlines()[0][:200]})") from None
        ctx.graph = ir.to_graph(upgraded)
        notes.append(f"upgraded opset {opset} -> {self.min_opset}")
        return True

    def _downgrade_opset(self, ctx: Context, notes: list[str], opset: int) -> bool:
        try:
            converted = version_converter.convert_version(ir.to_model(ctx.graph), self.max_opset)
            onnx.checker.check_model(converted)
        except Exception as exc:
            raise OqError(f"model uses opset {opset}, newer than the newest with quantization kernels in the "
                          f"installed onnxruntime ({self.max_opset}), and onnx's version converter could not convert "
                          f"it down ({str(exc).splitlines()[0][:160]}); export the model at opset {self.max_opset} "
                          f"or lower") from None
        ctx.graph = ir.to_graph(converted)
        notes.append(f"converted opset {opset} -> {self.max_opset} (the newest the installed onnxruntime runs Q/DQ at)")
        return True

    @staticmethod
    def _constants_to_initializers(graph: gs.Graph) -> bool:
        outputs = {t.name for t in graph.outputs}
        changed = False
        for node in graph.nodes:
            if node.op != "Constant" or node.outputs[0].name in outputs:
                continue
            value = ir.constant_value(node.outputs[0])
            if value is None:
                continue  # value_float/value_ints etc.: rare, left alone
            out = node.outputs[0]
            ir.replace_all_uses(out, gs.Constant(out.name, value))
            node.outputs.clear()
            changed = True
        if changed:
            graph.nodes = [n for n in graph.nodes if not (n.op == "Constant" and not n.outputs)]
        return changed

    @staticmethod
    def _drop_identities(graph: gs.Graph) -> bool:
        outputs = {t.name for t in graph.outputs}
        keep, changed = [], False
        for node in graph.nodes:
            if node.op == "Identity" and node.outputs[0].name not in outputs:
                ir.replace_all_uses(node.outputs[0], node.inputs[0])
                node.inputs.clear()
                node.outputs.clear()
                changed = True
            else:
                keep.append(node)
        graph.nodes = keep
        return changed

    @staticmethod
    def _name_nodes(graph: gs.Graph) -> bool:
        counts = Counter(n.name for n in graph.nodes)
        namer = ir.Namer(taken={n.name for n in graph.nodes if n.name and counts[n.name] == 1})
        changed = False
        for node in graph.nodes:
            if node.name and counts[node.name] == 1:
                continue
            node.name = namer(node.name or node.op.lower())
            changed = True
        return changed

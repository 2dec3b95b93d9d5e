"""Cross-layer equalization: rescale the channels between two weighted layers so that per-tensor weight grids fit.

For A -> [Relu | LeakyRelu | PRelu | nothing] -> B, where the activation commutes with a positive per-channel scale,
dividing A's output channel i (weights and bias) by s_i and multiplying B's input channel i by s_i leaves the
function unchanged. With s_i = sqrt(r_A,i / r_B,i) (r = the channel's largest |weight|) both channels end with range
sqrt(r_A,i * r_B,i), so one per-tensor scale no longer has to cover a few huge channels while most are tiny
(Nagel et al., "Data-Free Quantization", 2019). Chains are swept a few times, since a middle layer takes part in two
pairs. Targets with per-tensor weights (vitis) turn it on with `cross_layer_equalization = true`.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from oq import ir
from oq.opinfo import op_names, weighted_op
from oq.passmanager import Context, Pass, PassResult

_HOMOGENEOUS = ("Relu", "LeakyRelu", "PRelu")  # f(s * x) = s * f(x) for s > 0, per channel
_SWEEPS = 8


def _out_ranges(node: gs.Node, w: np.ndarray) -> np.ndarray:
    return weighted_op(node).output_ranges(node, w)


def _in_ranges(node: gs.Node, w: np.ndarray) -> np.ndarray:
    return weighted_op(node).input_ranges(node, w)


def _layer_ok(node: gs.Node, uses: ir.UseIndex) -> str | None:
    info = weighted_op(node)
    if info is None or not info.rescalable:
        return f"not {op_names(lambda w: w.rescalable)}"
    widx, bidx = info.weight_input, info.bias_input
    if len(node.inputs) <= widx or ir.constant_value(node.inputs[widx]) is None:
        return "weight is not a constant"
    if len(uses.consumers(node.inputs[widx])) > 1:
        return "weight is shared"
    if len(node.inputs) > bidx and node.inputs[bidx].name:
        if ir.constant_value(node.inputs[bidx]) is None or len(uses.consumers(node.inputs[bidx])) > 1:
            return "bias is not a private constant"
    if node.op == "Gemm" and node.attrs.get("transA", 0):
        return "Gemm with transA"
    return None


def equalizable_pairs(graph: gs.Graph) -> list[tuple[gs.Node, gs.Node | None, gs.Node]]:
    """(A, activation or None, B) triples whose channels can be rescaled without changing the function."""
    uses = ir.UseIndex(graph)
    outputs = {t.name for t in graph.outputs}
    pairs = []
    for a in graph.nodes:
        if _layer_ok(a, uses) or a.outputs[0].name in outputs:
            continue
        act, t = None, a.outputs[0]
        nxt = uses.sole_consumer(t)
        if nxt is not None and nxt.op in _HOMOGENEOUS and nxt.inputs[0] is t:
            act, t = nxt, nxt.outputs[0]
            if t.name in outputs:
                continue
            nxt = uses.sole_consumer(t)
        if nxt is None or _layer_ok(nxt, uses) or nxt.inputs[0] is not t:
            continue
        pairs.append((a, act, nxt))
    return pairs


class CrossLayerEqualization(Pass):
    name = "cross-layer-equalization"

    def run(self, ctx: Context) -> PassResult:
        pairs = equalizable_pairs(ctx.graph)
        if not pairs:
            return PassResult(False, ["no equalizable layer pairs"])
        weights = {}  # tensor name -> current float64 values

        def value(t: gs.Tensor) -> np.ndarray:
            if t.name not in weights:
                weights[t.name] = ir.constant_value(t).astype(np.float64)
            return weights[t.name]

        done: dict[tuple[int, int], tuple[gs.Node, gs.Node]] = {}  # by ids: graphsurgeon nodes are not hashable
        for _ in range(_SWEEPS):
            for a, act, b in pairs:
                ia, ib = weighted_op(a), weighted_op(b)
                wa, wb = value(a.inputs[ia.weight_input]), value(b.inputs[ib.weight_input])
                ra, rb = ia.output_ranges(a, wa), ib.input_ranges(b, wb)
                if ra.shape != rb.shape:
                    continue
                s = np.ones_like(ra)
                ok = (ra > 0) & (rb > 0)
                s[ok] = np.sqrt(ra[ok] / rb[ok])
                weights[a.inputs[ia.weight_input].name] = ia.scale_output_channels(a, wa, 1.0 / s)
                bias = a.inputs[ia.bias_input] if len(a.inputs) > ia.bias_input else None
                if bias is not None and bias.name:  # [C], or Gemm's scalar / [N] / [M, N]
                    weights[bias.name] = value(bias) / s
                weights[b.inputs[ib.weight_input].name] = ib.scale_input_channels(b, wb, s)
                done[id(a), id(b)] = (a, b)
        if not done:
            return PassResult(False, ["no layer pair has matching channel counts"])
        touched = {id(n): n for pair in done.values() for n in pair}
        for node in touched.values():
            info = weighted_op(node)
            for k in (info.weight_input, info.bias_input):
                if len(node.inputs) > k and node.inputs[k].name in weights:
                    t = node.inputs[k]
                    node.inputs[k] = gs.Constant(t.name, weights[t.name].astype(ir.constant_value(t).dtype))
        return PassResult(True, [f"equalized {len(done)} layer pairs: "
                                 + ", ".join(f"{a.name}->{b.name}" for a, b in done.values())])

"""Fold inference-mode BatchNormalization into the preceding Conv, ConvTranspose or Gemm."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from oq import ir
from oq.opinfo import op_names, weighted_op
from oq.passmanager import Context, Pass, PassResult


def _bn_factors(bn: gs.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """BN as y = x * f + s per channel, or None if its parameters are not constants."""
    params = [ir.constant_value(t) for t in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    f = gamma / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
    return f, beta - mean * f


class FoldBatchNorm(Pass):
    name = "fold-batchnorm"

    def run(self, ctx: Context) -> PassResult:
        graph = ctx.graph
        uses = ir.UseIndex(graph)
        notes, folded = [], 0
        for bn in list(graph.nodes):
            if bn.op != "BatchNormalization" or not bn.outputs:
                continue
            reason = self._try_fold(bn, uses)
            if reason:
                notes.append(f"{bn.name} not folded: {reason}")
            else:
                folded += 1
        if folded:
            graph.nodes = [n for n in graph.nodes if n.outputs]
            notes.insert(0, f"folded {folded} BatchNormalization")
        return PassResult(folded > 0, notes)

    def _try_fold(self, bn: gs.Node, uses: ir.UseIndex) -> str | None:
        if bn.attrs.get("training_mode", 0) or len([t for t in bn.outputs if t.name]) > 1:
            return "training-mode BatchNormalization"
        x = bn.inputs[0]
        prev = ir.producer(x)
        info = weighted_op(prev) if prev is not None else None
        if info is None or not info.rescalable:
            names = op_names(lambda w: w.rescalable)
            return f"input is not produced by {names} ({prev.op if prev else 'graph input'})"
        if uses.sole_consumer(x) is None:
            return f"{prev.op} output '{x.name}' is read by other nodes too"
        factors = _bn_factors(bn)
        if factors is None:
            return "scale/bias/mean/var are not constants"
        f, shift = factors
        widx, bidx = info.weight_input, info.bias_input
        w_t = prev.inputs[widx]
        w = ir.constant_value(w_t)
        if w is None:
            return f"{prev.op} weight '{w_t.name}' is not a constant"
        n_users = len(uses.consumers(w_t))
        if n_users > 1:
            return f"{prev.op} weight '{w_t.name}' is shared by {n_users} nodes"
        if prev.op == "Gemm" and (x.shape is None or len(x.shape) != 2):
            return "Gemm output is not 2-D"
        has_bias = len(prev.inputs) > bidx and prev.inputs[bidx].name
        b = ir.constant_value(prev.inputs[bidx]) if has_bias else np.zeros(f.shape, np.float64)
        if b is None:
            return f"{prev.op} bias is not a constant"
        if has_bias and len(uses.consumers(prev.inputs[bidx])) > 1:
            return f"{prev.op} bias '{prev.inputs[bidx].name}' is shared"
        if prev.op == "Gemm":
            alpha, beta = prev.attrs.get("alpha", 1.0), prev.attrs.get("beta", 1.0)
            b = beta * np.broadcast_to(b.astype(np.float64), f.shape)
            new_w = info.scale_output_channels(prev, w, f * alpha)
            prev.attrs["alpha"], prev.attrs["beta"] = 1.0, 1.0
        else:
            new_w = info.scale_output_channels(prev, w, f)
        new_b = b.astype(np.float64) * f + shift
        dtype = w.dtype
        prev.inputs[widx] = gs.Constant(w_t.name, new_w.astype(dtype))
        bias_name = prev.inputs[bidx].name if has_bias else f"{prev.name}_bias"
        bias = gs.Constant(bias_name, new_b.astype(dtype))
        if has_bias:
            prev.inputs[bidx] = bias
        else:
            prev.inputs.append(bias)
        y = bn.outputs[0]
        prev.outputs[0] = y  # the conv now produces what the BN produced
        bn.inputs.clear()
        bn.outputs.clear()
        return None

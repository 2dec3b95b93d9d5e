"""Move a float Relu/Clip/LeakyRelu that feeds only a MaxPool below it: act(MaxPool(x)) == MaxPool(act(x)).

Max-pooling commutes with any non-decreasing function (padding counts as -inf either way), so the result is
identical while the activation touches a quarter (2x2 pooling) of the values. It matters for quantized graphs: a
float stem (kept float by the target, e.g. an RGB conv) followed by Relu -> MaxPool -> QuantizeLinear would have
onnxruntime hoist the Q/DQ above the MaxPool (QDQ propagation) and run the pooling on uint8 NCHW data, many times
slower than its float NCHWc pooling; with the activation in between, nothing is hoisted and the activation is
absorbed into the QuantizeLinear. Runs after Q/DQ insertion, so it only ever sees activations left in float, and
only where a QuantizeLinear reads the pool (elsewhere a backend may rather fuse the activation into its producer).
"""
from __future__ import annotations

from oq import ir
from oq.passmanager import Context, Pass, PassResult

_MONOTONIC = ("Relu", "Clip", "LeakyRelu")


class SinkActivationBelowMaxPool(Pass):
    name = "sink-activation"

    def run(self, ctx: Context) -> PassResult:
        graph = ctx.graph
        uses = ir.UseIndex(graph)
        outputs = {t.name for t in graph.outputs}
        moved = []
        for act in list(graph.nodes):
            if act.op not in _MONOTONIC or not act.outputs or act.outputs[0].name in outputs:
                continue
            if act.op == "LeakyRelu" and act.attrs.get("alpha", 0.01) < 0:
                continue  # decreasing on the negative side
            pool = uses.sole_consumer(act.outputs[0])
            if pool is None or pool.op != "MaxPool" or pool.inputs[0] is not act.outputs[0]:
                continue
            if len([t for t in pool.outputs if t.name]) != 1:
                continue  # the Indices output would see the activation's ties
            reader = uses.sole_consumer(pool.outputs[0])
            if reader is None or reader.op != "QuantizeLinear" or pool.outputs[0].name in outputs:
                continue
            x, mid, y = act.inputs[0], act.outputs[0], pool.outputs[0]
            pool.inputs[0], pool.outputs[0] = x, mid  # x -> MaxPool -> mid -> act -> y
            act.inputs[0], act.outputs[0] = mid, y
            mid.shape = y.shape
            moved.append(f"{act.name} below {pool.name}")
        if moved:
            ir.toposort(graph)
        return PassResult(bool(moved), moved)

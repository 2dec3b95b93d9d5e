"""Rewrite the graph from the calibrated plan: Q/DQ on activations, int8 weights feeding DQ, int32 biases."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from oq import fakequant, ir
from oq.errors import OqError
from oq.opinfo import weighted_op
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.plan import ALL_CONSUMERS
from oq.spec import PACKED_DTYPES, QParams, quantize_array

INT32_SPEC_LIMIT = 2**31 - 1


def _qparam_constants(namer: ir.Namer, base: str, qp: QParams, dtype=np.float32) -> tuple[gs.Constant, gs.Constant]:
    """Scale in the quantized tensor's own float type (float16 models need opset 19), zero-point in the spec's."""
    scale = gs.Constant(namer(f"{base}_scale"), np.asarray(qp.scale, dtype))
    zp = gs.Constant(namer(f"{base}_zero_point"), np.asarray(qp.zero_point))
    return scale, zp


def _dq_node(namer, base: str, q_input: gs.Tensor, scale, zp, axis, shape, out_dtype=np.float32,
             block_size: int | None = None):
    out = gs.Variable(namer(f"{base}_dq"), dtype=out_dtype, shape=shape)
    attrs = {"axis": axis} if axis is not None else {}
    if block_size:
        attrs["block_size"] = block_size
    return gs.Node("DequantizeLinear", namer(f"{base}_DequantizeLinear"), attrs, [q_input, scale, zp], [out]), out


def _broadcast_shape(qp: QParams, rank: int) -> list[int] | None:
    if qp.axis is None or np.ndim(qp.scale) == 0:
        return None
    shape = [1] * rank
    shape[qp.axis % rank] = -1
    return shape


def _fake_quant(namer, base: str, x: gs.Tensor, qp: QParams, rank: int, shape, dtype):
    """oq.FakeQuant node on x (see oq.fakequant) with qparams shaped to broadcast per channel."""
    bshape = _broadcast_shape(qp, rank)
    scale = np.asarray(qp.scale, np.float32)
    zp = np.asarray(qp.zero_point, np.float32)
    if bshape is not None:
        scale, zp = scale.reshape(bshape), zp.reshape(bshape)
    qmin, qmax = qp.spec.qrange
    consts = [gs.Constant(namer(f"{base}_{k}"), np.asarray(v, np.float32))
              for k, v in (("scale", scale), ("zero_point", zp), ("qmin", qmin), ("qmax", qmax))]
    out = gs.Variable(namer(f"{base}_fq"), dtype=dtype, shape=shape)
    node = gs.Node(fakequant.NAME, namer(f"{base}_FakeQuant"), {}, [x, *consts], [out], domain=fakequant.DOMAIN)
    return [node], out


class InsertQDQ(Pass):
    name = "insert-qdq"
    requires = (has_plan,)

    def run(self, ctx: Context) -> PassResult:
        graph, plan = ctx.graph, ctx.plan
        namer = ir.Namer(graph)
        nodes = {n.name: n for n in graph.nodes}
        tensors = graph.tensors()
        new_nodes: list[gs.Node] = []
        notes: list[str] = []

        fake = getattr(ctx.target, "format", "qdq") == "fakequant"
        for key, wq in plan.weights.items():
            value = ir.constant_value(tensors[wq.tensor])
            if fake:
                fq, out = _fake_quant(namer, wq.tensor, tensors[wq.tensor], wq.qparams, value.ndim,
                                      list(value.shape), value.dtype)
                new_nodes += fq
                for node_name, idx in wq.consumers:
                    nodes[node_name].inputs[idx] = out
                continue
            q = gs.Constant(namer(f"{wq.tensor}_quantized"), quantize_array(value.astype(np.float32), wq.qparams))
            scale, zp = _qparam_constants(namer, wq.tensor, wq.qparams, value.dtype)
            dq, out = _dq_node(namer, wq.tensor, q, scale, zp, wq.axis, list(value.shape), value.dtype,
                               wq.qparams.block_size)
            if wq.spec.dtype in PACKED_DTYPES:  # 4-bit values sit in 8-bit containers until export packs them
                plan.packed.update({q.name: wq.spec.dtype, zp.name: wq.spec.dtype})
            new_nodes.append(dq)
            for node_name, idx in wq.consumers:
                nodes[node_name].inputs[idx] = out

        for bq in plan.biases:
            node = nodes[bq.node]
            aq, wq = plan.activations[bq.input_tensor], plan.weights[bq.weight_key]
            bidx = weighted_op(node).bias_input
            bias_t = node.inputs[bidx]
            bias = ir.constant_value(bias_t)
            if bias.dtype != np.float32:
                notes.append(f"{node.name}: {bias.dtype} bias kept in float (int32 bias needs float32 scales)")
                continue
            bias = bias.astype(np.float64)
            scale = (aq.qparams.scale.astype(np.float64) * wq.qparams.scale.astype(np.float64)).reshape(-1)
            scale = np.broadcast_to(scale, bias.shape) if scale.size == 1 else scale
            q = np.rint(bias / scale)
            if np.abs(q).max(initial=0) > INT32_SPEC_LIMIT:
                notes.append(f"{node.name}: bias kept in float, int32 would overflow (scale {scale.min():.3g})")
                continue
            s = gs.Constant(namer(f"{bias_t.name}_scale"), scale.astype(np.float32))
            zp = gs.Constant(namer(f"{bias_t.name}_zero_point"), np.zeros(scale.shape, np.int32))
            qc = gs.Constant(namer(f"{bias_t.name}_quantized"), q.astype(np.int32))
            dq, out = _dq_node(namer, bias_t.name, qc, s, zp, 0, list(bias.shape))
            new_nodes.append(dq)
            node.inputs[bidx] = out

        graph_outputs = {t.name for t in graph.outputs}
        for name, aq in plan.activations.items():
            tensor = tensors[name]
            if aq.qparams is None:
                raise OqError(f"internal: tensor '{name}' was planned for quantization but never calibrated")
            consumers = [(c, i) for c in list(tensor.outputs) for i, t in enumerate(c.inputs) if t is tensor]
            if aq.consumers is not ALL_CONSUMERS:
                consumers = [(c, i) for c, i in consumers if (c.name, i) in aq.consumers]
            if fake:
                fq, dq_out = _fake_quant(namer, name, tensor, aq.qparams, 0, tensor.shape, tensor.dtype or np.float32)
                new_nodes += fq
            else:
                scale, zp = _qparam_constants(namer, name, aq.qparams, tensor.dtype or np.float32)
                q_out = gs.Variable(namer(f"{name}_q"), dtype=aq.qparams.zero_point.dtype, shape=tensor.shape)
                new_nodes.append(gs.Node("QuantizeLinear", namer(f"{name}_QuantizeLinear"), {}, [tensor, scale, zp],
                                         [q_out]))
                dq, dq_out = _dq_node(namer, name, q_out, scale, zp, None, tensor.shape, tensor.dtype or np.float32)
                new_nodes.append(dq)
            for c, i in consumers:
                c.inputs[i] = dq_out
            if aq.consumers is ALL_CONSUMERS and name in graph_outputs:
                # keep the graph output's name: the DQ takes it, the producer's result gets a new name
                self._rename_output(graph, namer, tensor, dq_out)
        graph.nodes.extend(new_nodes)
        ir.toposort(graph)
        quantized = {n for n, (q, _) in plan.status.items() if q}
        return PassResult(bool(new_nodes), notes + [f"{len(new_nodes)} Q/DQ nodes for {len(quantized)} quantized nodes"])

    @staticmethod
    def _rename_output(graph, namer, tensor, dq_out):
        original = tensor.name
        tensor.name = namer(f"{original}_float")
        dq_out.name = original
        graph.outputs = [dq_out if t is tensor else t for t in graph.outputs]

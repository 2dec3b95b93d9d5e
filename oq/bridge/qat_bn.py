"""BatchNormalization-aware finetuning: Conv + BatchNormalization pairs trained with live batch statistics.

oq folds every inference-mode BatchNormalization into the Conv before it, so the quantized model has no BN left.
Given the float model it came from, `pairs(model, plan, float_model)` finds each Conv whose float output is read
only by a BatchNormalization, checks that refolding the float parameters gives the quantized weight, and returns the
unfolded parameters. The training graph then computes, as PyTorch's approximate ConvBn QAT (Krishnamoorthi 2018):

    sf = gamma / sqrt(running_var + eps)            BnFold, in front of the graph: also the folded weight W * sf
    w = fake_quant(W * sf)                          the quantized model's own weight path and learned scale
    conv = Conv(x, w)                               without bias
    y = BN_train(conv / sf + b)                     BnApply: batch statistics, running ones updated (momentum)

and, with the statistics frozen or in eval mode, y = conv + fake_quant(beta + (b - running_mean) * sf) through the
quantized model's own bias path (an int32 bias of scale s_x * s_w, or a float one), which is what the exported model
computes: it gets the codes of W * sf and the folded bias, in the input's graph, with no BatchNormalization.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from ..errors import OqError
from . import qat_graph
from .qat_graph import DOMAIN, _attr, _broadcast, _chain, _Graph, is_quantizer
from .registry import NodeAttrs

# BN parameters in the training graph, in the order BnFold reads them: oq.qat.bn.<kind>/<Conv name>
KINDS = ("weight", "bias", "gamma", "beta", "mean", "var")
LEARNED = KINDS[:4]  # trained with the weights' learning rate; mean and var follow the batches
# a folded float weight within this many quantization steps of the quantized one is the same weight
TOLERANCE_STEPS = 1.5


@dataclass
class BnPair:
    conv: str  # the Conv node's name (the same in both models)
    weight: str  # the tensor its weight quantizer reads in the training graph (BnFold writes it)
    bias: str  # the tensor its bias path reads (BnFold writes it)
    values: dict  # kind -> float32 array: the float Conv's weight and bias, BN's gamma, beta, mean, var
    eps: float

    def name(self, kind: str) -> str:
        return f"{DOMAIN}.bn.{kind}/{self.conv}"

    @property
    def names(self) -> list[str]:
        return [self.name(k) for k in KINDS]

    conv_output = property(lambda self: f"{DOMAIN}.bn.conv/{self.conv}")
    factor = property(lambda self: f"{DOMAIN}.bn.factor/{self.conv}")


@dataclass
class BnMode:
    """Whether BnApply normalises with batch statistics (training, not frozen) or adds the folded bias."""
    live: bool = True
    frozen: bool = False


def pairs(model: onnx.ModelProto, p: qat_graph.Plan, float_model) -> list[BnPair]:
    """The Conv + BatchNormalization pairs of `float_model` (ModelProto or path) trained BN-aware in `model`."""
    if not isinstance(float_model, onnx.ModelProto):
        from ..ir import load_model
        try:
            float_model = load_model(float_model)
        except TypeError:
            raise OqError(f"float_model must be an onnx.ModelProto or a path, got {type(float_model).__name__}") \
                from None
    f, g = _Graph(float_model.graph), _Graph(model.graph)
    convs = {n.name: n for n in g.nodes if n.op_type == "Conv" and n.domain in ("", "ai.onnx") and n.name}
    consts = {c.name: c for c in p.int_consts}
    found = []
    for conv in f.nodes:
        if conv.op_type != "Conv" or conv.name not in convs:
            continue
        readers = f.readers.get(conv.output[0], [])
        if len(readers) != 1 or readers[0][1] != 0 or not _inference_bn(readers[0][0], f):
            continue
        bn = readers[0][0]
        w_raw = f.array(conv.input[1]) if len(conv.input) > 1 else None
        if w_raw is None or w_raw.dtype != np.float32:
            continue
        has_bias = len(conv.input) > 2 and conv.input[2]
        b_raw = f.array(conv.input[2]) if has_bias else np.zeros(w_raw.shape[0], np.float32)
        if b_raw is None or b_raw.dtype != np.float32:
            continue
        values = dict(zip(KINDS, [w_raw, b_raw, *(f.array(t).astype(np.float32) for t in bn.input[1:5])]))
        eps = float(_attr(bn, "epsilon", 1e-5))
        found.append(_pair(g, convs[conv.name], consts, set(p.trainable), values, eps))
    if not found:
        raise OqError("float_model has no Conv followed by BatchNormalization whose Conv (by node name) is in the "
                      "quantized model: pass the float model oq quantized, before BatchNormalization was folded")
    return found


def _inference_bn(bn: onnx.NodeProto, f: _Graph) -> bool:
    return (bn.op_type == "BatchNormalization" and bn.domain in ("", "ai.onnx") and len(bn.input) == 5
            and not _attr(bn, "training_mode", 0) and len([o for o in bn.output if o]) == 1
            and all(f.array(t) is not None and f.array(t).dtype == np.float32 for t in bn.input[1:5]))


def _pair(g: _Graph, conv: onnx.NodeProto, consts: dict, trainable: set, values: dict, eps: float) -> BnPair:
    def fail(why: str):
        return OqError(f"float_model does not match the quantized model at Conv {conv.name!r}: {why}")

    entries = []
    for i, what in ((1, "weight"), (2, "bias")):
        if len(conv.input) <= i or not conv.input[i]:
            raise fail(f"the quantized Conv has no {what}")
        src, path = _chain(g, conv.input[i])
        if src is None or not (src in consts or src in trainable) or \
                any(len(g.readers.get(t, [])) != 1 for t in path[:-1]) or len(g.readers.get(src, [])) != 1:
            raise fail(f"its {what} is not a constant of its own that finetuning learns")
        entries.append((src, path))
    (w_src, w_path), (b_src, _) = entries
    w_q = consts[w_src].float_init if w_src in consts else g.array(w_src).astype(np.float32)
    if w_q.shape != values["weight"].shape or values["bias"].shape != (w_q.shape[0],) or \
            any(values[k].shape != (w_q.shape[0],) for k in KINDS[2:]):
        raise fail(f"weight shape {list(values['weight'].shape)} in float_model, {list(w_q.shape)} in the "
                   "quantized model")
    step, lo, hi = _grid(g, w_src, w_path, consts, w_q)
    sf = values["gamma"].astype(np.float64) / np.sqrt(values["var"].astype(np.float64) + eps)
    refold = (values["weight"].astype(np.float64) * sf.reshape([-1] + [1] * (w_q.ndim - 1))).astype(np.float32)
    gap = np.abs(np.clip(refold, lo, hi) - np.clip(w_q, lo, hi)) / step
    far = int(np.count_nonzero(~(gap <= TOLERANCE_STEPS)))
    if far:
        raise fail(f"{far} of {gap.size} refolded weights (W * gamma / sqrt(var + eps)) are more than "
                   f"{TOLERANCE_STEPS} quantization steps from its weight (largest {float(np.nanmax(gap)):.3g}): "
                   "another model, or cross-layer equalization (quantize with equalize=False)")
    name = lambda src: consts[src].float_name if src in consts else src
    return BnPair(conv.name, name(w_src), name(b_src), values, eps)


def _grid(g: _Graph, src: str, path: list, consts: dict, w: np.ndarray):
    """(step, lowest, highest value) of the weight's grid, broadcast against it; a relative step when unquantized."""
    if src in consts:
        c = consts[src]
        s = g.array(c.scale).astype(np.float64)
        z = g.array(c.zero_point).astype(np.float64) if c.zero_point else np.zeros(s.shape)
        step = _broadcast(s, w.shape, c.axis, c.block_size)
        return (step, *(_broadcast((b - z) * s, w.shape, c.axis, c.block_size) for b in (c.lo, c.hi)))
    quantizer = g.producer.get(path[-2]) if len(path) > 1 else None
    scale = g.array(quantizer.input[1]) if quantizer is not None and is_quantizer(quantizer) else None
    if scale is None:
        return max(float(np.abs(w).max(initial=0)), 1e-30) * 1e-3, -np.inf, np.inf
    s = scale.astype(np.float64)
    if quantizer.op_type == "FakeQuant":  # scale, zero-point and bounds broadcast against the weight as they are
        z, qmin, qmax = (g.array(t) if t else None for t in [*quantizer.input, "", "", ""][2:5])
        z = np.zeros(()) if z is None else z.astype(np.float64)
        if qmin is None or qmax is None:
            return np.broadcast_to(s, w.shape), -np.inf, np.inf
        return np.broadcast_to(s, w.shape), (qmin - z) * s, (qmax - z) * s
    axis, block = _attr(quantizer, "axis", 1), _attr(quantizer, "block_size", 0)
    return _broadcast(s, w.shape, axis, block), -np.inf, np.inf


def rewrite(graph: onnx.GraphProto, nodes: list, bn: list[BnPair], momentum: float) -> tuple[list, list]:
    """The pairs in the training graph being built: their parameters as initializers of `graph` (in place of the
    tensors BnFold writes), and (BnFold nodes to run in front of everything, `nodes` with each pair's Conv without
    bias followed by BnApply)."""
    by_conv = {b.conv: b for b in bn}
    produced = {b.weight for b in bn} | {b.bias for b in bn}
    kept = [t for t in graph.initializer if t.name not in produced]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    front = []
    for b in bn:
        graph.initializer.extend(numpy_helper.from_array(b.values[k], b.name(k)) for k in KINDS)
        front.append(helper.make_node("BnFold", b.names, [b.weight, b.bias, b.factor], domain=DOMAIN,
                                      epsilon=b.eps, name=f"{DOMAIN}/bn_fold/{b.conv}"))
    out = []
    for n in nodes:
        b = by_conv.get(n.name) if n.op_type == "Conv" else None
        if b is None:
            out.append(n)
            continue
        conv = onnx.NodeProto()
        conv.CopyFrom(n)
        del conv.input[2:]
        conv.output[0] = b.conv_output
        out.append(conv)
        out.append(helper.make_node("BnApply", [b.conv_output, n.input[2], b.factor, *b.names[1:]],
                                    [n.output[0]], domain=DOMAIN, epsilon=b.eps, momentum=float(momentum),
                                    name=f"{DOMAIN}/bn_apply/{b.conv}"))
    return front, out


def bn_fold(attrs: NodeAttrs, inputs: list):
    """BnFold(W, b, gamma, beta, mean, var) -> (W * sf, b * sf + beta - mean * sf, sf), sf = gamma / sqrt(var + eps),
    computed in float64 as oq's fold pass does (so with nothing learned it gives the quantized model's weights)."""
    w, b, gamma, beta, mean, var = inputs
    f = gamma.double() / torch.sqrt(var.to(torch.float64, copy=True) + attrs.get("epsilon", 1e-5))
    w_fold = w.double() * f.reshape([-1] + [1] * (w.dim() - 1))
    b_fold = b.double() * f + (beta.double() - mean.to(torch.float64, copy=True) * f)
    return w_fold.to(w.dtype), b_fold.to(b.dtype), f.to(w.dtype)


def bn_apply(mode: BnMode, attrs: NodeAttrs, inputs: list):
    """BnApply(conv, folded bias, sf, b, gamma, beta, mean, var): BatchNormalization of the unscaled conv output
    with batch statistics (updating the running ones in place) while `mode.live`, else the conv plus the folded
    bias (as the exported model)."""
    y, bias, f, b, gamma, beta, mean, var = inputs
    view = [1, -1] + [1] * (y.dim() - 2)
    if not mode.live:
        return y + bias.reshape(view)
    # normalised with its own batch mean, conv / sf + b does not depend on b: b enters the running mean only, so
    # the statistics are those of conv / sf around mean - b (a pass over the activations fewer, and b gets no
    # gradient made of rounding noise, which Adam would blow up to steps of lr)
    with torch.no_grad():
        shifted = mean - b
    out = F.batch_norm(y / f.reshape(view), shifted, var, gamma, beta, training=True, momentum=attrs["momentum"],
                       eps=attrs["epsilon"])
    with torch.no_grad():
        mean.copy_(shifted + b)
    return out


__all__ = ["BnPair", "BnMode", "pairs", "rewrite", "bn_fold", "bn_apply", "KINDS", "LEARNED"]

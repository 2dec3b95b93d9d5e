"""An oq-quantized model as a trainable torch module (`QatModel`), and the write-back of what it learned.

The module runs, through the torch bridge, a training graph built from oq.bridge.qat_graph's plan: the model's own
nodes, where every DequantizeLinear reading a QuantizeLinear on the same grid, or reading an integer weight or bias,
is one fake-quant op (domain oq.qat) with a straight-through round, and in front of them a LearnedScale node per
scale group and a BiasScale node per int32 bias scale, writing the tensor names the original initializers had.
Everything the forward rounds is what onnxruntime computes on the exported model: the same float32 division,
rounding half to even and clamps, and scales, weight codes and int32 bias codes written back from the tensors the
forward used (so exporting with nothing learned gives the input model back, byte for byte). Given the float model,
Conv + BatchNormalization pairs train with batch statistics and fold back on export (oq.bridge.qat_bn).

Scales (LSQ, Esser et al. 2020): the gradient of fake quantization with a straight-through round is LSQ's, r - x/s
inside the grid and qmin - z or qmax - z outside. LSQ multiplies it by 1/sqrt(N qmax) to balance it against the
weights' gradients, but Adam divides every gradient by its own running RMS, which cancels any such constant; what it
does not cancel is that a step of lr is huge for a scale of 1e-4 and nothing for a scale of 1. So scales are learned
in the log domain, s = s0 * exp(t): a step changes any scale by the same factor, and it stays positive. Power-of-two
groups learn t = log2(s) with s = 2^ceil(t) and a straight-through ceil (TQT, as oq.bridge.fakequant's "pot").
Zero-points never change.
"""
from __future__ import annotations

import os
from functools import partial

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
import torch.nn.functional as F
from torch import nn

from . import dtypes, qat_bn, qat_graph
from .interpreter import to_torch
from .ops_quant import broadcast_qparam, quant_grid, quant_type
from .registry import NodeAttrs, OpDef, arg, builtin

DOMAIN = qat_graph.DOMAIN


def _sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad


class _FakeQuant(torch.autograd.Function):
    """(clamp(round(x / s) + z, lo, hi) - z) * s, QuantizeLinear then DequantizeLinear, computed as
    clamp(round(x / s), lo - z, hi - z) * s (the same integers), with a straight-through round:
    dy/dx = 1 and dy/ds = round(x/s) - x/s inside the grid; dy/dx = 0 and dy/ds = the clamped code outside."""

    @staticmethod
    def forward(ctx, x, s, z, lo, hi):
        if z is not None:
            lo, hi = lo - z, hi - z
        v = x / s
        r = torch.round(v)
        c = torch.clamp(r, lo, hi)
        ctx.save_for_backward(v, c, c == r, s)
        return c * s

    @staticmethod
    def backward(ctx, grad):
        v, c, inside, s = ctx.saved_tensors
        gx = torch.where(inside, grad, 0.0)
        gs = None
        if ctx.needs_input_grad[1] and s.numel() == 1:  # two dot products: half the passes over x of the below
            gs = (torch.dot(grad.reshape(-1), c.reshape(-1)) - torch.dot(gx.reshape(-1), v.reshape(-1))).reshape(s.shape)
        elif ctx.needs_input_grad[1]:
            gs = _sum_to(grad * c - gx * v, s)
        return (gx if ctx.needs_input_grad[0] else None), gs, None, None, None


class _Codes(torch.autograd.Function):
    """QuantizeLinear's codes clamp(round(x / s) + z, lo, hi), straight-through (for a Q whose codes are read by
    something other than its DequantizeLinear)."""

    @staticmethod
    def forward(ctx, x, s, z, lo, hi):
        v = x / s
        q = torch.round(v) if z is None else torch.round(v) + z
        c = torch.clamp(q, lo, hi)
        ctx.save_for_backward(v, s, c == q)
        return c

    @staticmethod
    def backward(ctx, grad):
        v, s, inside = ctx.saved_tensors
        g = torch.where(inside, grad, 0.0) / s
        return g, (_sum_to(-(g * v), s) if ctx.needs_input_grad[1] else None), None, None, None


class _CeilSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):
        return torch.ceil(u)

    @staticmethod
    def backward(ctx, grad):
        return grad


def codes(x, s, z, lo, hi) -> torch.Tensor:
    """QuantizeLinear's codes (no gradient), the integers _FakeQuant rounds to."""
    q = torch.round(x / s)
    return torch.clamp(q if z is None else q + z, lo, hi)


def _grid(attrs: NodeAttrs, inputs: list):
    """(x, scale, zero-point, lo, hi) of a QuantizeLinear-style node, broadcast against x, in x's float type."""
    x = inputs[0]
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    z = broadcast_qparam(arg(inputs, 2), x, axis, block)
    lo, hi = arg(inputs, 3), arg(inputs, 4)
    if lo is None:
        lo, hi = (float(attrs["qmin"]), float(attrs["qmax"])) if "qmin" in attrs else quant_grid(quant_type(attrs, z))
    else:
        lo, hi = (broadcast_qparam(b, x, axis, block).to(dtype) for b in (lo, hi))
    return (x.to(dtype), broadcast_qparam(inputs[1], x, axis, block).to(dtype), None if z is None else z.to(dtype),
            lo, hi)


def fake_quantize(attrs: NodeAttrs, inputs: list):
    """oq.qat FakeQuantize(x, scale, zero_point[, lo, hi]): a Q -> DQ pair, or a weight's codes dequantized."""
    return _FakeQuant.apply(*_grid(attrs, inputs))


def quantize_linear(attrs: NodeAttrs, inputs: list):
    return _Codes.apply(*_grid(attrs, inputs))


def _check_quantize(attrs: NodeAttrs) -> str | None:
    kind = quant_type(attrs)
    if kind not in dtypes.INT_RANGE or kind == onnx.TensorProto.INT32:
        return f"finetuning learns integer grids; quantizing to {dtypes.name(kind)} is not supported"
    return None


def fake_quant(attrs: NodeAttrs, inputs: list):
    """oq.FakeQuant(x, scale, zero_point, qmin, qmax), its function body with a straight-through round."""
    return _FakeQuant.apply(*inputs)


def learned_scale(attrs: NodeAttrs, inputs: list):
    t, base = inputs
    return torch.exp2(_CeilSTE.apply(base + t)) if attrs.get("pot", 0) else base * torch.exp(t)


def bias_scale(attrs: NodeAttrs, inputs: list):
    """float32(s_x * s_w) computed in float64, as oq writes int32 bias scales."""
    shape = list(attrs.get("shape", []))
    product = (inputs[0].double() * inputs[1].double()).float().reshape(-1)
    return product.reshape(shape) if product.numel() == int(np.prod(shape)) else product.expand(shape)


def clip(attrs: NodeAttrs, inputs: list):
    """Clip with constant bounds as hardtanh: the same values, and a backward of one pass instead of clamp's five
    with tensor bounds (ReLU6 sits on the widest tensors of mobile networks)."""
    lo, hi = arg(inputs, 1), arg(inputs, 2)
    if attrs.opset >= 11 and all(isinstance(b, torch.Tensor) and b.numel() == 1 and not b.requires_grad
                                 for b in (lo, hi)):
        return F.hardtanh(inputs[0], float(lo), float(hi))
    return builtin("Clip").fn(attrs, inputs)


OPS = {("", "QuantizeLinear"): OpDef(quantize_linear, _check_quantize), ("oq", "FakeQuant"): OpDef(fake_quant),
       ("", "Clip"): OpDef(clip),
       (DOMAIN, "FakeQuantize"): OpDef(fake_quantize), (DOMAIN, "LearnedScale"): OpDef(learned_scale),
       (DOMAIN, "BiasScale"): OpDef(bias_scale)}


def training_model(model: onnx.ModelProto, p: qat_graph.Plan, bn: list | None = None,
                   bn_momentum: float = 0.1) -> onnx.ModelProto:
    """The graph the bridge trains (see the module docstring), with `bn`'s Conv + BatchNormalization pairs
    unfolded (oq.bridge.qat_bn); not meant for onnxruntime."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    consts = {c.name: c for c in p.int_consts}
    fused = {a.output: a for a in p.activations if a.fused}
    replaced = {m for s in p.groups for m in s.members} | set(p.bias_scales) | set(consts)
    kept = [t for t in graph.initializer if t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    front = []
    for s in p.groups:
        graph.initializer.extend([numpy_helper.from_array(np.zeros(s.value.shape, np.float32), s.log_name),
                                  numpy_helper.from_array(s.base(), s.base_name)])
        front.append(helper.make_node("LearnedScale", [s.log_name, s.base_name], [s.key], domain=DOMAIN,
                                      pot=int(s.pot), name=f"{DOMAIN}/scale/{s.key}"))
        front.extend(helper.make_node("Identity", [s.key], [m], name=f"{DOMAIN}/tie/{m}") for m in s.members[1:])
    for name, (s_x, s_w, shape) in p.bias_scales.items():
        front.append(helper.make_node("BiasScale", [s_x, s_w], [name], domain=DOMAIN, shape=list(shape),
                                      name=f"{DOMAIN}/bias_scale/{name}"))
    for c in consts.values():
        graph.initializer.extend([numpy_helper.from_array(c.float_init, c.float_name),
                                  *(numpy_helper.from_array(b, n) for b, n in zip((c.lo, c.hi), c.bound_names))])
    nodes = []
    for n in graph.node:
        if n.op_type == "QuantizeLinear" and n.output[0] in fused:
            continue  # computed by its DequantizeLinear(s), below
        if n.op_type == "DequantizeLinear" and n.input[0] in fused:
            a = fused[n.input[0]]
            n = helper.make_node("FakeQuantize", [a.x, a.scale, a.zero_point or ""], list(n.output), domain=DOMAIN,
                                 axis=a.axis, block_size=a.block_size, qmin=a.qmin, qmax=a.qmax, name=n.name)
        elif n.op_type == "DequantizeLinear" and n.input[0] in consts:
            c = consts[n.input[0]]
            n = helper.make_node("FakeQuantize", [c.float_name, c.scale, c.zero_point or "", *c.bound_names],
                                 list(n.output), domain=DOMAIN, axis=c.axis, block_size=c.block_size, name=n.name)
        nodes.append(n)
    if bn:
        bn_front, nodes = qat_bn.rewrite(graph, nodes, bn, bn_momentum)
        front.extend(bn_front)
    del graph.node[:]
    graph.node.extend(front + nodes)  # parameters first: everything else may read them
    out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return out


class QatModel(nn.Module):
    """An oq-quantized model (ModelProto or path) as a trainable torch module; `export()` gives the ONNX model back
    with what it learned. `weights()`: the learned weights and biases; `scales()`: the scale parameters (log domain);
    `codes(*inputs)`: the QuantizeLinear codes of a forward, by the Q nodes' output names; `quantize(values)`: the
    codes for given Q inputs. With `float_model` (the model before oq folded BatchNormalization), Conv +
    BatchNormalization pairs train with batch statistics (oq.bridge.qat_bn, `bn_pairs`); `freeze_bn()` stops the
    statistics for good, eval mode uses the running ones."""

    def __init__(self, model: "onnx.ModelProto | str | os.PathLike", float_model=None, bn_momentum: float = 0.1):
        super().__init__()
        if not isinstance(model, onnx.ModelProto):
            from ..ir import load_model
            model = load_model(model)
        self.source = onnx.ModelProto()
        self.source.CopyFrom(model)  # the caller's model is never touched
        self.plan = qat_graph.plan(self.source)
        self.bn_pairs = [] if float_model is None else qat_bn.pairs(self.source, self.plan, float_model)
        self._bn_mode = qat_bn.BnMode()
        ops = OPS
        if self.bn_pairs:  # the mode is this module's own: train(), eval() and freeze_bn() set it
            ops = {**OPS, (DOMAIN, "BnFold"): OpDef(qat_bn.bn_fold),
                   (DOMAIN, "BnApply"): OpDef(partial(qat_bn.bn_apply, self._bn_mode))}
        self.module = to_torch(training_model(self.source, self.plan, self.bn_pairs, bn_momentum), ops=ops)
        for name in (b.name(k) for b in self.bn_pairs for k in ("mean", "var")):  # running statistics: buffers
            attr = self.module.attribute_name(name)
            value = getattr(self.module, attr).detach()
            delattr(self.module, attr)
            self.module.register_buffer(attr, value)
        learned = set(self.plan.trainable) | {c.float_name for c in self.plan.int_consts}
        learned |= {b.name(k) for b in self.bn_pairs for k in qat_bn.LEARNED}
        self._scale_names = [s.log_name for s in self.plan.groups]
        for name, param in self.module.initializer_parameters().items():
            param.requires_grad_(name in learned or name in self._scale_names)
        self._weight_names = [n for n in self.module.initializer_parameters() if n in learned]
        self._group_of = self.plan.group_of()

    def weights(self) -> list[nn.Parameter]:
        return [self.module.parameter_for(n) for n in self._weight_names]

    def scales(self) -> list[nn.Parameter]:
        return [self.module.parameter_for(n) for n in self._scale_names]

    def forward(self, *inputs):
        return self.module(*inputs)

    def train(self, mode: bool = True) -> "QatModel":
        super().train(mode)
        self._bn_mode.live = bool(mode) and not self._bn_mode.frozen
        return self

    def freeze_bn(self) -> None:
        """From now on BatchNormalization uses (and keeps) its running statistics, also in training mode."""
        self._bn_mode.frozen, self._bn_mode.live = True, False

    def _folded(self) -> dict[str, torch.Tensor]:
        """The tensors BnFold writes (folded weights and biases), from the current parameters."""
        out = {}
        for b in self.bn_pairs:
            w, bias, _ = qat_bn.bn_fold(NodeAttrs({"epsilon": b.eps}, op_type="BnFold"),
                                        [self.module.tensor_for(n) for n in b.names])
            out[b.weight], out[b.bias] = w, bias
        return out

    def _value(self, name: str, cache: dict) -> torch.Tensor:
        """A scale of the training graph, as its forward computes it."""
        if name not in cache:
            p, m = self.plan, self.module
            group = self._group_of.get(name)
            if group is not None:
                cache[name] = learned_scale(NodeAttrs({"pot": int(group.pot)}, op_type="LearnedScale"),
                                            [m.tensor_for(group.log_name), m.tensor_for(group.base_name)])
            elif name in p.bias_scales:
                s_x, s_w, shape = p.bias_scales[name]
                cache[name] = bias_scale(NodeAttrs({"shape": list(shape)}, op_type="BiasScale"),
                                         [self._value(s_x, cache), self._value(s_w, cache)])
            else:
                cache[name] = m.tensor_for(name)
        return cache[name]

    def _codes(self, x, scale, zero_point, axis, block, bounds, cache) -> torch.Tensor:
        m, s = self.module, self._value(scale, cache)
        inputs = [torch.as_tensor(x, device=s.device), s, m.tensor_for(zero_point) if zero_point else None, *bounds]
        attrs = NodeAttrs({"axis": axis, "block_size": block}, op_type="QuantizeLinear")
        if len(bounds) == 2 and not isinstance(bounds[0], torch.Tensor):
            attrs.update(qmin=bounds[0], qmax=bounds[1])
            inputs = inputs[:3]
        return codes(*_grid(attrs, inputs))

    @torch.no_grad()
    def codes(self, *inputs) -> dict[str, torch.Tensor]:
        _, values = self.module(*inputs, return_values=[a.x for a in self.plan.activations])
        return self.quantize(values)

    @torch.no_grad()
    def quantize(self, values: dict) -> dict[str, torch.Tensor]:
        """The codes each QuantizeLinear gives (by output name) for its input's value in `values` (by input name)."""
        cache: dict = {}
        return {a.output: self._codes(values[a.x], a.scale, a.zero_point, a.axis, a.block_size,
                                      (a.qmin, a.qmax), cache) for a in self.plan.activations if a.x in values}

    @torch.no_grad()
    def learned_values(self) -> dict[str, np.ndarray]:
        """Initializer name (of the original model) -> value to write: scales, codes, weights."""
        p, m, cache, folded = self.plan, self.module, {}, self._folded()
        value = lambda name: folded[name] if name in folded else m.tensor_for(name)
        out = {name: self._value(name, cache) for g in p.groups for name in g.members}
        out.update({name: self._value(name, cache) for name in p.bias_scales})
        for c in p.int_consts:
            bounds = [m.tensor_for(b) for b in c.bound_names]
            out[c.name] = self._codes(value(c.float_name), c.scale, c.zero_point, c.axis, c.block_size,
                                      bounds, cache).to(torch.int64)
        out.update({name: value(name).float() for name in p.trainable})
        return {k: v.detach().cpu().numpy() for k, v in out.items()}

    def export(self, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
        """The input model with the learned scales, weight codes, int32 biases and float weights written in."""
        return write_back(self.source, self.learned_values(), metadata or {})


def write_back(model: onnx.ModelProto, values: dict[str, np.ndarray], metadata: dict[str, str]) -> onnx.ModelProto:
    """A copy of `model` with initializers replaced by `values` (same names, element types and shapes; unchanged
    values keep their bytes) and `metadata` added to its metadata_props."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, init in enumerate(out.graph.initializer):
        if init.name in values:
            new = _tensor(init, values[init.name])
            if not np.array_equal(numpy_helper.to_array(new), numpy_helper.to_array(init)):
                out.graph.initializer[i].CopyFrom(new)
    props = {p.key: p.value for p in out.metadata_props}
    props.update(metadata)
    del out.metadata_props[:]
    for k, v in props.items():
        out.metadata_props.add(key=k, value=v)
    return out


def _tensor(like: onnx.TensorProto, value: np.ndarray) -> onnx.TensorProto:
    dims = list(like.dims)
    value = np.asarray(value).reshape(dims)
    np_dtype = helper.tensor_dtype_to_np_dtype(like.data_type)  # ml_dtypes' int4/uint4/bfloat16: stored packed
    if value.dtype.kind == "f" and np_dtype.kind in "iu":
        value = np.rint(value)
    return numpy_helper.from_array(np.array(value, dtype=np_dtype, order="C"), like.name)


__all__ = ["QatModel", "OPS", "training_model", "write_back", "codes"]

"""What quantization-aware finetuning learns in a quantized model (read with onnx and numpy only).

`plan(model)` reads an oq-quantized model (QuantizeLinear/DequantizeLinear pairs, or oq.FakeQuant nodes):

- **scale groups**: every float32 scale initializer of a Q, DQ or FakeQuant, learned as one parameter per group.
  Initializers are tied into one group when the graph made them share: a DQ and the Q it reads, or quantizers joined
  only through data-movement ops (MaxPool, Concat, Reshape, ...), holding bit-equal scales and zero-points (oq's
  targets give such neighbours one scale; equal float32 scales from separate calibrations do not otherwise occur).
  A group whose values are all powers of two stays a power of two.
- **integer constants**: an integer initializer read by DequantizeLinear (a weight, or an int32 bias) becomes a
  float parameter w = (q - z) * s, quantized again in every forward; an int32 bias whose scale is the product of
  its layer's input and weight scales (as oq writes it) has that scale re-derived from the learned ones.
- **trainable floats**: float initializers that are weights or biases of Conv/ConvTranspose/Gemm/MatMul, parameters
  of normalisation layers, or a MatMul's bias Add; every other float constant (zero-points, Clip bounds, Resize
  scales, ...) stays fixed.
- **pairs**: a QuantizeLinear read only by DequantizeLinear nodes on its own grid, trained as one fake-quant op.

oq.bridge.qat_module builds the training graph from the plan and writes the learned values back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from ..errors import OqError
from ..plan import UnionFind
from .dtypes import INT_RANGE

DOMAIN = "oq.qat"
QUANTIZERS = ("QuantizeLinear", "DequantizeLinear")
# Ops that move quantized values without changing them: quantizers joined only through these share a scale.
MOVEMENT = {"MaxPool", "Concat", "Flatten", "Reshape", "Transpose", "Resize", "Upsample", "Squeeze", "Unsqueeze",
            "Identity", "Slice", "Split", "Pad", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "Gather"}
# Inputs that hold learned weights: op -> input indices.
WEIGHT_INPUTS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (0, 1, 2), "MatMul": (0, 1),
                 "LayerNormalization": (1, 2), "BatchNormalization": (1, 2), "InstanceNormalization": (1, 2),
                 "GroupNormalization": (1, 2), "PRelu": (1,)}
LINEAR = ("MatMul", "Gemm", "Conv", "ConvTranspose")
BIAS_OPS = ("Conv", "ConvTranspose", "Gemm")
# int32 bias codes stay where float32 holds the clamp bound exactly
INT32_LIMIT = 2**31 - 2**7


@dataclass
class ScaleGroup:
    key: str  # the representative initializer: the LearnedScale node writes this name
    members: list[str]  # every initializer of the group (key first), all with the same values
    value: np.ndarray  # float32, the initial scale
    pot: bool  # every value a power of two: learned as log2, kept a power of two

    log_name = property(lambda self: f"{DOMAIN}.log/{self.key}")  # the learned parameter t
    base_name = property(lambda self: f"{DOMAIN}.base/{self.key}")  # the fixed starting point

    def base(self) -> np.ndarray:
        # log2 mode starts halfway inside the interval that ceil maps to the initial power, so a small step either
        # way keeps it; linear mode multiplies the initial scale by exp(t), exactly 1 at t = 0
        return (np.log2(self.value) - 0.5).astype(np.float32) if self.pot else self.value


@dataclass
class IntConst:
    name: str  # the integer initializer
    scale: str  # scale tensor read by its DequantizeLinear(s)
    zero_point: str | None
    axis: int
    block_size: int
    lo: np.ndarray  # int64 code bounds, shaped as the scale
    hi: np.ndarray
    float_init: np.ndarray  # float32 (q - z) * s

    float_name = property(lambda self: f"{DOMAIN}.float/{self.name}")
    bound_names = property(lambda self: (f"{DOMAIN}.lo/{self.name}", f"{DOMAIN}.hi/{self.name}"))


@dataclass
class Pair:
    """A QuantizeLinear node on a run-time tensor; `fused` when only DequantizeLinear nodes on its own grid read it."""
    output: str
    x: str
    scale: str
    zero_point: str | None
    axis: int
    block_size: int
    qmin: int
    qmax: int
    fused: bool


@dataclass
class Plan:
    groups: list[ScaleGroup] = field(default_factory=list)
    int_consts: list[IntConst] = field(default_factory=list)
    bias_scales: dict[str, tuple[str, str, tuple]] = field(default_factory=dict)  # name -> (s_x, s_w, shape)
    trainable: list[str] = field(default_factory=list)  # float initializers learned as they are
    activations: list["Pair"] = field(default_factory=list)  # QuantizeLinear nodes on run-time tensors
    input_specs: list[tuple[str, int, list]] = field(default_factory=list)  # graph inputs: name, type, dims

    def group_of(self) -> dict[str, ScaleGroup]:
        return {m: g for g in self.groups for m in g.members}


class _Graph:
    """Indexes of one GraphProto."""

    def __init__(self, graph: onnx.GraphProto):
        self.inits = {t.name: t for t in graph.initializer}
        self.nodes = list(graph.node)
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for n in self.nodes:
            for i, name in enumerate(n.input):
                if name:
                    self.readers.setdefault(name, []).append((n, i))
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str) -> np.ndarray | None:
        if name in self.inits and name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.inits[name])
        return self._arrays.get(name)

    def is_const(self, name: str) -> bool:
        return name in self.inits


def is_quantizer(node: onnx.NodeProto) -> bool:
    return (node.domain in ("", "ai.onnx") and node.op_type in QUANTIZERS) or \
        (node.domain == "oq" and node.op_type == "FakeQuant")


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def plan(model: onnx.ModelProto) -> Plan:
    g = _Graph(model.graph)
    quantizers = [n for n in g.nodes if is_quantizer(n)]
    if not quantizers:
        raise OqError("the model has no QuantizeLinear/DequantizeLinear or oq.FakeQuant nodes: finetune takes a "
                      "model quantized by oq (oq.quantize, or oq run)")
    out = Plan(input_specs=_input_specs(model.graph, g))
    bias_scale_inits = _bias_scales(g, out)
    out.groups = _groups(g, quantizers, bias_scale_inits)
    out.int_consts = _int_consts(g, out)
    out.trainable = _trainable(g, {c.name for c in out.int_consts})
    out.activations = _activations(g, {o.name for o in model.graph.output})
    return out


def _activations(g: _Graph, graph_outputs: set[str]) -> list[Pair]:
    found = []
    for n in g.nodes:
        if n.op_type != "QuantizeLinear" or n.domain not in ("", "ai.onnx") or g.is_const(n.input[0]):
            continue
        zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
        kind = g.inits[zp].data_type if zp in g.inits else None if zp else (_attr(n, "output_dtype", 0) or T.UINT8)
        if kind not in INT_RANGE or kind == T.INT32 or not g.is_const(n.input[1]):
            continue  # FP8, or a computed grid: the bridge refuses or runs it as it is
        grid = (tuple(n.input[1:3]), _attr(n, "axis", 1), _attr(n, "block_size", 0))
        readers = g.readers.get(n.output[0], [])
        fused = bool(readers) and n.output[0] not in graph_outputs and all(
            r.op_type == "DequantizeLinear" and i == 0 and
            (tuple(r.input[1:3]), _attr(r, "axis", 1), _attr(r, "block_size", 0)) == grid for r, i in readers)
        found.append(Pair(n.output[0], n.input[0], n.input[1], zp, grid[1], grid[2], *INT_RANGE[kind], fused))
    return found


def _input_specs(graph: onnx.GraphProto, g: _Graph) -> list:
    specs = []
    for vi in graph.input:
        if vi.name in g.inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] \
            if tt.HasField("shape") else None
        specs.append((vi.name, tt.elem_type, dims))
    return specs


def _bias_scales(g: _Graph, out: Plan) -> set[str]:
    """Scales of int32 bias DQs; those equal to s_x * s_w (computed as oq does) are re-derived in training."""
    found = set()
    for n in g.nodes:
        if n.op_type != "DequantizeLinear" or not g.is_const(n.input[0]) or len(n.input) < 2:
            continue
        if g.inits[n.input[0]].data_type != T.INT32 or not g.is_const(n.input[1]):
            continue
        s_b = n.input[1]
        found.add(s_b)
        readers = g.readers.get(n.output[0], [])
        if len(readers) != 1 or readers[0][0].op_type not in BIAS_OPS or readers[0][1] != 2:
            continue
        layer = readers[0][0]
        dqs = [g.producer.get(t) for t in layer.input[:2]]
        if any(d is None or d.op_type != "DequantizeLinear" or g.inits.get(d.input[1], T()).data_type != T.FLOAT
               for d in dqs):
            continue
        s_x, s_w = dqs[0].input[1], dqs[1].input[1]
        have = g.array(s_b)
        want = bias_scale(g.array(s_x), g.array(s_w), have.shape)
        if want is not None and np.allclose(want, have, rtol=1e-6, atol=0):
            out.bias_scales[s_b] = (s_x, s_w, tuple(have.shape))
    return found


def bias_scale(s_x: np.ndarray, s_w: np.ndarray, shape) -> np.ndarray | None:
    """float32(s_x * s_w) computed in float64, as oq's insert-qdq does, laid out as `shape`; None if it cannot be."""
    product = (np.asarray(s_x, np.float64) * np.asarray(s_w, np.float64)).astype(np.float32).reshape(-1)
    if product.size == int(np.prod(shape, dtype=np.int64)) or product.size == 1:
        return np.broadcast_to(product, shape).copy() if product.size == 1 else product.reshape(shape)
    return None


def _upstream(g: _Graph, tensor: str, depth: int = 0) -> list[onnx.NodeProto]:
    """Quantizers whose output reaches `tensor` through data-movement ops only."""
    p = g.producer.get(tensor)
    if p is None or depth > 32:
        return []
    if is_quantizer(p):
        return [p]
    if p.op_type not in MOVEMENT or p.domain not in ("", "ai.onnx"):
        return []
    data = p.input if p.op_type == "Concat" else p.input[:1]
    return [q for name in data if name and not g.is_const(name) for q in _upstream(g, name, depth + 1)]


def _same_grid(g: _Graph, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
    """Bit-equal scales, zero-points (and FakeQuant bounds), and the same element types."""
    if (a.op_type == "FakeQuant") != (b.op_type == "FakeQuant"):
        return False
    n = 5 if a.op_type == "FakeQuant" else 3
    for i in range(1, n):
        x = a.input[i] if i < len(a.input) else ""
        y = b.input[i] if i < len(b.input) else ""
        if x == y:
            continue
        vx, vy = g.array(x), g.array(y)
        if vx is None or vy is None or g.inits[x].data_type != g.inits[y].data_type or vx.shape != vy.shape \
                or not np.array_equal(vx, vy):
            return False
    return True


def _groups(g: _Graph, quantizers: list, excluded: set[str]) -> list[ScaleGroup]:
    learnable = {n.input[1] for n in quantizers if len(n.input) > 1 and g.is_const(n.input[1])
                 and g.inits[n.input[1]].data_type == T.FLOAT and n.input[1] not in excluded}
    uf = UnionFind()
    for name in sorted(learnable):
        uf.find(name)
    for node in quantizers:
        if g.is_const(node.input[0]) or node.input[1] not in learnable:
            continue
        for other in _upstream(g, node.input[0]):
            if other.input[1] in learnable and _same_grid(g, node, other):
                uf.union(other.input[1], node.input[1])
    order = {name: i for i, name in enumerate(t.name for t in g.inits.values())}
    groups = []
    for members in uf.groups().values():
        members = sorted(members, key=order.__getitem__)
        value = g.array(members[0]).astype(np.float32)
        pot = bool(value.size) and bool(np.all(value > 0)) and bool(np.all(np.frexp(value)[0] == 0.5))
        groups.append(ScaleGroup(members[0], members, value, pot))
    return sorted(groups, key=lambda s: order[s.key])


def _int_consts(g: _Graph, out: Plan) -> list[IntConst]:
    learned_scale = {m for s in out.groups for m in s.members} | set(out.bias_scales)
    weights = _weight_chains(g)
    found = []
    for name, init in g.inits.items():
        if init.data_type not in INT_RANGE:
            continue
        readers = g.readers.get(name, [])
        if not readers or any(n.op_type != "DequantizeLinear" or i != 0 for n, i in readers):
            continue
        first = readers[0][0]
        keys = {(tuple(n.input[1:]), _attr(n, "axis", 1), _attr(n, "block_size", 0)) for n, _ in readers}
        scale = first.input[1]
        if len(keys) != 1 or not (scale in learned_scale or g.is_const(scale) and g.inits[scale].data_type == T.FLOAT):
            continue  # read with several grids, or through a computed or non-float32 scale: left as it is
        if not any(n.output[0] in weights for n, _ in readers):
            continue
        zp = first.input[2] if len(first.input) > 2 and first.input[2] else None
        found.append(_int_const(g, name, init.data_type, scale, zp, _attr(first, "axis", 1),
                                _attr(first, "block_size", 0)))
    return found


def _int_const(g: _Graph, name: str, elem_type: int, scale: str, zp: str | None, axis: int, block: int) -> IntConst:
    codes = g.array(name).astype(np.int64)
    s = g.array(scale).astype(np.float32)
    z = g.array(zp).astype(np.int64) if zp else np.zeros(s.shape, np.int64)
    s_b, z_b = _broadcast(s, codes.shape, axis, block), _broadcast(z, codes.shape, axis, block)
    w = ((codes - z_b).astype(np.float32) * s_b).astype(np.float32)
    if elem_type == T.INT32:
        lo, hi = np.full(s.shape, -INT32_LIMIT, np.int64), np.full(s.shape, INT32_LIMIT, np.int64)
    else:
        # codes never go past the largest |q - z| the model has among the values sharing a scale: a narrow range
        # (-127..127), 4-bit codes held in 8-bit containers and a saturation guard's 7-bit channels all stay so
        qmin, qmax = INT_RANGE[elem_type]
        reach = _reduce_max(np.abs(codes - z_b), s.shape, axis, block)
        zs = np.broadcast_to(z, s.shape)
        lo, hi = np.maximum(qmin, zs - reach), np.minimum(qmax, zs + reach)
    return IntConst(name, scale, zp, axis, block, lo.astype(np.int64), hi.astype(np.int64), w)


def _broadcast(value: np.ndarray, shape, axis: int, block: int) -> np.ndarray:
    """A scale-shaped value against a tensor of `shape` (per tensor, per axis, per block)."""
    if value.size == 1 and block <= 0:
        return value.reshape(())
    axis %= len(shape)
    if block > 0:
        return np.repeat(value, block, axis=axis).take(np.arange(shape[axis]), axis=axis)
    view = [1] * len(shape)
    view[axis] = value.size
    return value.reshape(view)


def _reduce_max(a: np.ndarray, scale_shape, axis: int, block: int) -> np.ndarray:
    if int(np.prod(scale_shape, dtype=np.int64)) == 1 and block <= 0:
        return np.asarray(a.max(initial=0)).reshape(scale_shape)
    axis %= a.ndim
    if block > 0:
        return np.maximum.reduceat(a, np.arange(0, a.shape[axis], block), axis=axis).reshape(scale_shape)
    other = tuple(i for i in range(a.ndim) if i != axis)
    return a.max(axis=other, initial=0).reshape(scale_shape)


def _chain(g: _Graph, tensor: str) -> tuple[str | None, list[str]]:
    """(the initializer a weight input comes from through its quantizers or None, the tensors on the way)."""
    path = [tensor]
    while not g.is_const(path[-1]):
        p = g.producer.get(path[-1])
        if p is None or not is_quantizer(p) or len(path) > 8:
            return None, path
        path.append(p.input[0])
    return path[-1], path


def _weight_inputs(g: _Graph):
    for n in g.nodes:
        if n.domain not in ("", "ai.onnx"):
            continue
        for i in WEIGHT_INPUTS.get(n.op_type, ()):
            if i < len(n.input) and n.input[i]:
                yield n.input[i]
        if n.op_type in ("Add", "Sub") and len(n.input) == 2:  # the bias of an exported Linear: MatMul + Add
            for i, other in ((0, 1), (1, 0)):
                p = g.producer.get(n.input[other])
                if p is not None and p.op_type in LINEAR:
                    yield n.input[i]


def _weight_chains(g: _Graph) -> set[str]:
    """Every tensor between an initializer and a weight input it feeds through quantizers."""
    return {t for w in _weight_inputs(g) for src, path in [_chain(g, w)] if src is not None for t in path}


def _trainable(g: _Graph, int_consts: set[str]) -> list[str]:
    found = []
    for t in _weight_inputs(g):
        src = _chain(g, t)[0]
        if src is not None and src not in int_consts and src not in found \
                and g.inits[src].data_type in (T.FLOAT, T.FLOAT16, T.DOUBLE, T.BFLOAT16):
            found.append(src)
    return found


__all__ = ["plan", "Plan", "ScaleGroup", "IntConst", "Pair", "bias_scale", "DOMAIN"]

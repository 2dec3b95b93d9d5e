"""u8 x s8 layers as onnxruntime's kernels see them: weights in GEMM form and activations as GEMM rows, in the
kernels' K order; and finding such layers in a QDQ (or QOperator) model."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from ..opinfo import weighted_op
from .pairs import largest, pair_excess


def gemm_weights(op: str, w: np.ndarray, attrs: dict) -> np.ndarray:
    """Weight as [G, K, N_per_group] with K in the order onnxruntime's kernels pair it (oq.opinfo's gemm_weight)."""
    info = weighted_op(op)
    if info is None or info.gemm_weight is None:
        raise ValueError(op)
    wg = info.gemm_weight(gs.Node(op, attrs=attrs), np.asarray(w))
    if wg is None:
        raise ValueError(f"{op} weight with batch dimensions")
    return wg


@dataclass
class ConvGeometry:
    kernel: tuple
    strides: tuple
    dilations: tuple
    pads: tuple  # begin..., end...
    auto_pad: str
    group: int

    @classmethod
    def from_attrs(cls, attrs: dict, w_shape) -> "ConvGeometry":
        kernel = tuple(int(k) for k in (attrs.get("kernel_shape") or w_shape[2:]))
        d = len(kernel)
        auto_pad = attrs.get("auto_pad", "NOTSET")
        if isinstance(auto_pad, bytes):
            auto_pad = auto_pad.decode()
        return cls(kernel, tuple(int(s) for s in (attrs.get("strides") or [1] * d)),
                   tuple(int(s) for s in (attrs.get("dilations") or [1] * d)),
                   tuple(int(p) for p in (attrs.get("pads") or [0] * (2 * d))), auto_pad or "NOTSET",
                   int(attrs.get("group", 1)))

    def pads_for(self, spatial) -> tuple[list[int], list[int]]:
        d = len(self.kernel)
        if self.auto_pad in ("NOTSET", ""):
            return list(self.pads[:d]), list(self.pads[d:])
        if self.auto_pad == "VALID":
            return [0] * d, [0] * d
        begin, end = [], []
        for s, k, st, dl in zip(spatial, self.kernel, self.strides, self.dilations):
            total = max((math.ceil(s / st) - 1) * st + (k - 1) * dl + 1 - s, 0)
            small = total // 2
            begin.append(small if self.auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        return begin, end

    def out_spatial(self, spatial) -> list[int]:
        pb, pe = self.pads_for(spatial)
        return [(s + b + e - dl * (k - 1) - 1) // st + 1
                for s, b, e, k, st, dl in zip(spatial, pb, pe, self.kernel, self.strides, self.dilations)]


@dataclass
class IntLayer:
    """One u8-activation x s8-weight layer as onnxruntime runs it."""

    name: str
    op: str  # Conv, MatMul or Gemm
    x: str  # name of the uint8 activation tensor (or of the float tensor it is quantized from, in a plan)
    y: str  # name of the layer's output
    x_scale: float
    x_zp: int
    w_q: np.ndarray  # int8, the op's own layout
    w_scale: np.ndarray  # float32 [channels]
    attrs: dict = field(default_factory=dict)
    alpha: float = 1.0
    # int8 activations: onnxruntime's QDQ optimizer turns them into uint8 (value + 128, zero point + 128) on x86
    # (QDQS8ToU8Transformer) before fusing, so the kernel sees x + 128; x_zp above is already shifted.
    x_offset: int = 0
    wg: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.w_q = np.asarray(self.w_q)
        self.wg = gemm_weights(self.op, self.w_q, self.attrs)
        self.w_scale = np.broadcast_to(np.asarray(self.w_scale, np.float32).reshape(-1), (self.channels,)).copy()
        self.geometry = ConvGeometry.from_attrs(self.attrs, self.w_q.shape) if self.op == "Conv" else None

    @property
    def groups(self) -> int:
        return self.wg.shape[0]

    @property
    def k(self) -> int:
        return self.wg.shape[1]

    @property
    def channels(self) -> int:
        return self.wg.shape[0] * self.wg.shape[2]

    @property
    def exact_kernel(self) -> str | None:
        """Why onnxruntime runs this layer without pair saturation, or None."""
        if self.op == "Conv" and self.groups > 1 and self.wg.shape[1] == int(np.prod(self.geometry.kernel)) \
                and self.wg.shape[2] == 1:
            return "depthwise: exact int32 kernel"
        return None

    # -- activations as GEMM rows ---------------------------------------------------------------------------
    def _as_rows_input(self, x: np.ndarray) -> np.ndarray:
        if self.op == "Gemm":
            return x.T if self.attrs.get("transA", 0) else x
        return x

    def row_count(self, x_shape) -> int:
        if self.op == "Conv":
            return int(x_shape[0]) * int(np.prod(self.geometry.out_spatial(x_shape[2:])))
        if self.op == "Gemm":
            return int(x_shape[1] if self.attrs.get("transA", 0) else x_shape[0])
        return int(np.prod(x_shape[:-1]))

    def rows(self, x: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """u8 GEMM rows [G, R, K] (K in the kernel's order) for row indices `idx` (default: all)."""
        x = np.asarray(x)
        if self.x_offset:
            x = (x.astype(np.int16) + self.x_offset).astype(np.uint8)
        if self.op != "Conv":
            flat = self._as_rows_input(x).reshape(-1, self.k)
            return (flat if idx is None else flat[idx])[None]
        geo = self.geometry
        n, c = x.shape[:2]
        spatial = x.shape[2:]
        pb, pe = geo.pads_for(spatial)
        out = geo.out_spatial(spatial)
        xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(pb, pe)), constant_values=self.x_zp)
        if idx is None:
            idx = np.arange(n * int(np.prod(out)))
        coords = np.unravel_index(idx, (n, *out))
        taps = np.array(list(itertools.product(*[range(k) for k in geo.kernel])), dtype=np.int64)  # [T, D]
        sp = [coords[1 + d][:, None] * geo.strides[d] + taps[None, :, d] * geo.dilations[d]
              for d in range(len(out))]
        cg = c // self.groups
        groups = []
        for g in range(self.groups):
            ch = np.arange(g * cg, (g + 1) * cg)
            sel = (coords[0][:, None, None], ch[None, None, :]) + tuple(s[:, :, None] for s in sp)
            groups.append(xp[sel].reshape(len(idx), -1))  # [R, T, Cg] -> [R, T*Cg]
        return np.stack(groups)

    def place(self, values: np.ndarray, x_shape) -> np.ndarray:
        """Per-row, per-channel values [R_all, C] into the layout of the layer's output."""
        if self.op == "Conv":
            out = self.geometry.out_spatial(x_shape[2:])
            return np.moveaxis(values.reshape(int(x_shape[0]), *out, self.channels), -1, 1)
        if self.op == "Gemm":
            return values
        return values.reshape(*x_shape[:-1], self.channels)

    # -- arithmetic ----------------------------------------------------------------------------------------
    def excess(self, a: np.ndarray) -> tuple[np.ndarray, int]:
        """(saturated - exact) accumulators [R, C] for rows a [G, R, K], and the count of saturated pairs."""
        parts, count = [], 0
        amax = largest(a)
        for g in range(self.groups):
            e, c = pair_excess(a[g], self.wg[g], amax)
            parts.append(e)
            count += c
        return np.concatenate(parts, axis=1), count

    def exact(self, a: np.ndarray) -> np.ndarray:
        """Zero-point-corrected exact accumulators sum((a - zp) * w) [R, C] (float64)."""
        return np.concatenate([(a[g].astype(np.float64) - self.x_zp) @ self.wg[g].astype(np.float64)
                               for g in range(self.groups)], axis=1)

    @property
    def out_scale(self) -> np.ndarray:
        return (np.float64(self.x_scale) * self.w_scale.astype(np.float64)) * self.alpha

    def correction(self, x: np.ndarray) -> np.ndarray:
        """What pair saturation adds to the layer's float output for activation x (whole tensor), float32."""
        if self.exact_kernel:
            return np.zeros((), np.float32)
        e, count = self.excess(self.rows(x))
        if count == 0:
            return np.zeros((), np.float32)
        return self.place((e * self.out_scale).astype(np.float32), x.shape)


# ---------------------------------------------------------------------------------------------------------------
# finding u8 x s8 layers in a QDQ (or QOperator) model
# ---------------------------------------------------------------------------------------------------------------

def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


class _Consts:
    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.values = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        for n in g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        self.producer = {o: n for n in g.node for o in n.output}

    def get(self, name: str):
        return self.values.get(name) if name else None


_QLINEAR_BASE = {"QLinearConv": "Conv", "QLinearMatMul": "MatMul"}  # integer ops and the float op they compute


def find_layers(model: onnx.ModelProto) -> tuple[list[IntLayer], list[tuple[str, str, str]]]:
    """u8 x s8 layers of a QDQ model (Conv/MatMul/Gemm reading DQ(uint8 activation) and DQ(int8 constant weight)),
    plus QLinearConv / QLinearMatMul. Returns (layers, skipped) with skipped = [(node, op, why)]."""
    consts = _Consts(model)
    layers, skipped = [], []
    for node in model.graph.node:
        op = node.op_type
        base = _QLINEAR_BASE.get(op, op)
        info = weighted_op(base)
        if info is None or info.gemm_weight is None or node.domain not in ("", "ai.onnx"):
            continue
        name = node.name or node.output[0]
        attrs = _attrs(node)
        layer_node = gs.Node(base, attrs=attrs)
        if op in _QLINEAR_BASE:
            x, xs, xz, w, ws, wz = node.input[:6]
            zp = consts.get(xz)
            wq, wsv, wzv, xsv = consts.get(w), consts.get(ws), consts.get(wz), consts.get(xs)
        else:
            x_dq, w_dq = (consts.producer.get(i) for i in node.input[:2])
            if x_dq is None or x_dq.op_type != "DequantizeLinear" or len(x_dq.input) < 3:
                continue  # a float layer
            if w_dq is None or w_dq.op_type != "DequantizeLinear":
                skipped.append((name, op, "weight is not dequantized"))
                continue
            if consts.get(w_dq.input[0]) is None:
                skipped.append((name, op, "activation x activation: u8 x u8 kernel on x86, exact"))
                continue
            x, xsv, zp = x_dq.input[0], consts.get(x_dq.input[1]), consts.get(x_dq.input[2])
            wq, wsv = consts.get(w_dq.input[0]), consts.get(w_dq.input[1])
            wzv = consts.get(w_dq.input[2]) if len(w_dq.input) > 2 else None
            w_axis = _attrs(w_dq).get("axis", 1)
            # the output-channel axis of a 2-D weight: a MatMul weight with batch dimensions is checked on axis 1
            if wq is not None and wsv is not None and np.size(wsv) > 1 and wq.ndim and \
                    w_axis % wq.ndim != info.output_axis(layer_node, 2):
                skipped.append((name, op, "weight scales are not per output channel"))
                continue
        if zp is None or xsv is None or np.asarray(zp).dtype not in (np.uint8, np.int8):
            skipped.append((name, op, "activation is not 8-bit with constant qparams"))
            continue
        if wq is not None and wq.dtype == np.uint8 and wsv is not None:
            skipped.append((name, op, "u8 x u8 (e.g. activation x activation): exact kernel"))
            continue
        if wq is None or wq.dtype != np.int8 or wsv is None:
            skipped.append((name, op, "weight is not a constant int8 tensor"))
            continue
        if wzv is not None and np.any(np.asarray(wzv) != 0):
            skipped.append((name, op, "weight zero point is not 0"))
            continue
        if info.gemm_weight(layer_node, wq) is None:
            skipped.append((name, op, f"{base} weight with batch dimensions"))
            continue
        signed = np.asarray(zp).dtype == np.int8
        if signed and op.startswith("QLinear"):
            # only QDQ graphs are rewritten to u8 activations on x86; s8 x s8 QLinearConv / QLinearMatMul /
            # MatMulInteger give the same results on AVX2 (qemu) as on VNNI: no pair saturation
            skipped.append((name, op, "int8 activation in a QLinear op: s8 x s8 kernel, exact"))
            continue
        layers.append(IntLayer(name, base, x, node.output[0], float(np.asarray(xsv).reshape(-1)[0]),
                               int(np.asarray(zp).reshape(-1)[0]) + (128 if signed else 0), wq,
                               np.asarray(wsv, np.float32), attrs,
                               info.product_scale(layer_node),
                               x_offset=128 if signed else 0))
    return layers, skipped


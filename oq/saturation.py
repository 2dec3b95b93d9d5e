"""onnxruntime's u8 x s8 integer kernels on x86 CPUs without VNNI: emulation, analysis and a check of QDQ models.

What the kernels do (read from the MLAS sources of onnxruntime, `onnxruntime/core/mlas/lib`; it cannot be observed on
a VNNI host, so everything here is emulated in numpy and never depends on the CPU it runs on):

- On AVX2 and AVX-512 without VNNI, the u8 activation x s8 weight GEMM kernels (`QgemmU8S8KernelAvx2`,
  `QgemvU8S8KernelAvx2`, the AVX512Core variants) and the symmetric convolution kernel (`ConvSymKernelAvx2`, used by
  QLinearConv when the weight zero point is 0) broadcast 4 consecutive K values of the activation row, multiply them
  with 4 consecutive K values of the packed weight column with VPMADDUBSW, which adds the products of the pairs
  (k, k+1), k even, into int16 *with saturation*, then widen with VPMADDWD and accumulate in int32. Raw u8 values are
  multiplied (the activation zero point is corrected afterwards through the weight column sums), so the magnitude of
  a pair is `a[k]*w[k] + a[k+1]*w[k+1]` with `a` in [0, 255].
- The K order is the GEMM's: for MatMul / Gemm it is the row index of B ([K, N]; with Gemm transB=1, the column
  index of B [N, K]); for Conv it is NOT the weight's memory order (c_in, kh, kw): QLinearConv transposes the input
  to NHWC and reorders the filter to [kernel position][c_in][c_out] (`ReorderFilter`, `MlasConvSymPackW`), so
  K = (kh, kw, c_in) with c_in fastest, per group. Pairs are two neighbouring input channels at the same tap (or,
  when c_in per group is odd, can straddle two taps). K is zero-padded to a multiple of 4.
- Depthwise convolutions (one input and one output channel per group) use other kernels
  (`ConvSymDepthwiseKernelAvx2`: VPMOVZXBD/VPMOVSXBD + VPMADDWD on 32-bit lanes; `MlasConvDepthwise` in C): exact.
- u8 x u8 (activation x activation MatMuls) widens to int16 before VPMADDWD: exact. VNNI (VPDPBUSD), AMX and ARM64
  (UDOT/SDOT, or UMULL/SMLAL) accumulate exactly in int32.
- QDQ graphs with int8 activations (onnxruntime.quantization's default) are rewritten on x86 to uint8 activations
  (value + 128, zero point + 128) before fusion, so the kernel sees x + 128. QLinear ops with int8 activations
  (QOperator format) run s8 x s8 kernels that do not saturate.
- Not every QDQ layer is fused: onnxruntime leaves some DQ -> Conv -> Q groups in float (they cannot saturate);
  `fused_layers` asks onnxruntime's optimiser which ones it fuses.

Verified, not just read: with onnxruntime 1.32 run under `qemu-x86_64 -cpu Haswell` (AVX2, no VNNI), MatMulInteger
u8 x s8 returns exactly `pair_sums(...).saturated`, and `emulate` reproduces the fused outputs of oq's and
quantize_static's QDQ models (QLinearConv through both the symmetric-conv and the GEMM paths, depthwise, QGemm,
QLinearMatMul, batch 1 GEMV) to float rounding (tests/test_saturation.py runs one such check when qemu is
installed). s8 x s8 QLinearConv / QLinearMatMul / MatMulInteger gave identical results on AVX2 and VNNI. Assumed
from the sources only: AVX-512 without VNNI (AVX512Core kernels, same 4-byte K packing; qemu does not emulate
AVX-512) and the Windows-only SSE4.1 kernel.

Only same-sign pairs can saturate: |a0*w0 + a1*w1| <= max(a0*|w0|, a1*|w1|) <= 255*128 < 32767 otherwise. With
8-bit per-channel weights some weight of every channel is +-127, so with a=255 a neighbour of the same sign with
|w| >= 2 is enough: the analytic worst case flags nearly every layer. Weights with |w| <= 64 can never saturate
(255 * (64 + 64) = 32640; onnxruntime's own `reduce_range` uses the same [-64, 64]), which is the floor of the
scales the guard (oq/passes/saturation.py) chooses from for the channels that saturate on calibration data.

A model guarded for `avx2` runs correctly on every CPU (VNNI and ARM just lose the small 7-bit cost on the guarded
channels); a model made for `vnni` can lose a lot on an AVX2 machine.
"""
from __future__ import annotations

import itertools
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

INT16_MIN, INT16_MAX = -32768, 32767
# Symmetric 7-bit-ish weights that can never saturate a pair: 255 * (64 + 64) = 32640 <= 32767.
SAFE_WEIGHT_QMAX = 64
CPU_CHOICES = ("auto", "vnni", "avx2", "avx512", "arm64")
SATURATING_CPUS = ("avx2", "avx512")
CPU_WORDS = {
    "vnni": "x86 with VNNI (VPDPBUSD: exact int32 accumulation)",
    "avx2": "x86 AVX2 without VNNI (VPMADDUBSW: pairs of u8*s8 products saturate in int16)",
    "avx512": "x86 AVX-512 without VNNI (VPMADDUBSW: pairs of u8*s8 products saturate in int16)",
    "arm64": "ARM64 (UDOT/SDOT or widening multiplies: exact int32 accumulation)",
}


# ---------------------------------------------------------------------------------------------------------------
# deployment CPU
# ---------------------------------------------------------------------------------------------------------------

def detect_cpu(cpuinfo: "str | Path" = "/proc/cpuinfo", machine: str | None = None) -> tuple[str, str]:
    """(kind, how it was found) for this machine: kind is one of vnni, avx2, avx512, arm64."""
    machine = (machine or platform.machine() or "").lower()
    if machine in ("arm64", "aarch64") or machine.startswith("arm"):
        return "arm64", f"machine {machine}"
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "avx2", "CPU flags unreadable (no /proc/cpuinfo): assumed avx2, the case that needs the guard"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    for f in ("avx512_vnni", "avx_vnni", "amx_int8"):
        if f in flags:
            return "vnni", f"{f} in /proc/cpuinfo"
    if "avx512bw" in flags:
        return "avx512", "avx512bw without vnni in /proc/cpuinfo"
    if "avx2" in flags:
        return "avx2", "avx2 without vnni in /proc/cpuinfo"
    return "avx2", "no avx2 in /proc/cpuinfo (SSE kernels, some also pair products): assumed avx2"


def resolve_cpu(choice: str) -> tuple[str, str]:
    """Map the `cpu` option (auto, vnni, avx2, avx512, arm64) to a CPU kind and a sentence saying why."""
    if choice not in CPU_CHOICES:
        raise ValueError(f"unknown cpu {choice!r}; choose from {', '.join(CPU_CHOICES)}")
    if choice == "auto":
        kind, how = detect_cpu()
        return kind, f"auto: this machine, {how}"
    return choice, "given"


# ---------------------------------------------------------------------------------------------------------------
# the arithmetic
# ---------------------------------------------------------------------------------------------------------------

class PairSums(NamedTuple):
    saturated: np.ndarray  # int64 [M, N]: what the VPMADDUBSW kernel accumulates
    exact: np.ndarray  # int64 [M, N]: the true integer product
    saturated_pairs: int  # pairs (row, k pair, column) whose int16 sum saturated
    total_pairs: int


def _exact_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    # float64 is exact here (|sums| < 2**53) and uses BLAS, unlike integer matmul
    return np.rint(a.astype(np.float64) @ w.astype(np.float64)).astype(np.int64)


def _split_pairs(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (k even, k odd) halves of a [.., K, N] weight, K zero-padded to even."""
    if w.shape[-2] % 2:
        pad = [(0, 0)] * w.ndim
        pad[-2] = (0, 1)
        w = np.pad(w, pad)
    w = w.astype(np.int32)
    return w[..., 0::2, :], w[..., 1::2, :]


def pair_excess(a: np.ndarray, w: np.ndarray, amax: int | None = None,
                chunk_elems: int = 1 << 22) -> tuple[np.ndarray, int]:
    """(saturated - exact) of `a @ w` for u8 a [M, K] and s8 w [K, N], and the number of saturated pairs.

    Vectorised over the pairs that can saturate at all: same sign and amax * (|w0| + |w1|) beyond the int16 limit,
    amax being the largest value of `a` (all others contribute exactly).
    """
    a = np.asarray(a)
    m, k = a.shape
    out = np.zeros((m, w.shape[1]), np.int64)
    if m == 0 or k == 0:
        return out, 0
    if amax is None:
        amax = int(a.max())
    w0, w1 = _split_pairs(np.asarray(w))
    same = (w0 * w1) > 0
    bound = amax * (np.abs(w0) + np.abs(w1))
    limit = np.where(w0 > 0, INT16_MAX, -INT16_MIN)
    jj, nn = np.nonzero(same & (bound > limit))
    if len(jj) == 0:
        return out, 0
    order = np.argsort(nn, kind="stable")
    jj, nn = jj[order], nn[order]
    cols, starts = np.unique(nn, return_index=True)
    if k % 2:
        a = np.pad(a, [(0, 0), (0, 1)])
    a0, a1 = a[:, 0::2], a[:, 1::2]
    wa, wb = w0[jj, nn], w1[jj, nn]
    count = 0
    step = max(1, chunk_elems // len(jj))
    for s in range(0, m, step):
        p = a0[s:s + step, jj].astype(np.int32) * wa + a1[s:s + step, jj].astype(np.int32) * wb
        e = np.clip(p, INT16_MIN, INT16_MAX) - p
        count += int(np.count_nonzero(e))
        out[s:s + step, cols] = np.add.reduceat(e.astype(np.int64), starts, axis=1)
    return out, count


def pair_sums(a_u8: np.ndarray, w_s8: np.ndarray) -> PairSums:
    """Emulate VPMADDUBSW + VPMADDWD + VPADDD for u8 a [M, K] and s8 w [K, N].

    Each pair of adjacent-K products (k, k+1), k even, is added in int16 with saturation to [-32768, 32767], then the
    pair sums are accumulated exactly in int32. K is zero-padded to even, as MLAS pads it to a multiple of 4.
    """
    a = np.asarray(a_u8)
    w = np.asarray(w_s8)
    if a.dtype != np.uint8 or w.dtype != np.int8:
        raise TypeError(f"pair_sums wants uint8 activations and int8 weights, got {a.dtype} and {w.dtype}")
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[0]:
        raise ValueError(f"shapes {a.shape} x {w.shape} are not [M, K] x [K, N]")
    exact = _exact_matmul(a, w)
    excess, count = pair_excess(a, w)
    return PairSums(exact + excess, exact, count, a.shape[0] * ((a.shape[1] + 1) // 2) * w.shape[1])


def pair_bounds(wg: np.ndarray, amax: int = 255) -> np.ndarray:
    """Worst |pair sum| per output column for weights in GEMM form [G, K, N] (K in the kernel's order): the larger
    of amax*(max(w0,0)+max(w1,0)) and -amax*(min(w0,0)+min(w1,0)) over the pairs. Returns [G*N] (channel order)."""
    w0, w1 = _split_pairs(np.asarray(wg))
    pos = amax * (np.maximum(w0, 0) + np.maximum(w1, 0))
    neg = -amax * (np.minimum(w0, 0) + np.minimum(w1, 0))
    worst = np.maximum(pos.max(axis=1, initial=0), neg.max(axis=1, initial=0))  # [G, N]
    return worst.reshape(-1)


def order_free_bounds(w_rows: np.ndarray, amax: int = 255) -> np.ndarray:
    """Worst |pair sum| per channel for ANY pairing of its weights (w_rows [C, K]): amax times the sum of its two
    largest same-sign magnitudes. Conservative whatever order a kernel packs K in."""
    w = np.asarray(w_rows, np.int32)
    if w.shape[1] < 2:
        return np.abs(w).max(axis=1, initial=0) * amax
    pos = -np.sort(-np.maximum(w, 0), axis=1)[:, :2].sum(axis=1)
    neg = -np.sort(np.minimum(w, 0), axis=1)[:, :2].sum(axis=1)
    return amax * np.maximum(pos, neg)


def exceeds_int16(bound: np.ndarray) -> np.ndarray:
    # a positive sum saturates above 32767, a negative one below -32768; bounds are magnitudes, so use the
    # stricter positive limit (conservative by one unit for negative pairs)
    return np.asarray(bound) > INT16_MAX


# ---------------------------------------------------------------------------------------------------------------
# layers: weights in GEMM form and activations as GEMM rows, in onnxruntime's K order
# ---------------------------------------------------------------------------------------------------------------

def gemm_weights(op: str, w: np.ndarray, attrs: dict) -> np.ndarray:
    """Weight as [G, K, N_per_group] with K in the order onnxruntime's kernels pair it."""
    w = np.asarray(w)
    if op == "Conv":
        group = int(attrs.get("group", 1))
        co, cg = w.shape[:2]
        spatial = w.shape[2:]
        wg = w.reshape(group, co // group, cg, *spatial)
        wg = np.moveaxis(wg, 1, -1)  # [G, Cg, *k, Co_g]
        wg = np.moveaxis(wg, 1, -2)  # [G, *k, Cg, Co_g]: K = (taps, c_in), c_in fastest
        return wg.reshape(group, -1, co // group)
    if op == "Gemm":
        return (w.T if attrs.get("transB", 0) else w)[None]
    if op == "MatMul":
        if w.ndim != 2:
            raise ValueError("MatMul weight with batch dimensions")
        return w[None]
    raise ValueError(op)


def channel_axis(op: str, attrs: dict) -> int:
    if op == "Conv":
        return 0
    if op == "Gemm":
        return 0 if attrs.get("transB", 0) else 1
    return 1


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
        amax = int(a.max()) if a.size else 0
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


def find_layers(model: onnx.ModelProto) -> tuple[list[IntLayer], list[tuple[str, str, str]]]:
    """u8 x s8 layers of a QDQ model (Conv/MatMul/Gemm reading DQ(uint8 activation) and DQ(int8 constant weight)),
    plus QLinearConv / QLinearMatMul. Returns (layers, skipped) with skipped = [(node, op, why)]."""
    consts = _Consts(model)
    layers, skipped = [], []
    for node in model.graph.node:
        op = node.op_type
        if op not in ("Conv", "MatMul", "Gemm", "QLinearConv", "QLinearMatMul") or node.domain not in ("", "ai.onnx"):
            continue
        name = node.name or node.output[0]
        attrs = _attrs(node)
        if op.startswith("QLinear"):
            base = "Conv" if op == "QLinearConv" else "MatMul"
            x, xs, xz, w, ws, wz = node.input[:6]
            zp = consts.get(xz)
            wq, wsv, wzv, xsv = consts.get(w), consts.get(ws), consts.get(wz), consts.get(xs)
        else:
            base = op
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
            if wq is not None and wsv is not None and np.size(wsv) > 1 and wq.ndim and \
                    w_axis % wq.ndim != channel_axis(base, attrs):
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
        if base == "MatMul" and wq.ndim != 2:
            skipped.append((name, op, "MatMul weight with batch dimensions"))
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
                               float(attrs.get("alpha", 1.0)) if base == "Gemm" else 1.0,
                               x_offset=128 if signed else 0))
    return layers, skipped


# ---------------------------------------------------------------------------------------------------------------
# analysis and checks
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class AnalyticRow:
    name: str
    op: str
    k: int
    channels: int
    at_risk: int  # channels with a pair that can saturate, onnxruntime's pairing
    at_risk_any_order: int  # same, for any pairing (conservative)
    worst: float  # worst |pair sum| / 32767, onnxruntime's pairing
    note: str = ""


def analyze_layer(layer: IntLayer, amax: int = 255) -> AnalyticRow:
    """Analytic worst case: every activation at `amax` (the largest u8 value it can take: with min/max
    calibration the calibrated maximum maps to 255)."""
    note = layer.exact_kernel or ""
    if note:
        return AnalyticRow(layer.name, layer.op, layer.k, layer.channels, 0, 0, 0.0, note)
    b = pair_bounds(layer.wg, amax)
    rows = np.moveaxis(layer.wg, 1, 2).reshape(layer.channels, layer.k)
    free = order_free_bounds(rows, amax)
    return AnalyticRow(layer.name, layer.op, layer.k, layer.channels, int(exceeds_int16(b).sum()),
                       int(exceeds_int16(free).sum()), float(b.max(initial=0) / INT16_MAX))


def analyze_model(model: onnx.ModelProto, amax: int = 255) -> tuple[list[AnalyticRow], list]:
    layers, skipped = find_layers(model)
    return [analyze_layer(l, amax) for l in layers], skipped


@dataclass
class LayerCheck:
    name: str
    op: str
    k: int
    channels: int
    rows: int  # GEMM rows (output positions) emulated
    amax: int  # largest u8 activation seen
    saturated_pairs: int
    total_pairs: int
    channels_saturating: int
    max_rel_err: float  # max |error| / max |exact output|, layer output before bias
    sqnr_db: float  # exact vs saturated layer output
    note: str = ""

    @property
    def saturated_fraction(self) -> float:
        return self.saturated_pairs / self.total_pairs if self.total_pairs else 0.0


def _sqnr(signal_energy: float, noise_energy: float) -> float:
    if noise_energy <= 0:
        return float("inf")
    if signal_energy <= 0:
        return float("-inf")
    return float(10 * np.log10(signal_energy / noise_energy))


def check_rows(layer: IntLayer, a: np.ndarray) -> LayerCheck:
    """Emulate one layer on GEMM rows a [G, R, K]."""
    r = a.shape[1]
    if layer.exact_kernel or r == 0:
        return LayerCheck(layer.name, layer.op, layer.k, layer.channels, r, int(a.max()) if a.size else 0, 0, 0, 0,
                          0.0, float("inf"), layer.exact_kernel or "no data")
    exact = layer.exact(a) * layer.out_scale
    e, count = layer.excess(a)
    err = e * layer.out_scale
    ymax = float(np.abs(exact).max())
    return LayerCheck(layer.name, layer.op, layer.k, layer.channels, r, int(a.max()), count,
                      r * ((layer.k + 1) // 2) * layer.channels, int((e != 0).any(axis=0).sum()),
                      float(np.abs(err).max() / ymax) if ymax > 0 else 0.0,
                      _sqnr(float((exact ** 2).sum()), float((err ** 2).sum())))


def _session(model: onnx.ModelProto, optimize: bool = False):
    import tempfile

    import onnxruntime as ort

    from . import ir

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if ir.model_size(model) > ir.EXTERNAL_DATA_THRESHOLD:
        with tempfile.TemporaryDirectory(prefix="oq-saturation-") as tmp:
            path = ir.save_model(model, Path(tmp) / "model.onnx", external_data=True)
            return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    present = {o.name for o in m.graph.output} | {i.name for i in m.graph.input}
    wanted = [n for n in dict.fromkeys(names) if n not in present]
    if not wanted:
        return m
    known = {vi.name: vi for vi in m.graph.value_info}
    if any(n not in known for n in wanted):
        try:
            inferred = onnx.shape_inference.infer_shapes(m)
            known.update({vi.name: vi for vi in inferred.graph.value_info})
        except Exception:  # noqa: BLE001 - types are a convenience here; onnxruntime infers them too
            pass
    for n in wanted:
        vi = onnx.ValueInfoProto()
        if n in known and known[n].type.tensor_type.elem_type:
            vi.name = n
            vi.type.tensor_type.elem_type = known[n].type.tensor_type.elem_type
        else:
            vi.name = n
        m.graph.output.append(vi)
    return m


def _feeds_iter(feeds) -> Iterable[dict]:
    return [feeds] if isinstance(feeds, dict) else feeds


def capture(model: onnx.ModelProto, names: list[str], feeds) -> Iterable[dict[str, np.ndarray]]:
    """Run the model (onnxruntime, optimisations off) on each feed and yield {name: value} for `names`."""
    inputs = {i.name for i in model.graph.input}
    run_names = [n for n in dict.fromkeys(names) if n not in inputs]
    sess = _session(_with_outputs(model, run_names))
    for feed in _feeds_iter(feeds):
        values = dict(zip(run_names, sess.run(run_names, feed))) if run_names else {}
        values.update({n: feed[n] for n in names if n in inputs})
        yield values


def check_model_saturation(model: onnx.ModelProto, feeds, max_rows: int = 4096, seed: int = 0
                           ) -> tuple[list[LayerCheck], list]:
    """Emulate pair saturation for every u8 x s8 layer of a QDQ model on calibration feeds (a feed dict or an
    iterable of them). The u8 inputs are captured by running the model in onnxruntime with optimisations off
    (the graph's own semantics); at most `max_rows` output positions per layer are emulated (a random subset).
    Host-independent. Returns (per-layer checks, skipped layers)."""
    layers, skipped = find_layers(model)
    rng = np.random.default_rng(seed)
    collected: dict[int, list[np.ndarray]] = {i: [] for i in range(len(layers))}
    for values in capture(model, [l.x for l in layers], feeds):
        for i, layer in enumerate(layers):
            if layer.exact_kernel:
                continue
            x = values[layer.x]
            total = layer.row_count(x.shape)
            idx = np.sort(rng.choice(total, size=min(total, max_rows), replace=False))
            collected[i].append(layer.rows(x, idx))
    checks = []
    fused = fused_layers(model, [l for l in layers if not l.exact_kernel])
    for i, layer in enumerate(layers):
        parts = collected[i]
        a = np.concatenate(parts, axis=1) if parts else np.zeros((layer.groups, 0, layer.k), np.uint8)
        if a.shape[1] > max_rows:
            a = a[:, np.sort(rng.choice(a.shape[1], size=max_rows, replace=False))]
        check = check_rows(layer, a)
        if fused is not None and not check.note and layer.name not in fused:
            check.note = "not fused by onnxruntime: runs in float, cannot saturate"
        checks.append(check)
    return checks, skipped


FUSED_OPS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "MatMulInteger", "ConvInteger")


def fused_layers(model: onnx.ModelProto, layers: list[IntLayer]) -> set[str] | None:
    """Names of the layers onnxruntime's CPU provider turns into integer kernels, found by letting it optimise the
    model (extended level, where the QDQ fusions run; the choice does not depend on the CPU's VNNI support). A
    layer that stays DQ -> Conv -> Q runs in float and cannot saturate (e.g. onnxruntime leaves a Conv unfused when
    its input's DequantizeLinear also feeds other nodes). None if onnxruntime cannot optimise the model."""
    import tempfile

    import onnxruntime as ort

    already = {l.name for l in layers if any(n.op_type.startswith("QLinear") and (n.name or n.output[0]) == l.name
                                             for n in model.graph.node)}
    try:
        with tempfile.TemporaryDirectory(prefix="oq-fused-") as tmp:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
            ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            optimized = onnx.load(so.optimized_model_filepath)
    except Exception:  # noqa: BLE001 - the caller falls back to "every layer fuses"
        return None
    names, outputs = set(), set()
    for n in optimized.graph.node:
        if n.op_type in FUSED_OPS:
            names.add(n.name.split("_token_")[0])
            outputs.update(n.output)
    q_out = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear":
            q_out.setdefault(n.input[0], []).append(n.output[0])
    return already | {l.name for l in layers
                      if l.name in names or l.y in outputs or any(o in outputs for o in q_out.get(l.y, []))}


def emulate(model: onnx.ModelProto, feeds: dict, layers: list[IntLayer] | None = None,
            max_rounds: int | None = None) -> list[np.ndarray]:
    """The model's outputs as onnxruntime's fused u8 x s8 kernels compute them on an x86 CPU without VNNI.

    The graph runs in onnxruntime with optimisations off (float Conv/MatMul on dequantized values = the exact
    integer result); the output of every u8 x s8 layer gets the saturation error its kernel would add, computed in
    numpy from the layer's actual u8 input. Corrections are fed back as extra inputs and the run repeated until
    they stop changing (at most one round per layer along the longest chain). Differs from the real kernels only
    in float rounding of the requantization."""
    if layers is None:
        layers = [l for l in find_layers(model)[0] if not l.exact_kernel]
        fused = fused_layers(model, layers)
        if fused:
            layers = [l for l in layers if l.name in fused]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    n_out = len(m.graph.output)
    nodes_by_out = {n.output[0]: n for n in m.graph.node if n.output}
    corr_names = []
    adds = []
    for i, layer in enumerate(layers):
        node = nodes_by_out[layer.y]
        exact_name, corr = f"{layer.y}__oq_exact", f"{layer.y}__oq_saturation"
        node.output[0] = exact_name
        adds.append(helper.make_node("Add", [exact_name, corr], [layer.y], name=f"{layer.name}__oq_saturation"))
        m.graph.input.append(helper.make_tensor_value_info(corr, onnx.TensorProto.FLOAT, None))
        corr_names.append(corr)
    # put each Add right after its layer so the node list stays topologically sorted
    new_nodes = []
    add_for = {a.input[0]: a for a in adds}
    for n in m.graph.node:
        new_nodes.append(n)
        if n.output and n.output[0] in add_for:
            new_nodes.append(add_for[n.output[0]])
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    x_names = list(dict.fromkeys(l.x for l in layers))
    inputs = {i.name for i in model.graph.input}
    fetch = [o.name for o in m.graph.output] + [x for x in x_names if x not in inputs]
    sess = _session(_with_outputs(m, fetch))
    corr = {c: np.zeros((), np.float32) for c in corr_names}
    last_x: dict[str, np.ndarray] = {}
    rounds = (max_rounds or len(layers) + 1)
    res = None
    for _ in range(rounds + 1):
        res = dict(zip(fetch, sess.run(fetch, {**feeds, **corr})))
        res.update({x: feeds[x] for x in x_names if x in inputs})
        changed = False
        for layer, c in zip(layers, corr_names):
            x = res[layer.x]
            key = f"{layer.x}|{layer.name}"
            if key in last_x and np.array_equal(last_x[key], x):
                continue
            last_x[key] = x
            new = layer.correction(x)
            if not (new.shape == corr[c].shape and np.array_equal(new, corr[c])):
                changed = True
            corr[c] = new
        if not changed:
            break
    return [res[o.name] for o in m.graph.output[:n_out]]


# ---------------------------------------------------------------------------------------------------------------
# the guard's per-channel decision
# ---------------------------------------------------------------------------------------------------------------

# Candidate largest weight magnitudes for a channel that saturates: its scale becomes max|w| / q. 64 is the floor
# where no pair can saturate whatever the activations (255 * (64 + 64) = 32640).
QMAX_LADDER = (120, 112, 104, 96, 88, 80, 72, SAFE_WEIGHT_QMAX)


@dataclass
class GuardDecision:
    reduced: np.ndarray  # bool [C]: channels that get a coarser scale
    scale: np.ndarray  # float32 [C]: the chosen scale (the plan's where not reduced)
    qmax: np.ndarray  # int [C]: largest |q| of the reduced channels (0 where not reduced)
    saturated_pairs: int  # on the sampled rows, with the plan's 8-bit weights
    total_pairs: int
    channels_saturating: int
    sqnr8_db: float  # emulated layer output with the plan's 8-bit weights (saturating) vs float weights
    sqnr_guarded_db: float  # with the chosen scales
    sqnr8_exact_db: float  # the plan's 8-bit weights on a CPU that does not saturate (VNNI)


def guard_decision(layer: IntLayer, w_float: np.ndarray, a: np.ndarray, per_channel: bool = True,
                   ladder=QMAX_LADDER) -> GuardDecision:
    """Choose, per output channel, between the plan's 8-bit scale and coarser scales max|w|/q (q in `ladder`, down
    to 64 where no pair can saturate) the one whose emulated layer output (pair saturation included) has the smallest
    squared error on the sampled GEMM rows a [G, R, K], against the layer computed with float weights on the same
    quantized activations. Only channels that saturate on the rows are candidates. With per-tensor weight scales
    one q is chosen for the whole layer (smallest total error)."""
    wf = gemm_weights(layer.op, np.asarray(w_float, np.float64), layer.attrs)  # [G, K, Ng]
    amax_w = np.abs(wf).max(axis=1).reshape(-1)  # [C]
    if not per_channel:
        amax_w = np.full_like(amax_w, amax_w.max(initial=0))
    xs = float(layer.x_scale)
    ng = wf.shape[2]
    # errors are computed directly as activations @ (integer weight - float weight / scale), in float32: no
    # cancellation between two large accumulators, and BLAS speed
    ac = [a[g].astype(np.float32) - np.float32(layer.x_zp) for g in range(layer.groups)]
    amax_a = int(a.max()) if a.size else 0
    s8 = layer.w_scale.astype(np.float64)
    sig = float(sum(((xs * (ac[g] @ wf[g].astype(np.float32))).astype(np.float64) ** 2).sum()
                    for g in range(layer.groups)))

    def rounding_err(g, wq, w_over_s):  # [R, cols] accumulator units
        return (ac[g] @ (wq.astype(np.float64) - w_over_s).astype(np.float32)).astype(np.float64)

    err8 = np.concatenate([rounding_err(g, layer.wg[g], wf[g] / s8[g * ng:(g + 1) * ng])
                           for g in range(layer.groups)], axis=1)
    excess, count = layer.excess(a)
    e8x = ((err8 * (s8 * xs)) ** 2).sum(axis=0)
    e8 = (((err8 + excess) * (s8 * xs)) ** 2).sum(axis=0)
    del err8
    saturating = (excess != 0).any(axis=0)
    best_e, best_s = e8.copy(), s8.copy()
    best_q = np.zeros(layer.channels, np.int64)
    # only the channels that saturate are re-emulated (all of them when one scale serves the whole layer)
    cols = np.arange(layer.channels) if not per_channel else np.nonzero(saturating)[0]
    for q in (ladder if saturating.any() else ()):
        s = np.where(amax_w > 0, amax_w / q, s8)
        e = np.full(layer.channels, np.inf)
        for g in np.unique(cols // ng):
            c = cols[cols // ng == g]
            w_over_s = wf[g][:, c - g * ng] / s[c]
            wq = np.clip(np.rint(w_over_s), -q, q).astype(np.int8)
            err = rounding_err(g, wq, w_over_s) + pair_excess(a[g], wq, amax_a)[0]
            e[c] = ((err * (s[c] * xs)) ** 2).sum(axis=0)
        if per_channel:
            better = saturating & (e < best_e)
        else:
            better = np.full(layer.channels, bool(e.sum() < best_e.sum()))
        best_e, best_s, best_q = np.where(better, e, best_e), np.where(better, s, best_s), np.where(better, q, best_q)
    reduced = best_q > 0
    return GuardDecision(reduced, best_s.astype(np.float32), best_q, count,
                         a.shape[1] * ((layer.k + 1) // 2) * layer.channels, int(saturating.sum()),
                         _sqnr(sig, float(e8.sum())), _sqnr(sig, float(best_e.sum())), _sqnr(sig, float(e8x.sum())))


# ---------------------------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------------------------


def _db(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.1f}"


def _short(name: str, width: int = 40) -> str:
    return (name if len(name) <= width else "..." + name[-(width - 3):]).ljust(width + 1)


def format_checks(checks: list[LayerCheck], skipped=()) -> str:
    lines = ["u8 x s8 pair saturation (VPMADDUBSW, x86 without VNNI), emulated on the given inputs:",
             f"  {'layer':<41}{'op':<7}{'K':>6}{'ch':>5}{'rows':>7}{'amax':>5}{'sat. pairs':>12}"
             f"{'ch sat':>7}{'max rel err':>12}{'SQNR dB':>9}"]
    for c in checks:
        if c.note:
            lines.append(f"  {_short(c.name)}{c.op:<7}{c.k:>6}{c.channels:>5}{c.rows:>7}{'':>5}  {c.note}")
            continue
        lines.append(f"  {_short(c.name)}{c.op:<7}{c.k:>6}{c.channels:>5}{c.rows:>7}{c.amax:>5}"
                     f"{100 * c.saturated_fraction:>11.3f}%{c.channels_saturating:>7}{c.max_rel_err:>12.4f}"
                     f"{_db(c.sqnr_db):>9}")
    for name, op, why in skipped:
        lines.append(f"  {_short(name)}{op:<7} skipped: {why}")
    if not checks and not skipped:
        lines.append("  (no u8 x s8 Conv/MatMul/Gemm layers)")
    return "\n".join(lines)


def format_analytic(rows: list[AnalyticRow], skipped=(), amax: int = 255) -> str:
    lines = [f"u8 x s8 pair saturation (VPMADDUBSW, x86 without VNNI), analytic worst case with activations at "
             f"{amax}:",
             "  (pairs in onnxruntime's K order: Conv (kh, kw, c_in), MatMul/Gemm rows of B; 'any order' is the",
             "   bound for any pairing. Worst case only: give --calib to emulate on real activations)",
             f"  {'layer':<41}{'op':<7}{'K':>6}{'ch':>5}{'ch at risk':>11}{'any order':>10}{'worst/32767':>12}"]
    for r in rows:
        if r.note:
            lines.append(f"  {_short(r.name)}{r.op:<7}{r.k:>6}{r.channels:>5}  {r.note}")
            continue
        lines.append(f"  {_short(r.name)}{r.op:<7}{r.k:>6}{r.channels:>5}{r.at_risk:>11}{r.at_risk_any_order:>10}"
                     f"{r.worst:>12.2f}")
    for name, op, why in skipped:
        lines.append(f"  {_short(name)}{op:<7} skipped: {why}")
    if not rows and not skipped:
        lines.append("  (no u8 x s8 Conv/MatMul/Gemm layers)")
    return "\n".join(lines)


def inspect_saturation(model: onnx.ModelProto, feeds=None, max_rows: int = 4096) -> str:
    """What `oq inspect --saturation` prints: with feeds (a feed dict or an iterable of them), the emulation on
    those inputs and the whole-model effect on the first feed; without, the analytic worst case."""
    if feeds is None:
        rows, skipped = analyze_model(model)
        return format_analytic(rows, skipped)
    feeds = list(_feeds_iter(feeds))
    checks, skipped = check_model_saturation(model, feeds, max_rows=max_rows)
    text = format_checks(checks, skipped)
    if feeds and any(not c.note for c in checks):
        exact = _session(model).run(None, feeds[0])
        emulated = emulate(model, feeds[0])
        sig = sum(float((np.asarray(e, np.float64) ** 2).sum()) for e in exact)
        noise = sum(float(((np.asarray(e, np.float64) - np.asarray(x, np.float64)) ** 2).sum())
                    for e, x in zip(exact, emulated))
        text += (f"\nwhole model on the first feed: outputs as an AVX2 CPU computes them vs exact integer kernels "
                 f"(VNNI/ARM): SQNR {_db(_sqnr(sig, noise))} dB")
    return text

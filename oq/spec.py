"""Quantization specs (what a target asks for) and the qparams computed from observed ranges."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np
import onnx

from .errors import OqError

# dtype name -> (qmin, qmax, numpy dtype, onnx elem type)
DTYPES = {
    "int8": (-128, 127, np.int8, onnx.TensorProto.INT8),
    "uint8": (0, 255, np.uint8, onnx.TensorProto.UINT8),
    "int16": (-32768, 32767, np.int16, onnx.TensorProto.INT16),
    "uint16": (0, 65535, np.uint16, onnx.TensorProto.UINT16),
    "int32": (-(2**31), 2**31 - 1, np.int32, onnx.TensorProto.INT32),
    # 4-bit integers (Q/DQ from opset 21); held in 8-bit containers until export packs them
    "int4": (-8, 7, np.int8, onnx.TensorProto.INT4),
    "uint4": (0, 15, np.uint8, onnx.TensorProto.UINT4),
    # FP8 E4M3 (finite, no inf): a float grid whose largest magnitude is 448; Q/DQ from opset 19
    "float8e4m3": (-448, 448, ml_dtypes.float8_e4m3fn, onnx.TensorProto.FLOAT8E4M3FN),
}
FLOAT_DTYPES = ("float8e4m3",)
PACKED_DTYPES = ("int4", "uint4")
GRANULARITIES = ("per_tensor", "per_channel", "per_block")
ROUNDINGS = ("half_even", "half_away")
# Below this a scale underflows float32 arithmetic in the runtimes; zero-range tensors get scale 1.
MIN_SCALE = 1e-12


@dataclass(frozen=True)
class QuantSpec:
    dtype: str = "int8"
    symmetric: bool = True
    narrow_range: bool = False
    granularity: str = "per_tensor"
    observer: str = "minmax"
    power_of_two: bool = False
    # constraints
    quant_min: int | None = None  # narrower integer range than the dtype's (e.g. 4-bit values in int8)
    quant_max: int | None = None
    min_scale: float = 0.0
    zero_point: int | None = None  # fixed zero-point (symmetric specs only)
    rounding: str = "half_even"  # how weights are rounded offline; runtimes always round half to even
    block_size: int | None = None  # per_block: values along the weight's reduction axis sharing one scale

    def __post_init__(self):
        if self.dtype not in DTYPES or self.dtype == "int32":
            raise OqError(f"unsupported quantization dtype {self.dtype!r}; choose from "
                          f"{', '.join(d for d in DTYPES if d != 'int32')}")
        if self.granularity not in GRANULARITIES:
            raise OqError(f"unknown granularity {self.granularity!r}; choose from {', '.join(GRANULARITIES)}")
        if self.rounding not in ROUNDINGS:
            raise OqError(f"unknown rounding {self.rounding!r}; choose from {', '.join(ROUNDINGS)}")
        lo, hi = DTYPES[self.dtype][:2]
        qmin, qmax = self.qrange
        if not lo <= qmin < qmax <= hi:
            raise OqError(f"quant_min/quant_max [{qmin}, {qmax}] must be an increasing range inside {self.dtype} "
                          f"[{lo}, {hi}]")
        if self.zero_point is not None:
            if not self.symmetric:
                raise OqError("an asymmetric spec cannot fix the zero-point (asymmetric means the zero-point "
                              "follows the data); use symmetric = true or drop zero_point")
            if not qmin <= self.zero_point <= qmax:
                raise OqError(f"zero_point {self.zero_point} is outside the range [{qmin}, {qmax}]")
        if self.is_float and (not self.symmetric or self.narrow_range or self.power_of_two or
                              self.quant_min is not None or self.quant_max is not None or self.zero_point):
            raise OqError(f"{self.dtype} is a float grid: symmetric only, zero-point 0, no narrow_range, "
                          f"power_of_two or quant_min/quant_max")
        if (self.granularity == "per_block") != (self.block_size is not None):
            raise OqError("block_size goes with granularity = \"per_block\" (and per_block needs a block_size)")
        if self.block_size is not None and self.block_size < 2:
            raise OqError(f"block_size must be at least 2, got {self.block_size}")
        if not (self.min_scale >= 0 and np.isfinite(self.min_scale)):
            raise OqError(f"min_scale must be a finite number >= 0, got {self.min_scale}")

    @property
    def signed(self) -> bool:
        return DTYPES[self.dtype][0] < 0

    @property
    def qrange(self) -> tuple[int, int]:
        qmin, qmax = DTYPES[self.dtype][:2]
        qmin = self.quant_min if self.quant_min is not None else qmin
        qmax = self.quant_max if self.quant_max is not None else qmax
        if self.narrow_range and self.signed and qmin == -qmax - 1:
            qmin += 1
        return qmin, qmax

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def bits(self) -> int:
        if self.is_float:
            return 8
        qmin, qmax = self.qrange
        return int(np.ceil(np.log2(qmax - qmin + 1)))

    @property
    def np_dtype(self):
        return DTYPES[self.dtype][2]

    def with_(self, **changes) -> "QuantSpec":
        return replace(self, **changes)


@dataclass
class QParams:
    scale: np.ndarray  # float32, scalar or 1-D (per channel)
    zero_point: np.ndarray  # spec dtype, same shape as scale
    axis: int | None = None
    spec: QuantSpec = field(default_factory=QuantSpec)
    block_size: int | None = None  # scale has the tensor's shape with `axis` divided into blocks

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    def expanded(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero-point broadcastable against a tensor of `shape`."""
        scale, zp = np.asarray(self.scale), np.asarray(self.zero_point)
        if self.axis is None or scale.ndim == 0:
            return scale, zp
        axis = self.axis % len(shape)
        if self.block_size:
            take = np.arange(shape[axis]) // self.block_size
            return np.take(scale, take, axis=axis), np.take(zp, take, axis=axis)
        view = [1] * len(shape)
        view[axis] = -1
        return scale.reshape(view), zp.reshape(view)


def qparams_from_range(lo, hi, spec: QuantSpec, axis: int | None = None) -> QParams:
    """Scale and zero-point covering [lo, hi] (widened to include 0), vectorised over channels."""
    lo = np.minimum(np.asarray(lo, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, dtype=np.float64), 0.0)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise OqError("observed range is not finite (NaN or inf in the data)")
    qmin, qmax = spec.qrange
    if spec.symmetric:
        amax = np.maximum(-lo, hi)
        center = spec.zero_point if spec.zero_point is not None else (0 if spec.signed else (qmin + qmax + 1) // 2)
        zp = np.full_like(amax, center)
        # the side of the grid with fewer steps bounds the scale
        scale = amax / max(min(qmax - center, center - qmin), 1)
    else:
        scale = (hi - lo) / (qmax - qmin)
    degenerate = ~(scale > MIN_SCALE)
    scale = np.where(degenerate, 1.0, scale)
    scale = np.maximum(scale, spec.min_scale)
    if spec.power_of_two:
        scale = np.exp2(np.ceil(np.log2(scale)))
    if not spec.symmetric:
        zp = np.clip(np.round(qmin - lo / scale), qmin, qmax)
        zp = np.where(degenerate, np.clip(0, qmin, qmax), zp)
    return QParams(scale.astype(np.float32), zp.astype(spec.np_dtype), axis, spec)


def quantize_array(x: np.ndarray, qp: QParams) -> np.ndarray:
    """Round-half-to-even (or the spec's offline rounding) and saturate, as ONNX QuantizeLinear does."""
    scale, zp = qp.expanded(x.shape)
    zp = zp.astype(np.float64)
    qmin, qmax = qp.spec.qrange
    v = x.astype(np.float64) / scale.astype(np.float64)
    if qp.spec.is_float:  # saturate, then round to the nearest representable value (ties to even)
        return np.asarray(np.clip(v, qmin, qmax).astype(np.float32).astype(qp.spec.np_dtype))
    q = (np.rint(v) if qp.spec.rounding == "half_even" else np.sign(v) * np.floor(np.abs(v) + 0.5)) + zp
    return np.asarray(np.clip(q, qmin, qmax).astype(qp.spec.np_dtype))


def dequantize_array(q: np.ndarray, qp: QParams) -> np.ndarray:
    scale, zp = qp.expanded(q.shape)
    return ((q.astype(np.float32) - zp.astype(np.float32)) * scale).astype(np.float32)


# Clipping factors tried by the MSE weight search, relative to each channel's min/max.
WEIGHT_MSE_FACTORS = np.linspace(0.5, 1.0, 26)


def _mse_clip(w2d: np.ndarray, lo: np.ndarray, hi: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per row of w2d, the shrink of [lo, hi] whose quantization error (rounding + clipping) is smallest."""
    best_err = np.full(w2d.shape[0], np.inf)
    best = np.ones(w2d.shape[0])
    for f in WEIGHT_MSE_FACTORS:
        qp = qparams_from_range(lo * f, hi * f, spec, axis=0)
        err = ((w2d - dequantize_array(quantize_array(w2d, qp), qp)) ** 2).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, f, best)
    return lo * best, hi * best


def weight_qparams(w: np.ndarray, spec: QuantSpec, axis: int | None) -> QParams:
    """Qparams of a constant, per channel along `axis` when the spec asks for it. The spec's observer picks the
    range: "minmax" (default) or "mse" (clip each channel where the quantization error is smallest)."""
    w = np.asarray(w, dtype=np.float32)
    if spec.granularity == "per_block" and axis is not None and w.ndim > 0 and w.size:
        return _block_qparams(w, spec, axis % w.ndim)
    per_channel = spec.granularity == "per_channel" and axis is not None and w.ndim > 0
    if w.size == 0:
        n = w.shape[axis] if per_channel else None
        return qparams_from_range(np.zeros(n) if n else 0.0, np.zeros(n) if n else 0.0, spec, axis if n else None)
    if per_channel:
        axis = axis % w.ndim
        w2d = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    else:
        w2d = w.reshape(1, -1)
    lo, hi = w2d.min(axis=1).astype(np.float64), w2d.max(axis=1).astype(np.float64)
    if spec.observer == "mse":
        lo, hi = _mse_clip(w2d, lo, hi, spec)
    qp = qparams_from_range(lo, hi, spec, 0)
    if spec.power_of_two:
        qp = _best_power_of_two(w2d, qp)
    if per_channel:
        return QParams(qp.scale, qp.zero_point, axis, spec)
    return QParams(qp.scale[0], qp.zero_point[0], None, spec)


def _block_qparams(w: np.ndarray, spec: QuantSpec, axis: int) -> QParams:
    """Min/max per block of `block_size` values along `axis` (the last block may be shorter)."""
    size, block = w.shape[axis], spec.block_size
    n_blocks = -(-size // block)
    moved = np.moveaxis(w, axis, -1)
    padded = np.concatenate([moved, np.repeat(moved[..., -1:], n_blocks * block - size, axis=-1)], axis=-1)
    blocks = padded.reshape(*moved.shape[:-1], n_blocks, block)
    qp = qparams_from_range(blocks.min(-1), blocks.max(-1), spec)
    return QParams(np.moveaxis(qp.scale, -1, axis), np.moveaxis(qp.zero_point, -1, axis), axis, spec, block)


def _best_power_of_two(w2d: np.ndarray, qp: QParams) -> QParams:
    """Power-of-two scales round up (no clipping); halving them doubles the resolution at the cost of clipping the
    largest values. Per row, keep whichever gives the smaller quantization error."""
    half = QParams((qp.scale / 2).astype(np.float32), qp.zero_point, 0, qp.spec)

    def err(p):
        return ((w2d - dequantize_array(quantize_array(w2d, p), p)) ** 2).sum(axis=1)
    use_half = err(half) < err(qp)
    return QParams(np.where(use_half, half.scale, qp.scale).astype(np.float32), qp.zero_point, 0, qp.spec)

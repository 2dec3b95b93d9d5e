"""Fake quantization in torch, with hand-written gradients for quantization-aware finetuning.

The forward is onnxruntime's QuantizeLinear followed by DequantizeLinear, bit for bit on float32 inputs:

    q = clamp(round(x / scale) + zero_point, qmin, qmax)      x / scale divided in float32, round half to even
    y = (q - zero_point) * scale                               in float32

onnxruntime divides by the scale in float32 (measured: x * (1 / scale) differs from its output on about one
Gaussian value in ten million, and on many values built to sit at .5 ties) and clamps before converting, so
saturation is exact. oq's offline weight quantization (oq.spec.quantize_array) divides in float64 instead, which
differs by one step on about one value in a million: those whose float32 quotient rounds onto a .5 tie. NaN
propagates as NaN here (forward and gradients).

Scales and zero-points are laid out as in oq.spec.QParams: a scalar (per tensor), a vector along `axis` (per
channel), or x's shape with `axis` divided into blocks of `block_size` (per block, the last block may be shorter).

Gradients (autograd.Function subclasses; round is straight-through, i.e. its derivative is taken as 1). With
v = x / s, r = round(v) and z the (rounded) zero-point, a value is inside when qmin <= r + z <= qmax:

    inside:  y = (r + z - z) * s = r * s      dy/dx = 1   dy/ds = r - v       dy/dz = 0
    below:   y = (qmin - z) * s               dy/dx = 0   dy/ds = qmin - z    dy/dz = -s
    above:   y = (qmax - z) * s               dy/dx = 0   dy/ds = qmax - z    dy/dz = -s

(dy/ds inside: d(r s)/ds = r + s dv/ds = r + s (-x / s^2) = r - v.) With z = 0 this is LSQ's gradient (Esser et
al., "Learned Step Size Quantization"): r - v inside, qmin or qmax outside. LSQ+ (Bhalgat et al.) writes the offset
in the float domain, y = clamp(round((x - beta) / s), qmin, qmax) * s + beta, whose dy/dbeta is 0 inside and 1
outside; here the offset is the integer-grid zero-point, beta = -z * s, so dy/dz = -s outside and 0 inside (and
dy/ds picks up -z outside, the beta's share). The zero-point is rounded in the forward (an integer grid, as the
deployed model has it) with a straight-through round. Each method's scale and zero-point gradients are multiplied
by the gradient scale g = 1 / sqrt(N * qmax), N the number of values of x sharing one scale (LSQ's choice).

Power-of-two scales (TQT, Jain et al.): the learned parameter is l = log2 of the scale and s = 2^ceil(l) with a
straight-through ceil, so dL/dl = dL/ds * ds/dl = dL/ds * s * ln 2 (no gradient scale unless one is given).

Every backward is the exact derivative of its forward with round (and ceil) replaced by a function of slope 1, so
the Functions take the rounding as an argument: a unit-slope surrogate lets finite differences check them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import OqError
from ..spec import QParams, QuantSpec

METHODS = ("ste", "lsq", "lsq+", "pot")
LN2 = math.log(2.0)
Rounding = Callable[[torch.Tensor], torch.Tensor]


def _sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reduce a gradient computed against x's shape to the shape of a broadcast operand."""
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad


def _quantize(x, scale, zp, qmin, qmax, rnd: Rounding):
    """(v, r, q) for v = x / scale, r = round(v), q = clamp(r + zp, qmin, qmax)."""
    v = x / scale
    r = rnd(v)
    return v, r, torch.clamp(r + zp, qmin, qmax)


def _regions(r, zp, qmin, qmax):
    """Masks of the values rounded below the grid, inside it and above it."""
    shifted = r + zp
    below, above = shifted < qmin, shifted > qmax
    return below, ~(below | above), above


def _scale_grad(v, r, zp, below, above, qmin, qmax):
    """dy/ds per value: r - v inside, qmin - z below, qmax - z above."""
    return torch.where(below, qmin - zp, torch.where(above, qmax - zp, r - v))


class FakeQuantSTE(torch.autograd.Function):
    """Fixed scale and zero-point; dL/dx passes where the value is inside the grid and is 0 where it saturates."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin: int, qmax: int, rnd: Rounding = torch.round):
        z = rnd(zero_point)
        _, r, q = _quantize(x, scale, z, qmin, qmax, rnd)
        ctx.save_for_backward(x, scale, z)
        ctx.consts = (qmin, qmax, rnd)
        return (q - z) * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale, z = ctx.saved_tensors
        qmin, qmax, rnd = ctx.consts
        _, inside, _ = _regions(rnd(x / scale), z, qmin, qmax)
        gx = torch.where(inside, grad, 0.0) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None


class FakeQuantLSQ(torch.autograd.Function):
    """Learned step size: gradients for x (straight-through) and the scale (LSQ, times `grad_scale`, a number or a
    tensor broadcasting against x); the zero-point stays fixed."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin: int, qmax: int, grad_scale=1.0, rnd: Rounding = torch.round):
        z = rnd(zero_point)
        _, _, q = _quantize(x, scale, z, qmin, qmax, rnd)
        ctx.save_for_backward(x, scale, z)
        ctx.consts = (qmin, qmax, grad_scale, rnd)
        return (q - z) * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale, z = ctx.saved_tensors
        qmin, qmax, g, rnd = ctx.consts
        v, r, _ = _quantize(x, scale, z, qmin, qmax, rnd)
        below, inside, above = _regions(r, z, qmin, qmax)
        gx = torch.where(inside, grad, 0.0) if ctx.needs_input_grad[0] else None
        gs = None
        if ctx.needs_input_grad[1]:
            gs = _sum_to(grad * _scale_grad(v, r, z, below, above, qmin, qmax) * g, scale)
        return gx, gs, None, None, None, None, None


class FakeQuantLSQPlus(torch.autograd.Function):
    """LSQ with a learned zero-point (LSQ+'s offset on the integer grid): dy/dz = 0 inside, -scale outside; the
    zero-point is rounded in the forward with a straight-through round. Both gradients are scaled by
    `grad_scale`."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin: int, qmax: int, grad_scale=1.0, rnd: Rounding = torch.round):
        z = rnd(zero_point)
        _, _, q = _quantize(x, scale, z, qmin, qmax, rnd)
        ctx.save_for_backward(x, scale, zero_point)
        ctx.consts = (qmin, qmax, grad_scale, rnd)
        return (q - z) * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale, zero_point = ctx.saved_tensors
        qmin, qmax, g, rnd = ctx.consts
        z = rnd(zero_point)
        v, r, _ = _quantize(x, scale, z, qmin, qmax, rnd)
        below, inside, above = _regions(r, z, qmin, qmax)
        gx = torch.where(inside, grad, 0.0) if ctx.needs_input_grad[0] else None
        gs = gz = None
        if ctx.needs_input_grad[1]:
            gs = _sum_to(grad * _scale_grad(v, r, z, below, above, qmin, qmax) * g, scale)
        if ctx.needs_input_grad[2]:
            gz = _sum_to(torch.where(inside, 0.0, -grad * scale) * g, zero_point)
        return gx, gs, gz, None, None, None, None


class FakeQuantPOT(torch.autograd.Function):
    """Power-of-two scale learned in the log2 domain: scale = 2^ceil(log2_scale), straight-through ceil, so
    dL/d(log2_scale) = scale * ln 2 * dL/dscale (dL/dscale as LSQ, times `grad_scale`). Zero-point fixed."""

    @staticmethod
    def forward(ctx, x, log2_scale, zero_point, qmin: int, qmax: int, grad_scale=1.0,
                rnd: Rounding = torch.round, ceil: Rounding = torch.ceil):
        scale = torch.exp2(ceil(log2_scale))
        z = rnd(zero_point)
        _, _, q = _quantize(x, scale, z, qmin, qmax, rnd)
        ctx.save_for_backward(x, log2_scale, scale, z)
        ctx.consts = (qmin, qmax, grad_scale, rnd)
        return (q - z) * scale

    @staticmethod
    def backward(ctx, grad):
        x, log2_scale, scale, z = ctx.saved_tensors
        qmin, qmax, g, rnd = ctx.consts
        v, r, _ = _quantize(x, scale, z, qmin, qmax, rnd)
        below, inside, above = _regions(r, z, qmin, qmax)
        gx = torch.where(inside, grad, 0.0) if ctx.needs_input_grad[0] else None
        gl = None
        if ctx.needs_input_grad[1]:
            ds = grad * _scale_grad(v, r, z, below, above, qmin, qmax) * g
            gl = _sum_to(ds * scale * LN2, log2_scale)
        return gx, gl, None, None, None, None, None, None


def _layout(t: torch.Tensor, shape, axis: int | None, block_size: int | None) -> torch.Tensor:
    """A per-tensor, per-channel or per-block parameter (oq's layout) broadcast against a tensor of `shape`
    (differentiably: autograd sums the gradients of a block back onto it)."""
    if axis is None or t.dim() == 0:
        if t.numel() != 1:
            raise OqError(f"a per-tensor scale/zero-point has one value, got shape {tuple(t.shape)}")
        return t.reshape(())
    rank = len(shape)
    if not -rank <= axis < rank:
        raise OqError(f"axis {axis} is out of range for a tensor of rank {rank}")
    axis %= rank
    size = shape[axis]
    if block_size:
        n_blocks = -(-size // block_size)
        want = tuple(shape[:axis]) + (n_blocks,) + tuple(shape[axis + 1:])
        if tuple(t.shape) != want:
            raise OqError(f"a per-block scale/zero-point for shape {tuple(shape)}, axis {axis}, block_size "
                          f"{block_size} has shape {want}, got {tuple(t.shape)}")
        index = torch.arange(size, device=t.device) // block_size
        return t.index_select(axis, index)
    if t.dim() != 1 or t.numel() != size:
        raise OqError(f"a per-channel scale/zero-point along axis {axis} of shape {tuple(shape)} has {size} values, "
                      f"got shape {tuple(t.shape)}")
    view = [1] * rank
    view[axis] = size
    return t.reshape(view)


def lsq_grad_scale(shape, qmin: int, qmax: int, axis: int | None = None, block_size: int | None = None,
                   device=None, dtype=torch.float32):
    """LSQ's gradient scale g = 1 / sqrt(N * qmax), N the values sharing a scale: a number per tensor, a tensor
    broadcasting against `shape` per channel or per block (the last, shorter block counts its own values)."""
    q_p = qmax if qmax > 0 else -qmin
    numel = math.prod(shape)
    if axis is None:
        return 1.0 / math.sqrt(max(numel, 1) * q_p)
    axis %= len(shape)
    size = shape[axis]
    rest = numel // size if size else 0
    if not block_size:
        return 1.0 / math.sqrt(max(rest, 1) * q_p)
    pos = torch.arange(size, device=device)
    start = pos // block_size * block_size
    count = torch.clamp(size - start, max=block_size) * rest
    view = [1] * len(shape)
    view[axis] = size
    return (1.0 / torch.sqrt(count.clamp(min=1).to(dtype) * q_p)).reshape(view)


def fake_quantize(x: torch.Tensor, scale, zero_point=0.0, qmin: int = -128, qmax: int = 127,
                  axis: int | None = None, block_size: int | None = None, method: str = "ste",
                  grad_scale=None) -> torch.Tensor:
    """Quantize-dequantize x on the integer grid [qmin, qmax], as QuantizeLinear -> DequantizeLinear.

    scale, zero_point: oq's layout (scalar; vector along `axis`; x's shape with `axis` in blocks of `block_size`).
    The zero-point is a float tensor holding integers (rounded half to even if not). method:
      "ste"   fixed scale and zero-point, straight-through x gradient
      "lsq"   learned scale (LSQ)
      "lsq+"  learned scale and zero-point (LSQ+)
      "pot"   power-of-two scale: `scale` is then log2 of the scale, learned (TQT); the forward uses 2^ceil of it
    grad_scale: multiplies the scale (and zero-point) gradients; default LSQ's 1 / sqrt(N * qmax) for "lsq" and
    "lsq+", 1 for "pot".
    """
    if method not in METHODS:
        raise OqError(f"unknown fake-quantization method {method!r}; choose from {', '.join(METHODS)}")
    if not qmin < qmax:
        raise OqError(f"qmin {qmin} must be below qmax {qmax}")
    if block_size is not None and (axis is None or block_size < 1):
        raise OqError("block_size needs an axis and must be positive")
    if not torch.is_floating_point(x):
        raise OqError(f"fake quantization takes a float tensor, got {x.dtype}")
    scale = torch.as_tensor(scale, dtype=x.dtype, device=x.device) if not torch.is_tensor(scale) else scale
    zero_point = torch.as_tensor(zero_point, device=x.device) if not torch.is_tensor(zero_point) else zero_point
    if not torch.is_floating_point(zero_point):
        zero_point = zero_point.to(scale.dtype if torch.is_floating_point(scale) else x.dtype)
    s = _layout(scale, x.shape, axis, block_size)
    z = _layout(zero_point, x.shape, axis, block_size) if zero_point.numel() > 1 else zero_point.reshape(())
    qmin, qmax = int(qmin), int(qmax)
    if method == "ste":
        return FakeQuantSTE.apply(x, s, z, qmin, qmax)
    if grad_scale is None:
        grad_scale = 1.0 if method == "pot" else lsq_grad_scale(tuple(x.shape), qmin, qmax, axis, block_size,
                                                                x.device, x.dtype)
    fn = {"lsq": FakeQuantLSQ, "lsq+": FakeQuantLSQPlus, "pot": FakeQuantPOT}[method]
    return fn.apply(x, s, z, qmin, qmax, grad_scale)


@dataclass
class FakeQuantParams:
    """An oq QParams as torch tensors, ready for fake_quantize.

    scale and zero_point keep oq's layout (zero_point as float); log2_scale (power-of-two specs) is the parameter
    method "pot" learns. `parameters(method)` lists the tensors a method learns, `to_qparams()` gives the oq QParams
    back (zero-point rounded and clamped to the grid, power-of-two scales from 2^ceil(log2_scale)).
    """
    scale: torch.Tensor
    zero_point: torch.Tensor
    qmin: int
    qmax: int
    axis: int | None = None
    block_size: int | None = None
    spec: QuantSpec = field(default_factory=QuantSpec)
    log2_scale: torch.Tensor | None = None

    @classmethod
    def from_qparams(cls, qp: QParams, dtype=torch.float32, device=None) -> "FakeQuantParams":
        spec = qp.spec
        if spec.is_float:
            raise OqError(f"{spec.dtype} is a float grid; fake quantization here covers integer grids")
        scale = torch.as_tensor(np.asarray(qp.scale, np.float32), device=device).to(dtype)
        zp = torch.as_tensor(np.asarray(qp.zero_point).astype(np.float64), device=device).to(dtype)
        axis = qp.axis if scale.dim() > 0 else None
        block = qp.block_size if axis is not None else None
        qmin, qmax = spec.qrange
        log2 = torch.log2(scale) if spec.power_of_two else None
        return cls(scale, zp, qmin, qmax, axis, block, spec, log2)

    @classmethod
    def from_spec(cls, spec: QuantSpec, scale, zero_point=None, axis: int | None = None,
                  block_size: int | None = None, dtype=torch.float32, device=None) -> "FakeQuantParams":
        """From a spec and scale/zero-point values (oq's layout); the zero-point defaults to the spec's own."""
        scale = np.asarray(scale, np.float32)
        if zero_point is None:
            qmin, qmax = spec.qrange
            default = spec.zero_point if spec.zero_point is not None else (
                0 if spec.signed else (qmin + qmax + 1) // 2 if spec.symmetric else qmin)
            zero_point = np.full(scale.shape, default)
        qp = QParams(scale, np.asarray(zero_point).astype(spec.np_dtype), axis, spec, block_size)
        return cls.from_qparams(qp, dtype, device)

    def parameters(self, method: str) -> list[torch.Tensor]:
        if method == "pot" and self.log2_scale is None:
            self.log2_scale = torch.log2(self.scale.detach())
        return {"ste": [], "lsq": [self.scale], "lsq+": [self.scale, self.zero_point],
                "pot": [self.log2_scale]}[method]

    def requires_grad_(self, method: str) -> "FakeQuantParams":
        """Make the tensors `method` learns leaves that require grad."""
        for t in self.parameters(method):
            t.requires_grad_(True)
        return self

    def __call__(self, x: torch.Tensor, method: str = "ste", grad_scale=None) -> torch.Tensor:
        scale = self.parameters("pot")[0] if method == "pot" else self.scale
        return fake_quantize(x, scale, self.zero_point, self.qmin, self.qmax, self.axis, self.block_size,
                             method, grad_scale)

    def to_qparams(self, method: str | None = None) -> QParams:
        """The current values as oq QParams; method "pot" (or a power-of-two spec with log2_scale) takes the scale
        from log2_scale."""
        use_log2 = method == "pot" or (method is None and self.spec.power_of_two and self.log2_scale is not None)
        with torch.no_grad():
            scale = torch.exp2(torch.ceil(self.parameters("pot")[0])) if use_log2 else self.scale
            zp = torch.clamp(torch.round(self.zero_point), self.qmin, self.qmax)
        scale = scale.detach().cpu().to(torch.float32).numpy()
        zp = zp.detach().cpu().to(torch.float64).numpy().astype(self.spec.np_dtype)
        return QParams(scale, zp, self.axis, self.spec, self.block_size)

"""QuantizeLinear, DequantizeLinear and oq's FakeQuant, plain (non-learnable) and bit-exact with onnxruntime.

QuantizeLinear returns its integer codes as a float tensor (float fake-quant: no integer dtype breaks autograd or
device moves); DequantizeLinear accepts those codes or real integer tensors (quantized weights and biases held as
buffers). Rounding is half to even (torch.round), codes saturate to the grid of the output type: int8, uint8,
int16, uint16, int4, uint4, and the FP8 types (rounded through torch's float8 dtypes). Scales are per tensor, per
axis (1-D scale along `axis`) or blocked (`block_size`, opset 21).

These are the built-in entries of the registry; learnable versions replace them with
`oq.bridge.registry.register("QuantizeLinear", fn)` (or per module with `to_torch(model, ops=...)`), and can reuse
`quant_grid` and `broadcast_qparam` from here.
"""
from __future__ import annotations

import torch
from onnx import TensorProto as T

from . import dtypes
from .registry import NodeAttrs, arg, op

_BY_STORAGE = {torch.int8: T.INT8, torch.uint8: T.UINT8, torch.int16: T.INT16, torch.int32: T.UINT16}


def quant_type(attrs: NodeAttrs, zero_point: torch.Tensor | None = None) -> int:
    """ONNX element type of a QuantizeLinear's output: the zero point's type, else output_dtype, else uint8."""
    if len(attrs.input_types) > 2 and attrs.input_types[2] is not None:
        return attrs.input_types[2]
    if zero_point is not None:
        return _BY_STORAGE.get(zero_point.dtype, T.UINT8)
    return attrs.get("output_dtype", 0) or T.UINT8


def _check_quantize(attrs: NodeAttrs) -> str | None:
    kind = attrs.input_types[2] if len(attrs.input_types) > 2 and attrs.input_types[2] else (
        attrs.get("output_dtype", 0) or T.UINT8)
    if kind not in dtypes.INT_RANGE and kind not in dtypes.FLOAT8 or kind == T.INT32:
        return f"quantizing to {dtypes.name(kind)} is not supported"
    return None


def quant_grid(kind: int) -> tuple[float, float]:
    """(qmin, qmax) of an integer element type."""
    lo, hi = dtypes.INT_RANGE[kind]
    return float(lo), float(hi)


def broadcast_qparam(value: torch.Tensor | None, x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor | None:
    """A scale or zero point shaped to broadcast against x: as is when per tensor, along `axis` when 1-D, repeated
    `block_size` times along `axis` when blocked."""
    if value is None or value.numel() == 1 and block_size <= 0:
        return None if value is None else value.reshape(())
    axis %= x.dim()
    if block_size > 0:
        return value.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
    view = [1] * x.dim()
    view[axis] = value.numel()
    return value.reshape(view)


def _codes_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


@op("QuantizeLinear", check=_check_quantize)
def quantize_linear(attrs: NodeAttrs, inputs: list):
    x, scale, zero_point = inputs[0], inputs[1], arg(inputs, 2)
    kind = quant_type(attrs, zero_point)
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    s = broadcast_qparam(scale, x, axis, block)
    codes = _codes_dtype(x)
    scaled = x.to(codes) / s.to(codes)  # half-precision inputs are divided in float32
    if kind in dtypes.FLOAT8:
        limit, fp8 = dtypes.FLOAT8[kind]
        if attrs.get("saturate", 1):
            scaled = torch.clamp(scaled, -limit, limit)
        return scaled.to(fp8).to(scaled.dtype)
    lo, hi = quant_grid(kind)
    q = torch.round(scaled)
    if zero_point is not None:
        q = q + broadcast_qparam(zero_point, x, axis, block).to(q.dtype)
    return torch.clamp(q, lo, hi)


@op("DequantizeLinear")
def dequantize_linear(attrs: NodeAttrs, inputs: list):
    x, scale, zero_point = inputs[0], inputs[1], arg(inputs, 2)
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    s = broadcast_qparam(scale, x, axis, block)
    zp = broadcast_qparam(zero_point, x, axis, block)
    if x.is_floating_point():
        centred = x.to(scale.dtype) if zp is None else x.to(scale.dtype) - zp.to(scale.dtype)
    else:  # integer tensors: subtract in integers first, as onnxruntime does (int32 biases are not exact in float)
        centred = (x.long() if zp is None else x.long() - zp.long()).to(scale.dtype)
    return centred * s


@op("FakeQuant", domain="oq")
def fake_quant(attrs: NodeAttrs, inputs: list):
    """oq.FakeQuant(x, scale, zero_point, qmin, qmax): the ops of its ONNX function body, in the same order."""
    x, scale, zero_point, qmin, qmax = inputs
    shifted = torch.round(x / scale) + zero_point
    return (torch.clamp(shifted, qmin, qmax) - zero_point) * scale

"""Resize (and the older Upsample) as separable gathers with per-axis weights.

Each resized axis maps output coordinates to input coordinates with the ONNX coordinate transformation, computed in
float32 as onnxruntime does, so nearest-neighbour picks the same pixels and linear/cubic use the same weights. The
result is a chain of index_select + weighted sums, differentiable with respect to the input.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .registry import NodeAttrs, arg, int_list, op

# tf_half_pixel_for_nearest (Resize-11) and tf_crop_and_resize are left out: onnxruntime runs neither
_COORDS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric")
_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _check(attrs: NodeAttrs) -> str | None:
    mode = attrs.get("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic", "bilinear", "trilinear"):
        return f"mode={mode!r} is not supported"
    if attrs.op_type == "Upsample":
        return None
    coords = attrs.get("coordinate_transformation_mode", "half_pixel")
    if coords not in _COORDS:
        return f"coordinate_transformation_mode={coords!r} is not supported"
    if attrs.get("nearest_mode", "round_prefer_floor") not in _NEAREST:
        return f"nearest_mode={attrs['nearest_mode']!r} is not an ONNX value"
    if attrs.get("antialias", 0) and mode != "nearest":
        return "antialias=1 is not supported"
    if attrs.get("keep_aspect_ratio_policy", "stretch") not in ("stretch", "not_larger", "not_smaller"):
        return f"keep_aspect_ratio_policy={attrs['keep_aspect_ratio_policy']!r} is not an ONNX value"
    return None


def _plan(attrs: NodeAttrs, x: torch.Tensor, scales_in, sizes_in) -> tuple[list[int], list[float]]:
    """Output sizes and the scale used in the coordinate transform of every axis."""
    rank = x.dim()
    shape = list(x.shape)
    axes = [a % rank for a in attrs.get("axes", range(rank))]
    scales = [1.0] * rank
    sizes = list(shape)
    f32 = np.float32
    if sizes_in is not None and sizes_in.numel():
        wanted = int_list(sizes_in)
        ratio = [float(f32(wanted[i]) / f32(shape[a])) for i, a in enumerate(axes)]
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            for i, a in enumerate(axes):
                sizes[a], scales[a] = wanted[i], ratio[i]
        else:
            common = min(ratio) if policy == "not_larger" else max(ratio)
            for a in axes:
                sizes[a] = int(math.floor(float(f32(common) * f32(shape[a])) + 0.5))
                scales[a] = common
    else:
        given = [float(v) for v in scales_in.reshape(-1).tolist()]
        for i, a in enumerate(axes):
            scales[a] = float(f32(given[i]))
            sizes[a] = int(f32(given[i]) * f32(shape[a]))
    return sizes, scales


def _source(coords: str, size_in: int, size_out: int, scale: float, device) -> torch.Tensor:
    """Input coordinate (float32) of every output position along one axis."""
    x = torch.arange(size_out, dtype=torch.float32, device=device)
    s = torch.tensor(scale, dtype=torch.float32)
    if coords == "asymmetric":
        return x / s
    if coords == "half_pixel":
        return (x + 0.5) / s - 0.5
    if coords == "pytorch_half_pixel":
        return (x + 0.5) / s - 0.5 if size_out > 1 else torch.zeros_like(x)
    if coords == "align_corners":
        if size_out == 1:
            return torch.zeros_like(x)
        return x * float(size_in - 1) / float(size_out - 1)
    # half_pixel_symmetric
    adjustment = np.float32(size_out) / (np.float32(scale) * np.float32(size_in))
    offset = np.float32(size_in / 2) * (np.float32(1) - adjustment)
    return float(offset) + (x + 0.5) / s - 0.5


def _nearest(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "floor":
        return torch.floor(x)
    if mode == "ceil":
        return torch.ceil(x)
    away = torch.sign(x) * torch.floor(torch.abs(x) + 0.5)  # std::round: halves away from zero
    if mode == "round_prefer_ceil":
        return away
    half = x == torch.trunc(x) + 0.5
    return torch.where(half, torch.floor(x), away)


def _cubic_weights(frac: torch.Tensor, a: float) -> list[torch.Tensor]:
    s = frac
    return [((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a,
            ((a + 2) * s - (a + 3)) * s * s + 1,
            ((a + 2) * (1 - s) - (a + 3)) * (1 - s) * (1 - s) + 1,
            ((a * (2 - s) - 5 * a) * (2 - s) + 8 * a) * (2 - s) - 4 * a]


def _taps(attrs: NodeAttrs, mode: str, coords: str, size_in: int, size_out: int, scale: float, device):
    """(indices, weights) per tap for one axis; weights None for nearest."""
    src = _source(coords, size_in, size_out, scale, device)
    last = size_in - 1
    if mode == "nearest":
        rounding = attrs.get("nearest_mode", "round_prefer_floor")
        if rounding == "simple":  # Resize-10 and Upsample: ceil when shrinking, floor when growing
            rounding = "ceil" if scale < 1.0 else "floor"
        index = _nearest(src, rounding).long().clamp(0, last)
        return [(index, None)]
    if mode == "linear":
        src = src.clamp(0.0, float(last))
        low = src.long().clamp(max=last)
        high = (low + 1).clamp(max=last)
        w_high = torch.abs(src - low.float())
        w_low = torch.abs(src - high.float())
        edge = low == high
        w_low = torch.where(edge, torch.full_like(w_low, 0.5), w_low)
        w_high = torch.where(edge, torch.full_like(w_high, 0.5), w_high)
        return [(low, w_low), (high, w_high)]
    base = torch.floor(src)
    weights = _cubic_weights(src - base, float(attrs.get("cubic_coeff_a", -0.75)))
    raw = [base.long() + k for k in (-1, 0, 1, 2)]
    if attrs.get("exclude_outside", 0):
        weights = [torch.where((r < 0) | (r > last), torch.zeros_like(w), w) for r, w in zip(raw, weights)]
        total = sum(weights)
        weights = [w / total for w in weights]
    return [(r.clamp(0, last), w) for r, w in zip(raw, weights)]


def _resample(attrs: NodeAttrs, x: torch.Tensor, sizes: list[int], scales: list[float], mode: str,
              coords: str) -> torch.Tensor:
    for axis in range(x.dim()):
        size_in, size_out = x.shape[axis], sizes[axis]
        if size_in == size_out and scales[axis] == 1.0 and mode != "nearest":
            continue
        taps = _taps(attrs, mode, coords, size_in, size_out, scales[axis], x.device)
        if mode == "nearest":
            index = taps[0][0]
            if size_in != size_out or not torch.equal(index, torch.arange(size_in, device=x.device)):
                x = x.index_select(axis, index)
            continue
        view = [1] * x.dim()
        view[axis] = size_out
        out = None
        for index, weight in taps:
            term = x.index_select(axis, index) * weight.to(x.dtype).reshape(view)
            out = term if out is None else out + term
        x = out
    return x


@op("Resize", check=_check)
def resize(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    if attrs.opset < 11:
        scales, sizes = inputs[1], None
        coords = "asymmetric"
        attrs = attrs.derive({"nearest_mode": "simple"})
    else:
        scales, sizes = arg(inputs, 2), arg(inputs, 3)
        coords = attrs.get("coordinate_transformation_mode", "half_pixel")
    out_sizes, out_scales = _plan(attrs, x, scales, sizes)
    mode = attrs.get("mode", "nearest")
    return _resample(attrs, x, out_sizes, out_scales, mode, coords)


@op("Upsample", check=_check)
def upsample(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    scales = arg(inputs, 1)
    if scales is None:
        scales = torch.tensor(attrs["scales"], dtype=torch.float32)
    out_sizes, out_scales = _plan(NodeAttrs({}, op_type="Upsample"), x, scales, None)
    mode = {"bilinear": "linear", "trilinear": "linear"}.get(attrs.get("mode", "nearest"), attrs.get("mode", "nearest"))
    return _resample(NodeAttrs({"nearest_mode": "simple"}, op_type="Upsample"), x, out_sizes, out_scales, mode,
                     "asymmetric")

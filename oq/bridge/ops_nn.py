"""Convolutions, pooling and normalisations.

Padding follows ONNX exactly: asymmetric pads and auto_pad are applied with F.pad before a pad-free torch kernel;
pooling output sizes (ceil_mode included) are computed here and the input padded to reach them, so torch's own
padding and ceil rules never come into play.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .registry import NodeAttrs, arg, op

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_AUTO_PAD = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _check_spatial(attrs: NodeAttrs) -> str | None:
    if attrs.get("auto_pad", "NOTSET") not in _AUTO_PAD:
        return f"auto_pad={attrs['auto_pad']!r} is not an ONNX value"
    kernel = attrs.get("kernel_shape")
    if kernel is not None and len(kernel) not in (1, 2, 3):
        return f"{len(kernel)}-d kernels (the bridge runs 1-d, 2-d and 3-d)"
    return None


def _torch_pad(begin: list[int], end: list[int]) -> list[int]:
    """ONNX begin/end pads as F.pad's list (last axis first)."""
    out = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += [b, e]
    return out


def _same_pads(size: int, kernel: int, stride: int, dilation: int, upper: bool) -> tuple[int, int]:
    out = -(-size // stride)
    total = max(0, (out - 1) * stride + (kernel - 1) * dilation + 1 - size)
    small = total // 2
    return (small, total - small) if upper else (total - small, small)


def _pads(attrs: NodeAttrs, sizes, kernel, strides, dilations) -> tuple[list[int], list[int]]:
    n = len(kernel)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pairs = [_same_pads(sizes[i], kernel[i], strides[i], dilations[i], auto == "SAME_UPPER") for i in range(n)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    if auto == "VALID":
        return [0] * n, [0] * n
    pads = list(attrs.get("pads", [0] * 2 * n))
    return pads[:n], pads[n:]


@op("Conv", check=_check_spatial)
def conv(attrs: NodeAttrs, inputs: list):
    x, w, b = inputs[0], inputs[1], arg(inputs, 2)
    n = w.dim() - 2
    kernel = list(w.shape[2:])
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    begin, end = _pads(attrs, list(x.shape[2:]), kernel, strides, dilations)
    padding = begin
    if begin != end:
        x = F.pad(x, _torch_pad(begin, end))
        padding = [0] * n
    return _CONV[n](x, w, b, strides, padding, dilations, attrs.get("group", 1))


@op("ConvTranspose", check=_check_spatial)
def conv_transpose(attrs: NodeAttrs, inputs: list):
    x, w, b = inputs[0], inputs[1], arg(inputs, 2)
    n = w.dim() - 2
    kernel = list(w.shape[2:])
    sizes = list(x.shape[2:])
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    extra = list(attrs.get("output_padding", [0] * n))
    y = _CONV_T[n](x, w, None, strides, 0, 0, attrs.get("group", 1), dilations)
    full = [(sizes[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 + extra[i] for i in range(n)]
    auto = attrs.get("auto_pad", "NOTSET")
    wanted = attrs.get("output_shape")
    if wanted is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        if wanted is None:
            wanted = [sizes[i] * strides[i] for i in range(n)]
        wanted = list(wanted)[-n:]
        total = [full[i] - wanted[i] for i in range(n)]
        if auto == "SAME_UPPER":
            begin, end = [t // 2 for t in total], [t - t // 2 for t in total]
        else:
            begin, end = [t - t // 2 for t in total], [t // 2 for t in total]
    elif auto == "VALID":
        begin, end = [0] * n, [0] * n
    else:
        pads = list(attrs.get("pads", [0] * 2 * n))
        begin, end = pads[:n], pads[n:]
    # crop the pads (negative F.pad) and append output_padding
    y = F.pad(y, _torch_pad([-p for p in begin], [extra[i] - end[i] for i in range(n)]))
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * n))
    return y


# --- pooling ----------------------------------------------------------------------------------------------------
def _pool_geometry(attrs: NodeAttrs, x: torch.Tensor):
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    sizes = list(x.shape[2:])
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    begin, end = _pads(attrs, sizes, kernel, strides, dilations)
    ceil = attrs.get("ceil_mode", 0) and attrs.get("auto_pad", "NOTSET") == "NOTSET"
    extra = []
    for i in range(n):
        span = (kernel[i] - 1) * dilations[i] + 1
        room = sizes[i] + begin[i] + end[i] - span
        out = (-(-room // strides[i]) if ceil else room // strides[i]) + 1
        if ceil and (out - 1) * strides[i] >= sizes[i] + begin[i]:
            out -= 1  # the last window must start inside the input or its leading pad
        extra.append(max(0, (out - 1) * strides[i] + span - (sizes[i] + begin[i] + end[i])))
    return kernel, strides, dilations, begin, end, extra


def _check_pool(attrs: NodeAttrs) -> str | None:
    if "kernel_shape" not in attrs:
        return "no kernel_shape attribute"
    if attrs.op_type == "MaxPool" and attrs.wants(1):
        return "the Indices output is not supported"
    return _check_spatial(attrs)


@op("MaxPool", check=_check_pool)
def max_pool(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    kernel, strides, dilations, begin, end, extra = _pool_geometry(attrs, x)
    n = len(kernel)
    if any(begin) or any(end) or any(extra):
        low = -math.inf if x.is_floating_point() else torch.iinfo(x.dtype).min
        x = F.pad(x, _torch_pad(begin, [e + x_ for e, x_ in zip(end, extra)]), value=low)
    return _MAX_POOL[n](x, kernel, strides, 0, dilations)


@op("AveragePool", check=_check_pool)
def average_pool(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    kernel, strides, dilations, begin, end, extra = _pool_geometry(attrs, x)
    n = len(kernel)
    plain = all(d == 1 for d in dilations)
    if not (any(begin) or any(end) or any(extra)) and plain:
        return _AVG_POOL[n](x, kernel, strides)
    # window sums over the zero-padded input, divided by how many positions each window counts
    include = bool(attrs.get("count_include_pad", 0))
    mask = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    if include:
        mask = F.pad(mask, _torch_pad(begin, end), value=1.0)
        mask = F.pad(mask, _torch_pad([0] * n, extra))
    else:
        mask = F.pad(mask, _torch_pad(begin, [e + x_ for e, x_ in zip(end, extra)]))
    x = F.pad(x, _torch_pad(begin, [e + x_ for e, x_ in zip(end, extra)]))
    sums = _window_sum(x, kernel, strides, dilations)
    counts = _window_sum(mask, kernel, strides, dilations)
    return sums / counts


def _window_sum(x: torch.Tensor, kernel, strides, dilations) -> torch.Tensor:
    n = len(kernel)
    channels = x.shape[1]
    ones = torch.ones((channels, 1, *kernel), dtype=x.dtype, device=x.device)
    return _CONV[n](x, ones, None, strides, 0, dilations, channels)


@op("GlobalAveragePool")
def global_average_pool(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@op("GlobalMaxPool")
def global_max_pool(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


# --- normalisation ----------------------------------------------------------------------------------------------
def _check_bn(attrs: NodeAttrs) -> str | None:
    if attrs.get("training_mode", 0) or any(attrs.wants(i) for i in range(1, 5)):
        return "training mode (running statistics outputs) is not supported; the bridge runs inference mode"
    return None


@op("BatchNormalization", check=_check_bn)
def batch_norm(attrs: NodeAttrs, inputs: list):
    x, scale, bias, mean, var = inputs[:5]
    view = (1, -1) + (1,) * (x.dim() - 2)
    # written out (not F.batch_norm, which refuses gradients for the statistics: here they are initializers too)
    factor = scale * torch.rsqrt(var + attrs.get("epsilon", 1e-5))
    return (x - mean.reshape(view)) * factor.reshape(view) + bias.reshape(view)


@op("InstanceNormalization")
def instance_norm(attrs: NodeAttrs, inputs: list):
    x, scale, bias = inputs[:3]
    return F.instance_norm(x, weight=scale, bias=bias, eps=attrs.get("epsilon", 1e-5))


@op("LayerNormalization")
def layer_norm(attrs: NodeAttrs, inputs: list):
    x, scale, bias = inputs[0], inputs[1], arg(inputs, 2)
    axis = attrs.get("axis", -1) % x.dim()
    eps = attrs.get("epsilon", 1e-5)
    shape = tuple(x.shape[axis:])
    dtype = x.dtype
    if attrs.get("stash_type", 1) == 1 and dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    simple = tuple(scale.shape) == shape and (bias is None or tuple(bias.shape) == shape)
    if simple and not (attrs.wants(1) or attrs.wants(2)):
        return F.layer_norm(x, shape, scale.to(x.dtype), None if bias is None else bias.to(x.dtype), eps).to(dtype)
    dims = tuple(range(axis, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    centred = x - mean
    inv_std = torch.rsqrt((centred * centred).mean(dim=dims, keepdim=True) + eps)
    y = centred * inv_std * scale
    if bias is not None:
        y = y + bias
    return y.to(dtype), mean, inv_std


@op("GroupNormalization")
def group_norm(attrs: NodeAttrs, inputs: list):
    x, scale, bias = inputs[:3]
    groups = attrs["num_groups"]
    channels = x.shape[1]
    y = F.group_norm(x, groups, None, None, attrs.get("epsilon", 1e-5))
    if scale.numel() != channels:  # opset 18: one scale and bias per group
        scale = scale.repeat_interleave(channels // groups)
        bias = bias.repeat_interleave(channels // groups)
    view = (1, channels) + (1,) * (x.dim() - 2)
    return y * scale.reshape(view) + bias.reshape(view)


@op("LRN")
def lrn(attrs: NodeAttrs, inputs: list):
    return F.local_response_norm(inputs[0], attrs["size"], attrs.get("alpha", 1e-4), attrs.get("beta", 0.75),
                                 attrs.get("bias", 1.0))

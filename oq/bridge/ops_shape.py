"""Shape, indexing and data-movement ops, constants and casts.

Shape-like inputs (Reshape's shape, Slice's starts, ...) are read as Python ints: the module runs eagerly, so a
shape computed by the graph (Shape -> Gather -> Concat -> Reshape) works the same as a constant one.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from onnx import TensorProto as T

from . import dtypes
from .registry import NodeAttrs, arg, int_list, op


@op("Identity")
def identity(attrs: NodeAttrs, inputs: list):
    return inputs[0]


@op("Dropout")
def dropout(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    training = arg(inputs, 2)
    if training is not None and bool(training):
        raise ValueError("training_mode=True is not supported (the bridge runs dropout in inference mode)")
    return x, torch.ones_like(x, dtype=torch.bool)


@op("Reshape")
def reshape(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    shape = int_list(inputs[1]) if attrs.opset >= 5 else list(attrs["shape"])
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


@op("Flatten")
def flatten(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    axis = attrs.get("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


@op("Transpose")
def transpose(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    perm = attrs.get("perm") or list(reversed(range(x.dim())))
    return x.permute(*perm)


@op("Concat")
def concat(attrs: NodeAttrs, inputs: list):
    return torch.cat([t for t in inputs if t is not None], dim=attrs["axis"])


@op("Split")
def split(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    axis = attrs.get("axis", 0)
    sizes = int_list(arg(inputs, 1)) if attrs.opset >= 13 else list(attrs.get("split", []))
    if not sizes:
        parts = attrs.get("num_outputs", len(attrs.outputs))
        chunk = -(-x.shape[axis] // parts)
        sizes = [min(chunk, x.shape[axis] - i * chunk) for i in range(parts)]
    return tuple(torch.split(x, sizes, dim=axis))


@op("Slice")
def slice_(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    if attrs.opset >= 10:
        starts, ends = int_list(inputs[1]), int_list(inputs[2])
        axes = int_list(arg(inputs, 3)) or list(range(len(starts)))
        steps = int_list(arg(inputs, 4)) or [1] * len(starts)
    else:
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes = list(attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= x.dim()
        size = x.shape[axis]
        start = start + size if start < 0 else start
        end = end + size if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), size), min(max(end, 0), size)
            index = [slice(None)] * axis + [slice(start, end, step)]
            x = x[tuple(index)]
        else:
            start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
            positions = torch.arange(start, end, step, device=x.device)
            x = x.index_select(axis, positions)
    return x


def _positive(index: torch.Tensor, size: int) -> torch.Tensor:
    index = index.long()
    return torch.where(index < 0, index + size, index)


@op("Gather")
def gather(attrs: NodeAttrs, inputs: list):
    x, index = inputs
    axis = attrs.get("axis", 0) % x.dim()
    index = _positive(index, x.shape[axis])
    out = x.index_select(axis, index.reshape(-1))
    return out.reshape((*x.shape[:axis], *index.shape, *x.shape[axis + 1:]))  # a tuple: () for a scalar result


@op("GatherElements")
def gather_elements(attrs: NodeAttrs, inputs: list):
    x, index = inputs
    axis = attrs.get("axis", 0) % x.dim()
    return torch.gather(x, axis, _positive(index, x.shape[axis]))


@op("GatherND", check=lambda a: "batch_dims > 0 is not supported" if a.get("batch_dims", 0) else None)
def gather_nd(attrs: NodeAttrs, inputs: list):
    x, index = inputs
    k = index.shape[-1]
    parts = tuple(_positive(index[..., i], x.shape[i]) for i in range(k))
    return x[parts]


@op("ScatterND", check=lambda a: None if a.get("reduction", "none") == "none" else "reduction is not supported")
def scatter_nd(attrs: NodeAttrs, inputs: list):
    x, index, updates = inputs
    out = x.clone()
    k = index.shape[-1]
    out[tuple(_positive(index[..., i], x.shape[i]) for i in range(k))] = updates
    return out


@op("Squeeze")
def squeeze(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    axes = int_list(arg(inputs, 1)) if attrs.opset >= 13 else list(attrs.get("axes", []))
    if not axes:
        return x.squeeze()
    return x.squeeze(tuple(a % x.dim() for a in axes))


@op("Unsqueeze")
def unsqueeze(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    axes = int_list(inputs[1]) if attrs.opset >= 13 else list(attrs["axes"])
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


@op("Expand")
def expand(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    return x.expand(torch.broadcast_shapes(x.shape, tuple(int_list(inputs[1]))))


@op("Tile")
def tile(attrs: NodeAttrs, inputs: list):
    return inputs[0].repeat(*int_list(inputs[1]))


@op("Shape")
def shape(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    rank = x.dim()
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return torch.tensor(list(x.shape[start:end]), dtype=torch.int64, device=x.device)


@op("Size")
def size(attrs: NodeAttrs, inputs: list):
    return torch.tensor(inputs[0].numel(), dtype=torch.int64, device=inputs[0].device)


@op("ConstantOfShape")
def constant_of_shape(attrs: NodeAttrs, inputs: list):
    value = attrs.get("value")
    if value is None:
        value = torch.zeros(1, dtype=torch.float32)
    dims = int_list(inputs[0])
    return torch.full(dims, value.reshape(-1)[0].item(), dtype=value.dtype, device=inputs[0].device)


def _check_constant(attrs: NodeAttrs) -> str | None:
    supported = {"value", "value_float", "value_floats", "value_int", "value_ints"}
    given = set(attrs) - supported
    return f"attribute {sorted(given)[0]} (string and sparse constants) is not supported" if given else None


@op("Constant", check=_check_constant)
def constant(attrs: NodeAttrs, inputs: list):
    if "value" in attrs:
        return attrs["value"].clone()
    if "value_float" in attrs or "value_floats" in attrs:
        return torch.tensor(attrs.get("value_float", attrs.get("value_floats")), dtype=torch.float32)
    return torch.tensor(attrs.get("value_int", attrs.get("value_ints")), dtype=torch.int64)


def _check_cast(attrs: NodeAttrs) -> str | None:
    to = attrs.get("to")
    if to not in dtypes.STORAGE or to in (T.INT4, T.UINT4):
        return f"casting to {dtypes.name(to)} is not supported"
    return None


def cast_to(x: torch.Tensor, to: int, saturate: bool = True) -> torch.Tensor:
    if to in dtypes.FLOAT8:
        limit, fp8 = dtypes.FLOAT8[to]
        x = x.float()
        if saturate:
            x = torch.clamp(x, -limit, limit)
        return x.to(fp8).float()
    target = dtypes.storage(to)
    if target == torch.bool:
        return x != 0
    return x.to(target)


@op("Cast", check=_check_cast)
def cast(attrs: NodeAttrs, inputs: list):
    return cast_to(inputs[0], attrs["to"], bool(attrs.get("saturate", 1)))


@op("CastLike")
def cast_like(attrs: NodeAttrs, inputs: list):
    to = attrs.input_type(1)
    if to in dtypes.FLOAT8:
        return cast_to(inputs[0], to, bool(attrs.get("saturate", 1)))
    return inputs[0].to(inputs[1].dtype)


@op("Range")
def range_(attrs: NodeAttrs, inputs: list):
    start, limit, delta = inputs
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype, device=start.device)


@op("TopK")
def top_k(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    k = int_list(inputs[1])[0] if attrs.opset >= 10 else attrs["k"]
    axis = attrs.get("axis", -1) % x.dim()
    values, index = torch.sort(x, dim=axis, descending=bool(attrs.get("largest", 1)), stable=True)
    return values.narrow(axis, 0, k), index.narrow(axis, 0, k)


@op("NonZero")
def non_zero(attrs: NodeAttrs, inputs: list):
    return torch.nonzero(inputs[0]).t()


@op("Trilu")
def trilu(attrs: NodeAttrs, inputs: list):
    k = int_list(arg(inputs, 1))[0] if arg(inputs, 1) is not None else 0
    return torch.triu(inputs[0], k) if attrs.get("upper", 1) else torch.tril(inputs[0], k)


@op("DepthToSpace")
def depth_to_space(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    if attrs.get("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


@op("SpaceToDepth")
def space_to_depth(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


# --- Pad --------------------------------------------------------------------------------------------------------
def _check_pad(attrs: NodeAttrs) -> str | None:
    mode = attrs.get("mode", "constant")
    return None if mode in ("constant", "reflect", "edge", "wrap") else f"mode={mode!r} is not supported"


def _pad_index(size: int, begin: int, end: int, mode: str, device) -> torch.Tensor:
    index = torch.arange(-begin, size + end, device=device)
    if mode == "edge":
        return index.clamp(0, size - 1)
    if mode == "wrap":
        return torch.remainder(index, size)
    period = 2 * (size - 1)
    if period == 0:
        return torch.zeros_like(index)
    index = torch.remainder(index, period)
    return torch.where(index >= size, period - index, index)


@op("Pad", check=_check_pad)
def pad(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    rank = x.dim()
    mode = attrs.get("mode", "constant")
    if attrs.opset >= 11:
        pads = int_list(inputs[1])
        value = arg(inputs, 2)
        value = value.reshape(-1)[0].item() if value is not None and value.numel() else 0
        axes = int_list(arg(inputs, 3)) or list(range(rank))
    else:
        pads, value, axes = list(attrs["pads"]), attrs.get("value", 0.0), list(range(rank))
    axes = [a % rank for a in axes]
    begin, end = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[i + len(axes)]
    if mode == "constant":
        flat = []
        for a in reversed(range(rank)):
            flat += [begin[a], end[a]]
        return F.pad(x, flat, value=value)
    for a in range(rank):
        if begin[a] or end[a]:
            x = x.index_select(a, _pad_index(x.shape[a], begin[a], end[a], mode, x.device))
    return x

"""Element-wise arithmetic, activations, comparisons, logic, MatMul/Gemm/Einsum, Softmax and reductions."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .registry import NodeAttrs, arg, int_list, op


def _binary(fn):
    return lambda attrs, inputs: fn(inputs[0], inputs[1])


for _name, _fn in {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Equal": torch.eq, "Less": torch.lt,
                   "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge,
                   "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
                   "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or,
                   "BitwiseXor": torch.bitwise_xor}.items():
    op(_name)(_binary(_fn))


@op("Div")
def div(attrs: NodeAttrs, inputs: list):
    a, b = inputs
    if a.is_floating_point():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


@op("Pow")
def pow_(attrs: NodeAttrs, inputs: list):
    x, y = inputs
    out = torch.pow(x, y)
    return out if out.dtype == x.dtype else out.to(x.dtype)


@op("Mod")
def mod(attrs: NodeAttrs, inputs: list):
    a, b = inputs
    return torch.fmod(a, b) if attrs.get("fmod", 0) else torch.remainder(a, b)


def _unary(fn):
    return lambda attrs, inputs: fn(inputs[0])


for _name, _fn in {"Sqrt": torch.sqrt, "Exp": torch.exp, "Log": torch.log, "Neg": torch.neg, "Abs": torch.abs,
                   "Reciprocal": torch.reciprocal, "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round,
                   "Sign": torch.sign, "Sin": torch.sin, "Cos": torch.cos, "Tan": torch.tan, "Asin": torch.asin,
                   "Acos": torch.acos, "Atan": torch.atan, "Sinh": torch.sinh, "Cosh": torch.cosh,
                   "Asinh": torch.asinh, "Acosh": torch.acosh, "Atanh": torch.atanh, "Erf": torch.erf,
                   "IsNaN": torch.isnan, "Not": torch.logical_not, "BitwiseNot": torch.bitwise_not,
                   "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Softplus": F.softplus,
                   "Softsign": F.softsign, "Mish": F.mish}.items():
    op(_name)(_unary(_fn))


@op("IsInf")
def is_inf(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    pos, neg = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    return (torch.isposinf(x) if pos else torch.zeros_like(x, dtype=torch.bool)) | \
        (torch.isneginf(x) if neg else torch.zeros_like(x, dtype=torch.bool))


@op("LeakyRelu")
def leaky_relu(attrs: NodeAttrs, inputs: list):
    return F.leaky_relu(inputs[0], attrs.get("alpha", 0.01))


@op("PRelu")
def prelu(attrs: NodeAttrs, inputs: list):
    x, slope = inputs
    return torch.where(x < 0, x * slope, x)


@op("Elu")
def elu(attrs: NodeAttrs, inputs: list):
    return F.elu(inputs[0], attrs.get("alpha", 1.0))


@op("Selu")
def selu(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    alpha, gamma = attrs.get("alpha", 1.67326319217681884765625), attrs.get("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


@op("Celu")
def celu(attrs: NodeAttrs, inputs: list):
    return F.celu(inputs[0], attrs.get("alpha", 1.0))


@op("ThresholdedRelu")
def thresholded_relu(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    return torch.where(x > attrs.get("alpha", 1.0), x, torch.zeros_like(x))


@op("Shrink")
def shrink(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    lambd, bias = attrs.get("lambd", 0.5), attrs.get("bias", 0.0)
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))


@op("HardSigmoid")
def hard_sigmoid(attrs: NodeAttrs, inputs: list):
    return torch.clamp(attrs.get("alpha", 0.2) * inputs[0] + attrs.get("beta", 0.5), 0.0, 1.0)


@op("HardSwish")
def hard_swish(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    return x * torch.clamp(x * (1.0 / 6.0) + 0.5, 0.0, 1.0)


@op("Gelu", check=lambda a: None if a.get("approximate", "none") in ("none", "tanh")
    else f"approximate={a['approximate']!r} is not an ONNX value")
def gelu(attrs: NodeAttrs, inputs: list):
    return F.gelu(inputs[0], approximate=attrs.get("approximate", "none"))


@op("Clip")
def clip(attrs: NodeAttrs, inputs: list):
    x = inputs[0]
    if attrs.opset < 11:
        return torch.clamp(x, attrs.get("min", -math.inf), attrs.get("max", math.inf))
    lo, hi = arg(inputs, 1), arg(inputs, 2)
    if lo is None and hi is None:
        return x
    return torch.clamp(x, min=lo, max=hi)


def _variadic(fn):
    return lambda attrs, inputs: functools.reduce(fn, [t for t in inputs if t is not None])


op("Sum")(_variadic(torch.add))
op("Max")(_variadic(torch.maximum))
op("Min")(_variadic(torch.minimum))


@op("Mean")
def mean(attrs: NodeAttrs, inputs: list):
    values = [t for t in inputs if t is not None]
    return functools.reduce(torch.add, values) / len(values)


@op("Where")
def where(attrs: NodeAttrs, inputs: list):
    return torch.where(inputs[0].bool(), inputs[1], inputs[2])


# --- products ---------------------------------------------------------------------------------------------------
@op("MatMul")
def matmul(attrs: NodeAttrs, inputs: list):
    return torch.matmul(inputs[0], inputs[1])


@op("Gemm")
def gemm(attrs: NodeAttrs, inputs: list):
    a, b, c = inputs[0], inputs[1], arg(inputs, 2)
    if attrs.get("transA", 0):
        a = a.transpose(0, 1)
    if attrs.get("transB", 0):
        b = b.transpose(0, 1)
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    y = torch.matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * beta)
    return y


@op("Einsum")
def einsum(attrs: NodeAttrs, inputs: list):
    return torch.einsum(attrs["equation"].replace(" ", ""), *inputs)


# --- softmax family ---------------------------------------------------------------------------------------------
def _softmax_like(fn):
    def run(attrs: NodeAttrs, inputs: list):
        x = inputs[0]
        if attrs.opset >= 13:
            return fn(x, attrs.get("axis", -1))
        axis = attrs.get("axis", 1) % max(x.dim(), 1)  # before opset 13: coerced to 2-D at axis
        shape = x.shape
        flat = x.reshape(math.prod(shape[:axis]), math.prod(shape[axis:]))
        return fn(flat, 1).reshape(shape)
    return run


def _hardmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    index = torch.argmax(x, dim=dim, keepdim=True)
    return torch.zeros_like(x).scatter_(dim, index, 1.0)


op("Softmax")(_softmax_like(lambda x, d: torch.softmax(x, d)))
op("LogSoftmax")(_softmax_like(lambda x, d: torch.log_softmax(x, d)))
op("Hardmax")(_softmax_like(_hardmax))


# --- reductions -------------------------------------------------------------------------------------------------
def _axes(attrs: NodeAttrs, inputs: list, since: int) -> list[int] | None:
    """Reduction axes (None: reduce nothing, noop_with_empty_axes)."""
    axes = int_list(arg(inputs, 1)) if attrs.opset >= since else list(attrs.get("axes", []))
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return None
        return list(range(inputs[0].dim()))
    return [a % max(inputs[0].dim(), 1) for a in axes]


def _reduction(fn, since: int = 18):
    def run(attrs: NodeAttrs, inputs: list):
        x = inputs[0]
        axes = _axes(attrs, inputs, since)
        if axes is None:
            return x
        keep = bool(attrs.get("keepdims", 1))
        if not axes:  # a 0-d input
            return fn(x.reshape(1), [0], False)
        return fn(x, axes, keep)
    return run


def _prod(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    for a in sorted(axes, reverse=True):
        x = torch.prod(x, dim=a, keepdim=True)
    return x if keep else x.squeeze(axes) if axes else x


op("ReduceSum")(_reduction(lambda x, d, k: torch.sum(x, dim=d, keepdim=k), since=13))
op("ReduceMean")(_reduction(lambda x, d, k: torch.mean(x, dim=d, keepdim=k)))
op("ReduceMax")(_reduction(lambda x, d, k: torch.amax(x, dim=d, keepdim=k)))
op("ReduceMin")(_reduction(lambda x, d, k: torch.amin(x, dim=d, keepdim=k)))
op("ReduceProd")(_reduction(_prod))
op("ReduceL1")(_reduction(lambda x, d, k: torch.sum(torch.abs(x), dim=d, keepdim=k)))
op("ReduceL2")(_reduction(lambda x, d, k: torch.sqrt(torch.sum(x * x, dim=d, keepdim=k))))
op("ReduceSumSquare")(_reduction(lambda x, d, k: torch.sum(x * x, dim=d, keepdim=k)))
op("ReduceLogSum")(_reduction(lambda x, d, k: torch.log(torch.sum(x, dim=d, keepdim=k))))
op("ReduceLogSumExp")(_reduction(lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k)))


def _arg_reduce(fn):
    def run(attrs: NodeAttrs, inputs: list):
        x = inputs[0]
        axis = attrs.get("axis", 0) % max(x.dim(), 1)
        keep = bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index", 0):
            index = fn(torch.flip(x, [axis]), dim=axis, keepdim=keep)
            return x.shape[axis] - 1 - index
        return fn(x, dim=axis, keepdim=keep)
    return run


op("ArgMax")(_arg_reduce(torch.argmax))
op("ArgMin")(_arg_reduce(torch.argmin))


@op("CumSum")
def cumsum(attrs: NodeAttrs, inputs: list):
    x, axis = inputs[0], int_list(inputs[1])[0]
    if attrs.get("reverse", 0):
        x = torch.flip(x, [axis])
    y = torch.cumsum(x, dim=axis)
    if attrs.get("exclusive", 0):
        y = y - x
    return torch.flip(y, [axis]) if attrs.get("reverse", 0) else y

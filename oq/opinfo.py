"""What oq knows about ONNX ops regardless of target: one table of the weighted ops (those that multiply their input
by a weight): where weight and bias sit, the weight's channel axes, and how to rescale its channels.

Every pass that needs such knowledge looks the op up here (`weighted_op(node)`) instead of testing op names; a new
weighted op is one more `WeightedOp` entry in `WEIGHTED_OPS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

Axis = Callable[[gs.Node, int], int]  # (node, rank of the weight) -> axis


def _one(node: gs.Node) -> float:
    return 1.0


def _gemm_alpha(node: gs.Node) -> float:
    return float(node.attrs.get("alpha", 1.0))


def _conv_gemm(node: gs.Node, w: np.ndarray) -> np.ndarray:
    """Conv weight [M, C/G, *k] as [G, K, M/G] with K = (taps, c_in), c_in fastest (im2col on NHWC data, the order
    onnxruntime's int8 kernels pair K in)."""
    group = int(node.attrs.get("group", 1))
    co, cg = w.shape[:2]
    wg = w.reshape(group, co // group, cg, *w.shape[2:])
    wg = np.moveaxis(wg, 1, -1)  # [G, Cg, *k, Co_g]
    wg = np.moveaxis(wg, 1, -2)  # [G, *k, Cg, Co_g]
    return wg.reshape(group, -1, co // group)


def _gemm_gemm(node: gs.Node, w: np.ndarray) -> np.ndarray:
    return (w.T if node.attrs.get("transB", 0) else w)[None]


def _matmul_gemm(node: gs.Node, w: np.ndarray) -> np.ndarray | None:
    return w[None] if w.ndim == 2 else None  # a weight with batch dimensions is many GEMMs


@dataclass(frozen=True)
class WeightedOp:
    """One weighted op. Channel axes are axes of the weight tensor; `grouped` names the side ("input" or "output")
    whose channels the `group` attribute splits: that side's axis is 1 and holds the channels of one group, the groups
    being consecutive blocks of axis 0 (channel i is index i % n of axis 1 in block i // n, n = shape[1])."""

    op: str
    output_axis: Axis  # weight axis indexing the op's output channels (per-channel scales run along it)
    input_axis: Axis  # weight axis summed over (the input channels; per-block scales run along it)
    weight_input: int = 1
    bias_input: int | None = None  # an input added per output channel, None when the op has none
    grouped: str | None = None
    convolution: bool = False  # its data input holds channels on axis 1 (min_input_channels applies)
    # the weight as [G, K, N/G], the GEMM(s) the op computes (None: no such form, or None returned for this weight)
    gemm_weight: Callable[[gs.Node, np.ndarray], np.ndarray | None] | None = None
    product_scale: Callable[[gs.Node], float] = _one  # constant factor on input x weight (Gemm's alpha)

    @property
    def rescalable(self) -> bool:
        """Output channels can absorb a per-channel affine map (weight scaled, bias scaled and shifted), as BatchNorm
        folding and cross-layer equalization need: only ops with a bias input."""
        return self.bias_input is not None

    def groups(self, node: gs.Node) -> int:
        return int(node.attrs.get("group", 1)) if self.grouped else 1

    def _side(self, node: gs.Node, rank: int, side: str) -> tuple[int, int]:
        """(weight axis of the side's channels, group count when that side is grouped else 0)."""
        axis = (self.output_axis if side == "output" else self.input_axis)(node, rank)
        return axis, self.groups(node) if self.grouped == side else 0

    def input_channels(self, node: gs.Node, shape) -> int:
        """Input channels of the op, from its weight's shape."""
        axis, g = self._side(node, len(shape), "input")
        return shape[axis] * g if g else shape[axis]

    def scale_output_channels(self, node: gs.Node, w: np.ndarray, f: np.ndarray) -> np.ndarray:
        """The weight (float64) with output channel i multiplied by f[i]."""
        return _scale(np.asarray(w, np.float64), f, *self._side(node, np.ndim(w), "output"))

    def scale_input_channels(self, node: gs.Node, w: np.ndarray, f: np.ndarray) -> np.ndarray:
        """The weight (float64) with input channel i multiplied by f[i]: compensates an input scaled by 1 / f."""
        return _scale(np.asarray(w, np.float64), f, *self._side(node, np.ndim(w), "input"))

    def output_ranges(self, node: gs.Node, w: np.ndarray) -> np.ndarray:
        """Largest |weight| per output channel (float64)."""
        return _ranges(np.abs(np.asarray(w, np.float64)), *self._side(node, np.ndim(w), "output"))

    def input_ranges(self, node: gs.Node, w: np.ndarray) -> np.ndarray:
        """Largest |weight| per input channel (float64)."""
        return _ranges(np.abs(np.asarray(w, np.float64)), *self._side(node, np.ndim(w), "input"))


def _scale(w: np.ndarray, f: np.ndarray, axis: int, groups: int) -> np.ndarray:
    if groups:
        return (w.reshape(groups, w.shape[0] // groups, w.shape[1], -1) * f.reshape(groups, 1, -1, 1)).reshape(w.shape)
    shape = [1] * w.ndim
    shape[axis] = -1
    return w * f.reshape(shape)


def _ranges(a: np.ndarray, axis: int, groups: int) -> np.ndarray:
    if groups:
        return a.reshape(groups, a.shape[0] // groups, a.shape[1], -1).max(axis=(1, 3)).reshape(-1)
    return np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1).max(axis=1)


def _trans_b(node: gs.Node) -> bool:
    return bool(node.attrs.get("transB", 0))


WEIGHTED_OPS: dict[str, WeightedOp] = {w.op: w for w in (
    # weight [M, C/group, k...]
    WeightedOp("Conv", output_axis=lambda n, r: 0, input_axis=lambda n, r: 1, bias_input=2, grouped="input",
               convolution=True, gemm_weight=_conv_gemm),
    # weight [C, M/group, k...]
    WeightedOp("ConvTranspose", output_axis=lambda n, r: 1, input_axis=lambda n, r: 0, bias_input=2,
               grouped="output", convolution=True),
    # B is [K, N], or [N, K] with transB; C (the bias) broadcasts to [M, N]
    WeightedOp("Gemm", output_axis=lambda n, r: 0 if _trans_b(n) else 1,
               input_axis=lambda n, r: 1 if _trans_b(n) else 0, bias_input=2, gemm_weight=_gemm_gemm,
               product_scale=_gemm_alpha),
    # B is [..., K, N]
    WeightedOp("MatMul", output_axis=lambda n, r: r - 1, input_axis=lambda n, r: r - 2, gemm_weight=_matmul_gemm),
)}


def weighted_op(node: gs.Node | str) -> WeightedOp | None:
    """The table entry of a node's op (or of an op name), None for ops without a weight."""
    return WEIGHTED_OPS.get(node if isinstance(node, str) else node.op)


def op_names(pred: Callable[[WeightedOp], bool] = lambda w: True, sep: str = "/") -> str:
    """"Conv/ConvTranspose/..." for the weighted ops that satisfy pred, for messages."""
    return sep.join(op for op, w in WEIGHTED_OPS.items() if pred(w))

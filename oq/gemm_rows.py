"""Weighted layers as GEMMs on rows of their input, for weight reconstruction.

A layer's output (without bias) is, per group g, rows_g(x) @ W_g: W_g is the weight gathered into [K, N/G] by an
index map (`index[g, k, n]` is the flat index of that weight value), rows_g(x) are [R, K] (im2col patches of a
convolution at R output positions, rows of a MatMul/Gemm input). The reconstruction error of a rounded weight at
those positions is then rows @ (W~ - W), exactly.

ConvTranspose is the convolution, with the flipped and transposed weight, of its input stuffed with stride - 1
zeros between values and padded by dilation * (kernel - 1) - pads (output_padding added at the end), so it has the
same form. numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from .opinfo import weighted_op
from .saturation.layers import IntLayer


@dataclass
class GemmLayer:
    """One layer as G GEMMs. `conv` computes the rows (its weight is the float weight in convolution form)."""

    index: np.ndarray  # int64 [G, K, N/G]
    conv: IntLayer
    transposed: dict | None = None  # ConvTranspose: strides, begin/end pads of the equivalent convolution

    @property
    def groups(self) -> int:
        return self.index.shape[0]

    @property
    def k(self) -> int:
        return self.index.shape[1]

    def _input(self, x: np.ndarray) -> np.ndarray:
        if self.transposed is None:
            return x
        t = self.transposed
        n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
        stuffed = np.zeros((n, c, *[(s - 1) * st + 1 for s, st in zip(spatial, t["strides"])]), x.dtype)
        stuffed[(slice(None), slice(None)) + tuple(slice(None, None, st) for st in t["strides"])] = x
        width = [(0, 0), (0, 0)] + [(max(b, 0), max(e, 0)) for b, e in zip(t["begin"], t["end"])]
        padded = np.pad(stuffed, width)
        crop = tuple(slice(max(-b, 0), padded.shape[2 + i] - max(-e, 0))
                     for i, (b, e) in enumerate(zip(t["begin"], t["end"])))
        return padded[(slice(None), slice(None)) + crop]

    def row_count(self, x_shape) -> int:
        if self.transposed is None:
            return self.conv.row_count(x_shape)
        t = self.transposed
        spatial = [(s - 1) * st + 1 + b + e for s, st, b, e in zip(x_shape[2:], t["strides"], t["begin"], t["end"])]
        return self.conv.row_count((x_shape[0], x_shape[1], *spatial))

    def rows(self, x: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """float32 rows [G, len(idx), K] at row indices idx (sample-major, then output position)."""
        return self.conv.rows(self._input(np.asarray(x, np.float32)), idx).astype(np.float32)


def _ints(values, default, n) -> list[int]:
    return [int(v) for v in values] if values else [default] * n


def gemm_layer(node: gs.Node, w: np.ndarray) -> GemmLayer | str:
    """The layer reading weight `w` (its op's weight input) as GEMMs, or why it cannot be."""
    info = weighted_op(node)
    if info is None:
        return f"{node.op} has no weight"
    attrs = dict(node.attrs)
    flat = np.arange(w.size, dtype=np.int64).reshape(w.shape)
    if node.op == "ConvTranspose":
        return _conv_transpose(node, w, flat, attrs)
    if info.gemm_weight is None:
        return f"{node.op} weights are not supported"
    index = info.gemm_weight(node, flat)
    if index is None:
        return f"{node.op} weight with batch dimensions"
    # IntLayer cuts the rows (im2col for Conv, x or x.T for Gemm, flattened leading axes for MatMul); it is given
    # the float weight, and neither quantizes nor pads with anything but 0 here
    conv = IntLayer(node.name, node.op, node.inputs[0].name, node.outputs[0].name, 1.0, 0, w,
                    np.ones(1, np.float32), attrs)
    return GemmLayer(np.ascontiguousarray(index), conv)


def _conv_transpose(node: gs.Node, w: np.ndarray, flat: np.ndarray, attrs: dict) -> GemmLayer | str:
    auto_pad = attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if attrs.get("output_shape") or auto_pad not in ("NOTSET", ""):
        return "ConvTranspose with output_shape or auto_pad"
    d = w.ndim - 2
    kernel = _ints(attrs.get("kernel_shape"), 0, 0) or list(w.shape[2:])
    strides = _ints(attrs.get("strides"), 1, d)
    dilations = _ints(attrs.get("dilations"), 1, d)
    pads = _ints(attrs.get("pads"), 0, 2 * d)
    out_pad = _ints(attrs.get("output_padding"), 0, d)
    group = int(attrs.get("group", 1))
    c_in, m_g = w.shape[:2]

    def as_conv(a):  # [C_in, M/g, k...] -> [M, C_in/g, k...], spatially flipped
        a = a.reshape(group, c_in // group, m_g, *a.shape[2:]).swapaxes(1, 2)
        a = np.flip(a, axis=tuple(range(3, 3 + d)))
        return np.ascontiguousarray(a.reshape(group * m_g, c_in // group, *a.shape[3:]))

    conv_attrs = {"group": group, "kernel_shape": kernel, "strides": [1] * d, "dilations": dilations,
                  "pads": [0] * (2 * d)}
    conv_node = gs.Node("Conv", attrs=conv_attrs)
    index = weighted_op("Conv").gemm_weight(conv_node, as_conv(flat))
    conv = IntLayer(node.name, "Conv", node.inputs[0].name, node.outputs[0].name, 1.0, 0, as_conv(w),
                    np.ones(1, np.float32), conv_attrs)
    begin = [dl * (k - 1) - p for dl, k, p in zip(dilations, kernel, pads[:d])]
    end = [dl * (k - 1) - p + op for dl, k, p, op in zip(dilations, kernel, pads[d:], out_pad)]
    return GemmLayer(np.ascontiguousarray(index), conv, {"strides": strides, "begin": begin, "end": end})


__all__ = ["GemmLayer", "gemm_layer"]

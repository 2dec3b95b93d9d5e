"""What oq knows about ONNX ops regardless of target: where weights and biases sit, and their channel axes."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

# op -> input index of the weight whose output channels get per-channel scales
WEIGHT_INPUT = {"Conv": 1, "ConvTranspose": 1, "Gemm": 1, "MatMul": 1}
# op -> input index of the bias, whose quantization derives from input and weight scales
BIAS_INPUT = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}


def weight_channel_axis(node: gs.Node, rank: int) -> int:
    """Axis of a weight tensor that indexes the op's output channels."""
    op = node.op
    if op == "Conv":
        return 0
    if op == "ConvTranspose":
        return 1  # weight is [C_in, C_out/group, k...]
    if op == "Gemm":
        return 0 if node.attrs.get("transB", 0) else 1
    if op == "MatMul":
        return rank - 1  # B is [..., K, N]
    raise KeyError(op)


def is_weight_input(node: gs.Node, index: int) -> bool:
    return WEIGHT_INPUT.get(node.op) == index


def is_bias_input(node: gs.Node, index: int) -> bool:
    return BIAS_INPUT.get(node.op) == index


def weight_block_axis(node: gs.Node, rank: int) -> int:
    """Axis of a weight tensor summed over by the op (its input channels): blocks of per-block scales run along it."""
    op = node.op
    if op == "Conv":
        return 1
    if op == "ConvTranspose":
        return 0
    if op == "Gemm":
        return 1 if node.attrs.get("transB", 0) else 0
    if op == "MatMul":
        return rank - 2
    raise KeyError(op)


def scale_output_channels(node: gs.Node, w: np.ndarray, f: np.ndarray) -> np.ndarray:
    """The weight (float64) with output channel i multiplied by f[i], for Conv, ConvTranspose (grouped: channel i
    is column i % (C_out / group) of group i // (C_out / group)) and Gemm (B's rows when transB, else its columns)."""
    w64 = np.asarray(w, np.float64)
    if node.op == "Conv":
        return w64 * f.reshape([-1] + [1] * (w.ndim - 1))
    if node.op == "ConvTranspose":
        g = node.attrs.get("group", 1)
        return (w64.reshape(g, w.shape[0] // g, w.shape[1], -1) * f.reshape(g, 1, -1, 1)).reshape(w.shape)
    if node.op == "Gemm":
        return w64 * (f.reshape(-1, 1) if node.attrs.get("transB", 0) else f.reshape(1, -1))
    raise KeyError(node.op)

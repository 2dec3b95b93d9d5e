"""The torch bridge (oq.bridge.to_torch) against onnxruntime: reference models float and quantized, single ops of every
supported family across opsets, gradients, the initializer mapping, and the errors it raises."""
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import models
import oq
from oq import fakequant
from oq.bridge import registry, to_torch

# the three Q/DQ and FakeQuant families, plus uint16 activations (opset 21) and FP8 (opset 19)
TARGETS = ("tensorrt", "onnxruntime", "academic", "qnn_w8a16", "tensorrt_fp8")
RNG = np.random.default_rng(0)


# --- helpers ----------------------------------------------------------------------------------------------------
def ort_run(model, feed, extra_outputs=()):
    """All outputs of the model (plus `extra_outputs`, made graph outputs of a copy) in onnxruntime, unoptimised."""
    if extra_outputs:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        have = {o.name for o in copy.graph.output}
        copy.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in extra_outputs if n not in have)
        model = copy
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def torch_run(module, feed, **kwargs):
    with torch.no_grad():
        return module(*[torch.from_numpy(np.asarray(v)) for v in feed.values()], **kwargs)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.size == 0:
        return 0.0
    return float(np.abs(got - ref).max() / max(ref.max() - ref.min(), 1e-12))


class W:
    """An initializer operand of a single-op model (optionally of an explicit ONNX element type)."""

    def __init__(self, value, elem_type=None):
        self.value, self.elem_type = np.asarray(value), elem_type


def _ir(opset):
    return 10 if opset >= 21 else 9 if opset >= 19 else 8


def graph_model(nodes, feeds, inits, outputs, opset=17, functions=(), domains=()):
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outputs], inits)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=opsets, ir_version=_ir(opset), functions=list(functions))


def single(op_type, operands, opset=17, n_out=1, domain="", **attrs):
    """(model, feed) of one node; operands are arrays (graph inputs), W (initializers) or None (omitted)."""
    feeds, inits, names = {}, [], []
    for i, v in enumerate(operands):
        if v is None:
            names.append("")
            continue
        name = f"in{i}"
        if isinstance(v, W):
            if v.elem_type is None:
                inits.append(numpy_helper.from_array(v.value, name))
            else:
                inits.append(helper.make_tensor(name, v.elem_type, v.value.shape, v.value.reshape(-1).tolist()))
        else:
            feeds[name] = np.asarray(v)
        names.append(name)
    outs = [f"out{i}" for i in range(n_out)]
    node = helper.make_node(op_type, names, outs, name=f"{op_type.lower()}_node", domain=domain, **attrs)
    return graph_model([node], feeds, inits, outs, opset), feeds


def reference_run(model, feed):
    """onnx's reference implementation, the oracle where onnxruntime lacks a mode (it names outputs as the graph)."""
    from onnx.reference import ReferenceEvaluator
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(None, feed)))


def compare(model, feed, tol=1e-5, oracle=ort_run):
    ref = oracle(model, feed)
    got = torch_run(to_torch(model), feed)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(ref)
    for (name, r), g in zip(ref.items(), got):
        g = g.numpy()
        assert g.shape == r.shape, f"{name}: shape {g.shape} vs onnxruntime {r.shape}"
        if r.dtype.kind in "biu" or g.dtype.kind in "biu":
            assert np.array_equal(g.astype(np.float64), r.astype(np.float64)), f"{name}: values differ"
        else:
            assert np.allclose(g, r, rtol=0, atol=tol * max(1.0, np.abs(r).max() if r.size else 1.0),
                               equal_nan=True), f"{name}: max error {np.abs(g - r).max()}"


def f32(*shape, low=-2.0, high=2.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def i64(*values):
    return np.array(values, np.int64)


def _conv_cases():
    x2, x1, x3 = f32(2, 4, 9, 10), f32(2, 4, 11), f32(1, 4, 5, 6, 7)
    w2, b4 = W(f32(6, 4, 3, 3)), W(f32(6))
    return {
        "conv2d_pads_stride": lambda: single("Conv", [x2, w2, b4], pads=[1, 1, 1, 1], strides=[2, 2]),
        "conv2d_asym_pads": lambda: single("Conv", [x2, w2], pads=[0, 1, 2, 0]),
        "conv2d_same_upper": lambda: single("Conv", [x2, W(f32(6, 4, 4, 4)), b4], auto_pad="SAME_UPPER",
                                            strides=[2, 2]),
        "conv2d_same_lower": lambda: single("Conv", [x2, W(f32(6, 4, 4, 4))], auto_pad="SAME_LOWER", strides=[2, 3]),
        "conv2d_valid": lambda: single("Conv", [x2, w2], auto_pad="VALID", strides=[2, 1]),
        "conv2d_depthwise_dilated": lambda: single("Conv", [x2, W(f32(4, 1, 3, 3))], group=4, dilations=[2, 2],
                                                   pads=[2, 2, 2, 2]),
        "conv1d": lambda: single("Conv", [x1, W(f32(3, 4, 3)), W(f32(3))], pads=[1, 2], dilations=[2]),
        "conv3d_groups": lambda: single("Conv", [x3, W(f32(6, 2, 3, 2, 3)), W(f32(6))], group=2,
                                        pads=[1, 0, 1, 1, 1, 0]),
        "convT2d": lambda: single("ConvTranspose", [x2, W(f32(4, 3, 3, 3)), W(f32(3))], strides=[2, 2],
                                  pads=[1, 1, 1, 1], output_padding=[1, 1]),
        "convT2d_groups_dilations": lambda: single("ConvTranspose", [x2, W(f32(4, 2, 3, 2))], group=2, dilations=[2, 1],
                                                   strides=[1, 2]),
        "convT2d_asym_pads": lambda: single("ConvTranspose", [x2, W(f32(4, 3, 4, 4))], strides=[2, 2],
                                            pads=[0, 1, 2, 1]),
        "convT2d_same_upper": lambda: single("ConvTranspose", [x2, W(f32(4, 3, 3, 3))], strides=[2, 2],
                                             auto_pad="SAME_UPPER"),
        "convT2d_same_lower": lambda: single("ConvTranspose", [x2, W(f32(4, 3, 3, 3))], strides=[2, 2],
                                             auto_pad="SAME_LOWER"),
        "convT2d_output_shape": lambda: single("ConvTranspose", [x2, W(f32(4, 3, 3, 3))], strides=[2, 2],
                                               output_shape=[19, 20]),
        "convT1d": lambda: single("ConvTranspose", [x1, W(f32(4, 2, 3)), W(f32(2))], strides=[3], output_padding=[2]),
        "convT3d": lambda: single("ConvTranspose", [x3, W(f32(4, 2, 2, 2, 2))], strides=[2, 2, 2]),
    }


def _dense_cases():
    a, b = f32(5, 7), f32(7, 3)
    return {
        "gemm": lambda: single("Gemm", [a, W(b), W(f32(3))]),
        "gemm_trans_alpha_beta": lambda: single("Gemm", [f32(7, 5), W(f32(3, 7)), W(f32(5, 3))], transA=1, transB=1,
                                                alpha=0.5, beta=2.0),
        "gemm_scalar_c": lambda: single("Gemm", [a, b, W(np.array(0.3, np.float32))], beta=-1.0),
        "gemm_no_c": lambda: single("Gemm", [a, W(b)], alpha=3.0),
        "matmul_2d": lambda: single("MatMul", [a, W(b)]),
        "matmul_batched_broadcast": lambda: single("MatMul", [f32(2, 3, 5, 7), f32(3, 7, 4)]),
        "matmul_vector": lambda: single("MatMul", [f32(7), b]),
        "einsum_bmm": lambda: single("Einsum", [f32(2, 3, 4), f32(2, 4, 5)], equation="bij,bjk->bik"),
        "einsum_transpose_ellipsis": lambda: single("Einsum", [f32(2, 3, 4)], equation="...ij->...ji"),
        "einsum_trace_sum": lambda: single("Einsum", [f32(3, 3), f32(3)], equation="ii,j->j"),
    }


def _elementwise_cases():
    x, y, pos = f32(3, 4, 5), f32(4, 5), f32(3, 4, 5, low=0.1, high=3)
    ints = RNG.integers(-9, 9, (3, 4)).astype(np.int32)
    cases = {f"{op.lower()}_broadcast": (lambda op=op: single(op, [x, y])) for op in ("Add", "Sub", "Mul", "Div")}
    cases.update({op.lower(): (lambda op=op: single(op, [x]))
                  for op in ("Neg", "Abs", "Exp", "Relu", "Sigmoid", "Tanh", "Erf", "HardSwish", "Softplus", "Floor",
                             "Ceil", "Round", "Sign", "Sin", "Elu", "Softsign")})
    cases.update({op.lower(): (lambda op=op: single(op, [pos])) for op in ("Sqrt", "Log", "Reciprocal")})
    cases.update({
        "mish_18": lambda: single("Mish", [x], opset=18),
        "div_int_trunc": lambda: single("Div", [ints, np.where(ints == 0, 3, ints)[::-1].copy()]),
        "pow": lambda: single("Pow", [pos, W(np.float32(1.7))]),
        "pow_int_exponent": lambda: single("Pow", [x, W(np.array([2], np.int64))]),
        "mod_fmod": lambda: single("Mod", [x, W(np.float32(0.7))], fmod=1),
        "leaky_relu": lambda: single("LeakyRelu", [x], alpha=0.2),
        "prelu_channel": lambda: single("PRelu", [f32(2, 3, 4, 4), W(f32(3, 1, 1))]),
        "hard_sigmoid": lambda: single("HardSigmoid", [x], alpha=0.3, beta=0.4),
        "gelu_exact": lambda: single("Gelu", [x], opset=20),
        "gelu_tanh": lambda: single("Gelu", [x], opset=20, approximate="tanh"),
        "clip_inputs": lambda: single("Clip", [x, W(np.float32(-0.5)), W(np.float32(0.7))], opset=13),
        "clip_max_only": lambda: single("Clip", [x, None, W(np.float32(0.7))], opset=13),
        "clip_attrs_opset6": lambda: single("Clip", [x], opset=6, min=-0.2, max=0.3),
        "equal_int": lambda: single("Equal", [ints, W(np.int32(3))]),
        "less": lambda: single("Less", [x, y]),
        "greater": lambda: single("Greater", [x, y]),
        "greater_or_equal": lambda: single("GreaterOrEqual", [x, y]),
        "and_not": lambda: single("And", [x > 0, y > 0]),
        "not": lambda: single("Not", [x > 0]),
        "where": lambda: single("Where", [x > 0, x, y]),
        "max_variadic": lambda: single("Max", [x, y, W(np.float32(0.1))]),
        "mean_variadic": lambda: single("Mean", [x, y]),
        "softmax_13": lambda: single("Softmax", [f32(2, 3, 4)], opset=13, axis=1),
        "softmax_default_axis": lambda: single("Softmax", [f32(2, 3, 4)]),
        "softmax_11_coerced": lambda: single("Softmax", [f32(2, 3, 4)], opset=11, axis=1),
        "logsoftmax_13": lambda: single("LogSoftmax", [f32(2, 3, 4)], opset=13, axis=0),
        "logsoftmax_11_coerced": lambda: single("LogSoftmax", [f32(2, 3, 4)], opset=11),
        "hardmax_11_coerced": lambda: single("Hardmax", [f32(2, 3, 4)], opset=11),
        "hardmax_13": lambda: single("Hardmax", [f32(2, 3, 4)], opset=13, axis=1),
        "selu": lambda: single("Selu", [x], alpha=1.5, gamma=0.7),
        "celu": lambda: single("Celu", [x], alpha=0.6),
        "thresholded_relu": lambda: single("ThresholdedRelu", [x], alpha=0.3),
        "shrink": lambda: single("Shrink", [x], lambd=0.4, bias=0.1),
        "isinf_negative": lambda: single("IsInf", [np.array([1, np.inf, -np.inf, np.nan], np.float32)],
                                         detect_positive=0),
        "xor": lambda: single("Xor", [x > 0, y > 0.5]),
        "sum_variadic": lambda: single("Sum", [x, y, x]),
        "min_variadic": lambda: single("Min", [x, y]),
    })
    return cases


def _norm_reduce_cases():
    x4, x3 = f32(2, 3, 5, 6), f32(2, 5, 8)
    return {
        "layernorm_last": lambda: single("LayerNormalization", [x3, W(f32(8)), W(f32(8))], epsilon=1e-3),
        "layernorm_axis1_stats": lambda: single("LayerNormalization", [x3, W(f32(5, 8))], axis=1, n_out=3),
        "layernorm_broadcast_scale": lambda: single("LayerNormalization", [x3, W(f32(1, 8)), W(f32(8))], axis=-2),
        "batchnorm_4d": lambda: single("BatchNormalization", [x4, W(f32(3)), W(f32(3)), W(f32(3)),
                                                              W(f32(3, low=0.5, high=2))], epsilon=1e-3),
        "batchnorm_2d": lambda: single("BatchNormalization", [f32(4, 3), W(f32(3)), W(f32(3)), W(f32(3)),
                                                              W(f32(3, low=0.5, high=2))]),
        "groupnorm_21": lambda: single("GroupNormalization", [f32(2, 6, 3, 4), W(f32(6)), W(f32(6))], opset=21,
                                       num_groups=3),
        "groupnorm_18": lambda: single("GroupNormalization", [f32(2, 6, 3, 4), W(f32(2)), W(f32(2))], opset=18,
                                       num_groups=2),
        "lrn": lambda: single("LRN", [x4], size=3, alpha=1e-3, beta=0.6, bias=1.5),
        "instancenorm": lambda: single("InstanceNormalization", [x4, W(f32(3)), W(f32(3))], epsilon=1e-4),
        "reducemean_attr_13": lambda: single("ReduceMean", [x4], opset=13, axes=[1, -1], keepdims=0),
        "reducemean_input_18": lambda: single("ReduceMean", [x4, W(i64(2, 3))], opset=18),
        "reducemean_all_18": lambda: single("ReduceMean", [x4], opset=18, keepdims=0),
        "reducemean_noop_18": lambda: single("ReduceMean", [x4, W(np.zeros(0, np.int64))], opset=18,
                                             noop_with_empty_axes=1),
        "reducesum_attr_11": lambda: single("ReduceSum", [x4], opset=11, axes=[0, 2]),
        "reducesum_input_13": lambda: single("ReduceSum", [x4, W(i64(-1))], opset=13, keepdims=0),
        "reducesum_all_13": lambda: single("ReduceSum", [x4], opset=13),
        "reducemax_attr_17": lambda: single("ReduceMax", [x4], opset=17, axes=[1], keepdims=0),
        "reducemax_input_18": lambda: single("ReduceMax", [x4, W(i64(1, 2))], opset=18),
        "reducemin_18": lambda: single("ReduceMin", [x4, W(i64(3))], opset=18),
        "reduceprod_18": lambda: single("ReduceProd", [x4, W(i64(1, 3))], opset=18, keepdims=0),
        "reducel2_18": lambda: single("ReduceL2", [x4, W(i64(2))], opset=18),
        "reducelogsumexp_18": lambda: single("ReduceLogSumExp", [x4, W(i64(1))], opset=18),
        "argmax_keepdims0": lambda: single("ArgMax", [x4], axis=2, keepdims=0),
        "argmax_last_index": lambda: single("ArgMax", [np.array([[1, 3, 3, 2], [5, 5, 1, 5]], np.float32)], axis=1,
                                            select_last_index=1),
        "argmin": lambda: single("ArgMin", [x4], axis=-1),
        "topk_largest": lambda: single("TopK", [x4, W(i64(3))], axis=-1, n_out=2),
        "topk_smallest_axis1": lambda: single("TopK", [x4, W(i64(2))], axis=1, largest=0, n_out=2),
        "topk_ties": lambda: single("TopK", [np.array([[1, 3, 3, 2, 3]], np.float32), W(i64(3))], n_out=2),
    }


def _pool_cases():
    x, x1, x3 = f32(2, 3, 11, 10), f32(2, 3, 13), f32(1, 2, 7, 6, 5)
    return {
        "maxpool_pads_stride": lambda: single("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        "maxpool_ceil": lambda: single("MaxPool", [x], kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1),
        "maxpool_ceil_pads": lambda: single("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 0, 0],
                                            ceil_mode=1),
        # ceil_mode's last window would start in the trailing pad: it is dropped
        "maxpool_1d_ceil_last_window": lambda: single("MaxPool", [x1], kernel_shape=[2], strides=[2], pads=[1, 1],
                                                      ceil_mode=1),
        "avgpool_1d_ceil_last_window": lambda: single("AveragePool", [x1], kernel_shape=[2], strides=[2], pads=[1, 1],
                                                      ceil_mode=1, count_include_pad=1),
        "maxpool_dilated_asym": lambda: single("MaxPool", [x], kernel_shape=[3, 3], dilations=[2, 1],
                                               pads=[0, 2, 1, 0]),
        "maxpool_same_upper": lambda: single("MaxPool", [x], kernel_shape=[4, 3], strides=[3, 2],
                                             auto_pad="SAME_UPPER"),
        "maxpool_1d": lambda: single("MaxPool", [x1], kernel_shape=[4], strides=[3]),
        "maxpool_3d": lambda: single("MaxPool", [x3], kernel_shape=[2, 3, 2], strides=[2, 2, 1],
                                     pads=[1, 1, 0, 0, 1, 1]),
        "avgpool_exclude_pad": lambda: single("AveragePool", [x], kernel_shape=[3, 3], strides=[2, 2],
                                              pads=[1, 1, 1, 1]),
        "avgpool_include_pad": lambda: single("AveragePool", [x], kernel_shape=[3, 3], strides=[2, 2],
                                              pads=[1, 2, 1, 0],
                                              count_include_pad=1),
        "avgpool_ceil": lambda: single("AveragePool", [x], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        "avgpool_ceil_include_pad": lambda: single("AveragePool", [x], kernel_shape=[3, 3], strides=[2, 2],
                                                   pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
        "avgpool_same_lower": lambda: single("AveragePool", [x], kernel_shape=[2, 3], strides=[2, 2],
                                             auto_pad="SAME_LOWER"),
        "avgpool_dilated_19": lambda: single("AveragePool", [x], opset=19, kernel_shape=[2, 2], dilations=[2, 3],
                                             pads=[1, 1, 1, 1]),
        "avgpool_plain_1d": lambda: single("AveragePool", [x1], kernel_shape=[3], strides=[2]),
        "global_avgpool": lambda: single("GlobalAveragePool", [x]),
        "global_maxpool": lambda: single("GlobalMaxPool", [x3]),
    }


def _resize_cases():
    x = f32(1, 2, 5, 7)
    cases = {}
    for coords in ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"):
        opset = 11 if coords == "asymmetric" else 13
        roi = W(np.zeros(0, np.float32)) if opset == 11 else None
        for rounding in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
            cases[f"resize_nearest_{coords}_{rounding}_up"] = (
                lambda c=coords, r=rounding, o=opset, roi=roi: single(
                    "Resize", [x, roi, W(np.array([1, 1, 2.5, 1.5], np.float32))], opset=o, mode="nearest",
                    coordinate_transformation_mode=c, nearest_mode=r))
        cases[f"resize_nearest_{coords}_sizes_down"] = (
            lambda c=coords, o=opset, roi=roi: single(
                "Resize", [x, roi, W(np.zeros(0, np.float32)), W(i64(1, 2, 3, 4))], opset=o, mode="nearest",
                coordinate_transformation_mode=c))
    for coords in ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"):
        cases[f"resize_linear_{coords}_scales"] = (
            lambda c=coords: single("Resize", [x, None, W(np.array([1, 1, 2, 1.5], np.float32))], opset=13,
                                    mode="linear", coordinate_transformation_mode=c))
        cases[f"resize_linear_{coords}_sizes_down"] = (
            lambda c=coords: single("Resize", [x, None, None, W(i64(1, 2, 3, 4))], opset=13, mode="linear",
                                    coordinate_transformation_mode=c))
    cases.update({
        "resize_linear_pytorch_half_pixel_to_one": lambda: single(
            "Resize", [x, None, None, W(i64(1, 2, 1, 4))], opset=13, mode="linear",
            coordinate_transformation_mode="pytorch_half_pixel"),
        "resize_linear_half_pixel_symmetric_19": lambda: single(
            "Resize", [x, None, W(np.array([1, 1, 1.7, 2.2], np.float32))], opset=19, mode="linear",
            coordinate_transformation_mode="half_pixel_symmetric"),
        "resize_cubic_half_pixel": lambda: single("Resize", [x, None, W(np.array([1, 1, 2, 1.5], np.float32))],
                                                  opset=13, mode="cubic"),
        "resize_cubic_exclude_outside": lambda: single("Resize", [x, None, None, W(i64(1, 2, 9, 4))], opset=13,
                                                       mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5),
        "resize_axes_18": lambda: single("Resize", [x, None, None, W(i64(10, 3))], opset=18, mode="linear",
                                         axes=[2, 3]),
        "resize_not_larger_18": lambda: single("Resize", [x, None, None, W(i64(8, 8))], opset=18, mode="nearest",
                                               axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
        "resize_opset10_nearest": lambda: single("Resize", [x, W(np.array([1, 1, 2, 3], np.float32))], opset=10),
        "resize_opset10_nearest_down": lambda: single("Resize", [x, W(np.array([1, 1, 0.6, 0.5], np.float32))],
                                                      opset=10),
        "resize_opset10_linear": lambda: single("Resize", [x, W(np.array([1, 1, 1.5, 2], np.float32))], opset=10,
                                                mode="linear"),
        "upsample_9_nearest": lambda: single("Upsample", [x, W(np.array([1, 1, 2, 3], np.float32))], opset=9),
        "upsample_7_linear_attr": lambda: single("Upsample", [x], opset=7, mode="linear", scales=[1.0, 1.0, 2.0, 1.5]),
        "resize_opset11_roi": lambda: single("Resize", [x, W(np.zeros(0, np.float32)),
                                                        W(np.array([1, 1, 0.5, 0.6], np.float32))], opset=11,
                                             mode="linear"),
    })
    return cases


def _pad_cases():
    x = f32(2, 3, 4, 5)
    return {
        "pad_constant_11": lambda: single("Pad", [x, W(i64(0, 1, 2, 0, 0, 2, 1, 3)), W(np.float32(0.5))], opset=11),
        "pad_constant_attr_2": lambda: single("Pad", [x], opset=2, pads=[0, 0, 1, 2, 0, 0, 3, 1], value=-1.0),
        "pad_reflect": lambda: single("Pad", [x, W(i64(0, 0, 2, 3, 0, 0, 1, 4))], opset=13, mode="reflect"),
        "pad_edge": lambda: single("Pad", [x, W(i64(0, 1, 2, 3, 1, 0, 1, 4))], opset=13, mode="edge"),
        "pad_wrap_19": lambda: single("Pad", [x, W(i64(0, 0, 2, 3, 0, 0, 1, 4))], opset=19, mode="wrap"),
        "pad_negative": lambda: single("Pad", [x, W(i64(0, 0, -1, 2, 0, 0, 1, -2))], opset=13),
        "pad_axes_18": lambda: single("Pad", [x, W(i64(1, 2, 3, 0)), None, W(i64(-1, 1))], opset=18, mode="edge"),
    }


def _fp8_cast_model():
    x = f32(3, 50) * 300
    nodes = [helper.make_node("Cast", ["x"], ["h"], name="to_fp8", to=T.FLOAT8E4M3FN),
             helper.make_node("Cast", ["h"], ["y"], name="back", to=T.FLOAT)]
    return graph_model(nodes, {"x": x}, [], ["y"], 19), {"x": x}


def _constants_model():
    x = f32(2, 3)
    nodes = [helper.make_node("Constant", [], ["c1"], name="c_floats", value_floats=[1.0, 2.0, 3.0]),
             helper.make_node("Constant", [], ["c2"], name="c_float", value_float=0.5),
             helper.make_node("Constant", [], ["c3"], name="c_ints", value_ints=[3, 2]),
             helper.make_node("Constant", [], ["c4"], name="c_tensor",
                              value=numpy_helper.from_array(np.float32([[1, -1]]))),
             helper.make_node("Add", ["x", "c1"], ["a"], name="add"),
             helper.make_node("Mul", ["a", "c2"], ["b"], name="mul"),
             helper.make_node("Reshape", ["b", "c3"], ["c"], name="reshape"),
             helper.make_node("Sub", ["c", "c4"], ["y"], name="sub")]
    return graph_model(nodes, {"x": x}, [], ["y"]), {"x": x}


def _shape_cases():
    x = f32(2, 3, 4, 5)
    return {
        "concat": lambda: single("Concat", [x, f32(2, 1, 4, 5), W(f32(2, 2, 4, 5))], axis=1),
        "split_attr_11": lambda: single("Split", [x], opset=11, axis=3, split=[2, 3], n_out=2),
        "split_input_13": lambda: single("Split", [x, W(i64(1, 3))], opset=13, axis=2, n_out=2),
        "split_equal_13": lambda: single("Split", [x], opset=13, axis=2, n_out=2),
        "split_num_outputs_18": lambda: single("Split", [x], opset=18, axis=3, num_outputs=3, n_out=3),
        "slice_steps_axes": lambda: single("Slice", [x, W(i64(1, -1)), W(i64(4, 0)), W(i64(2, 3)), W(i64(2, -2))]),
        "slice_negative_full": lambda: single("Slice", [x, W(i64(-1)), W(i64(-2**63)), W(i64(1)), W(i64(-1))]),
        "slice_large_end": lambda: single("Slice", [x, W(i64(1, 0)), W(i64(2**62, 3)), W(i64(-1, 0))]),
        "slice_attrs_9": lambda: single("Slice", [x], opset=9, starts=[0, 1], ends=[1, 100], axes=[0, 2]),
        "gather_axis1_negative": lambda: single("Gather", [x, W(np.array([[0, -1], [2, 1]], np.int64))], axis=1),
        "gather_scalar": lambda: single("Gather", [x, W(np.array(-2, np.int64))], axis=3),
        "gather_elements": lambda: single("GatherElements", [f32(3, 4), W(np.array([[0, 3], [-1, 2], [1, 1]]))],
                                          axis=1),
        "gathernd": lambda: single("GatherND", [x, W(np.array([[0, 1], [1, -1]], np.int64))]),
        "reshape_zero_minus_one": lambda: single("Reshape", [x, W(i64(0, -1, 5))]),
        "reshape_allowzero": lambda: single("Reshape", [x, W(i64(6, 20))], opset=14, allowzero=1),
        "transpose": lambda: single("Transpose", [x], perm=[0, 2, 3, 1]),
        "transpose_default": lambda: single("Transpose", [x]),
        "flatten_default": lambda: single("Flatten", [x]),
        "flatten_axis0": lambda: single("Flatten", [x], axis=0),
        "flatten_negative": lambda: single("Flatten", [x], axis=-1),
        "squeeze_attr_11": lambda: single("Squeeze", [f32(1, 3, 1, 2)], opset=11, axes=[-2]),
        "squeeze_input_13": lambda: single("Squeeze", [f32(1, 3, 1, 2), W(i64(0, 2))], opset=13),
        "squeeze_all_13": lambda: single("Squeeze", [f32(1, 3, 1, 2)], opset=13),
        "unsqueeze_attr_11": lambda: single("Unsqueeze", [f32(3, 2)], opset=11, axes=[0, -1]),
        "unsqueeze_input_13": lambda: single("Unsqueeze", [f32(3, 2), W(i64(1, 3))], opset=13),
        "expand_bidirectional": lambda: single("Expand", [f32(3, 1), W(i64(2, 1, 4))]),
        "tile": lambda: single("Tile", [f32(2, 3), W(i64(2, 3))]),
        "shape": lambda: single("Shape", [x]),
        "shape_start_end_15": lambda: single("Shape", [x], opset=15, start=1, end=-1),
        "size": lambda: single("Size", [x]),
        "constant_of_shape": lambda: single("ConstantOfShape", [W(i64(2, 3))],
                                            value=helper.make_tensor("v", T.INT32, [1], [7])),
        "constant_of_shape_default": lambda: single("ConstantOfShape", [W(i64(4))]),
        "cast_float_to_int": lambda: single("Cast", [x * 4], to=T.INT32),
        "cast_int_to_float": lambda: single("Cast", [np.arange(6, dtype=np.int64)], to=T.FLOAT),
        "cast_to_bool": lambda: single("Cast", [np.array([0.0, 0.5, -1.0], np.float32)], to=T.BOOL),
        "cast_fp8_19": _fp8_cast_model,
        "range_int": lambda: single("Range", [np.array(2, np.int64), W(np.array(17, np.int64)),
                                              W(np.array(3, np.int64))]),
        "range_float": lambda: single("Range", [np.array(1.0, np.float32), W(np.float32(-2.0)), W(np.float32(-0.5))]),
        "identity": lambda: single("Identity", [x]),
        "dropout_inference": lambda: single("Dropout", [x], opset=13),
        "depth_to_space_crd": lambda: single("DepthToSpace", [f32(1, 8, 2, 3)], blocksize=2, mode="CRD"),
        "space_to_depth": lambda: single("SpaceToDepth", [f32(1, 2, 4, 6)], blocksize=2),
        "trilu_lower": lambda: single("Trilu", [f32(4, 5), W(np.array(1, np.int64))], upper=0),
        "scatternd": lambda: single("ScatterND", [x, W(np.array([[1, 2], [0, -1]], np.int64)), f32(2, 4, 5)]),
        "nonzero": lambda: single("NonZero", [np.array([[0, 1, 0], [2, 0, 3]], np.float32)]),
        "constants": _constants_model,
        "cumsum_reverse_exclusive": lambda: single("CumSum", [x, W(np.array(2, np.int64))], reverse=1, exclusive=1),
    }


def _rnn(op_type, directions=1, layout=0, extras=(), **attrs):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op_type]
    hidden, size, steps, batch = 5, 4, 6, 3
    x = f32(batch, steps, size) if layout else f32(steps, batch, size)
    operands = [x, W(f32(directions, gates * hidden, size) / 2), W(f32(directions, gates * hidden, hidden) / 2)]
    operands.append(W(f32(directions, 2 * gates * hidden)) if "bias" in extras else None)
    operands.append(W(np.array([6, 4, 1], np.int32)) if "lens" in extras else None)
    state = (batch, directions, hidden) if layout else (directions, batch, hidden)
    operands.append(f32(*state) if "h0" in extras else None)
    if op_type == "LSTM":
        operands.append(f32(*state) if "c0" in extras else None)
        operands.append(W(f32(directions, 3 * hidden)) if "peephole" in extras else None)
    direction = {1: "forward", 2: "bidirectional"}[directions] if "reverse" not in extras else "reverse"
    return single(op_type, operands, opset=14, n_out=3 if op_type == "LSTM" else 2, hidden_size=hidden,
                  direction=direction, layout=layout, **attrs)


def _rnn_cases():
    return {
        "lstm_forward": lambda: _rnn("LSTM", extras=("bias",)),
        "lstm_reverse_states": lambda: _rnn("LSTM", extras=("bias", "h0", "c0", "reverse")),
        "lstm_bidirectional_peephole": lambda: _rnn("LSTM", 2, extras=("bias", "h0", "c0", "peephole")),
        "lstm_sequence_lens": lambda: _rnn("LSTM", 2, extras=("bias", "lens", "h0")),
        "lstm_clip_input_forget": lambda: _rnn("LSTM", extras=("bias",), clip=0.5, input_forget=1),
        "gru_forward": lambda: _rnn("GRU", extras=("bias",)),
        "lstm_layout1": lambda: _rnn("LSTM", 2, layout=1, extras=("bias", "h0", "c0")),
        "gru_linear_before_reset": lambda: _rnn("GRU", 2, extras=("bias", "h0"), linear_before_reset=1),
        "gru_reverse_lens": lambda: _rnn("GRU", extras=("bias", "lens", "reverse")),
        "gru_activations": lambda: _rnn("GRU", extras=("bias",), activations=["HardSigmoid", "LeakyRelu"],
                                        activation_alpha=[0.3, 0.05], activation_beta=[0.4]),
        "rnn_bidirectional": lambda: _rnn("RNN", 2, extras=("bias", "h0")),
    }


def _if_model(sign):
    x = sign * np.abs(f32(3, 4))
    outer = numpy_helper.from_array(f32(3, 4), "outer_w")
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "outer_w"], ["t"], name="then_mul")], "then", [],
                               [helper.make_empty_tensor_value_info("t")])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "k"], ["e"], name="else_sub")], "else", [],
                               [helper.make_empty_tensor_value_info("e")],
                               [numpy_helper.from_array(np.float32(2.5), "k")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)]
    model = graph_model(nodes, {"x": x}, [outer, numpy_helper.from_array(np.float32(0), "zero")], ["y"])
    return model, {"x": x}


def _control_cases():
    return {
        "if_then": lambda: _if_model(1),
        "if_else": lambda: _if_model(-1),
    }


def _ties(*shape, scale=0.5):
    """Values on and between rounding ties of `scale`, with some far outside any 8-bit grid."""
    x = (RNG.integers(-600, 600, shape) * (scale / 2)).astype(np.float32)
    return np.where(RNG.random(shape) < 0.5, x, f32(*shape) * 100 * scale).astype(np.float32)


def _qdq_chain(zp_type, zp_value, opset=21, block=None):
    x = _ties(4, 6)
    scale = np.float32(0.5) if block is None else RNG.uniform(0.2, 1, (4, 2)).astype(np.float32)
    zp = np.full(np.shape(scale), zp_value, np.int64)
    attrs = {} if block is None else {"axis": 1, "block_size": block}
    if zp_type in (T.INT4, T.UINT4):
        x = x / 16
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q", **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq", **attrs),
             helper.make_node("Cast", ["q"], ["codes"], name="codes", to=T.INT32)]
    inits = [numpy_helper.from_array(np.asarray(scale), "s"),
             helper.make_tensor("z", zp_type, zp.shape, zp.reshape(-1))]
    # onnxruntime hands FP8 and 4-bit tensors back as raw bytes (or not at all): the codes are read through a Cast
    outputs = ["y"] if zp_type in (T.FLOAT8E4M3FN, T.FLOAT8E5M2) else ["codes", "y"]
    return graph_model(nodes, {"x": x}, inits, outputs, opset), {"x": x}


def _fake_quant_model():
    x = _ties(2, 3, 4, 4)
    inits = [numpy_helper.from_array(np.array([0.5, 0.25, 1.0], np.float32).reshape(1, 3, 1, 1), "s"),
             numpy_helper.from_array(np.array([0.0, 3.0, -2.0], np.float32).reshape(1, 3, 1, 1), "z"),
             numpy_helper.from_array(np.float32(-8), "lo"), numpy_helper.from_array(np.float32(7), "hi")]
    node = helper.make_node("FakeQuant", ["x", "s", "z", "lo", "hi"], ["y"], name="fq", domain=fakequant.DOMAIN)
    model = graph_model([node], {"x": x}, inits, ["y"], 17)
    fakequant.attach(model)
    return model, {"x": x}


def _quant_cases():
    x = _ties(2, 3, 4)
    per_axis = W(np.array([0.5, 0.25, 1.0], np.float32))
    return {
        "q_uint8_per_tensor": lambda: single("QuantizeLinear", [x, W(np.float32(0.5)), W(np.uint8(128))], opset=13),
        "q_no_zero_point": lambda: single("QuantizeLinear", [x, W(np.float32(0.25))], opset=13),
        "q_int8_per_axis": lambda: single("QuantizeLinear", [x, per_axis, W(np.array([0, 3, -5], np.int8))], opset=13),
        "q_int8_per_axis_last": lambda: single("QuantizeLinear", [x, W(np.full(4, 0.5, np.float32)),
                                                                  W(np.zeros(4, np.int8))], opset=13, axis=-1),
        "q_int16_21": lambda: single("QuantizeLinear", [x * 300, W(np.float32(0.5)), W(np.int16(-7))], opset=21),
        "q_uint16_21": lambda: single("QuantizeLinear", [x * 300, W(np.float32(0.5)), W(np.array(30000), T.UINT16)],
                                      opset=21),
        "qdq_int4_21": lambda: _qdq_chain(T.INT4, 1),
        "qdq_uint4_21": lambda: _qdq_chain(T.UINT4, 8),
        "q_output_dtype_21": lambda: single("QuantizeLinear", [x, W(np.float32(0.5))], opset=21, output_dtype=T.INT8),
        "q_blocked_21": lambda: single("QuantizeLinear", [x, W(RNG.uniform(0.2, 1, (2, 3, 2)).astype(np.float32)),
                                                          W(np.array(RNG.integers(-3, 3, (2, 3, 2)), np.int8))],
                                       opset=21, axis=2, block_size=3),
        "dq_int8_per_axis": lambda: single("DequantizeLinear", [RNG.integers(-128, 127, (2, 3, 4)).astype(np.int8),
                                                                per_axis, W(np.array([0, 3, -5], np.int8))], opset=13),
        "dq_uint8_per_tensor": lambda: single("DequantizeLinear", [RNG.integers(0, 255, (2, 3)).astype(np.uint8),
                                                                   W(np.float32(0.1)), W(np.uint8(7))], opset=13),
        "dq_int32_bias": lambda: single("DequantizeLinear", [RNG.integers(-2**31, 2**31 - 1, 50).astype(np.int32),
                                                             W(np.float32(3e-5))], opset=13),
        "dq_int4_weight_21": lambda: single("DequantizeLinear", [W(RNG.integers(-8, 7, (3, 4)), T.INT4),
                                                                 W(np.float32(0.3)), W(np.array(-1), T.INT4)],
                                            opset=21),
        "dq_blocked_21": lambda: single("DequantizeLinear", [RNG.integers(-128, 127, (4, 5)).astype(np.int8),
                                                             W(RNG.uniform(0.2, 1, (4, 2)).astype(np.float32))],
                                        opset=21, axis=1, block_size=3),
        "qdq_int8_21": lambda: _qdq_chain(T.INT8, -3),
        "qdq_uint16_21": lambda: _qdq_chain(T.UINT16, 1000),
        "qdq_uint4_blocked_21": lambda: _qdq_chain(T.UINT4, 8, block=3),
        "qdq_fp8_e4m3_19": lambda: _qdq_chain(T.FLOAT8E4M3FN, 0, opset=19),
        "fake_quant": _fake_quant_model,
    }


CASES = {}
for _family in (_conv_cases, _dense_cases, _elementwise_cases, _norm_reduce_cases, _pool_cases, _resize_cases,
                _pad_cases, _shape_cases, _rnn_cases, _control_cases, _quant_cases):
    CASES.update(_family())


# onnxruntime does not run batch-first (layout=1) recurrences
REFERENCE_ORACLE = {"lstm_layout1"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_single_op_matches_onnxruntime(case):
    model, feed = CASES[case]()
    compare(model, feed, oracle=reference_run if case in REFERENCE_ORACLE else ort_run)


# --- reference models -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", models.REFERENCE_MODELS)
def test_reference_model_round_trip(name, model_paths):
    feed = models.make_inputs(name, 4, seed=1)
    model = onnx.load(str(model_paths[name]))
    ref = ort_run(model, feed)[model.graph.output[0].name]
    module = to_torch(model_paths[name])  # from the path
    assert module.input_names == [i.name for i in model.graph.input]
    got = torch_run(module, feed).numpy()
    assert rel_err(got, ref) <= 1e-5, f"{name}: {rel_err(got, ref):.2e} of the output range"


@pytest.fixture(scope="module")
def quantized(model_paths, calib_files):
    cache = {}

    def get(name, target):
        if (name, target) not in cache:
            cache[name, target] = oq.quantize(model_paths[name], target, calib_files[name][0], progress=False).model
        return cache[name, target]
    return get


def _quant_nodes(model):
    return [n for n in model.graph.node if n.op_type == "QuantizeLinear" or n.domain == fakequant.DOMAIN]


def _zero_point_type(model, node):
    zero_point = next((t for t in model.graph.initializer if len(node.input) > 2 and t.name == node.input[2]), None)
    return zero_point.data_type if zero_point is not None else None


def _ort_codes(model, node, value):
    """onnxruntime's output of a quantizer as float64 (it hands FP8 tensors back as their bytes)."""
    if _zero_point_type(model, node) == T.FLOAT8E4M3FN:
        import ml_dtypes
        return value.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return value.astype(np.float64)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", models.REFERENCE_MODELS)
def test_quantized_model_codes_and_outputs(name, target, quantized):
    """Fed onnxruntime's value at every quantizer input, the module gives the same integer codes at every
    QuantizeLinear (the same values at every FakeQuant) and the same outputs; left to itself, it differs only where
    a last-bit float difference upstream (torch and onnxruntime sum convolutions in different orders) lands on a
    rounding tie: neighbouring codes on a small share of the values of 8-bit grids, outputs within 1% of their
    range."""
    model = quantized(name, target)
    feed = models.make_inputs(name, 4, seed=1)
    quant = _quant_nodes(model)
    assert quant
    probes = [n.input[0] for n in quant] + [n.output[0] for n in quant]
    ref = ort_run(model, feed, probes)
    output = model.graph.output[0].name
    module = to_torch(model)
    forced = {n.input[0] for n in quant} & {t for n in model.graph.node for t in n.output}
    handle = module.register_value_hook(lambda t, v: torch.from_numpy(ref[t]) if t in forced else None)
    got, values = torch_run(module, feed, return_values=[n.output[0] for n in quant])
    handle.remove()
    for n in quant:
        assert np.array_equal(values[n.output[0]].numpy().astype(np.float64), _ort_codes(model, n, ref[n.output[0]])), \
            f"{name}/{target}: {n.op_type} {n.name} differs from onnxruntime"
    assert rel_err(got.numpy(), ref[output]) <= 1e-5
    free, values = torch_run(module, feed, return_values=[n.output[0] for n in quant])
    for n in quant:
        if _zero_point_type(model, n) in (T.UINT16, T.INT16):
            continue  # 256 times finer: last-bit differences move codes everywhere; the output check below stands
        a, b = values[n.output[0]].numpy().astype(np.float64), _ort_codes(model, n, ref[n.output[0]])
        if (a != b).any():  # neighbours on the grid, on a handful of values
            grid = np.unique(np.concatenate([a.ravel(), b.ravel()]))
            rank = np.searchsorted(grid, a) - np.searchsorted(grid, b)
            assert np.abs(rank).max() <= 1 and (a != b).mean() <= 1e-3, f"{name}/{target}: {n.name}"
    assert rel_err(free.numpy(), ref[output]) <= 1e-2


# --- gradients --------------------------------------------------------------------------------------------------
GRAD_CASES = {
    "conv": lambda: single("Conv", [f32(2, 3, 8, 8), W(f32(4, 3, 3, 3)), W(f32(4))], pads=[1, 1, 1, 1]),
    "gemm": lambda: single("Gemm", [f32(5, 7), W(f32(3, 7)), W(f32(3))], transB=1),
    "matmul": lambda: single("MatMul", [f32(2, 5, 7), W(f32(7, 3))]),
    "layernorm": lambda: single("LayerNormalization", [f32(2, 5, 8), W(f32(8)), W(f32(8))]),
    "lstm": lambda: _rnn("LSTM", 2, extras=("bias", "peephole")),
    "gru": lambda: _rnn("GRU", extras=("bias",), linear_before_reset=1),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_gradients_reach_parameters(case):
    model, feed = GRAD_CASES[case]()
    module = to_torch(model)
    params = module.initializer_parameters()
    assert params and all(p.requires_grad for p in params.values())
    inputs = [torch.from_numpy(v).requires_grad_(v.dtype == np.float32) for v in feed.values()]
    out = module(*inputs)
    loss = sum((o.float() ** 2).sum() for o in (out if isinstance(out, tuple) else (out,)))
    loss.backward()
    for name, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert inputs[0].grad is not None and inputs[0].grad.abs().sum() > 0


def test_gradients_through_a_reference_model(model_paths):
    module = to_torch(model_paths["resnet_mini"])
    x = torch.from_numpy(models.make_inputs("resnet_mini", 2, seed=1)["input"])
    module(x).logsumexp(dim=1).sum().backward()
    params = module.initializer_parameters()
    missing = [k for k, p in params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert len(params) > 10 and not missing


# --- construction: what the bridge refuses, and how ---------------------------------------------------------------
def test_unsupported_ops_are_all_named_at_construction():
    x = f32(1, 4)
    nodes = [helper.make_node("Foo", ["x"], ["a"], name="custom_foo", domain="com.example"),
             helper.make_node("Relu", ["a"], ["b"], name="fine_relu"),
             helper.make_node("NonMaxSuppression", ["b", "b"], ["c"], name="nms")]
    model = graph_model(nodes, {"x": x}, [], ["c"], domains=["com.example"])
    with pytest.raises(oq.OqError) as info:
        to_torch(model)
    message = str(info.value)
    assert "\n" not in message
    assert "com.example.Foo" in message and "custom_foo" in message
    assert "NonMaxSuppression" in message and "nms" in message and "fine_relu" not in message


def test_unsupported_attributes_fail_at_construction():
    x = f32(1, 2, 4, 4)
    nodes = [helper.make_node("Resize", ["x", "", "s"], ["a"], name="crop_resize", mode="linear",
                              coordinate_transformation_mode="tf_crop_and_resize"),
             helper.make_node("MaxPool", ["a"], ["b", "idx"], name="pool_with_indices", kernel_shape=[2, 2]),
             helper.make_node("BatchNormalization", ["b", "w", "w", "w", "w"], ["c"], name="bn_train", training_mode=1)]
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s"),
             numpy_helper.from_array(np.ones(2, np.float32), "w")]
    with pytest.raises(oq.OqError) as info:
        to_torch(graph_model(nodes, {"x": x}, inits, ["c", "idx"]))
    message = str(info.value)
    for name in ("crop_resize", "tf_crop_and_resize", "pool_with_indices", "Indices", "bn_train", "training"):
        assert name in message


def test_subgraph_ops_are_checked_too():
    model, _ = _if_model(1)
    then_g = next(a.g for a in model.graph.node[2].attribute if a.name == "then_branch")
    then_g.node[0].op_type = "Unique"
    with pytest.raises(oq.OqError, match="Unique.*then_mul"):
        to_torch(model)


def test_model_local_functions_are_inlined():
    """A custom function other than oq.FakeQuant runs from its body."""
    body = [helper.make_node("Mul", ["a", "a"], ["sq"]), helper.make_node("Add", ["sq", "a"], ["out"])]
    fn = helper.make_function("my.ops", "SquarePlus", ["a"], ["out"], body, [helper.make_opsetid("", 17)])
    x = f32(3, 4)
    node = helper.make_node("SquarePlus", ["x"], ["y"], name="sp", domain="my.ops")
    model = graph_model([node], {"x": x}, [], ["y"], functions=[fn], domains=["my.ops"])
    compare(model, {"x": x})


def test_import_oq_does_not_import_torch():
    code = "import sys, oq, oq.bridge; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_torch_is_a_one_line_error():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import oq, oq.bridge\n"
            "try:\n    oq.bridge.to_torch('m.onnx')\n"
            "except oq.OqError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "the torch bridge needs torch: pip install 'oq-quant[torch]'"


# --- the module's interface ---------------------------------------------------------------------------------------
def test_initializers_map_to_parameters_and_buffers(quantized):
    model = quantized("resnet_mini", "tensorrt")
    module = to_torch(model)
    names = module.initializer_names()
    assert sorted(names) == sorted(t.name for t in model.graph.initializer)
    state = module.state_dict()
    for init in model.graph.initializer:
        tensor = module.tensor_for(init.name)
        assert tuple(tensor.shape) == tuple(init.dims)
        assert np.array_equal(tensor.detach().numpy(), numpy_helper.to_array(init))
        attr = module.attribute_name(init.name)
        assert attr.isidentifier() and attr in state
        is_float = init.data_type == T.FLOAT
        assert isinstance(tensor, torch.nn.Parameter) == is_float
        if is_float:
            assert module.parameter_for(init.name) is tensor
        else:
            with pytest.raises(oq.OqError, match="not a parameter"):
                module.parameter_for(init.name)
    with pytest.raises(oq.OqError, match="no initializer"):
        module.tensor_for("nope")


def test_write_back_round_trip(model_paths):
    model = onnx.load(str(model_paths["mlp"]))
    module = to_torch(model)
    name = next(iter(module.initializer_parameters()))
    with torch.no_grad():
        module.parameter_for(name).mul_(2)
    updated = module.write_back(model)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in updated.graph.initializer}
    assert np.array_equal(after[name], before[name] * 2)
    assert all(np.array_equal(after[k], before[k]) for k in before if k != name)
    feed = models.make_inputs("mlp", 4, seed=1)
    assert rel_err(torch_run(module, feed).numpy(), ort_run(updated, feed)["logits"]) <= 1e-5


def test_return_values_and_errors(model_paths):
    module = to_torch(model_paths["transformer"])
    feed = models.make_inputs("transformer", 2, seed=1)
    out, values = torch_run(module, feed, return_values=["tokens"])
    assert np.array_equal(values["tokens"].numpy(), feed["tokens"])
    with pytest.raises(oq.OqError, match="no value named 'missing'"):
        torch_run(module, feed, return_values=["missing"])
    with pytest.raises(oq.OqError, match="takes 1 input"):
        module()


def test_ops_can_be_replaced_per_module_and_globally():
    model, feed = _qdq_chain(T.INT8, 0, opset=13)
    calls = []

    def traced(attrs, inputs):
        calls.append(attrs.name)
        return registry.builtin("QuantizeLinear").fn(attrs, inputs)

    compare_module = to_torch(model, ops={"QuantizeLinear": traced})
    torch_run(compare_module, feed)
    assert calls == ["q"]
    registry.register("DequantizeLinear", lambda attrs, inputs: inputs[0] * 0)
    try:
        assert not torch_run(to_torch(model), feed)[1].any()
    finally:
        registry.unregister("DequantizeLinear")
    assert torch_run(to_torch(model), feed)[1].abs().sum() > 0
    assert ("oq", "FakeQuant") in registry.supported_ops()

"""In-graph probes: what each observed tensor is reduced to inside onnxruntime, and that observers end up exactly
where feeding them whole tensors would put them."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from oq.calibration import observe
from oq.data import model_inputs, open_calibration
from oq.observers import MinMaxObserver, Observer, make_observer
from oq.probes import add_probes, nonnegative_tensors, plan_probes


def conv_model(batch="N"):
    """x[N,4,12,10] -> Conv(8) -> c (signed) -> Relu -> r -> Conv(6) -> d -> Clip(-1, 6) -> k; Flatten(r) -> f."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 4, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(6, 8, 1, 1)).astype(np.float32), "w2")
    lo = numpy_helper.from_array(np.array(-1, np.float32), "lo")
    hi = numpy_helper.from_array(np.array(6, np.float32), "hi")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["d"]),
             helper.make_node("Clip", ["d", "lo", "hi"], ["k"]),
             helper.make_node("Flatten", ["r"], ["f"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 12, 10])],
                              [helper.make_tensor_value_info("k", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("f", TensorProto.FLOAT, None)], [w1, w2, lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def full_tensors(model, names, x):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in names:
        if n not in {o.name for o in m.graph.output}:
            m.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(names, {"x": x})))


def data_for(model, x):
    return open_calibration(lambda: ({"x": x[i:i + 1]} for i in range(len(x))), model_inputs(model))


def test_non_negative_tensors_follow_the_producing_ops():
    model = conv_model()
    extra = [helper.make_node("Clip", ["c"], ["c0"], min=0.0),  # opset-6 style attribute (not run, only read)
             helper.make_node("Max", ["c", "zero"], ["m"]),
             helper.make_node("Add", ["r", "c"], ["mixed"]),
             helper.make_node("Mul", ["r", "r"], ["sq"]),
             helper.make_node("Resize", ["r", "", "scales"], ["up_cubic"], mode="cubic"),
             helper.make_node("Resize", ["r", "", "scales"], ["up_nearest"], mode="nearest")]
    model.graph.node.extend(extra)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    known = nonnegative_tensors(model)
    assert {"r", "f", "c0", "m", "sq", "up_nearest"} <= known
    assert not {"c", "d", "k", "mixed", "up_cubic", "x"} & known  # Clip at -1 may go negative


def test_probe_kinds():
    model = conv_model()

    class Mine(Observer):
        name = "mine"

    observers = {"c": make_observer("minmax"), "r": make_observer("percentile"), "f": make_observer("minmax"),
                 "k": Mine(), "d": make_observer("entropy")}
    observers["r"].rows_are_samples = True
    probes = plan_probes(model, observers)
    assert probes["c"].kind == "extent" and not probes["c"].nonnegative
    assert probes["r"].kind == "sample" and probes["r"].nonnegative
    assert probes["f"].kind == "full"  # rank 2
    assert probes["k"].kind == "full"  # an observer that declares no probe gets whole tensors
    assert probes["d"].kind == "full"  # axis 0 not known to hold samples: no sub-grid


def test_probe_graph_pools_instead_of_fetching():
    model = conv_model()
    observers = {"c": make_observer("minmax"), "r": make_observer("minmax")}
    probes = plan_probes(model, observers)
    probed = add_probes(model, probes)
    ops = [n.op_type for n in probed.graph.node[len(model.graph.node):]]
    assert ops == ["GlobalMaxPool", "ReduceMin", "GlobalMaxPool"]  # no min for the non-negative Relu output
    outputs = {o.name for o in probed.graph.output}
    assert "c" not in outputs and "r" not in outputs
    ort.InferenceSession(probed.SerializeToString(), providers=["CPUExecutionProvider"])  # loads as is


@pytest.mark.parametrize("method", ["minmax", "ema"])
def test_extent_probes_give_the_same_ranges_as_whole_tensors(method):
    model = conv_model()
    x = np.random.default_rng(1).normal(size=(12, 4, 12, 10)).astype(np.float32)
    names = ["x", "c", "r", "d", "k"]
    probed = {n: make_observer(method) for n in names}
    observe(model, probed, data_for(model, x), batch_size=4, progress=False)
    direct = {n: make_observer(method) for n in names}
    for i in range(0, 12, 4):
        for n, v in full_tensors(model, names, x[i:i + 4]).items():
            direct[n].update(v)
    for n in names:
        lo, hi = direct[n].range()
        if n == "r":
            lo = 0.0  # proven non-negative: its minimum is reported as 0, which qparams include anyway
        assert probed[n].range() == pytest.approx((lo, hi), rel=1e-6, abs=1e-7), n
        assert probed[n].count == direct[n].count


@pytest.mark.parametrize("method", ["percentile", "entropy", "mse"])
def test_sample_probes_bin_a_regular_sub_grid_of_each_sample(method):
    model = conv_model()
    x = np.random.default_rng(2).normal(size=(10, 4, 12, 10)).astype(np.float32)
    obs = make_observer(method)
    obs.rows_are_samples, obs.sample_limit = True, 8 * 4 * 4  # 8 channels x 12 x 10 -> stride 3: 4 x 4 positions
    probes = plan_probes(model, {"c": obs})
    assert probes["c"].weight == 9 and probes["c"].fetch_per_sample == 8 * 4 * 4
    observe(model, {"c": obs}, data_for(model, x), batch_size=3, progress=False)
    c = full_tensors(model, ["c"], x)["c"]
    expected = make_observer(method)
    expected.update_sample(float(c.min()), float(c.max()), c[:, :, ::3, ::3], 9)
    assert np.array_equal(obs.counts, expected.counts) and obs.exact_zeros == expected.exact_zeros
    assert obs.range() == pytest.approx(expected.range(), rel=1e-6)
    # and the same whatever the batching
    again = make_observer(method)
    again.rows_are_samples, again.sample_limit = True, 8 * 4 * 4
    observe(model, {"c": again}, data_for(model, x), batch_size=10, progress=False)
    assert np.array_equal(again.counts, obs.counts) and again.range() == obs.range()


def test_symbolic_sample_shape_falls_back_to_whole_tensors():
    model = conv_model()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    model = onnx.shape_inference.infer_shapes(onnx.ModelProto.FromString(
        _strip_value_info(model).SerializeToString()))
    obs = make_observer("percentile")
    obs.rows_are_samples = True
    probes = plan_probes(model, {"c": obs, "r": MinMaxObserver()})
    assert probes["c"].kind == "full"
    assert probes["r"].kind == "extent"  # pooling needs no static shape


def _strip_value_info(model):
    del model.graph.value_info[:]
    return model


def test_rank3_sample_probes_take_every_sth_value_of_the_flattened_sample():
    """[N, tokens, features]: a strided last axis would see the same few features of every token; the flattened
    stride (odd) cycles through all of them."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 16])
    w = numpy_helper.from_array(np.random.default_rng(3).normal(size=(16, 16)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"])], "g", [x],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, None)], [w])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    obs = make_observer("percentile")
    obs.rows_are_samples, obs.sample_limit = True, 20  # 96 values per sample -> stride 5 -> 20 values
    probes = plan_probes(model, {"h": obs})
    assert probes["h"].weight == 5 and probes["h"].fetch_per_sample == 20
    data = np.random.default_rng(4).normal(size=(9, 6, 16)).astype(np.float32)
    data[:, :, 7] *= 30  # an outlier feature, as transformers have
    observe(model, {"h": obs}, open_calibration(lambda: ({"x": data[i:i + 1]} for i in range(9)),
                                                 model_inputs(model)), batch_size=4, progress=False)
    h = full_tensors(model, ["h"], data)["h"]
    expected = make_observer("percentile")
    expected.update_sample(float(h.min()), float(h.max()), h.reshape(9, -1)[:, ::5], 5)
    assert np.array_equal(obs.counts, expected.counts)
    assert {i % 16 for i in range(0, 96, 5)} == set(range(16))  # every feature index is visited


def test_rank5_tensors_pool_over_all_three_spatial_axes():
    """Volumetric / video convolutions: [N, C, D, H, W]."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.normal(size=(4, 2, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1] * 6)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 6, 7, 8])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)], [w])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    obs = make_observer("mse")
    obs.rows_are_samples, obs.sample_limit = True, 4 * 2 * 3 * 3  # stride 3 over D, H, W: 2 x 3 x 3 positions
    probes = plan_probes(model, {"c": obs})
    assert probes["c"].weight == 27 and probes["c"].fetch_per_sample == 72
    x = rng.normal(size=(5, 2, 6, 7, 8)).astype(np.float32)
    observe(model, {"c": obs}, data_for(model, x), batch_size=2, progress=False)
    c = full_tensors(model, ["c"], x)["c"]
    expected = make_observer("mse")
    expected.update_sample(float(c.min()), float(c.max()), c[:, :, ::3, ::3, ::3], 27)
    assert np.array_equal(obs.counts, expected.counts) and obs.range() == pytest.approx(expected.range())

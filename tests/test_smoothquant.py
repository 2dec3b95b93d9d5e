"""SmoothQuant: the smoothed float model computes what the original did, and W8A8 accuracy improves where
activation channels have outliers; --algo combinations are validated."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import models
import oq
from conftest import run_onnx, sqnr_db
from oq import ir
from oq.errors import OqError
from oq.passes.smoothquant import SmoothQuant

OUTLIERS = (3, 17, 40, 58)


def outlier_block(reshape: bool = False):
    """LayerNorm (gamma 30x on a few channels, as trained transformers show) -> q/k projections and an MLP whose second layer reads a Mul by a constant; with `reshape`, the MLP input comes through a
    Reshape instead (no producer that can absorb the scales)."""
    rng = np.random.default_rng(0)
    d, h = 64, 96
    inits = []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    gamma = np.ones(d)
    gamma[list(OUTLIERS)] = 30.0
    nodes = [helper.make_node("LayerNormalization", ["x", const("gamma", gamma), const("beta", rng.normal(size=d))],
                              ["ln"], axis=-1, name="ln"),
             helper.make_node("MatMul", ["ln", const("wq", rng.normal(size=(d, d)) / 8)], ["q"], name="q"),
             helper.make_node("Identity", ["q"], ["q_id"], name="q_id"),
             helper.make_node("MatMul", ["ln", const("wk", rng.normal(size=(d, d)) / 8)], ["k"], name="k"),
             helper.make_node("Add", ["q_id", "k"], ["qk"], name="qk"),
             helper.make_node("MatMul", ["qk", const("w1", rng.normal(size=(d, h)) / 8)], ["h1"], name="fc1"),
             helper.make_node("Relu", ["h1"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", const("half", [0.5])], ["m"], name="half")]
    mlp_in = "m"
    if reshape:
        inits.append(numpy_helper.from_array(np.asarray([0, 0, h], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["m", "shape"], ["m2"], name="reshape"))
        mlp_in = "m2"
    scale = np.ones(h)
    scale[::17] = 25.0  # outlier channels in the MLP's hidden activation too
    next(n for n in nodes if n.name == "half").input[1] = const("half_vec", 0.5 * scale)
    nodes.append(helper.make_node("MatMul", [mlp_in, const("w2", rng.normal(size=(h, d)) / 8)], ["y"], name="fc2"))
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)

    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n, seed):
    return {"x": np.random.default_rng(seed).normal(size=(n, 8, 64)).astype(np.float32)}


class _Data:
    """The smallest calibration source: batches of a stacked feed."""

    def __init__(self, feed):
        self.feed, self.where = feed, "test data"

    def __len__(self):
        return len(self.feed["x"])

    def batches(self, size):
        for i in range(0, len(self), size):
            part = {k: v[i:i + size] for k, v in self.feed.items()}
            yield len(part["x"]), part


def _smooth(model, **kw):
    ctx = oq.prepare(model)  # shapes inferred, as the pipeline has them
    ctx.target = oq.load_target("tensorrt")
    result = SmoothQuant(_Data(_feeds(32, 0)), **kw).run(ctx)
    return ir.to_model(ctx.graph), result


@pytest.mark.parametrize("reshape, insert_mul, folded, inserted", [(False, False, 2, 0), (True, True, 1, 2)])
def test_smoothed_float_model_computes_the_same_output(reshape, insert_mul, folded, inserted):
    model = outlier_block(reshape)
    smoothed, result = _smooth(model, alpha=0.5, insert_mul=insert_mul)
    assert result.modified and f"smoothed {folded + inserted} of {folded + inserted}" in result.notes[0]
    assert sum("folded into" in n for n in result.notes) == folded
    assert sum("Mul by 1/s inserted" in n for n in result.notes) == inserted
    feed = _feeds(16, 1)
    ref, out = run_onnx(model, feed), run_onnx(smoothed, feed)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    gamma = next(numpy_helper.to_array(i) for i in smoothed.graph.initializer if i.name == "gamma")
    assert gamma[list(OUTLIERS)].max() / np.median(gamma) < 10  # the outliers moved into the weights


def test_without_a_foldable_producer_the_layer_is_skipped_and_reported():
    model = outlier_block(reshape=True)
    smoothed, result = _smooth(model, alpha=0.5)
    assert "smoothed 1 of 1" in result.notes[0] and "folded into LayerNormalization 'ln'" in result.notes[1]
    assert any("'m2': not smoothed (produced by Reshape 'reshape'" in n for n in result.notes)
    assert any("'qk': not smoothed (produced by Add 'qk'" in n for n in result.notes)
    w2 = next(numpy_helper.to_array(i) for i in smoothed.graph.initializer if i.name == "w2")
    np.testing.assert_array_equal(w2, next(numpy_helper.to_array(i) for i in model.graph.initializer
                                           if i.name == "w2"))


def _sqnr_with_and_without(path_or_model, calib, held, **kw):
    ref = run_onnx(path_or_model, held)
    plain = oq.quantize(path_or_model, "tensorrt", calib, progress=False)
    smooth = oq.quantize(path_or_model, "tensorrt", calib, progress=False, algo="smoothquant", **kw)
    return sqnr_db(ref, run_onnx(plain.model, held)), sqnr_db(ref, run_onnx(smooth.model, held)), smooth


def test_outlier_channels_gain_at_w8a8(tmp_path):
    model = outlier_block()
    np.savez(tmp_path / "c.npz", **_feeds(64, 0))
    base, smooth, result = _sqnr_with_and_without(model, tmp_path / "c.npz", _feeds(128, 1))
    print(f"outlier block W8A8 tensorrt: {base:.2f} -> {smooth:.2f} dB")
    assert smooth > base + 4.0  # measured: 24.21 -> 30.78 dB
    names = [p.name for p in result.report.passes]
    assert names.index("smoothquant") < names.index("annotate") < names.index("calibrate")


def test_reference_transformer_gains_at_w8a8(model_paths, calib_files):
    calib = calib_files["transformer"][0]
    held = models.make_inputs("transformer", 128, seed=1)
    base, searched, _ = _sqnr_with_and_without(model_paths["transformer"], calib, held)
    _, fixed, _ = _sqnr_with_and_without(model_paths["transformer"], calib, held, smoothquant_alpha=0.5)
    print(f"transformer W8A8 tensorrt: {base:.2f} -> {searched:.2f} dB (alpha searched), {fixed:.2f} (alpha 0.5)")
    assert searched > base + 1.0 and fixed > base + 1.0  # measured: 40.14 -> 41.82 (searched), 41.65 (0.5)


@pytest.mark.parametrize("algo, algos, rounding", [
    ("smoothquant", ("smoothquant",), None),
    ("bias-correction", ("bias-correction",), None),
    ("smoothquant+adaround", ("smoothquant", "adaround"), "adaround"),
    ("qdrop, bias-correction", ("qdrop", "bias-correction"), "qdrop"),
    ("rtn+smoothquant+bias-correction", ("rtn", "smoothquant", "bias-correction"), None),
])
def test_algo_combinations(algo, algos, rounding):
    config = oq.RunConfig(algo=algo)
    assert config.algos == algos and config.rounding_algo == rounding


@pytest.mark.parametrize("kwargs, message", [
    ({"algo": "smoothquant+bogus"}, "--algo: unknown algorithm 'bogus'; choose rtn, adaround, brecq, qdrop, "
                                    "smoothquant, bias-correction"),
    ({"algo": "adaround+brecq"}, "--algo: adaround and brecq are both weight-rounding algorithms; choose one"),
    ({"algo": "smoothquant", "smoothquant_alpha": 1.0}, "--smoothquant-alpha: must be a number between 0 and 1"),
    ({"algo": "adaround", "smoothquant_alpha": 0.5}, "--smoothquant-alpha: applies to --algo smoothquant only"),
])
def test_algo_mistakes_are_one_line_errors(kwargs, message):
    with pytest.raises(OqError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        oq.RunConfig(**kwargs)
    assert "\n" not in str(err.value)

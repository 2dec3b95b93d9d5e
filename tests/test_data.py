"""Calibration data sources: each one validated with one-line errors, and batching never changes qparams."""
import sys
import types

import numpy as np
import onnx
import pytest

import models
import oq
from oq.data import model_inputs, open_calibration
from oq.errors import OqError
from oq.preprocess import parse_preprocess


@pytest.fixture(scope="module")
def cnn(model_paths):
    return model_paths["resnet_mini"], model_inputs(onnx.load(str(model_paths["resnet_mini"])))


def write_images(folder, n, size=(40, 48)):
    from PIL import Image
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


def test_image_folder_preprocessing(cnn, tmp_path):
    path, specs = cnn
    folder = write_images(tmp_path / "imgs", 5)
    data = open_calibration(folder, specs, preprocess="resize=36,scale=1/255,mean=0.5/0.5/0.5,std=0.25/0.25/0.25")
    samples = list(data.samples())
    assert len(samples) == 5 and samples[0]["input"].shape == (1, 3, 32, 32)  # centre crop to the model's size
    x = samples[0]["input"]
    assert x.dtype == np.float32 and -2.01 <= x.min() and x.max() <= 2.01
    result = oq.quantize(path, "tensorrt", folder, progress=False, preprocess="scale=1/255")
    assert result.report.calibration["samples"] == 5


def test_unreadable_image_is_named(cnn, tmp_path):
    path, specs = cnn
    folder = write_images(tmp_path / "imgs", 2)
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(OqError, match=r"broken\.jpg: cannot read image"):
        oq.quantize(path, "tensorrt", folder, progress=False)


@pytest.mark.parametrize("spec,msg", [("crop=abc", "expected N or HxW"), ("color=red", "unknown key 'color'"),
                                      ("std=0", "must not be 0"), ("layout=chw", "expected nchw or nhwc")])
def test_bad_preprocess_spec(spec, msg):
    with pytest.raises(OqError, match=msg):
        parse_preprocess(spec)


def test_callable_source(cnn, tmp_path, monkeypatch):
    path, specs = cnn
    module = types.ModuleType("oq_test_feeds")
    module.good = lambda: ({"input": x[None]} for x in models.make_inputs("resnet_mini", 6)["input"])

    def boom():
        yield {"input": models.make_inputs("resnet_mini", 1)["input"]}
        raise RuntimeError("disk on fire")
    module.boom = boom
    module.wrong = lambda: [{"image": np.zeros((1, 3, 32, 32), np.float32)}]
    module.notdict = lambda: [np.zeros(3)]
    monkeypatch.setitem(sys.modules, "oq_test_feeds", module)
    result = oq.quantize(path, "tensorrt", "oq_test_feeds:good", progress=False)
    assert result.report.calibration["samples"] == 6
    with pytest.raises(OqError, match="raised RuntimeError at sample 1: disk on fire"):
        oq.quantize(path, "tensorrt", "oq_test_feeds:boom", progress=False)
    with pytest.raises(OqError, match="has no array for input 'input'; it has: 'image'"):
        oq.quantize(path, "tensorrt", "oq_test_feeds:wrong", progress=False)
    with pytest.raises(OqError, match="sample 0 is a ndarray"):
        oq.quantize(path, "tensorrt", "oq_test_feeds:notdict", progress=False)
    with pytest.raises(OqError, match="has no attribute 'missing'"):
        oq.quantize(path, "tensorrt", "oq_test_feeds:missing", progress=False)
    with pytest.raises(OqError, match="cannot import module 'no_such_mod_xyz'"):
        oq.quantize(path, "tensorrt", "no_such_mod_xyz:f", progress=False)


def test_random_calibration_only_when_asked_and_warned(cnn):
    path, _ = cnn
    result = oq.quantize(path, "tensorrt", "random", calib_size=4, progress=False)
    assert any("random data" in w for w in result.report.warnings)
    with pytest.raises(OqError, match="no calibration data given"):
        oq.quantize(path, "tensorrt", None, progress=False)


def qparams_of(model):
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.name: (inits[n.input[1]].tolist(), inits[n.input[2]].tolist())
            for n in model.graph.node if n.op_type == "QuantizeLinear"}


@pytest.mark.parametrize("target,method", [("tensorrt", None), ("onnxruntime", None), ("tensorrt", "percentile"),
                                           ("tensorrt", "entropy"), ("onnxruntime", "mse")])
def test_batch_size_does_not_change_qparams(model_paths, calib_files, target, method):
    path, calib = model_paths["mobilenet_mini"], calib_files["mobilenet_mini"][0]
    one = oq.quantize(path, target, calib, batch_size=1, calib_method=method, progress=False)
    sixteen = oq.quantize(path, target, calib, batch_size=16, calib_method=method, progress=False)
    assert qparams_of(one.model) == qparams_of(sixteen.model)


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_memory_budget_splits_passes_without_changing_qparams(model_paths, calib_files, method):
    path, calib = model_paths["resnet_mini"], calib_files["resnet_mini"][0]
    whole = oq.quantize(path, "onnxruntime", calib, calib_method=method, progress=False)
    # probes fetch a few values per channel, so only a tiny budget forces a split
    split = oq.quantize(path, "onnxruntime", calib, calib_method=method, max_memory_mb=0.001, progress=False)
    assert whole.report.calibration["passes"] == 1 and split.report.calibration["passes"] > 1
    assert qparams_of(whole.model) == qparams_of(split.model)


def test_calibration_memory_does_not_grow_with_samples(model_paths):
    """Peak Python-side memory (numpy outputs included) of the streaming runner: 32 vs 256 samples."""
    import tracemalloc

    from oq.calibration import observe
    from oq.data import NpzStack
    from oq.observers import make_observer

    model = onnx.load(str(model_paths["decoder"]))  # the largest activations of the reference models
    names = [n.output[0] for n in model.graph.node]
    specs = model_inputs(model)
    arrays = models.make_inputs("decoder", 256)

    class InMemory(NpzStack):
        def __init__(self, n):
            self.where, self.specs, self.limit, self.count = "mem", specs, n, 256

        def samples(self):
            for i in range(self.limit):
                yield {"input": arrays["input"][i:i + 1]}

    peaks = []
    for n in (32, 256):
        observers = {name: make_observer("minmax") for name in names}
        tracemalloc.start()
        observe(model, observers, InMemory(n), batch_size=16, progress=False)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.1 * peaks[0], peaks


def test_arrays_in_memory_quantize_exactly_as_the_same_npz(cnn, tmp_path):
    path, specs = cnn
    x = np.random.default_rng(3).random((10, *[d if isinstance(d, int) else 1 for d in specs[0].shape[1:]]),
                                        dtype=np.float32)
    npz = tmp_path / "c.npz"
    np.savez(npz, **{specs[0].name: x})
    results = [oq.quantize(path, "tensorrt", calib, progress=False) for calib in
               (str(npz), {specs[0].name: x}, [{specs[0].name: x[i:i + 1]} for i in range(10)])]
    weights = [{t.name: onnx.numpy_helper.to_array(t) for t in r.model.graph.initializer} for r in results]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(np.array_equal(other[k], weights[0][k]) for k in other)
    assert all(r.report.calibration["samples"] == 10 for r in results)
    meta = [{p.key: p.value for p in r.model.metadata_props}["oq.calibration_sha256"] for r in results]
    assert "not hashed" not in meta[1] and "not hashed" not in meta[2]
    changed = {specs[0].name: x + 1}
    assert {p.key: p.value for p in oq.quantize(path, "tensorrt", changed, progress=False).model.metadata_props}[
        "oq.calibration_sha256"] != meta[1]


def test_in_memory_calibration_errors_are_one_line(cnn):
    path, specs = cnn
    with pytest.raises(OqError, match="calibration arrays has no array for input 'input'; it has: 'wrong'"):
        oq.quantize(path, "tensorrt", {"wrong": np.zeros((2, 3, 32, 32), np.float32)})
    with pytest.raises(OqError, match="calibration data must be a path .* got list_iterator"):
        oq.quantize(path, "tensorrt", iter([{"input": np.zeros((1, 3, 32, 32), np.float32)}]))
    with pytest.raises(OqError, match="calibration list sample 1"):
        oq.quantize(path, "tensorrt", [{"input": np.zeros((1, 3, 32, 32), np.float32)}, {"x": 1}])

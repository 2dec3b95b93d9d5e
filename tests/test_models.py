"""Tests for the reference-model zoo in ``models/``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import models
from models import CNN_MODELS, REFERENCE_MODELS, build, get_spec, load_torch, make_inputs

torch = pytest.importorskip("torch")

EXPECTED_OPS = {
    "resnet_mini": {"Conv", "BatchNormalization", "Relu", "MaxPool", "Add", "Concat", "GlobalAveragePool", "Gemm"},
    "mobilenet_mini": {"Conv", "BatchNormalization", "Clip", "Add", "GlobalAveragePool", "Gemm"},
    "decoder": {"ConvTranspose", "BatchNormalization", "Relu", "Conv"},
    "mlp": {"Gemm", "BatchNormalization", "Relu"},
    "transformer": {"MatMul", "Softmax", "LayerNormalization", "Add", "Erf"},
}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("model_cache")


@pytest.fixture(scope="session")
def built(cache_dir):
    return {name: build(name, cache_dir) for name in REFERENCE_MODELS}


@pytest.fixture(scope="session")
def protos(built):
    return {name: onnx.load(str(path)) for name, path in built.items()}


@pytest.fixture(scope="session")
def torch_models():
    return {name: load_torch(name) for name in REFERENCE_MODELS}


def _session(path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _ops(proto) -> Counter:
    return Counter(n.op_type for n in proto.graph.node)


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _const_values(proto) -> dict[str, np.ndarray]:
    vals = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    for n in proto.graph.node:
        if n.op_type == "Constant":
            vals[n.output[0]] = numpy_helper.to_array(_attr(n, "value"))
    return vals


# ------------------------------------------------------------------ API


def test_api_constants():
    assert REFERENCE_MODELS == ("resnet_mini", "mobilenet_mini", "decoder", "mlp", "transformer")
    assert CNN_MODELS == ("resnet_mini", "mobilenet_mini")
    assert set(CNN_MODELS) <= set(REFERENCE_MODELS)
    with pytest.raises(KeyError):
        build("nope")
    with pytest.raises(KeyError):
        make_inputs("nope", 1)


# ------------------------------------------------------------ graph checks


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_graph_is_valid_standard_onnx(name, built, protos):
    path, proto = built[name], protos[name]
    assert path.is_file() and path.suffix == ".onnx"
    onnx.checker.check_model(str(path), full_check=True)
    assert {(o.domain or "ai.onnx", o.version) for o in proto.opset_import} == {("ai.onnx", 17)}
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    assert set(_ops(proto)) >= EXPECTED_OPS[name]

    spec = get_spec(name)
    assert [i.name for i in proto.graph.input] == list(spec.inputs)
    assert [o.name for o in proto.graph.output] == list(spec.outputs)
    for vi, shape in [*zip(proto.graph.input, spec.inputs.values()), *zip(proto.graph.output, spec.outputs.values())]:
        assert vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert _dims(vi) == list(shape), vi.name
    assert _dims(proto.graph.input[0])[0] == "batch"
    # initializers are not graph inputs
    inits = {i.name for i in proto.graph.initializer}
    assert not inits & {i.name for i in proto.graph.input}


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_batchnorm_kept_and_nontrivial(name, protos, torch_models):
    proto = protos[name]
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in torch_models[name].modules())
    assert has_bn == get_spec(name).has_batchnorm == (name != "transformer")
    bns = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    n_torch_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in torch_models[name].modules())
    assert len(bns) == n_torch_bn
    vals = _const_values(proto)
    for bn in bns:
        assert len(bn.output) == 1  # inference form: no running-stat outputs
        assert _attr(bn, "training_mode", 0) == 0
        gamma, beta, mean, var = (vals[i] for i in bn.input[1:5])
        assert np.all(var > 0)
        assert np.std(var) > 1e-3 and not np.allclose(var, 1.0, atol=0.05)
        assert np.abs(mean).max() > 1e-2 and np.std(mean) > 1e-3
        # learned affine parameters (init 1 / 0), moved by training
        assert not np.allclose(gamma, 1.0, atol=0.05) and np.std(gamma) > 0.02
        assert not np.allclose(beta, 0.0, atol=0.05) and np.std(beta) > 0.02
        # folding would change the producer's weights by gamma / sqrt(var + eps) visibly
        scale = gamma / np.sqrt(var + _attr(bn, "epsilon", 1e-5))
        assert np.abs(scale - 1.0).max() > 0.1


def test_resnet_ops(protos):
    ops = _ops(protos["resnet_mini"])
    assert ops["Concat"] >= 1 and ops["Add"] >= 2
    assert ops["BatchNormalization"] == ops["Conv"]  # every conv (incl. the 1x1 downsample) has BN
    assert ops["MaxPool"] == 1 and ops["GlobalAveragePool"] == 1
    convs = [n for n in protos["resnet_mini"].graph.node if n.op_type == "Conv"]
    assert any(_attr(c, "kernel_shape") == [1, 1] and _attr(c, "strides") == [2, 2] for c in convs)
    concat = next(n for n in protos["resnet_mini"].graph.node if n.op_type == "Concat")
    assert _attr(concat, "axis") == 1 and len(concat.input) == 2


def test_mobilenet_ops(protos):
    proto = protos["mobilenet_mini"]
    vals = _const_values(proto)
    depthwise = []
    for n in proto.graph.node:
        if n.op_type == "Conv":
            w = vals[n.input[1]]
            group = _attr(n, "group", 1)
            if group > 1 and group == w.shape[0] and w.shape[1] == 1:
                depthwise.append(n)
    assert len(depthwise) >= 3
    assert any(_attr(n, "strides") == [2, 2] for n in depthwise)
    clips = [n for n in proto.graph.node if n.op_type == "Clip"]
    assert clips
    for c in clips:
        assert float(vals[c.input[1]]) == 0.0 and float(vals[c.input[2]]) == 6.0
    assert _ops(proto)["Add"] >= 2  # residual connections
    assert "Relu" not in _ops(proto)


def test_decoder_ops(protos):
    cts = [n for n in protos["decoder"].graph.node if n.op_type == "ConvTranspose"]
    assert len(cts) == 2
    assert all(_attr(n, "strides") == [2, 2] for n in cts)
    assert any(_attr(n, "group", 1) > 1 for n in cts)


def test_mlp_ops(protos):
    ops = _ops(protos["mlp"])
    assert ops["Gemm"] == 3 and "MatMul" not in ops


def test_transformer_ops(protos):
    proto = protos["transformer"]
    ops = _ops(proto)
    assert ops["MatMul"] >= 6  # q, k, v, q.k^T, attn.v, out proj (+ FFN)
    assert ops["Softmax"] == 1 and ops["LayerNormalization"] == 2
    assert "BatchNormalization" not in ops
    assert _dims(proto.graph.input[0]) == ["batch", "seq", 64]
    assert _dims(proto.graph.output[0]) == ["batch", "seq", 64]
    # plain graph: no attention contrib ops, no shape side-graphs
    assert not {"Attention", "MultiHeadAttention", "Shape", "Gather"} & set(ops)


# ------------------------------------------------------ numerics vs torch


def _compare(sess, model, feeds, tol=1e-4):
    (x,) = feeds.values()
    got = sess.run(None, feeds)[0]
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err < tol, f"max rel err {err:.2e}"
    return want


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_onnx_matches_torch(name, built, torch_models):
    sess = _session(built[name])
    model = torch_models[name]
    assert not model.training
    out = _compare(sess, model, make_inputs(name, 16, seed=1))
    # meaningful scale: nothing vanished or exploded
    assert 0.3 < float(out.std()) < 10.0
    # dynamic batch
    _compare(sess, model, make_inputs(name, 3, seed=2))


def test_transformer_dynamic_seq(built, torch_models):
    sess = _session(built["transformer"])
    for seq in (7, 23):
        feeds = make_inputs("transformer", 4, seed=1, seq_len=seq)
        assert feeds["tokens"].shape == (4, seq, 64)
        out = _compare(sess, torch_models["transformer"], feeds)
        assert out.shape == (4, seq, 64)


def test_load_torch_deterministic(torch_models):
    a = torch_models["resnet_mini"].state_dict()
    fresh = load_torch("resnet_mini")
    b = fresh.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not load_torch("mlp").training
    # every call returns its own module
    with torch.no_grad():
        fresh.fc.weight.zero_()
    assert not torch.equal(load_torch("resnet_mini").fc.weight, fresh.fc.weight)


def test_training_reproducible_and_leaves_torch_state_alone():
    """Training twice in this process gives bit-identical weights and restores threads, RNG, determinism.

    (A shortened recipe keeps it fast; the fixtures hold the full recipe's result.)
    """
    from models import zoo

    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    first, log = zoo.train("mlp", steps=150)
    with torch.no_grad():  # training must still work under no_grad
        again, _ = zoo.train("mlp", steps=150)
    assert log["steps"] == 150
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == det
    assert torch.equal(torch.get_rng_state(), rng)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(get_spec("mlp").seed)
        untrained = zoo.FACTORIES["mlp"]().state_dict()
    assert not torch.equal(first["fc1.weight"], untrained["fc1.weight"])


# ------------------------------------------------------- weight fixtures


@pytest.mark.parametrize("name", models.SPECS)
def test_weight_fixture_is_current(name):
    """Every model's committed weights were frozen from the current zoo.py, data.py and specs.py."""
    from models import _weights

    status = _weights.status(name)
    assert status == "ok", (
        f"models/weights/{name}.npz is {status}: the model sources changed since it was frozen, so every machine "
        f"now trains {name} itself (host-dependent weights). Run `python -m models freeze {name}` and commit "
        f"models/weights/{name}.npz."
    )


@pytest.mark.parametrize("name", models.SPECS)
def test_load_torch_gives_the_fixture_weights(name, monkeypatch):
    import warnings

    from models import _weights, zoo

    monkeypatch.setattr(zoo, "_TRAINED", {})  # load from the file, not from this process' memo
    with warnings.catch_warnings():
        warnings.simplefilter("error", models.HostDependentWeightsWarning)
        state = load_torch(name).state_dict()
    with np.load(_weights.weights_path(name), allow_pickle=False) as npz:
        stored = {k: npz[k] for k in npz.files}
    assert str(stored.pop(_weights.HASH_KEY)) == _weights.training_hash(name)
    assert set(state) == set(stored)
    for key, tensor in state.items():
        got = tensor.numpy()
        assert got.dtype == stored[key].dtype and got.shape == stored[key].shape, key
        assert got.tobytes() == stored[key].tobytes(), key


def test_weight_fixture_files_are_deterministic(tmp_path):
    """Writing the same weights again reproduces the committed file byte for byte (re-freezing makes no diff)."""
    from models import _weights

    arrays, _ = _weights.read("mlp")
    again = _weights.write("mlp", arrays, tmp_path)
    assert again.read_bytes() == _weights.weights_path("mlp").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _short_mlp_recipe(monkeypatch):
    import dataclasses

    from models import zoo

    monkeypatch.setitem(zoo.RECIPES, "mlp", dataclasses.replace(zoo.RECIPES["mlp"], steps=20))
    monkeypatch.setattr(zoo, "_TRAINED", {})
    monkeypatch.setattr(zoo, "TRAINING_LOG", {})


@pytest.mark.parametrize("why", ["missing", "stale"])
def test_missing_or_stale_fixture_trains_here_with_a_warning(why, tmp_path, monkeypatch):
    import shutil

    from models import _weights

    committed = _weights.weights_path("mlp")
    _short_mlp_recipe(monkeypatch)
    monkeypatch.setattr(_weights, "WEIGHTS_DIR", tmp_path)
    if why == "stale":  # frozen from other sources than the current ones
        shutil.copyfile(committed, tmp_path / "mlp.npz")
        monkeypatch.setattr(_weights, "training_hash", lambda name: "0" * 16)
    assert _weights.status("mlp") == why and _weights.load("mlp") is None
    with pytest.warns(models.HostDependentWeightsWarning, match=r"mlp\.npz is " + why) as record:
        model = load_torch("mlp")
    assert "python -m models freeze mlp" in str(record[0].message)
    assert not model.training
    with np.load(committed) as npz:  # 20 steps, not the frozen weights
        assert not np.array_equal(model.fc1.weight.detach().numpy(), npz["fc1.weight"])


def test_freeze_cli_writes_a_current_fixture(tmp_path, monkeypatch, capsys):
    from models import _weights
    from models.__main__ import main

    _short_mlp_recipe(monkeypatch)
    monkeypatch.setattr(_weights, "WEIGHTS_DIR", tmp_path)
    assert main(["freeze", "mlp"]) == 0
    assert str(tmp_path / "mlp.npz") in capsys.readouterr().out
    assert _weights.status("mlp") == "ok"
    state = load_torch("mlp").state_dict()  # the memo holds what was frozen
    frozen = _weights.load("mlp")
    assert all(state[k].numpy().tobytes() == frozen[k].tobytes() for k in state)


# held-out score floor per model: accuracy (chance 0.1, majority class ~0.3 for the
# CNNs) or R^2 of the regression target (0 for a constant / copy-the-input model)
TRAINED_FLOOR = {"resnet_mini": 0.5, "mobilenet_mini": 0.45, "decoder": 0.7, "mlp": 0.65, "transformer": 0.7}


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_models_are_trained(name, torch_models):
    from models import zoo
    from models.data import make_labelled

    model = torch_models[name]
    assert zoo.evaluate(name, model, n=256) > TRAINED_FLOOR[name]
    inputs, target = make_labelled(name, 8, seed=1)
    np.testing.assert_array_equal(inputs[get_spec(name).input_name], make_inputs(name, 8, seed=1)[get_spec(name).input_name])
    if name in ("resnet_mini", "mobilenet_mini", "mlp"):
        assert target.dtype == np.int64 and target.shape == (8,) and target.min() >= 0 and target.max() < 10
        with torch.no_grad():
            logits = model(torch.from_numpy(make_inputs(name, 256, seed=1)["input"]))
        # confident but not saturated, and varied predictions
        assert 1.0 < float(logits.std()) < 8.0
        assert len(torch.unique(logits.argmax(dim=1))) >= 5
    else:
        assert target.dtype == np.float32 and target.shape == inputs[get_spec(name).input_name].shape[:1] + tuple(
            {"decoder": (3, 32, 32), "transformer": (16, 64)}[name]
        )


# ------------------------------------------------------------- inputs


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_make_inputs(name, protos):
    proto = protos[name]
    a = make_inputs(name, 8, seed=0)
    assert list(a) == [i.name for i in proto.graph.input]
    (x,) = a.values()
    assert x.dtype == np.float32 and x.shape[0] == 8
    assert np.isfinite(x).all()
    spec = get_spec(name)
    assert x.shape[1:] == tuple(16 if d == "seq" else d for d in spec.inputs[spec.input_name][1:])
    # deterministic per seed, prefix-stable, different across seeds
    np.testing.assert_array_equal(x, make_inputs(name, 8, seed=0)[proto.graph.input[0].name])
    np.testing.assert_array_equal(x[:3], make_inputs(name, 3, seed=0)[proto.graph.input[0].name])
    (y,) = make_inputs(name, 8, seed=1).values()
    assert not np.allclose(x, y)
    # samples within a batch differ
    assert not np.allclose(x[0], x[1])
    # roughly normalised
    assert 0.3 < float(x.std()) < 3.0 and abs(float(x.mean())) < 1.0


def test_image_inputs_look_like_images():
    (x,) = make_inputs("resnet_mini", 16, seed=0).values()
    assert x.shape == (16, 3, 32, 32)
    # ImageNet-normalised pixels in [0, 1]
    assert x.min() >= (0 - 0.485) / 0.229 - 1e-4 and x.max() <= (1 - 0.406) / 0.225 + 1e-4
    # smooth: neighbouring pixels are strongly correlated
    corr = np.corrcoef(x[..., :, :-1].ravel(), x[..., :, 1:].ravel())[0, 1]
    assert corr > 0.8
    assert set(make_inputs("mobilenet_mini", 2)) == {"input"}


# -------------------------------------------------------------- caching


def test_cache_reused(built, cache_dir):
    path = built["mlp"]
    assert path.parent == cache_dir
    assert models.cache_key("mlp") in path.name
    mtime = path.stat().st_mtime_ns
    again = build("mlp", cache_dir)
    assert again == path and again.stat().st_mtime_ns == mtime
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(".tmp")]


def test_cache_dir_respected(built, tmp_path, monkeypatch):
    other = build("mlp", tmp_path / "other")
    assert other.parent == tmp_path / "other" and other.is_file()
    assert other != built["mlp"] and other.name == built["mlp"].name
    monkeypatch.setenv("OQ_MODEL_CACHE", str(tmp_path / "env"))
    assert models.default_cache_dir() == tmp_path / "env"
    from_env = build("mlp")
    assert from_env.parent == tmp_path / "env" and from_env.is_file()
    # per user, outside the checkout, so fresh clones reuse the exported models
    monkeypatch.delenv("OQ_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.default_cache_dir() == tmp_path / "xdg" / "oq" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec asks
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_cache_dir() == tmp_path / "home" / ".cache" / "oq" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.default_cache_dir() == tmp_path / "home" / ".cache" / "oq" / "models"


def test_cache_key_tracks_torch_version_model_and_weights(tmp_path, monkeypatch):
    import shutil

    from models import _export, _weights

    key = _export.cache_key("mlp")
    assert key != _export.cache_key("decoder")
    monkeypatch.setattr(_export, "_torch_version", lambda: "0.0.0")
    assert _export.cache_key("mlp") != key
    monkeypatch.undo()
    assert _export.cache_key("mlp") == key
    # the fixture's bytes are part of the key: re-frozen weights export anew
    arrays, _ = _weights.read("mlp")
    monkeypatch.setattr(_weights, "WEIGHTS_DIR", tmp_path)
    shutil.copyfile(Path(models.__file__).parent / "weights" / "mlp.npz", tmp_path / "mlp.npz")
    assert _export.cache_key("mlp") == key
    arrays["fc3.bias"] = arrays["fc3.bias"] + np.float32(1e-3)
    _weights.write("mlp", arrays, tmp_path)
    assert _export.cache_key("mlp") != key
    (tmp_path / "mlp.npz").unlink()
    assert _export.cache_key("mlp") not in (key, _export.cache_key("decoder"))


# ------------------------------------------------------------------ CLI


def test_cli_export(tmp_path, cache_dir, capsys):
    from models.__main__ import main

    out = tmp_path / "out"
    assert main(["export", "mlp", "-o", str(out), "--cache-dir", str(cache_dir)]) == 0
    printed = capsys.readouterr().out.split()
    expected = [out / "mlp.onnx", out / "mlp.calib.npz", out / "mlp.eval.npz"]
    assert printed == [str(p) for p in expected]
    onnx.checker.check_model(str(expected[0]))
    calib, held_out = np.load(expected[1]), np.load(expected[2])
    assert calib["input"].shape == (64, 64) and held_out["input"].shape == (32, 64)
    np.testing.assert_array_equal(calib["input"], make_inputs("mlp", 64, seed=0)["input"])
    np.testing.assert_array_equal(held_out["input"], make_inputs("mlp", 32, seed=1)["input"])


def test_bench_transformer_builds_trains_and_quantizes_accurately(cache_dir, tmp_path):
    """The wide encoder block the latency benchmarks use: not in every test's model set, so checked once here."""
    import oq
    from conftest import run_onnx, sqnr_db

    assert set(models.BENCH_MODELS) == {"transformer_wide"}
    path = build("transformer_wide", cache_dir)
    proto = onnx.load(str(path))
    assert {"MatMul", "Softmax", "LayerNormalization", "Erf"} <= set(_ops(proto))
    held_out = make_inputs("transformer_wide", 16, seed=1)
    ref = run_onnx(str(path), held_out)
    torch_out = load_torch("transformer_wide")(torch.from_numpy(held_out["tokens"])).detach().numpy()
    np.testing.assert_allclose(ref, torch_out, atol=1e-4, rtol=1e-4)
    np.savez(tmp_path / "calib.npz", **make_inputs("transformer_wide", 32))
    q = oq.quantize(path, "onnxruntime", tmp_path / "calib.npz", progress=False)
    assert sqnr_db(ref, run_onnx(q.model, held_out, optimize=True)) >= 25.0

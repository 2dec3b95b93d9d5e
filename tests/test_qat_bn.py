"""BatchNormalization-aware finetuning (oq.finetune(float_model=...), oq.bridge.qat_bn): nothing learned gives the
quantized weights and biases back, the running statistics follow torch's momentum rule and are folded into the
exported bias, the module in eval mode computes what onnxruntime computes on the export, training lowers a loss,
frozen statistics stay, and the errors."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import oq
from oq.bridge.qat_module import QatModel

EPS = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def float_model(seed: int = 0, bn: bool = True) -> onnx.ModelProto:
    """input [n,3,8,8] -> conv1 (1x1, with bias) -> bn1 -> Relu -> conv2 (3x3, no bias) -> bn2 -> Relu -> mean
    -> Gemm -> y [n,4]; BN statistics far from (0, 1) so folding them matters."""
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, np.float32)
    inits = [numpy_helper.from_array(f32(rng.normal(0, 0.5, (8, 3, 1, 1))), "w1"),
             numpy_helper.from_array(f32(rng.normal(0, 0.2, 8)), "b1"),
             numpy_helper.from_array(f32(rng.normal(0, 0.2, (8, 8, 3, 3))), "w2"),
             numpy_helper.from_array(f32(rng.normal(0, 0.5, (4, 8))), "wg"),
             numpy_helper.from_array(f32(rng.normal(0, 0.1, 4)), "bg")]
    convs = {"1": helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1"),
             "2": helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1])}
    nodes = []
    for i, c in (("1", "c1"), ("2", "c2")):
        nodes.append(convs[i])
        inits += [numpy_helper.from_array(f32(rng.uniform(0.5, 1.5, 8)), f"gamma{i}"),
                  numpy_helper.from_array(f32(rng.normal(0, 0.3, 8)), f"beta{i}"),
                  numpy_helper.from_array(f32(rng.normal(0, 0.3, 8)), f"mean{i}"),
                  numpy_helper.from_array(f32(rng.uniform(0.3, 2.0, 8)), f"var{i}")]
        if bn:
            nodes.append(helper.make_node("BatchNormalization", [c, f"gamma{i}", f"beta{i}", f"mean{i}", f"var{i}"],
                                          [f"n{i}"], name=f"bn{i}", epsilon=EPS))
        nodes.append(helper.make_node("Relu", [f"n{i}" if bn else c], [f"r{i}"], name=f"relu{i}"))
    nodes += [helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
              helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
              helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "convbn", [helper.make_tensor_value_info("input", T.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", T.FLOAT, ["n", 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def inputs(n: int, seed: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, (n, 3, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def fp():
    return float_model()


@pytest.fixture(scope="module")
def quantized(fp, tmp_path_factory):
    made, calib = {}, tmp_path_factory.mktemp("qat_bn") / "calib.npz"
    np.savez(calib, input=inputs(64, 0))

    def get(target, **bits):
        key = (target, *sorted(bits.items()))
        if key not in made:  # cpu="vnni": no saturation guard re-quantizing channels (the weights stay BN's fold)
            model = onnx.ModelProto()
            model.CopyFrom(fp)
            made[key] = oq.quantize(model, target, str(calib), progress=False, cpu="vnni", **bits).model
        return made[key]
    return get


def ort_run(model, x):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def inits(model) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def nodes(model) -> list:
    return [n.SerializeToString() for n in model.graph.node]


def regression(model, n=128, seed=5, low=-1.0, high=1.0):
    """Batches of 16 from `inputs`, the target a fixed affine map of the float model's output."""
    x = inputs(n, seed, low, high)
    y = ort_run(model, x) * 1.5 + 0.3
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, n, 16)]


TARGETS = [("onnxruntime", {}), ("tensorrt", {}), ("academic", dict(weight_bits=4, act_bits=4))]


# ---------------------------------------------------------------------------------------------------------------
# nothing learned: the quantized model back


@pytest.mark.parametrize("target, bits", TARGETS)
def test_zero_epochs_refold_to_the_quantized_weights_and_biases(quantized, fp, target, bits):
    q = quantized(target, **bits)
    out = oq.finetune(q, regression(fp)[:1], F.mse_loss, epochs=0, float_model=fp)
    assert nodes(out) == nodes(q) and not any(n.op_type == "BatchNormalization" for n in out.graph.node)
    assert [(t.name, t.data_type, list(t.dims)) for t in out.graph.initializer] == \
        [(t.name, t.data_type, list(t.dims)) for t in q.graph.initializer]
    # BnFold computes W * gamma / sqrt(var + eps) and the folded bias in float64 as oq's fold pass does, so the
    # same float32 weights and biases, quantized on the same grids to the same codes: the model back, byte for byte
    assert [t.SerializeToString() for t in out.graph.initializer] == \
        [t.SerializeToString() for t in q.graph.initializer]
    record = json.loads({p.key: p.value for p in out.metadata_props}["oq.finetune"])
    assert record["bn_aware"] == 2 and record["bn_momentum"] == 0.1 and record["freeze_bn_epoch"] is None


# ---------------------------------------------------------------------------------------------------------------
# the running statistics: torch's momentum rule, folded into the exported bias


def test_running_statistics_follow_the_batches_into_the_exported_bias(quantized, fp):
    # vitis: the graph input quantized too (so numpy can compute conv1's input), int32 biases of scale s_x * s_w
    q = quantized("vitis", equalize=False)
    # the calibration inputs are uniform in [-1, 1]; these in [0, 1]: conv1's outputs have another mean
    batches = regression(fp, n=96, seed=7, low=0.0, high=1.0)
    m = 0.3
    out = oq.finetune(q, batches, F.mse_loss, epochs=1, lr=0.0, scale_lr=0.0, float_model=fp, bn_momentum=m)
    f, before, after = inits(fp), inits(q), inits(out)
    producer = {n.output[0]: n for n in q.graph.node}
    conv = next(n for n in q.graph.node if n.name == "conv1")
    x_dq, w_dq, b_dq = (producer[t] for t in conv.input)
    s_x, z_x = before[x_dq.input[1]], before[x_dq.input[2]]
    x_lo, x_hi = np.iinfo(z_x.dtype).min, np.iinfo(z_x.dtype).max
    s_w = before[w_dq.input[1]].reshape(-1, 1, 1, 1)  # per tensor or per channel
    reach = np.abs(before[w_dq.input[0]].astype(np.int64)).reshape(s_w.shape[0], -1).max(1).reshape(-1, 1, 1, 1)
    codes = lambda sf: np.clip(np.rint((w * sf[:, None, None, None]).astype(np.float32) / s_w), -reach, reach)
    w, b, gamma, beta = (f[k].astype(np.float64) for k in ("w1", "b1", "gamma1", "beta1"))
    mean, var = f["mean1"].astype(np.float64), f["var1"].astype(np.float64)
    for x, _ in batches:  # numpy, step by step, what each training forward does
        sf = gamma / np.sqrt(var + np.float32(EPS))
        xq = (np.clip(np.rint(x / s_x) + z_x, x_lo, x_hi) - z_x) * s_x
        y = np.einsum("nchw,oc->nohw", xq.astype(np.float64), (codes(sf) * s_w)[:, :, 0, 0])
        y = y / sf.astype(np.float32)[None, :, None, None] + b[None, :, None, None]
        mean = (1 - m) * mean + m * y.mean(axis=(0, 2, 3))
        var = (1 - m) * var + m * y.transpose(1, 0, 2, 3).reshape(8, -1).var(axis=1, ddof=1)
    sf = gamma / np.sqrt(var + np.float32(EPS))
    want = np.rint((b * sf + beta - mean * sf).astype(np.float32) / before[b_dq.input[1]])
    assert np.abs(after[b_dq.input[0]] - want).max() <= 1  # int32 rounding of float32 sums in another order
    assert np.abs(want - before[b_dq.input[0]]).min() > 20  # ... and the statistics moved every channel's bias
    # the weights: W * sf with the new running variance, on the quantized model's grid
    np.testing.assert_array_equal(after[w_dq.input[0]], codes(sf))


def test_frozen_statistics_stay(quantized, fp):
    q = quantized("onnxruntime")
    batches = regression(fp, n=48, seed=7, low=0.0, high=1.0)
    qm = QatModel(q, float_model=fp).train()
    stats = {n: qm.module.tensor_for(n).clone() for b in qm.bn_pairs for n in b.names[4:]}
    qm(torch.from_numpy(batches[0][0]))
    assert all(not torch.equal(qm.module.tensor_for(n), v) for n, v in stats.items())  # live: they move
    qm = QatModel(q, float_model=fp).train()
    qm.freeze_bn()
    qm.train()  # stays frozen
    qm(torch.from_numpy(batches[0][0]))
    assert all(torch.equal(qm.module.tensor_for(n), v) for n, v in stats.items())
    frozen = oq.finetune(q, batches, F.mse_loss, epochs=2, lr=0.0, scale_lr=0.0, float_model=fp, freeze_bn_epoch=0)
    nothing = oq.finetune(q, batches, F.mse_loss, epochs=0, float_model=fp)
    assert [t.SerializeToString() for t in frozen.graph.initializer] == \
        [t.SerializeToString() for t in nothing.graph.initializer]


# ---------------------------------------------------------------------------------------------------------------
# eval mode computes the exported model; training helps


@pytest.mark.parametrize("target, bits", [TARGETS[0], TARGETS[2]])
def test_eval_module_matches_onnxruntime_on_the_export(quantized, fp, target, bits):
    q = quantized(target, **bits)
    qm = QatModel(q, float_model=fp).train()
    learned = {b.name(k): qm.module.tensor_for(b.name(k)).detach().clone() for b in qm.bn_pairs
               for k in ("weight", "gamma", "beta")}
    assert {id(t) for t in qm.weights()} >= {id(qm.module.tensor_for(n)) for n in learned}
    assert not any(isinstance(qm.module.tensor_for(b.name(k)), torch.nn.Parameter) for b in qm.bn_pairs
                   for k in ("mean", "var"))  # running statistics are buffers
    opt = torch.optim.Adam([{"params": qm.weights(), "lr": 3e-3}, {"params": qm.scales(), "lr": 1e-2}])
    for x, y in regression(fp, seed=9, low=0.0, high=1.0)[:4]:
        loss = F.mse_loss(qm(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(not torch.equal(qm.module.tensor_for(n), v) for n, v in learned.items())
    out = qm.eval().export()
    x = inputs(64, 11)
    with torch.no_grad():
        mine = qm(torch.from_numpy(x)).numpy()
    theirs = ort_run(out, x)
    spread = float(theirs.max() - theirs.min())
    # the same codes but where float sums in another order tip a value across a .5 tie: one activation step
    assert np.abs(mine - theirs).max() <= 0.01 * spread, (np.abs(mine - theirs).max(), spread)
    assert np.median(np.abs(mine - theirs)) <= 1e-5 * spread
    assert nodes(out) == nodes(q)


@pytest.mark.parametrize("target, bits", [TARGETS[0], TARGETS[2]])
def test_bn_aware_training_lowers_the_loss(quantized, fp, target, bits):
    q = quantized(target, **bits)
    batches = regression(fp, n=256, seed=3)
    out = oq.finetune(q, batches, F.mse_loss, epochs=4, lr=3e-3, scale_lr=1e-2, float_model=fp)
    x = inputs(256, 4)
    want = ort_run(fp, x) * 1.5 + 0.3
    mse = lambda model: float(((ort_run(model, x) - want) ** 2).mean())
    assert mse(out) < 0.5 * mse(q), (mse(q), mse(out))
    assert nodes(out) == nodes(q)
    onnx.checker.check_model(out, full_check=True)


# ---------------------------------------------------------------------------------------------------------------
# errors


def test_errors_say_what_is_wrong(quantized, fp):
    q = quantized("onnxruntime")
    items = regression(fp)[:1]

    def message(**kw):
        with pytest.raises(oq.OqError) as e:
            oq.finetune(q, items, F.mse_loss, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert message(float_model=float_model(seed=1)).startswith(
        "float_model does not match the quantized model at Conv 'conv1': ")
    assert "quantization steps" in message(float_model=float_model(seed=1))
    assert message(float_model=float_model(bn=False)).startswith(
        "float_model has no Conv followed by BatchNormalization")
    assert message(float_model=fp, bn_momentum=-0.1) == "bn_momentum must be a number from 0 to 1, got -0.1"
    assert message(float_model=fp, bn_momentum=1.5) == "bn_momentum must be a number from 0 to 1, got 1.5"
    assert message(float_model=fp, freeze_bn_epoch=-1) == \
        "freeze_bn_epoch must be None or a whole number >= 0, got -1"
    assert message(float_model=3).startswith("float_model must be an onnx.ModelProto or a path")

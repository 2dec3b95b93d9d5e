"""Quantization-aware finetuning (oq.finetune, oq.bridge.qat_module): the exact round trip, a lower task loss in
onnxruntime after training, the targets' constraints after the write-back (zero-points, powers of two, shared scales,
int32 biases, weight code ranges, packed int4), the torch module's codes against onnxruntime's, the gradients, and the
errors."""
import hashlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import models
import oq
from models.data import make_labelled
from oq.bridge.qat_module import QatModel, _FakeQuant

NAME = "resnet_mini"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(float model path, calibration .npz, training batches, held-out inputs, held-out labels)."""
    root = tmp_path_factory.mktemp("qat")
    x, y = make_labelled(NAME, 512, seed=1000)
    x_te, y_te = make_labelled(NAME, 256, seed=2)
    np.savez(root / "calib.npz", input=x["input"][:64])
    batches = [(x["input"][i:i + 32], y[i:i + 32]) for i in range(0, 512, 32)]
    return models.build(NAME), root / "calib.npz", batches, x_te["input"], y_te


@pytest.fixture(scope="module")
def quantized(data):
    made = {}

    def get(target, **bits):
        key = (target, *sorted(bits.items()))
        if key not in made:
            made[key] = oq.quantize(data[0], target, data[1], progress=False, **bits).model
        return made[key]
    return get


def ort_run(model, feed, extra=()):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in extra)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def inits(model) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def nodes(model) -> list:
    return [n.SerializeToString() for n in model.graph.node]


# ---------------------------------------------------------------------------------------------------------------
# nothing learned: the input model back


@pytest.mark.parametrize("target, bits", [("tensorrt", {}), ("onnxruntime", {}), ("vitis", {}), ("qnn", {}),
                                          ("academic", dict(weight_bits=4, act_bits=4))])
def test_zero_epochs_gives_the_model_back(quantized, data, target, bits):
    q = quantized(target, **bits)
    out = oq.finetune(q, data[2], F.cross_entropy, epochs=0)
    assert [t.SerializeToString() for t in out.graph.initializer] == [t.SerializeToString() for t in q.graph.initializer]
    assert nodes(out) == nodes(q)
    feed = {"input": data[3][:16]}
    np.testing.assert_array_equal(ort_run(out, feed)["logits"], ort_run(q, feed)["logits"])


def test_zero_learning_rates_change_nothing(quantized, data):
    q = quantized("onnxruntime")
    out = oq.finetune(q, data[2][:3], F.cross_entropy, epochs=1, lr=0.0, scale_lr=0.0)
    assert [t.SerializeToString() for t in out.graph.initializer] == [t.SerializeToString() for t in q.graph.initializer]
    assert '"steps": 3' in {p.key: p.value for p in out.metadata_props}["oq.finetune"]


# ---------------------------------------------------------------------------------------------------------------
# training helps, measured in onnxruntime on the returned model


def _loss_and_accuracy(model, x, y):
    logits = ort_run(model, {"input": x})["logits"]
    return float(F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y))), float((logits.argmax(1) == y).mean())


def test_finetuning_w4a4_recovers_accuracy(quantized, data):
    q = quantized("academic", weight_bits=4, act_bits=4)
    out = oq.finetune(q, data[2], F.cross_entropy, epochs=2, lr=3e-4)
    loss_ptq, acc_ptq = _loss_and_accuracy(q, data[3], data[4])
    loss_qat, acc_qat = _loss_and_accuracy(out, data[3], data[4])
    loss_fp, acc_fp = _loss_and_accuracy(onnx.load(str(data[0])), data[3], data[4])
    # measured: fp32 0.66, PTQ 0.33 (loss 2.22), QAT 0.64 (loss 1.00)
    assert acc_qat > acc_ptq + 0.2 and acc_qat > acc_fp - 0.1, (acc_ptq, acc_qat, acc_fp)
    assert loss_qat < 0.6 * loss_ptq, (loss_ptq, loss_qat)
    assert nodes(out) == nodes(q)
    onnx.checker.check_model(out, full_check=True)


# ---------------------------------------------------------------------------------------------------------------
# the target's constraints after the write-back


def _changed(a: dict, b: dict, names) -> list:
    return [n for n in names if not np.array_equal(a[n], b[n])]


def _quantizers(model, op="DequantizeLinear"):
    return [n for n in model.graph.node if n.op_type == op]


def test_tensorrt_zero_points_codes_and_files_kept(quantized, data, tmp_path):
    q = quantized("tensorrt")
    path = tmp_path / "q.onnx"
    onnx.save(q, str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    out = oq.finetune(path, data[2][:6], F.cross_entropy, epochs=1, lr=1e-3, scale_lr=1e-2)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    before, after = inits(q), inits(out)
    dqs = _quantizers(q)
    zps = [n.input[2] for n in dqs]
    assert all(not after[z].any() for z in zps) and not _changed(before, after, zps)
    scales = sorted({n.input[1] for n in dqs})
    assert len(_changed(before, after, scales)) > len(scales) // 2  # scales learned
    weights = [n.input[0] for n in dqs if n.input[0] in before]
    assert _changed(before, after, weights)
    for w in weights:  # per channel, never past the largest code the input had: -127..127 stays narrow
        reach = np.abs(before[w].astype(int)).reshape(len(before[w]), -1).max(1)
        assert (np.abs(after[w].astype(int)).reshape(len(after[w]), -1).max(1) <= reach).all()
        assert after[w].dtype == before[w].dtype
    assert nodes(out) == nodes(q)
    onnx.checker.check_model(out, full_check=True)


def test_vitis_powers_of_two_shared_scales_and_int32_biases(quantized, data):
    q = quantized("vitis")
    qm = QatModel(q)
    opt = torch.optim.Adam([{"params": qm.weights(), "lr": 1e-3}, {"params": qm.scales(), "lr": 0.2}])
    for x, y in data[2][:4]:
        loss = F.cross_entropy(qm(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = qm.export()
    before, after = inits(q), inits(out)
    scales = sorted({n.input[1] for n in _quantizers(q)})
    assert all(np.all(np.frexp(after[s])[0] == 0.5) for s in scales)  # powers of two, all of them
    assert _changed(before, after, scales)  # ... and some moved to another power
    # scales the graph shares (Concat inputs and output, MaxPool's) stay equal
    tied = [g.members for g in qm.plan.groups if len(g.members) > 1]
    assert len(tied) == 3 and any(len(m) == 3 for m in tied)
    for members in tied:
        assert all(np.array_equal(after[m], after[members[0]]) for m in members)
    # int32 biases: scale = s_x * s_w with the new scales, codes = round(b / scale) of the learned float bias
    learned = {n: p.detach().numpy() for n, p in qm.module.initializer_parameters().items()}
    layers = {n.input[2]: n for n in q.graph.node if n.op_type in ("Conv", "Gemm") and len(n.input) > 2}
    producer = {n.output[0]: n for n in q.graph.node}
    biases = [n for n in _quantizers(q) if before.get(n.input[0], np.zeros(0)).dtype == np.int32]
    for dq in biases:
        layer = layers[dq.output[0]]
        s_x, s_w = (after[producer[t].input[1]] for t in layer.input[:2])
        want = (s_x.astype(np.float64) * s_w.astype(np.float64)).astype(np.float32)
        s_b = after[dq.input[1]]
        np.testing.assert_array_equal(s_b, np.broadcast_to(want, s_b.shape))
        b = torch.from_numpy(learned[f"oq.qat.float/{dq.input[0]}"])
        np.testing.assert_array_equal(after[dq.input[0]], torch.round(b / torch.tensor(s_b)).numpy())
    assert len(biases) == 10 and _changed(before, after, [n.input[1] for n in biases])
    onnx.checker.check_model(out, full_check=True)


def _int4_model():
    """x -> Q/DQ (uint8) -> Conv with an INT4 weight (per channel, codes -5..6) and an int32 bias -> logits."""
    rng = np.random.default_rng(0)
    w = rng.integers(-5, 7, size=(4, 3, 3, 3))
    s_x, s_w = np.float32(0.02), rng.uniform(0.01, 0.03, 4).astype(np.float32)
    s_b = (np.float64(s_x) * s_w.astype(np.float64)).astype(np.float32)
    inits_ = [numpy_helper.from_array(np.array(s_x), "sx"), numpy_helper.from_array(np.array(128, np.uint8), "zx"),
              helper.make_tensor("w", T.INT4, w.shape, w.ravel().tolist()),
              numpy_helper.from_array(s_w, "sw"), helper.make_tensor("zw", T.INT4, [4], [0] * 4),
              numpy_helper.from_array(rng.integers(-300, 300, 4).astype(np.int32), "b"),
              numpy_helper.from_array(s_b, "sb"), numpy_helper.from_array(np.zeros(4, np.int32), "zb")]
    graph = helper.make_graph([
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], axis=0),
        helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["bd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"]), helper.make_node("Flatten", ["p"], ["y"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, ["n", 3, 8, 8])], [helper.make_tensor_value_info("y", T.FLOAT, ["n", 4])],
        inits_)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_packed_int4_weights_stay_int4_within_their_range():
    q = _int4_model()
    onnx.checker.check_model(q, full_check=True)
    x = np.random.default_rng(1).normal(size=(64, 3, 8, 8)).astype(np.float32)
    target = ort_run(q, {"x": x})["y"] * 1.5 + 0.3  # a regression the codes have to move for
    batches = [(x[i:i + 16], target[i:i + 16]) for i in range(0, 64, 16)]
    out = oq.finetune(q, batches, F.mse_loss, epochs=20, lr=3e-3, scale_lr=2e-2)
    w = {t.name: t for t in out.graph.initializer}["w"]
    assert w.data_type == T.INT4 and len(w.raw_data) == 4 * 27 // 2  # two codes a byte
    before, after = inits(q), inits(out)
    assert _changed(before, after, ["w", "b", "sx", "sw", "sb"]) == ["w", "b", "sx", "sw", "sb"]
    codes = after["w"].astype(int)
    assert codes.min() >= -6 and codes.max() <= 6  # never past the largest |code| the input had
    mse = lambda m: float(((ort_run(m, {"x": x})["y"] - target) ** 2).mean())
    assert mse(out) < 0.5 * mse(q)


# ---------------------------------------------------------------------------------------------------------------
# the torch module computes what onnxruntime computes on the exported model


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_module_codes_match_onnxruntime(quantized, data, target):
    q = quantized(target)
    qm = QatModel(q)
    opt = torch.optim.Adam([{"params": qm.weights(), "lr": 1e-3}, {"params": qm.scales(), "lr": 1e-2}])
    for x, y in data[2][:3]:
        loss = F.cross_entropy(qm(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = qm.eval().export()
    x = data[3][:32]
    mine = {k: v.numpy() for k, v in qm.codes(torch.from_numpy(x)).items()}
    q_inputs = [n.input[0] for n in _quantizers(q, "QuantizeLinear")]
    theirs = ort_run(out, {"input": x}, extra=list(mine) + [t for t in q_inputs if t != "input"])
    assert len(mine) == len(q_inputs)
    # the same forward: codes differ only where float sums in another order tip a value across a .5 tie
    total = sum(c.size for c in mine.values())
    wrong = sum(int((c != theirs[k]).sum()) for k, c in mine.items())
    assert wrong <= 1e-4 * total, (wrong, total)
    with torch.no_grad():
        np.testing.assert_allclose(qm(torch.from_numpy(x)).numpy(), theirs["logits"], atol=1e-3)
    # the same quantizers: onnxruntime's own Q inputs give onnxruntime's codes, exactly
    again = qm.quantize({t: theirs.get(t, x) for t in q_inputs})
    for name, codes in again.items():
        np.testing.assert_array_equal(codes.numpy(), theirs[name], err_msg=name)


def test_fake_quant_gradients_are_lsq():
    x = torch.tensor([-3.0, -0.26, 0.04, 0.56, 1.2, 9.0], requires_grad=True)
    s = torch.tensor(0.1, requires_grad=True)
    y = _FakeQuant.apply(x, s, torch.tensor(2.0), -8.0, 7.0)  # codes -8..7 around zero-point 2: -1.0 .. 0.5
    np.testing.assert_allclose(y.detach().numpy(), [-1.0, -0.3, 0.0, 0.5, 0.5, 0.5], atol=1e-7)
    y.backward(torch.ones_like(y))
    np.testing.assert_array_equal(x.grad.numpy(), [0, 1, 1, 0, 0, 0])
    v = x.detach() / 0.1
    inside = torch.tensor([False, True, True, False, False, False])
    want = torch.where(inside, torch.round(v) - v, torch.tensor([-10.0, 0, 0, 5, 5, 5])).sum()
    np.testing.assert_allclose(float(s.grad), float(want), rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# errors and options


def test_errors_say_what_is_wrong(quantized, data):
    q = quantized("tensorrt")
    x, y = data[2][0]

    def message(model=q, items=None, loss=F.cross_entropy, **kw):
        with pytest.raises(oq.OqError) as e:
            oq.finetune(model, items if items is not None else [(x, y)], loss, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert message(model=str(data[0])).startswith("the model has no QuantizeLinear/DequantizeLinear")
    takes = "the model takes 1 input(s): input (float [batch,3,32,32])"
    assert message(items=[((x, x), y)]) == f"train_data inputs are 2 tensors; {takes}"
    assert message(items=[(x,)]) == f"each train_data item must be an (inputs, target) pair, got a tuple of 1; {takes}"
    assert message(items=[({"image": x}, y)]) == f"train_data inputs have keys ['image']; {takes}"
    assert message(items=[(x[:, :2], y)]) == f"train_data input 'input' has shape [32, 2, 32, 32]; {takes}"
    assert message(loss=lambda o, t: F.cross_entropy(o, t, reduction="none")) == \
        "loss must return a scalar tensor, got shape [32]"
    assert message(loss=lambda o, t: 1.0) == "loss must return a scalar tensor, got float"
    assert message(items=[]) == "train_data is empty"
    assert message(items=((x, y) for _ in range(2)), epochs=2).startswith("train_data gave no items in epoch 2")
    assert message(optimizer="lbfgs").startswith("unknown optimizer 'lbfgs'")
    assert message(epochs=-1) == "epochs must be a whole number >= 0, got -1"
    if not torch.cuda.is_available():
        assert message(device="cuda") == ("device 'cuda': torch.cuda.is_available() is False (no CUDA GPU, or a "
                                           "CPU-only torch build); use device='cpu'")


def test_inputs_by_name_or_position_and_progress(quantized, data, capsys):
    q = quantized("tensorrt")
    (x, y), = data[2][:1]
    a = oq.finetune(q, [({"input": x}, y)], F.cross_entropy, lr=1e-3)
    b = oq.finetune(q, [((torch.from_numpy(x),), torch.from_numpy(y))], F.cross_entropy, lr=1e-3,
                    optimizer=lambda groups: torch.optim.Adam(groups))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                         batch_size=32)
    c = oq.finetune(q, loader, F.cross_entropy, lr=1e-3)
    for other in (b, c):
        assert [t.SerializeToString() for t in a.graph.initializer] == \
            [t.SerializeToString() for t in other.graph.initializer]
    assert _changed(inits(q), inits(a), [t.name for t in q.graph.initializer])
    assert capsys.readouterr().err == ""  # no bar when stderr is not a terminal
    oq.finetune(q, [(x, y)], F.cross_entropy, progress=True)
    assert capsys.readouterr().err.startswith("finetune: 1 steps in ")


def test_without_torch_finetune_says_how_to_install_it():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import oq\n"
            "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
            "try:\n    oq.finetune('m.onnx', [], None)\n"
            "except oq.OqError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "the torch bridge needs torch: pip install 'oq-quant[torch]'"

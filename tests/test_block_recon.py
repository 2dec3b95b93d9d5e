"""Block reconstruction (--algo brecq, --algo qdrop): blocks found from the graph, the spill store, block models that
compute the float model exactly, held-out accuracy over round-to-nearest, the target's rules after write-back, the
per-block report, and errors before any learning starts."""
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import models
import oq
from oq import ir
from oq.blocks import live_counts, partition
from oq.errors import OqError
from oq.spill import SpillStore

from conftest import sqnr_db

torch = pytest.importorskip("torch")


def _conv(name, x, y, c_in, c_out, rng, inits):
    w = rng.normal(0, 0.3, (c_out, c_in, 3, 3)).astype(np.float32)
    inits.append(numpy_helper.from_array(w, f"{name}.w"))
    return helper.make_node("Conv", [x, f"{name}.w"], [y], name=name, pads=[1, 1, 1, 1])


def _residual_model(n_chain: int = 3) -> onnx.ModelProto:
    """stem conv, two residual blocks (conv-relu-conv + skip, relu), then a chain of n_chain convs."""
    rng, inits, nodes = np.random.default_rng(0), [], []
    nodes.append(_conv("stem", "x", "s", 3, 8, rng, inits))
    prev = "s"
    for b in range(2):
        nodes += [_conv(f"b{b}.c1", prev, f"b{b}.h", 8, 8, rng, inits),
                  helper.make_node("Relu", [f"b{b}.h"], [f"b{b}.r"], name=f"b{b}.relu1"),
                  _conv(f"b{b}.c2", f"b{b}.r", f"b{b}.o", 8, 8, rng, inits),
                  helper.make_node("Add", [f"b{b}.o", prev], [f"b{b}.a"], name=f"b{b}.add"),
                  helper.make_node("Relu", [f"b{b}.a"], [f"b{b}.y"], name=f"b{b}.relu2")]
        prev = f"b{b}.y"
    for i in range(n_chain):
        nodes.append(_conv(f"chain{i}", prev, f"chain{i}.y", 8, 8, rng, inits))
        prev = f"chain{i}.y"
    nodes.append(helper.make_node("ReduceMean", [prev], ["out"], name="pool", axes=[2, 3], keepdims=0))
    graph = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _weighted(graph):
    return {n.name for n in graph.nodes if n.op == "Conv"}


# ---------------------------------------------------------------------------------------------------------------
# blocks from the graph


def test_blocks_end_where_one_tensor_crosses():
    graph = ir.to_graph(_residual_model(n_chain=3))
    blocks = partition(graph, _weighted(graph), block_layers=2)
    assert [b.layers for b in blocks] == [["stem"], ["b0.c1", "b0.c2"], ["b1.c1", "b1.c2"],
                                          ["chain0", "chain1"], ["chain2"]]
    # a residual block's input is the previous block's output and reaches its Add
    assert blocks[1].inputs == ["s"] and blocks[1].outputs == ["b0.y"]
    assert [n.name for n in blocks[1].nodes][-2:] == ["b0.add", "b0.relu2"]
    assert blocks[-1].outputs == ["chain2.y"]  # the pooling after the last weighted layer is in no block
    assert all(b.inputs == [a.outputs[0]] for a, b in zip(blocks, blocks[1:]))


def test_live_counts_see_the_skip_connection():
    graph = ir.to_graph(_residual_model(n_chain=0))
    counts = dict(zip([n.name for n in graph.nodes], live_counts(list(graph.nodes), list(graph.inputs))))
    assert counts["stem"] == 1 and counts["b0.c1"] == 2 and counts["b0.relu1"] == 2 and counts["b0.relu2"] == 1


def test_chains_pack_and_long_segments_split():
    graph = ir.to_graph(_residual_model(n_chain=6))
    blocks = partition(graph, _weighted(graph), block_layers=4)
    # the stem packs with the first residual block, the second with two chain layers
    assert [b.layers for b in blocks] == [["stem", "b0.c1", "b0.c2"], ["b1.c1", "b1.c2", "chain0", "chain1"],
                                          ["chain2", "chain3", "chain4", "chain5"]]
    # a segment with more weighted layers than max_layers is cut where the fewest tensors cross
    split = partition(graph, _weighted(graph), block_layers=4, max_layers=1)
    assert all(len(b.layers) == 1 for b in split) and len(split) == 11
    assert split[2].inputs == ["b0.h", "s"] and split[2].outputs == ["b0.y"]  # inside a residual block: two


# ---------------------------------------------------------------------------------------------------------------
# the spill store


def test_spill_store_keeps_values_on_disk_beyond_its_budget(tmp_path):
    a, b = np.arange(100, dtype=np.float32), np.ones((4, 5), np.int64)
    with SpillStore(a.nbytes, folder=tmp_path) as store:
        store.put("a", 0, a)
        store.put("b", 0, b)  # over the budget: written to disk
        assert store.in_memory == a.nbytes and store.on_disk == b.nbytes
        np.testing.assert_array_equal(store.get("a", 0), a)
        np.testing.assert_array_equal(store.get("b", 0), b)
        assert len(list(tmp_path.rglob("*.npy"))) == 1
        store.drop("b")
        assert ("b", 0) not in store and store.on_disk == 0 and not list(tmp_path.rglob("*.npy"))
        store.put("c", 1, b)
        store.put("scalar", 0, np.array(3, np.int64))  # shape scalars stay 0-d, in memory or on disk
        assert store.get("scalar", 0).shape == ()
    assert not list(tmp_path.iterdir())  # the private folder is gone after close


# ---------------------------------------------------------------------------------------------------------------
# block models compute the float model


def test_block_models_with_identity_quantizers_reproduce_the_float_graph():
    from oq.bridge import to_torch
    from oq.bridge.blockgraph import DOMAIN, block_model

    model = _residual_model(n_chain=2)
    graph = ir.to_graph(model)
    blocks = partition(graph, _weighted(graph), block_layers=2)
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8)).astype(np.float32)
    names = sorted({t for b in blocks for t in (*b.inputs, *b.outputs)})
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
                              if n not in {o.name for o in model.graph.output})
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in probe.graph.output], sess.run(None, {"x": x})))
    values["x"] = x
    identity = {(DOMAIN, "ActQuant"): lambda attrs, inputs: inputs[0],
                (DOMAIN, "WeightQuant"): lambda attrs, inputs: inputs[0]}
    for block in blocks:
        names = [n.name for n in block.nodes]
        acts = {(names[0], 0): "a"}
        weights = {(n.name, 1): n.inputs[1].name for n in block.nodes if n.op == "Conv"}
        sub = block_model(model, names, block.inputs, block.outputs, acts, weights)
        assert sum(n.op_type == "WeightQuant" for n in sub.graph.node) == len(block.layers)
        assert sum(n.op_type == "ActQuant" for n in sub.graph.node) == 1
        out = to_torch(sub, ops=identity)(*[torch.as_tensor(values[n]) for n in block.inputs])
        out = out if isinstance(out, tuple) else (out,)
        for name, value in zip(block.outputs, out):
            np.testing.assert_allclose(value.detach().numpy(), values[name], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# a reference model end to end


def _quantize(name, tmp_path, algo, n=64, **kw):
    calib = tmp_path / f"{name}.npz"
    if not calib.exists():
        np.savez(calib, **models.make_inputs(name, n))
    return oq.quantize(models.build(name), calib=calib, algo=algo, progress=False, **kw)


def _run(model, feed):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _inits(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.fixture(scope="module")
def resnet_w4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("brecq")
    kw = dict(target="academic", weight_bits=4, algo_iters=100)
    return _quantize("resnet_mini", tmp, "rtn", **kw), _quantize("resnet_mini", tmp, "brecq", **kw)


def test_brecq_beats_round_to_nearest_on_held_out_data(resnet_w4):
    rtn, brecq = resnet_w4
    held = models.make_inputs("resnet_mini", 32, seed=1)
    ref = _run(models.build("resnet_mini"), held)
    s_rtn, s_brecq = sqnr_db(ref, _run(rtn.model, held)), sqnr_db(ref, _run(brecq.model, held))
    assert s_brecq > s_rtn + 3.0, (s_rtn, s_brecq)
    record = brecq.report.calibration["reconstruction"]
    assert record["algorithm"] == "brecq" and len(record["blocks"]) >= 3
    for block in record["blocks"]:
        assert block["layers"] and block["inputs"] and block["outputs"]
        assert (block["loss_learned"] < block["loss_nearest"]) == (block["kept"] == "learned")
        assert block["validation_chunks"] == 1  # 64 samples: four chunks of 16, one held out
    notes = "\n".join(next(p.notes for p in brecq.report.passes if p.name == "block-reconstruction"))
    assert re.search(r"block 0 \(\d+ layers, .*\): loss \S+ -> \S+ \([+-]\d+\.\d dB, (learned|calibrated) activation scales\)", notes), notes


def test_brecq_output_has_the_structure_of_round_to_nearest(resnet_w4):
    rtn, brecq = resnet_w4
    onnx.checker.check_model(brecq.model, full_check=True)
    sig = lambda m: [(n.op_type, n.domain, list(n.input), list(n.output)) for n in m.graph.node]  # noqa: E731
    assert sig(rtn.model) == sig(brecq.model)
    a, b = _inits(rtn.model), _inits(brecq.model)
    assert a.keys() == b.keys()
    assert any(not np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("target", ["tensorrt", "vitis"])
def test_qdrop_keeps_the_target_rules(tmp_path, target):
    result = _quantize("resnet_mini", tmp_path, "qdrop", n=16, target=target, algo_iters=20)
    model, inits = result.model, _inits(result.model)
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq
    scales = [inits[n.input[1]] for n in qdq if n.input[1] in inits]
    if target == "tensorrt":
        assert all(np.all(inits[n.input[2]] == 0) for n in qdq if len(n.input) > 2 and n.input[2] in inits)
    else:
        assert all(np.all(np.exp2(np.round(np.log2(s))) == s) for s in scales)
    # scales shared across a Concat's inputs stay shared
    producers = {o: n for n in model.graph.node for o in n.output}
    for concat in (n for n in model.graph.node if n.op_type == "Concat"):
        dq = [producers.get(i) for i in concat.input]
        if all(d is not None and d.op_type == "DequantizeLinear" for d in dq):
            assert len({inits[d.input[1]].tobytes() for d in dq}) == 1
    record = result.report.calibration["reconstruction"]
    assert record["algorithm"] == "qdrop" and record["drop"] == 0.5
    onnx.checker.check_model(model, full_check=True)


def test_an_op_the_bridge_cannot_run_fails_before_learning(tmp_path):
    model = _residual_model(n_chain=2)
    nodes = list(model.graph.node)
    at = next(i for i, n in enumerate(nodes) if n.name == "chain0")
    keep = numpy_helper.from_array(np.ones(8, bool), "keep")
    compress = helper.make_node("Compress", ["b1.y", "keep"], ["b1.kept"], name="squeeze_channels", axis=1)
    nodes[at].input[0] = "b1.kept"
    model.graph.ClearField("node")
    model.graph.node.extend(nodes[:at] + [compress] + nodes[at:])
    model.graph.initializer.append(keep)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).normal(size=(4, 3, 8, 8)).astype(np.float32))
    with pytest.raises(OqError, match=r"torch bridge cannot run this model: unsupported op\(s\): Compress "
                                      r"\(node 'squeeze_channels'\)"):
        oq.quantize(path, target="tensorrt", calib=tmp_path / "c.npz", algo="qdrop", progress=False)


def test_cli_runs_qdrop(tmp_path, capsys):
    from oq.cli import main

    calib = tmp_path / "c.npz"
    np.savez(calib, **models.make_inputs("mlp", 32))
    out = tmp_path / "q.onnx"
    code = main(["run", str(models.build("mlp")), "--target", "tensorrt", "--calib", str(calib), "--algo", "qdrop",
                 "--algo-iters", "30", "-o", str(out)])
    assert code == 0 and out.exists()
    text = capsys.readouterr()
    assert "block-reconstruction" in text.out + text.err


def test_spilling_block_data_to_disk_changes_nothing(tmp_path):
    kw = dict(target="tensorrt", algo_iters=30, n=32)
    in_memory = _quantize("mlp", tmp_path, "qdrop", **kw)
    spilled = _quantize("mlp", tmp_path, "qdrop", max_memory_mb=0.002, **kw)
    assert in_memory.report.calibration["reconstruction"]["peak_spilled_mb"] == 0
    assert spilled.report.calibration["reconstruction"]["peak_spilled_mb"] > 0
    assert spilled.report.calibration["reconstruction"]["peak_cached_mb"] <= 0.002
    a, b = _inits(in_memory.model), _inits(spilled.model)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_exporters_minus_one_batch_is_dynamic_and_scalar_gathers_run(tmp_path):
    """An input declared [-1, 3, 8, 8] (as paddle2onnx writes a dynamic batch) takes a stack of samples, and a
    block reading a shape scalar (Shape -> Gather with a scalar index, as transformer exports build reshape
    targets) runs in the bridge."""
    from oq.bridge import to_torch

    model = _residual_model(n_chain=1)
    model.graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_param")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).normal(size=(8, 3, 8, 8)).astype(np.float32))
    result = oq.quantize(path, target="tensorrt", calib=tmp_path / "c.npz", progress=False)
    assert any(n.op_type == "QuantizeLinear" for n in result.model.graph.node)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i"], ["n"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                              [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                              [numpy_helper.from_array(np.array(1, np.int64), "i")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = to_torch(m)(torch.zeros(2, 5))
    assert out.shape == () and int(out) == 5

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from oq import ir
from oq.errors import OqError


def tiny_model(opset=17):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).flatten())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]),
                             opset_imports=[helper.make_opsetid("", opset)])


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(OqError, match="no such file"):
        ir.load_model(tmp_path / "missing.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not protobuf \xff\xfe")
    with pytest.raises(OqError, match="bad.onnx"):
        ir.load_model(bad)
    with pytest.raises(OqError, match="is a directory"):
        ir.load_model(tmp_path)


def test_save_is_atomic_and_roundtrips(tmp_path):
    path = tmp_path / "m.onnx"
    ir.save_model(tiny_model(), path)
    assert onnx.load(str(path)).graph.node[0].op_type == "MatMul"
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temp leftovers
    with pytest.raises(OqError, match="does not exist"):
        ir.save_model(tiny_model(), tmp_path / "nope" / "m.onnx")


def test_external_data_roundtrip(tmp_path):
    model = tiny_model()
    big = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    model.graph.initializer.append(onnx.numpy_helper.from_array(big, "big"))
    path = tmp_path / "ext.onnx"
    ir.save_model(model, path, external_data=True)
    assert (tmp_path / "ext.onnx.data").stat().st_size >= big.nbytes
    assert len(model.graph.initializer[1].raw_data) == big.nbytes  # the caller's model is untouched
    loaded = ir.load_model(path)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[1]), big)


def test_use_index_and_namer():
    graph = ir.to_graph(tiny_model())
    uses = ir.UseIndex(graph)
    [use] = uses.consumers("h")
    assert (use.node.name, use.index) == ("relu", 0)
    assert uses.sole_consumer(graph.tensors()["h"]).name == "relu"
    assert uses.sole_consumer(graph.tensors()["y"]) is None  # graph output
    namer = ir.Namer(graph)
    assert namer("h") == "h_1" and namer("h") == "h_2" and namer("fresh") == "fresh"


def test_toposort_orders_and_detects_cycles():
    graph = ir.to_graph(tiny_model())
    graph.nodes.reverse()
    ir.toposort(graph)
    assert [n.name for n in graph.nodes] == ["mm", "relu"]
    a = gs.Variable("a", np.float32)
    b = gs.Variable("b", np.float32)
    cyc = gs.Graph(nodes=[gs.Node("Relu", "r1", inputs=[a], outputs=[b]),
                          gs.Node("Relu", "r2", inputs=[b], outputs=[a])])
    with pytest.raises(OqError, match="cycle"):
        ir.toposort(cyc)


def test_models_past_the_size_threshold_use_external_data_end_to_end(tmp_path, monkeypatch, model_paths):
    """The >2 GB path (external data for the session, the output and shape inference), with the threshold lowered
    so a small model takes it."""
    import models
    import oq
    from conftest import run_onnx, sqnr_db

    monkeypatch.setattr(ir, "EXTERNAL_DATA_THRESHOLD", 10_000)
    src = tmp_path / "src.onnx"
    ir.save_model(onnx.load(str(model_paths["resnet_mini"])), src)
    assert (tmp_path / "src.onnx.data").exists()
    calib = tmp_path / "c.npz"
    np.savez(calib, **models.make_inputs("resnet_mini", 16))
    out = tmp_path / "out.onnx"
    oq.quantize(src, "onnxruntime", calib, progress=False, output=out)
    assert (tmp_path / "out.onnx.data").exists()
    assert out.stat().st_size < 200_000  # weights live in the data file
    feed = models.make_inputs("resnet_mini", 4, seed=2)
    assert sqnr_db(run_onnx(src, feed), run_onnx(out, feed)) > 15

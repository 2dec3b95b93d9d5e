import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import models
import oq
from conftest import run_onnx
from oq import ir
from oq.errors import OqError, PassError
from oq.fusions import find_fusions
from oq.passmanager import Context, FixedPoint, Pass, PassManager, PassResult
from oq.report import Report


class Counting(Pass):
    name = "counting"

    def __init__(self, changes):
        self.changes = list(changes)
        self.calls = 0

    def run(self, ctx):
        self.calls += 1
        return PassResult(self.changes.pop(0) if self.changes else False)


def empty_ctx():
    return Context(graph=ir.to_graph(helper.make_model(helper.make_graph([], "g", [], []))), report=Report())


def test_manager_records_each_pass():
    ctx = empty_ctx()
    PassManager([Counting([True]), Counting([False])]).run(ctx)
    assert [(p.name, p.modified) for p in ctx.report.passes] == [("counting", True), ("counting", False)]
    assert all(p.seconds >= 0 for p in ctx.report.passes)


def test_fixed_point_repeats_until_nothing_changes():
    a, b = Counting([True, True, False]), Counting([False, True, False])
    result = FixedPoint("group", [a, b]).run(empty_ctx())
    assert result.modified and a.calls == 3 and b.calls == 3


def test_manager_names_failing_pass_and_broken_promises():
    class Boom(Pass):
        name = "boom"

        def run(self, ctx):
            raise ValueError("kaput")

    class Liar(Pass):
        name = "liar"
        ensures = (lambda ctx: "graph is not empty",)

        def run(self, ctx):
            return PassResult(False)

    class Needy(Pass):
        name = "needy"
        requires = (lambda ctx: "needs a plan",)

    with pytest.raises(PassError, match="pass 'boom' failed: ValueError: kaput"):
        PassManager([Boom()]).run(empty_ctx())
    with pytest.raises(PassError, match="pass 'liar' broke its promise: graph is not empty"):
        PassManager([Liar()]).run(empty_ctx())
    with pytest.raises(PassError, match="pass 'needy' cannot run: needs a plan"):
        PassManager([Needy()]).run(empty_ctx())


def conv_bn_model(shared_weight=False, opset=17):
    rng = np.random.default_rng(0)
    c = 4
    inits = [helper.make_tensor(n, TensorProto.FLOAT, v.shape, v.flatten()) for n, v in [
        ("w", rng.normal(size=(c, 3, 3, 3)).astype(np.float32)),
        ("gamma", rng.uniform(0.5, 2, c).astype(np.float32)), ("beta", rng.normal(size=c).astype(np.float32)),
        ("mean", rng.normal(size=c).astype(np.float32)), ("var", rng.uniform(0.5, 2, c).astype(np.float32))]]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if shared_weight:
        nodes.append(helper.make_node("Conv", ["x", "w"], ["z"], name="conv2", pads=[1, 1, 1, 1]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    return helper.make_model(helper.make_graph(nodes, "g", [x], outputs, inits),
                             opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("name", models.REFERENCE_MODELS)
def test_prepare_folds_batchnorm_exactly(name, model_paths):
    ctx = oq.prepare(model_paths[name])
    folded = ir.to_model(ctx.graph)
    original = onnx.load(str(model_paths[name]))
    had_bn = any(n.op_type == "BatchNormalization" for n in original.graph.node)
    assert had_bn == (name != "transformer")
    assert not [n for n in folded.graph.node if n.op_type == "BatchNormalization"]
    onnx.checker.check_model(folded, full_check=True)
    feed = models.make_inputs(name, 8, seed=3)
    ref, got = run_onnx(original, feed), run_onnx(folded, feed)
    assert np.abs(ref - got).max() <= 1e-4 * np.abs(ref).max()


def test_bn_with_shared_weight_is_refused_with_reason():
    ctx = oq.prepare(conv_bn_model(shared_weight=True))
    assert [n.op for n in ctx.graph.nodes].count("BatchNormalization") == 1
    notes = [n for p in ctx.report.passes for n in p.notes]
    assert any("bn not folded: Conv weight 'w' is shared by 2 nodes" in n for n in notes), notes


def test_old_opset_is_upgraded():
    model = conv_bn_model(opset=11)
    ctx = oq.prepare(model)
    assert ctx.graph.opset >= 13
    assert any("upgraded opset 11" in n for p in ctx.report.passes for n in p.notes)
    feed = {"x": np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(run_onnx(ir.to_model(ctx.graph), feed), run_onnx(model, feed), atol=1e-4)


def test_unconvertible_opset_is_a_clear_error():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    node = helper.make_node("NoSuchOp", ["x"], ["y"])
    model = helper.make_model(helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", 1, [2])]),
                              opset_imports=[helper.make_opsetid("", 7)])
    with pytest.raises(OqError, match="opset 7; oq needs opset >= 13"):
        oq.prepare(model)


def test_fold_constants_folds_static_shape_chains():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Constant", [], ["idx"], name="c", value=helper.make_tensor("v", 7, [], [0])),
             helper.make_node("Gather", ["s", "idx"], ["b"], name="gather"),
             helper.make_node("Constant", [], ["m1"], name="c2", value=helper.make_tensor("v", 7, [1], [-1])),
             helper.make_node("Unsqueeze", ["b", "zero"], ["b1"], name="unsq"),
             helper.make_node("Concat", ["b1", "m1"], ["shape2"], name="cat", axis=0),
             helper.make_node("Reshape", ["x", "shape2"], ["y"], name="reshape")]
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", 1, None)], [zero]),
                              opset_imports=[helper.make_opsetid("", 17)])
    ctx = oq.prepare(model)
    assert [n.op for n in ctx.graph.nodes] == ["Reshape"]
    np.testing.assert_array_equal(ir.constant_value(ctx.graph.nodes[0].inputs[1]), [2, -1])


def test_fusion_groups_on_reference_cnn(model_paths):
    ctx = oq.prepare(model_paths["resnet_mini"])
    groups, _ = find_fusions(ctx.graph, ["conv_add_relu", "conv_relu", "linear_relu"])
    kinds = sorted(g.pattern for g in groups)
    assert kinds.count("conv_add_relu") == 2 and kinds.count("conv_relu") >= 5
    for g in groups:
        if g.pattern == "conv_add_relu":
            [ops] = [[n.op for n in g.nodes]]
            assert ops == ["Conv", "Add", "Relu"]
            assert len(g.side_inputs) == 1 and g.side_inputs[0][0].op == "Add"


def test_relu6_clip_fuses_and_plain_clip_does_not(model_paths):
    ctx = oq.prepare(model_paths["mobilenet_mini"])
    groups, _ = find_fusions(ctx.graph, ["conv_relu"])
    assert any(g.nodes[-1].op == "Clip" for g in groups)

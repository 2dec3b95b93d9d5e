"""The EfficientNet-B0-shaped benchmark model: its size, its ONNX graph, and ONNX matching torch (at 64x64, fast)."""
from collections import Counter

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from conftest import run_onnx  # noqa: E402
from models import efficientnet  # noqa: E402

RES = 64


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = efficientnet.build_onnx(tmp_path_factory.mktemp("b0") / "b0.onnx", resolution=RES, seed=0)
    return efficientnet.build_torch(RES, seed=0), onnx.load(path)


def test_size_and_graph(built):
    model, proto = built
    assert 4.5e6 <= sum(p.numel() for p in model.parameters()) <= 5.5e6
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["Conv"] >= 50 and ops["BatchNormalization"] >= 40, ops  # BN kept for oq to fold
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert proto.graph.input[0].name == efficientnet.INPUT_NAME and dims[0].dim_param == "batch"
    assert [d.dim_value for d in dims[1:]] == [3, RES, RES]
    bn = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(m.running_var.min() > 0 and m.running_mean.abs().max() > 0 for m in bn)


def test_onnx_matches_torch(built):
    model, proto = built
    x = efficientnet.make_images(3, RES, seed=1)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    got = run_onnx(proto, {efficientnet.INPUT_NAME: x})
    assert got.shape == (3, efficientnet.CLASSES)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_images_are_seeded(tmp_path):
    a = efficientnet.make_images(3, 32, seed=0)
    assert np.array_equal(a[:2], efficientnet.make_images(2, 32, seed=0))
    assert not np.array_equal(a, efficientnet.make_images(3, 32, seed=1))
    path = efficientnet.write_images(tmp_path / "d.npz", 3, 32)
    with np.load(path) as npz:
        assert npz.files == [efficientnet.INPUT_NAME] and np.array_equal(npz[efficientnet.INPUT_NAME], a)

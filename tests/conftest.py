import numpy as np
import onnx
import onnxruntime as ort
import pytest

import models


@pytest.fixture(scope="session")
def model_paths():
    """Reference models, looked up once per session in the per-user cache (exported from the weight fixtures on a miss).

    ``OQ_MODEL_CACHE=DIR`` points the cache elsewhere (see ``models.default_cache_dir``).
    """
    return {name: models.build(name) for name in models.REFERENCE_MODELS}


@pytest.fixture(scope="session")
def calib_files(tmp_path_factory):
    """Per model: (calibration .npz path, held-out feed dict) from the same distribution."""
    root = tmp_path_factory.mktemp("calib")
    out = {}
    for name in models.REFERENCE_MODELS:
        path = root / f"{name}.npz"
        np.savez(path, **models.make_inputs(name, 64, seed=0))
        out[name] = (path, models.make_inputs(name, 32, seed=1))
    return out


def run_onnx(model, feed, optimize=False):
    """First output of the model in onnxruntime; optimisations off unless asked (the graph's own semantics)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def sqnr_db(ref, x):
    ref = np.asarray(ref, np.float64)
    noise = ((ref - np.asarray(x, np.float64)) ** 2).sum()
    return float("inf") if noise == 0 else float(10 * np.log10((ref ** 2).sum() / noise))


@pytest.fixture
def one_torch_thread():
    """torch on one thread: two threads on a busy two-core machine spend most of a step waiting for each other."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

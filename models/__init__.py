"""Reference ONNX models for oq's tests, demos and benchmarks.

The models are small torch definitions (``models/zoo.py``) whose trained
weights are committed (``models/weights/NAME.npz``, written by ``python -m
models freeze``), exported to ONNX on demand and cached per user (see
:func:`default_cache_dir`; the ONNX files are never committed)::

    from models import build, make_inputs, load_torch
    path = build("resnet_mini")                 # .onnx path, exported if not cached
    calib = make_inputs("resnet_mini", 64)      # {"input": float32 [64,3,32,32]}, seed 0
    held_out = make_inputs("resnet_mini", 32, seed=1)
    torch_model = load_torch("resnet_mini")     # same weights, eval mode

Importing this package does not import torch; only exporting (``build`` on a
cache miss) and ``load_torch`` need it.  ``load_torch`` trains on this machine
only when a model's fixture is missing or stale (with a
:class:`HostDependentWeightsWarning`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._export import CACHE_ENV, build, cache_key, cached_path, default_cache_dir
from ._weights import HostDependentWeightsWarning
from .data import make_inputs
from .specs import OPSET, SPECS, ModelSpec, get_spec

if TYPE_CHECKING:  # pragma: no cover
    import torch

REFERENCE_MODELS: tuple[str, ...] = ("resnet_mini", "mobilenet_mini", "decoder", "mlp", "transformer")
CNN_MODELS: tuple[str, ...] = ("resnet_mini", "mobilenet_mini")
# Built on demand by the benchmarks only (not part of every test's model set).
BENCH_MODELS: tuple[str, ...] = ("transformer_wide",)

assert set(REFERENCE_MODELS) | set(BENCH_MODELS) == set(SPECS)


def load_torch(name: str) -> "torch.nn.Module":
    """The torch model behind reference model ``name``: the frozen (committed) weights, eval mode."""
    from .zoo import load_torch as _load_torch

    return _load_torch(name)


__all__ = [
    "BENCH_MODELS",
    "CACHE_ENV",
    "CNN_MODELS",
    "HostDependentWeightsWarning",
    "OPSET",
    "REFERENCE_MODELS",
    "SPECS",
    "ModelSpec",
    "build",
    "cache_key",
    "cached_path",
    "default_cache_dir",
    "get_spec",
    "load_torch",
    "make_inputs",
]

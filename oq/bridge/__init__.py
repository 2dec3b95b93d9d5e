"""The torch bridge: run an ONNX model (float or quantized) as a torch module, e.g. to fine-tune it.

    from oq.bridge import to_torch
    module = to_torch("model.onnx")          # or a ModelProto
    y = module(x)                             # graph inputs in order -> graph output(s)
    module.parameter_for("conv1.weight")      # the trainable parameter behind a float initializer

torch is an optional dependency of oq (`pip install 'oq-quant[torch]'`): `import oq` never imports it, and this
package imports it only when something from it is used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import OqError

if TYPE_CHECKING:  # pragma: no cover
    from .interpreter import OnnxModule

_LAZY = {"OnnxModule": "interpreter", "registry": None}


def require_torch():
    """torch, or a one-line OqError saying how to install it."""
    try:
        import torch
    except ImportError:
        raise OqError("the torch bridge needs torch: pip install 'oq-quant[torch]'") from None
    return torch


def to_torch(model, ops=None) -> "OnnxModule":
    """The ONNX model (ModelProto or path) as a torch.nn.Module; see oq.bridge.interpreter.to_torch."""
    require_torch()
    from .interpreter import to_torch as _to_torch
    return _to_torch(model, ops=ops)


def __getattr__(name: str):
    if name in _LAZY:
        require_torch()
        module = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
        return module if _LAZY[name] is None else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["to_torch", "OnnxModule", "require_torch"]

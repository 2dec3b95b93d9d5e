"""oq: an ONNX-graph-first post-training quantizer."""
from .api import QuantResult, prepare, quantize, run
from .config import RunConfig
from .errors import InternalError, OqError
from .observers import register_observer
from .target import load_target


def finetune(model, train_data, loss, **options):
    """Quantization-aware finetuning of a model quantized by oq; returns the new onnx.ModelProto. Needs torch
    (`pip install 'oq-quant[torch]'`); see oq.bridge.qat.finetune for the options."""
    from .bridge import require_torch

    require_torch()  # imported here so that `import oq` never imports torch
    from .bridge.qat import finetune as run_finetune

    return run_finetune(model, train_data, loss, **options)


__all__ = ["quantize", "run", "prepare", "finetune", "RunConfig", "QuantResult", "OqError", "InternalError",
           "load_target", "register_observer"]
__version__ = "0.1.0"

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


def analyze(model, target="tensorrt", calib=None, eval=None, **options):
    """Quantize as oq.quantize would, then measure which quantized tensors and nodes cost accuracy; returns an
    oq.analysis.Analysis. See oq.analysis.run.analyze for the options."""
    from .analysis import analyze as run_analyze  # imported on use: `import oq` stays light

    return run_analyze(model, target, calib, eval, **options)


def quantize_to_goal(model, min_sqnr, target="tensorrt", calib=None, **options):
    """oq.quantize keeping in float the fewest nodes that bring the model output SQNR against fp32 to `min_sqnr` dB
    (`oq run --min-sqnr`); returns the QuantResult, its report.goal saying what was kept in float and why. See
    oq.analysis.fallback.quantize_to_goal for the options (eval, state, max_pruning, output)."""
    from .analysis.fallback import quantize_to_goal as run_to_goal  # imported on use: `import oq` stays light

    return run_to_goal(model, min_sqnr, target, calib, **options)


__all__ = ["quantize", "quantize_to_goal", "run", "prepare", "finetune", "analyze", "RunConfig", "QuantResult",
           "OqError", "InternalError", "load_target", "register_observer"]
__version__ = "0.1.0"

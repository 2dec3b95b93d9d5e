"""oq: an ONNX-graph-first post-training quantizer."""
from .api import QuantResult, prepare, quantize, run
from .config import RunConfig
from .errors import InternalError, OqError
from .observers import register_observer
from .target import load_target

__all__ = ["quantize", "run", "prepare", "RunConfig", "QuantResult", "OqError", "InternalError", "load_target",
           "register_observer"]
__version__ = "0.1.0"

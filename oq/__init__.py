"""oq: an ONNX-graph-first post-training quantizer."""
from .api import QuantResult, prepare, quantize
from .errors import OqError
from .observers import register_observer
from .target import load_target

__all__ = ["quantize", "prepare", "QuantResult", "OqError", "load_target", "register_observer"]
__version__ = "0.1.0"

"""Which quantized tensors and nodes cost accuracy, and how much: `oq analyze` / oq.analyze()."""
from .records import Analysis, NodeRecord, TensorRecord
from .run import analyze

__all__ = ["analyze", "Analysis", "NodeRecord", "TensorRecord"]

"""What `oq analyze` found: per quantized tensor (graphwise) and per quantized node (layerwise), ranked."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class TensorRecord:
    """One quantized activation, measured with the whole model quantized."""

    tensor: str  # the float tensor quantized
    dequantized: str  # the tensor the next layers read instead
    order: int  # position along the graph (topological)
    producer: str  # node computing the tensor ("" for a graph input)
    producer_op: str
    consumers: list[str]  # nodes reading the dequantized tensor, as "name (Op)"
    shape: list[int]  # of the first evaluation batch
    dtype: str
    scale: list[float]
    zero_point: list[float]
    range: list[float]  # the representable range [lo, hi] (per channel: the widest)
    fp32_range: list[float]  # the float values seen, [min, max]
    calib_method: str
    sqnr_db: float
    cosine: float
    clip_ratio: float  # share of float values outside `range`
    clip_noise_share: float  # share of the error that clipping causes (squared distance beyond the range)


@dataclass
class NodeRecord:
    """One node reading quantized inputs."""

    name: str
    op: str
    order: int
    inputs: list[str]  # its quantized activation inputs (float tensor names)
    weight: str | None  # its quantized weight, if any
    layerwise_sqnr_db: float | None  # model output SQNR with only this node's inputs quantized (None: not measured)
    input_sqnr_db: float | None  # worst graphwise SQNR among its activation inputs
    weight_sqnr_db: float | None  # float weight vs its dequantized value
    clip_ratio: float  # largest clipping ratio among its activation inputs
    clip_noise_share: float  # of that input: share of its error that clipping causes
    # its layerwise output noise over the whole quantized model's (None: layerwise skipped): the share of the total
    # error this node alone causes, when the nodes' errors add up
    noise_share: float | None = None
    hint: str = ""
    channel_ranges: dict | None = None  # per output channel weight min/max and grid range (worst weighted nodes)


@dataclass
class Analysis:
    model: str
    target: str
    samples: int
    eval_source: str
    on_calibration_data: bool
    calib_method: str
    output_sqnr_db: float  # model outputs, whole model quantized vs fp32
    output_cosine: float
    outputs: dict[str, dict]  # per model output: sqnr_db, cosine
    reference_sqnr_db: float  # the float twin's outputs vs fp32: rounding only (BatchNorm folding)
    tensors: list[TensorRecord] = field(default_factory=list)  # worst graphwise SQNR first
    nodes: list[NodeRecord] = field(default_factory=list)  # worst layerwise SQNR first
    layerwise: bool = True
    warnings: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    # plot data, not part of the JSON: float value samples of the worst tensors
    histograms: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def measured_on(self) -> str:
        return "measured on calibration data" if self.on_calibration_data else f"measured on {self.eval_source}"

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("histograms")
        out["measured_on"] = self.measured_on
        return _finite(out)

    def to_json_text(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_json(self, path: "str | os.PathLike") -> None:
        """Write the JSON report atomically."""
        from .files import write_outputs

        write_outputs({path: self.to_json_text().encode()})

    def to_html_text(self) -> str:
        from .html import render

        return render(self)

    def to_html(self, path: "str | os.PathLike") -> None:
        """Write the self-contained HTML report atomically (needs matplotlib)."""
        from .files import write_outputs

        write_outputs({path: self.to_html_text().encode()})

    def summary(self, top: int = 20) -> str:
        from .text import summary

        return summary(self, top)


def _finite(value):
    """JSON has no infinity: an exact match (no noise) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value

"""Torch-free description of the reference models' ONNX interfaces."""

from __future__ import annotations

from dataclasses import dataclass

OPSET = 17


@dataclass(frozen=True)
class ModelSpec:
    name: str
    seed: int  # torch.manual_seed used to initialise the weights
    # ONNX input name -> shape; str entries are symbolic (dynamic) dims.
    inputs: dict[str, tuple[int | str, ...]]
    # ONNX output name -> shape.
    outputs: dict[str, tuple[int | str, ...]]
    # Whether the model contains BatchNorm layers (kept as BatchNormalization in ONNX).
    has_batchnorm: bool
    description: str = ""

    @property
    def input_name(self) -> str:
        (name,) = self.inputs
        return name

    @property
    def output_name(self) -> str:
        (name,) = self.outputs
        return name


SPECS: dict[str, ModelSpec] = {
    "resnet_mini": ModelSpec(
        "resnet_mini", seed=101,
        inputs={"input": ("batch", 3, 32, 32)}, outputs={"logits": ("batch", 10)},
        has_batchnorm=True,
        description="small ResNet: Conv/BN/ReLU, MaxPool, residual Adds, 1x1 downsample, "
        "inception-style Concat, GlobalAveragePool, Gemm head",
    ),
    "mobilenet_mini": ModelSpec(
        "mobilenet_mini", seed=102,
        inputs={"input": ("batch", 3, 32, 32)}, outputs={"logits": ("batch", 10)},
        has_batchnorm=True,
        description="MobileNetV2-style: inverted residuals, depthwise Conv, ReLU6 (Clip 0..6)",
    ),
    "decoder": ModelSpec(
        "decoder", seed=103,
        inputs={"input": ("batch", 16, 8, 8)}, outputs={"image": ("batch", 3, 32, 32)},
        has_batchnorm=True,
        description="upsampling decoder: ConvTranspose (one grouped) + BN + ReLU, Conv to RGB",
    ),
    "mlp": ModelSpec(
        "mlp", seed=104,
        inputs={"input": ("batch", 64)}, outputs={"logits": ("batch", 10)},
        has_batchnorm=True,
        description="Gemm-BN-ReLU, Gemm-ReLU, Gemm on tabular-like features",
    ),
    "transformer": ModelSpec(
        "transformer", seed=105,
        inputs={"tokens": ("batch", "seq", 64)}, outputs={"hidden": ("batch", "seq", 64)},
        has_batchnorm=False,
        description="one pre-LN encoder block, 4 heads, hand-written attention "
        "(MatMul/Softmax), LayerNormalization, erf-GELU FFN",
    ),
    "transformer_wide": ModelSpec(
        "transformer_wide", seed=106,
        inputs={"tokens": ("batch", "seq", 64)}, outputs={"hidden": ("batch", "seq", 64)},
        has_batchnorm=False,
        description="the encoder block at width 128 (FFN 512) between 64<->128 projections: wide enough for int8 "
        "kernels to pay, for latency benchmarks",
    ),
}


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown reference model {name!r}; choose from {sorted(SPECS)}") from None

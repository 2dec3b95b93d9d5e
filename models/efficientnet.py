"""An EfficientNet-B0-shaped CNN with seeded random weights, for reconstruction speed benchmarks.

The layout is B0's (Tan & Le 2019): a stride-2 3x3 stem, 16 MBConv blocks in 7 stages (1x1 expand, depthwise 3x3
or 5x5, squeeze-and-excitation, 1x1 project, BatchNorm after every convolution, SiLU, residual Add where shapes
match), a 1x1 head to 1280 channels, global average pooling and a 1000-way linear classifier: 5.29 M parameters
and 81 Conv nodes in ONNX (the SE convolutions included). Dropout and stochastic depth are left out (identities in
eval mode).

This is not one of the reference models (no trained weights, not in ``models.SPECS``): accuracy numbers on it
only compare quantized outputs with the float ones. The weights are random but seeded; BatchNorm gets random
gamma/beta and running statistics measured on seeded synthetic images at the build resolution, so the
activations stay well scaled through all 16 blocks and oq's BN folding has non-trivial statistics to fold.

    from models.efficientnet import build_onnx, write_images
    build_onnx("b0.onnx")                      # opset 17, input "input" [batch,3,224,224], output "logits"
    write_images("calib.npz", 256)             # {"input": float32 [256,3,224,224]}, seed 0
    write_images("held_out.npz", 64, seed=1)
"""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np

from ._weights import write_atomic
from .data import _image, _rng
from .specs import OPSET

INPUT_NAME, OUTPUT_NAME = "input", "logits"
# per stage: expand ratio, kernel, stride, output channels, repeats (EfficientNet-B0)
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
STEM, HEAD, CLASSES = 32, 1280, 1000
_IMAGE_SALT = 7  # keeps these images apart from the reference models' (models.data salts 0..)


def make_images(n: int, resolution: int = 224, seed: int = 0) -> np.ndarray:
    """``n`` smooth synthetic RGB images, 8-bit levels, ImageNet-normalised: float32 [n, 3, R, R]. Sample ``i``
    depends only on ``(seed, i)``."""
    out = np.empty((n, 3, resolution, resolution), np.float32)
    for i in range(n):
        out[i] = _image(_rng(seed, i, _IMAGE_SALT), resolution)[0]
    return out


def write_images(path: "str | os.PathLike", n: int, resolution: int = 224, seed: int = 0) -> Path:
    """:func:`make_images` saved as an .npz keyed by the graph input name (samples along axis 0)."""
    path = Path(path)
    buf = io.BytesIO()
    np.savez(buf, **{INPUT_NAME: make_images(n, resolution, seed)})
    write_atomic(path, buf.getvalue())
    return path


def _torch_modules():
    import torch
    from torch import nn

    def conv_bn(cin, cout, k=1, stride=1, groups=1, act=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.SiLU()) if act else nn.Sequential(*layers)

    class SqueezeExcite(nn.Module):
        def __init__(self, channels: int, squeeze: int):
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.reduce, self.act = nn.Conv2d(channels, squeeze, 1), nn.SiLU()
            self.expand, self.gate = nn.Conv2d(squeeze, channels, 1), nn.Sigmoid()

        def forward(self, x):
            return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))

    class MBConv(nn.Module):
        def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int):
            super().__init__()
            mid = cin * expand
            self.expand = conv_bn(cin, mid) if expand != 1 else nn.Identity()
            self.depthwise = conv_bn(mid, mid, kernel, stride, groups=mid)
            self.se = SqueezeExcite(mid, max(1, cin // 4))
            self.project = conv_bn(mid, cout, act=False)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.project(self.se(self.depthwise(self.expand(x))))
            return x + y if self.residual else y

    class EfficientNetB0(nn.Module):
        def __init__(self):
            super().__init__()
            blocks, cin = [conv_bn(3, STEM, 3, 2)], STEM
            for expand, kernel, stride, cout, repeats in STAGES:
                for r in range(repeats):
                    blocks.append(MBConv(cin, cout, expand, kernel, stride if r == 0 else 1))
                    cin = cout
            blocks.append(conv_bn(cin, HEAD))
            self.features = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Linear(HEAD, CLASSES)

        def forward(self, x):
            return self.classifier(torch.flatten(self.pool(self.features(x)), 1))

    return torch, nn, EfficientNetB0


def build_torch(resolution: int = 224, seed: int = 0):
    """The eval-mode torch model: seeded init (torch's defaults, He-normal convolutions), random BN gamma/beta, BN
    running statistics measured on 16 synthetic images at ``resolution``. The caller's RNG state is kept."""
    torch, nn, EfficientNetB0 = _torch_modules()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = EfficientNetB0()
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.normal_(m.bias, 0.0, 0.2)
                m.momentum = None  # cumulative average: one batch sets the statistics to its own
                m.reset_running_stats()
        images = torch.from_numpy(make_images(16, resolution, seed=1000 + seed))
        with torch.no_grad():
            model.train()(images)
    return model.eval()


def build_onnx(path: "str | os.PathLike", resolution: int = 224, seed: int = 0) -> Path:
    """Export :func:`build_torch` to ``path`` (written atomically): opset 17, BatchNormalization kept, dynamic batch
    axis, as models/_export.py exports the reference models. Returns the path."""
    import onnx

    from ._export import _materialise_shared_initializers, _rename_anonymous_initializers

    torch = _torch_modules()[0]
    model = build_torch(resolution, seed)
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and PRESERVE notices
        torch.onnx.export(model, (torch.zeros(1, 3, resolution, resolution),), buf, dynamo=False,
                          input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                          dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}, opset_version=OPSET,
                          training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=True)
    proto = onnx.load_from_string(buf.getvalue())
    _materialise_shared_initializers(proto)
    _rename_anonymous_initializers(proto)
    proto.graph.name = "efficientnet_b0"
    proto.doc_string = (f"EfficientNet-B0-shaped CNN, random weights (seed {seed}), BN statistics at "
                        f"{resolution}x{resolution}")
    onnx.checker.check_model(proto, full_check=True)
    path = Path(path)
    write_atomic(path, proto.SerializeToString())
    return path

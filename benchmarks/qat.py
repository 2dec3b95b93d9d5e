"""Quantization-aware finetuning benchmark (printed numbers, never a timed test).

    python -m benchmarks.qat [--models resnet_mini mobilenet_mini] [--epochs 3] [--train 1024] [--test 512]
                             [--batch 32] [--repeats 3] [--threads 1] [--bn-momentum 0.1] [--freeze-bn-epoch N]

(a) Accuracy on a held-out split (make_labelled seed 2), evaluated in onnxruntime: the fp32 model, W4A4 on the
academic target after post-training quantization (oq.quantize, calibrated on 64 training samples), and the same
model after `--epochs` epochs of oq.finetune on `--train` labelled samples (seed 1000, the seed the reference models
were trained with), Adam, cross-entropy: as oq quantized it (BatchNorm folded into the convolutions, "QAT"), and
BN-aware (`float_model=`: each Conv + BatchNorm pair trained with batch statistics and folded again, "QAT BN").

(b) Speed of one finetuning epoch (the same batches, Adam, cross-entropy) in three forms: oq's bridge (the ONNX graph
interpreted by oq.bridge, what oq.finetune runs); the torch definition of the same network from `models/` with
BatchNorm folded into the convolutions (what the quantized graph holds), trained in float; and that torch network
with the same number of LSQ fake-quant ops as the quantized graph (per-channel weights, per-tensor activations, via
oq.bridge.fakequant). Medians of `--repeats` interleaved runs; the ratios are bridge / torch.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def _batches(x: np.ndarray, y: np.ndarray, batch: int):
    import torch
    return [(torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])) for i in range(0, len(x), batch)]


def _accuracy(model, x: np.ndarray, y: np.ndarray, name: str) -> float:
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return float((sess.run(None, {name: x})[0].argmax(1) == y).mean())


class _FakeQuantLayer:
    """A Conv2d/Linear whose input (per tensor) and weight (per channel) go through LSQ fake quantization."""

    @staticmethod
    def wrap(layer, act_scale: float, bits: int):
        import torch
        import torch.nn.functional as F
        from torch import nn

        from oq.bridge.fakequant import fake_quantize

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = layer
                w = layer.weight.detach()
                self.w_scale = nn.Parameter(w.abs().flatten(1).amax(1).clamp(min=1e-8) / (2 ** (bits - 1) - 1))
                self.a_scale = nn.Parameter(torch.tensor(act_scale))
                self.wq, self.aq = (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1), (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)

            def forward(self, x):
                x = fake_quantize(x, self.a_scale, 0.0, *self.aq, method="lsq")
                w = fake_quantize(self.layer.weight, self.w_scale, 0.0, *self.wq, axis=0, method="lsq")
                if isinstance(self.layer, nn.Linear):
                    return F.linear(x, w, self.layer.bias)
                c = self.layer
                return F.conv2d(x, w, c.bias, c.stride, c.padding, c.dilation, c.groups)

        return Wrapped()


def _torch_networks(name: str, bits: int, act_scale: float):
    """(float, fake-quant) copies of the torch definition with BatchNorm folded, and the fake-quant count."""
    import copy

    from torch import nn
    from torch.fx.experimental.optimization import fuse

    import models

    fused = fuse(models.load_torch(name).eval())
    fq = copy.deepcopy(fused)
    count = 0
    for parent in list(fq.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, (nn.Conv2d, nn.Linear)):
                setattr(parent, child_name, _FakeQuantLayer.wrap(child, act_scale, bits))
                count += 2
    return fused.train(), fq.train(), count


def _epoch(model, params, data) -> float:
    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(params, lr=1e-4)
    start = time.perf_counter()
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def run(args) -> None:
    import onnx
    import torch

    import models
    import oq
    from models.data import make_labelled
    from oq.bridge.qat import QatModel

    from .common import cpu_flags

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_flags()}; torch {torch.__version__}, {args.threads} threads; batch {args.batch}; "
          f"{args.train} training / {args.test} held-out samples")
    results, speeds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = str(models.build(name))
            x_tr, y_tr = make_labelled(name, args.train, seed=1000)
            x_te, y_te = make_labelled(name, args.test, seed=2)
            inp = next(iter(x_tr))
            np.savez(f"{tmp}/{name}.npz", **{inp: x_tr[inp][:64]})
            ptq = oq.quantize(path, "academic", f"{tmp}/{name}.npz", weight_bits=4, act_bits=4, progress=False).model
            data = _batches(x_tr[inp], y_tr, args.batch)
            start = time.perf_counter()
            qat = oq.finetune(ptq, data, torch.nn.functional.cross_entropy, epochs=args.epochs, lr=args.lr,
                              scale_lr=args.scale_lr, progress=False)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            qat_bn = oq.finetune(ptq, data, torch.nn.functional.cross_entropy, epochs=args.epochs, lr=args.lr,
                                 scale_lr=args.scale_lr, progress=False, float_model=path,
                                 bn_momentum=args.bn_momentum, freeze_bn_epoch=args.freeze_bn_epoch)
            seconds_bn = time.perf_counter() - start
            results.append((name, *(_accuracy(m, x_te[inp], y_te, inp) for m in (path, ptq, qat, qat_bn)), seconds,
                            seconds_bn))

            n_fq = sum(n.op_type == "FakeQuant" for n in ptq.graph.node)
            act = float(np.median([onnx.numpy_helper.to_array(t) for t in ptq.graph.initializer
                                   if t.name.endswith("_scale") and not t.dims]))
            plain, faked, n_torch = _torch_networks(name, 4, act)
            bridge = QatModel(ptq).train()
            runs = {k: [] for k in ("bridge", "float", "fq")}
            for _ in range(args.repeats):  # interleaved, so machine noise hits all three alike
                runs["bridge"].append(_epoch(bridge, bridge.weights() + bridge.scales(), data))
                runs["float"].append(_epoch(plain, list(plain.parameters()), data))
                runs["fq"].append(_epoch(faked, list(faked.parameters()), data))
            med = {k: statistics.median(v) for k, v in runs.items()}
            speeds.append((name, med, n_fq, n_torch, len(data)))

    print(f"\n(a) held-out accuracy, W4A4 academic target, {args.epochs} epochs of oq.finetune (lr {args.lr}, "
          f"scale_lr {args.scale_lr}; QAT BN: bn_momentum {args.bn_momentum}, freeze_bn_epoch {args.freeze_bn_epoch})")
    print(f"{'model':<16}{'fp32':>8}{'PTQ':>8}{'QAT':>8}{'QAT BN':>8}{'finetune s':>12}{'BN s':>8}")
    for name, fp, ptq_acc, qat_acc, bn_acc, seconds, seconds_bn in results:
        print(f"{name:<16}{fp:>8.3f}{ptq_acc:>8.3f}{qat_acc:>8.3f}{bn_acc:>8.3f}{seconds:>12.1f}{seconds_bn:>8.1f}")
    print(f"\n(b) one epoch, seconds (median of {args.repeats}); torch: the models/ definition, BatchNorm folded")
    print(f"{'model':<16}{'steps':>6}{'bridge':>9}{'torch fp32':>12}{'torch+FQ':>10}{'bridge/fp32':>13}"
          f"{'bridge/FQ':>11}{'FQ ops (onnx/torch)':>21}")
    for name, med, n_fq, n_torch, steps in speeds:
        print(f"{name:<16}{steps:>6}{med['bridge']:>9.2f}{med['float']:>12.2f}{med['fq']:>10.2f}"
              f"{med['bridge'] / med['float']:>13.2f}{med['bridge'] / med['fq']:>11.2f}{f'{n_fq} / {n_torch}':>21}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qat", description="oq.finetune: accuracy and speed")
    p.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train", type=int, default=1024)
    p.add_argument("--test", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--scale-lr", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bn-momentum", type=float, default=0.1)
    p.add_argument("--freeze-bn-epoch", type=int, default=None)
    # one: on a shared two-core machine, two torch threads spend most of a step waiting for each other
    p.add_argument("--threads", type=int, default=1)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()

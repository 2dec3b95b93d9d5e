"""Quantization-aware finetuning of an oq-quantized ONNX model: `finetune(model, train_data, loss, ...)`.

The model is trained as an oq.bridge.qat_module.QatModel (the graph run by the torch bridge, with straight-through
rounding and learned scales) and written back into the same graph; see qat_module for what is learned and how the
result stays bit-exact with onnxruntime, and qat_graph for the target's constraints that are kept.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnx
import torch

from ..errors import OqError
from . import dtypes
from .qat_module import QatModel

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def finetune(model, train_data, loss, *, epochs: int = 1, lr: float = 1e-4, scale_lr: float = 1e-3,
             learn_scales: bool = True, device="cpu", optimizer="adam", progress: bool | None = None,
             float_model=None, bn_momentum: float = 0.1, freeze_bn_epoch: int | None = None) -> onnx.ModelProto:
    """Quantization-aware finetuning of an oq-quantized model (path or ModelProto); returns a new ModelProto.

    train_data: re-iterable (a list, a DataLoader) of (inputs, target); inputs is a tensor or array (one graph
    input), a tuple of them (graph inputs in order) or a dict by input name. loss(outputs, target) returns a scalar
    tensor; outputs is the graph output (a tuple when there are several). lr: the weights' learning rate; scale_lr:
    the scales' (in the log domain: a relative step); learn_scales=False keeps every scale. optimizer: "adam",
    "adamw", "sgd", or a callable taking torch parameter groups. progress: None shows a bar on a terminal only.
    The result has the input's graph, with the learned weights re-quantized to their codes, the learned scales, and
    the target's constraints kept: zero-points, powers of two, shared scales, int32 bias scales s_x * s_w.
    float_model: the model (path or ModelProto) oq quantized, with its BatchNormalization; each Conv it follows
    trains BN-aware (oq.bridge.qat_bn): batch statistics, running ones updated with `bn_momentum` (torch's
    convention) until `freeze_bn_epoch` epochs have run (None: never), and folded again into the exported Conv.
    """
    _check_options(epochs, lr, scale_lr, loss)
    _check_bn_options(bn_momentum, freeze_bn_epoch)
    dev = _device(device)
    qm = QatModel(model, float_model=float_model, bn_momentum=float(bn_momentum)).to(dev)
    groups = [{"params": qm.weights(), "lr": float(lr)}]
    if learn_scales:
        groups.append({"params": qm.scales(), "lr": float(scale_lr)})
    else:
        for t in qm.scales():
            t.requires_grad_(False)
    groups = [g for g in groups if g["params"]]
    opt = _optimizer(optimizer, groups) if groups else None
    qm.train()
    bar, steps, start, last = _bar(progress, epochs, train_data), 0, time.perf_counter(), torch.tensor(float("nan"))
    try:
        for epoch in range(epochs):
            if freeze_bn_epoch is not None and epoch >= freeze_bn_epoch:
                qm.freeze_bn()
            seen = 0
            for item in train_data:
                inputs, target = _split(item, qm.plan.input_specs, dev)
                value = _scalar(loss(qm(*inputs), target), opt is not None)
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                    value.backward()
                    opt.step()
                seen, steps, last = seen + 1, steps + 1, value.detach()  # read only when shown: no GPU sync
                bar.update(1)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{float(last):.4g}", refresh=False)
            if not seen:
                raise OqError(f"train_data gave no items in epoch {epoch + 1}: pass a list or a DataLoader (a "
                              "generator is used up after one pass)" if epoch else "train_data is empty")
    finally:
        bar.close()
    if progress and not hasattr(bar, "set_postfix"):
        sys.stderr.write(f"finetune: {steps} steps in {time.perf_counter() - start:.2f}s, last loss {float(last):.4g}\n")
    qm.eval()
    record = {"epochs": epochs, "steps": steps, "lr": float(lr), "scale_lr": float(scale_lr) if learn_scales else 0.0,
              "optimizer": optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "custom")}
    if float_model is not None:
        record.update(bn_aware=len(qm.bn_pairs), bn_momentum=float(bn_momentum), freeze_bn_epoch=freeze_bn_epoch)
    return qm.export({"oq.finetune": json.dumps(record, sort_keys=True)})


def _check_options(epochs, lr, scale_lr, loss) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise OqError(f"epochs must be a whole number >= 0, got {epochs!r}")
    for name, v in (("lr", lr), ("scale_lr", scale_lr)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise OqError(f"{name} must be a number >= 0, got {v!r}")
    if not callable(loss):
        raise OqError(f"loss must be a function loss(outputs, target) -> scalar tensor, got {type(loss).__name__}")


def _check_bn_options(bn_momentum, freeze_bn_epoch) -> None:
    if isinstance(bn_momentum, bool) or not isinstance(bn_momentum, (int, float)) or not 0 <= bn_momentum <= 1:
        raise OqError(f"bn_momentum must be a number from 0 to 1, got {bn_momentum!r}")
    if freeze_bn_epoch is not None and (isinstance(freeze_bn_epoch, bool) or not isinstance(freeze_bn_epoch, int)
                                        or freeze_bn_epoch < 0):
        raise OqError(f"freeze_bn_epoch must be None or a whole number >= 0, got {freeze_bn_epoch!r}")


def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise OqError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OqError(f"device {str(device)!r}: torch.cuda.is_available() is False (no CUDA GPU, or a CPU-only torch "
                      "build); use device='cpu'")
    return dev


def _optimizer(optimizer, groups: list) -> torch.optim.Optimizer:
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise OqError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}, or pass a callable "
                          "taking parameter groups")
        return OPTIMIZERS[optimizer.lower()](groups)
    if callable(optimizer):
        return optimizer(groups)
    raise OqError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or a callable, got {type(optimizer).__name__}")


def _bar(progress, epochs: int, train_data):
    from ..calibration import progress_reporter

    try:
        total = epochs * len(train_data)
    except TypeError:
        total = None
    bar = progress_reporter(False if progress is True and not _tty() else progress, "finetune", total)
    if hasattr(bar, "unit"):
        bar.unit = "step"
    return bar


def _tty() -> bool:
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _expected(specs) -> str:
    def one(name, elem, dims):
        shape = "" if dims is None else " [" + ",".join(str(d) for d in dims) + "]"
        return f"{name} ({dtypes.name(elem).lower()}{shape})"
    return ", ".join(one(*s) for s in specs)


def _split(item, specs, dev: torch.device) -> tuple[list[torch.Tensor], object]:
    """(inputs in graph order as tensors on `dev`, target on `dev`) from one train_data item."""
    names = [s[0] for s in specs]
    takes = f"the model takes {len(specs)} input(s): {_expected(specs)}"
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise OqError(f"each train_data item must be an (inputs, target) pair, got {_describe(item)}; {takes}")
    inputs, target = item
    if isinstance(inputs, dict):
        if set(inputs) != set(names):
            raise OqError(f"train_data inputs have keys {sorted(map(str, inputs))}; {takes}")
        inputs = [inputs[n] for n in names]
    elif isinstance(inputs, (tuple, list)):
        if len(inputs) != len(names):
            raise OqError(f"train_data inputs are {len(inputs)} tensors; {takes}")
    elif len(names) == 1:
        inputs = [inputs]
    else:
        raise OqError(f"train_data inputs are one tensor; {takes} (pass a tuple or a dict)")
    out = []
    for (name, elem, dims), value in zip(specs, inputs):
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        if dims is not None and (t.dim() != len(dims) or any(isinstance(d, int) and d > 0 and d != n
                                                             for d, n in zip(dims, t.shape))):
            raise OqError(f"train_data input {name!r} has shape {list(t.shape)}; {takes}")
        out.append(t.to(device=dev, dtype=dtypes.storage(elem) if elem else None))
    return out, _to(target, dev)


def _to(value, dev: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value).to(dev)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, dev) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, dev) for k, v in value.items()}
    return value


def _describe(item) -> str:
    if isinstance(item, (tuple, list)):
        return f"a {type(item).__name__} of {len(item)}"
    shape = getattr(item, "shape", None)
    return f"{type(item).__name__}{'' if shape is None else ' of shape ' + str(list(shape))}"


def _scalar(value, needs_grad: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise OqError(f"loss must return a scalar tensor, got {got}")
    if needs_grad and not value.requires_grad:
        raise OqError("the loss has no gradient: compute it with torch operations on the model's outputs")
    return value.reshape(())


__all__ = ["finetune", "QatModel"]

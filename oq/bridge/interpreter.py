"""`to_torch(model)`: an ONNX model as a torch module that interprets its graph node by node.

Float initializers become trainable `nn.Parameter`s (under sanitised names; `parameter_for(onnx_name)` finds them),
other initializers and Constant node values become buffers, so `.to(device)` and `state_dict()` cover every tensor
of the model. Every node runs as torch ops taken from the registry (oq.bridge.registry), so autograd flows through
the whole graph. Anything the bridge cannot run is reported, all at once, when the module is built.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import OqError
from . import dtypes
from .program import Compiler, Program, RunContext, execute, last_uses
from .registry import OpDef, as_opdef


def to_torch(model: onnx.ModelProto | str | os.PathLike, ops: dict | None = None) -> "OnnxModule":
    """The model as a torch module: `module(*inputs)` takes the graph inputs in order and returns the graph output
    (a tuple when there are several). `ops` maps (domain, op_type) or op_type to a replacement op function for this
    module only (see oq.bridge.registry)."""
    return OnnxModule(model, ops=ops)


class OnnxModule(nn.Module):
    """An ONNX graph run node by node with torch ops. Graph inputs that are also initializers (old IR versions)
    are not arguments of forward: they take the initializer's value."""

    def __init__(self, model: onnx.ModelProto | str | os.PathLike, ops: dict | None = None):
        super().__init__()
        if not isinstance(model, onnx.ModelProto):
            from ..ir import load_model
            model = load_model(model)
        local = {(k if isinstance(k, tuple) else ("", k)): as_opdef(v) for k, v in (ops or {}).items()}
        compiler = Compiler(model, local)
        self._program: Program = compiler.graph(_with_types(model).graph)
        problems = []
        if compiler.unsupported:
            problems.append("unsupported op(s): " + ", ".join(compiler.unsupported))
        problems.extend(compiler.problems)
        if problems:
            raise OqError("the torch bridge cannot run this model: " + "; ".join(problems))
        inits = self._program.initializers
        self.input_names: list[str] = [n for n in self._program.inputs if n not in inits]
        self.output_names: list[str] = list(self._program.outputs)
        self.opset: int = compiler.opsets.get("", 0)
        self._last_use = last_uses(self._program)
        self._hooks: OrderedDict[int, Callable] = OrderedDict()
        self._attr_of: dict[tuple[str, str], str] = {}   # (graph path, onnx name) -> attribute of this module
        self._initializers: dict[str, str] = {}          # onnx initializer name -> attribute
        taken: set[str] = set()
        for program in self._program.walk():
            for name, proto in program.constants.items():
                attr = _fresh(name, taken, self)
                try:
                    value = dtypes.tensor_from_proto(proto)
                except TypeError as exc:
                    raise OqError(f"the torch bridge cannot run this model: {exc}") from None
                if name in program.initializers:
                    if dtypes.is_float_type(proto.data_type):
                        self.register_parameter(attr, nn.Parameter(value))
                    else:
                        self.register_buffer(attr, value)
                    key = name if name not in self._initializers else f"{program.path}{name}"
                    self._initializers[key] = attr
                else:
                    self.register_buffer(attr, value, persistent=False)
                self._attr_of[program.path, name] = attr
                program.constants[name] = None  # the module holds the value now; let the proto go

    # --- running ---------------------------------------------------------------------------------------------
    def forward(self, *inputs, return_values: Iterable[str] | None = None):
        """Graph outputs for the given graph inputs; with `return_values=[names]`, `(outputs, {name: value})` for
        those values of the main graph as well (node outputs, inputs or initializers)."""
        if len(inputs) != len(self.input_names):
            raise OqError(f"the model takes {len(self.input_names)} input(s) ({', '.join(self.input_names)}), "
                          f"got {len(inputs)}")
        program = self._program
        env = {name: self._fetch(program, name) for name in program.constants}
        for name, value in zip(self.input_names, inputs):
            env[name] = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        keep = set(return_values) if return_values is not None else None
        ctx = RunContext(tuple(self._hooks.values()), self._fetch)
        env = execute(program, env, ctx, keep=keep, last_use=self._last_use)
        outputs = tuple(env[o] for o in program.outputs)
        result = outputs[0] if len(outputs) == 1 else outputs
        if keep is None:
            return result
        missing = [n for n in return_values if n not in env]
        if missing:
            raise OqError(f"no value named {', '.join(map(repr, missing))} in the main graph")
        return result, {n: env[n] for n in return_values}

    def register_value_hook(self, hook: Callable[[str, torch.Tensor], torch.Tensor | None]) -> RemovableHandle:
        """Call `hook(name, value)` on every node output as it is computed (in subgraphs too); a tensor it returns
        replaces the value for the rest of the run."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def _fetch(self, program: Program, name: str) -> torch.Tensor:
        attr = self._attr_of.get((program.path, name))
        if attr is None:  # a subgraph inside a model-local function body: not registered, made on use
            return dtypes.tensor_from_proto(program.constants[name])
        return getattr(self, attr)

    # --- initializers ----------------------------------------------------------------------------------------
    def initializer_names(self) -> list[str]:
        """ONNX names of the model's initializers (subgraph ones whose name is taken are prefixed by their path)."""
        return list(self._initializers)

    def parameter_for(self, onnx_name: str) -> nn.Parameter:
        """The trainable parameter holding float initializer `onnx_name`."""
        value = self.tensor_for(onnx_name)
        if not isinstance(value, nn.Parameter):
            raise OqError(f"initializer {onnx_name!r} is not float ({value.dtype}): it is a buffer, not a parameter")
        return value

    def tensor_for(self, onnx_name: str) -> torch.Tensor:
        """The parameter or buffer holding initializer `onnx_name`."""
        if onnx_name not in self._initializers:
            raise OqError(f"no initializer named {onnx_name!r}")
        return getattr(self, self._initializers[onnx_name])

    def attribute_name(self, onnx_name: str) -> str:
        """The (sanitised) name under which initializer `onnx_name` is registered on this module."""
        if onnx_name not in self._initializers:
            raise OqError(f"no initializer named {onnx_name!r}")
        return self._initializers[onnx_name]

    def initializer_parameters(self) -> dict[str, nn.Parameter]:
        """ONNX name -> parameter, for every float initializer."""
        return {k: getattr(self, a) for k, a in self._initializers.items()
                if isinstance(getattr(self, a), nn.Parameter)}

    def write_back(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of `model` (the one this module was built from) with the main graph's float initializers set to
        the current parameter values."""
        out = onnx.ModelProto()
        out.CopyFrom(model)
        params = self.initializer_parameters()
        for i, init in enumerate(out.graph.initializer):
            if init.name in params:
                value = params[init.name].detach().cpu()
                np_dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
                array = (value.float() if value.dtype == torch.bfloat16 else value).numpy().astype(np_dtype)
                out.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(array, init.name))
        return out

    def extra_repr(self) -> str:
        return (f"inputs={self.input_names}, outputs={self.output_names}, opset={self.opset}, "
                f"nodes={sum(len(p.steps) for p in self._program.walk())}")


def _with_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with inferred element types in value_info where onnx can infer them (the original otherwise)."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is a convenience: QuantizeLinear falls back to the zero point's dtype
        return model


_SAFE = re.compile(r"[^0-9A-Za-z_]")


def _fresh(onnx_name: str, taken: set[str], module: nn.Module) -> str:
    base = _SAFE.sub("_", onnx_name).strip("_") or "tensor"
    if base[0].isdigit():
        base = "t_" + base
    name, k = base, 1
    while name in taken or hasattr(module, name):
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


__all__ = ["OnnxModule", "to_torch", "OpDef"]

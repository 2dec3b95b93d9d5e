"""The op registry of the torch bridge: (domain, op_type) -> function(attrs, inputs) -> outputs.

An op function receives the node's decoded attributes as a `NodeAttrs` (a dict that also knows the node's name, the
opset of its domain, the ONNX element types of its inputs and which outputs are read) and the list of its input
tensors (None for an omitted optional input; trailing omitted inputs are simply absent). It returns one tensor or a
sequence of tensors, one per node output (None for an output that is not produced).

An op may also have a `check(attrs)` run when the module is built: it returns a sentence saying why this node cannot
be run (an attribute value the bridge does not implement), or None. So everything unsupported is reported before
any tuning starts.

Built-in ops are registered by the `ops_*` modules with `@op(...)`. `register(...)` installs a replacement for every
module built afterwards (e.g. learnable QuantizeLinear/DequantizeLinear/FakeQuant), `unregister(...)` restores the
built-in, `builtin(...)` returns the built-in one; `to_torch(model, ops={...})` replaces ops for one module only.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

DEFAULT_DOMAINS = ("", "ai.onnx")
BUILTIN_MODULES = ("ops_math", "ops_nn", "ops_shape", "ops_resize", "ops_rnn", "ops_quant", "ops_control")

OpFn = Callable[["NodeAttrs", list], Any]
CheckFn = Callable[["NodeAttrs"], Optional[str]]


@dataclass(frozen=True)
class OpDef:
    fn: OpFn
    check: CheckFn | None = None


class NodeAttrs(dict):
    """A node's attributes, decoded (ints, floats, str, lists, numpy arrays for tensors, subgraphs), plus context."""

    def __init__(self, attrs: dict, *, op_type: str, domain: str = "", name: str = "", opset: int = 21,
                 input_types: list | None = None, outputs: list | None = None):
        super().__init__(attrs)
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self.opset = opset
        self.input_types = list(input_types or [])
        self.outputs = list(outputs or [""])

    def input_type(self, i: int) -> int | None:
        return self.input_types[i] if i < len(self.input_types) else None

    def wants(self, i: int) -> bool:
        """Whether output i is read (declared with a non-empty name)."""
        return i < len(self.outputs) and bool(self.outputs[i])

    def derive(self, values: dict) -> "NodeAttrs":
        """A copy with some attribute values replaced (subgraphs bound to a scope, for one call)."""
        out = NodeAttrs({**self, **values}, op_type=self.op_type, domain=self.domain, name=self.name,
                        opset=self.opset, input_types=self.input_types, outputs=self.outputs)
        return out

    def where(self) -> str:
        return f"{self.op_type} node {self.name!r}"


_BUILTIN: dict[tuple[str, str], OpDef] = {}
_OVERRIDES: dict[tuple[str, str], OpDef] = {}
_loaded = False


def _key(domain: str, op_type: str) -> tuple[str, str]:
    return ("" if domain in DEFAULT_DOMAINS else domain, op_type)


def op(*op_types: str, domain: str = "", check: CheckFn | None = None):
    """Decorator for the built-in ops: `@op("Relu")`, `@op("FakeQuant", domain="oq")`."""
    def wrap(fn: OpFn) -> OpFn:
        for op_type in op_types:
            _BUILTIN[_key(domain, op_type)] = OpDef(fn, check)
        return fn
    return wrap


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(f"{__package__}.{module}")


def register(op_type: str, fn: OpFn, domain: str = "", check: CheckFn | None = None) -> None:
    """Use `fn` for (domain, op_type) in every module built from now on, in place of the built-in."""
    _OVERRIDES[_key(domain, op_type)] = OpDef(fn, check)


def unregister(op_type: str, domain: str = "") -> None:
    _OVERRIDES.pop(_key(domain, op_type), None)


def builtin(op_type: str, domain: str = "") -> OpDef | None:
    _load_builtins()
    return _BUILTIN.get(_key(domain, op_type))


def lookup(op_type: str, domain: str = "", local: dict | None = None) -> OpDef | None:
    """The op for (domain, op_type): a per-module replacement, then a registered one, then the built-in."""
    _load_builtins()
    key = _key(domain, op_type)
    if local and key in local:
        return local[key]
    return _OVERRIDES.get(key) or _BUILTIN.get(key)


def as_opdef(value: OpFn | OpDef) -> OpDef:
    return value if isinstance(value, OpDef) else OpDef(value)


def supported_ops() -> list[tuple[str, str]]:
    """Every (domain, op_type) the bridge runs, sorted."""
    _load_builtins()
    return sorted(set(_BUILTIN) | set(_OVERRIDES))


# Small helpers shared by the op modules.
def arg(inputs: list, i: int):
    """Input i, or None when omitted."""
    return inputs[i] if i < len(inputs) else None


def int_list(value) -> list[int]:
    """A shape-like input (tensor, array, list) as Python ints."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (int, float)):
        return [int(value)]
    return [int(v) for v in value]

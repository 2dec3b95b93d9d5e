"""Graphs compiled for the interpreter: nodes resolved to registry ops, attributes decoded, problems collected.

A `Program` is one graph (the model's, an If branch, or the body of a model-local function at one call site) as a
list of steps. Running it maps input names to tensors in an environment (a dict; subgraphs see their outer scope
through a ChainMap) and returns the environment.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, field
from typing import Callable

import onnx
from onnx import helper

from ..errors import OqError
from . import dtypes
from .registry import NodeAttrs, OpDef, lookup

FunctionKey = tuple[str, str]


@dataclass
class Step:
    attrs: NodeAttrs
    op: OpDef
    inputs: list[str]
    outputs: list[str]
    subgraphs: dict[str, "Program"] = field(default_factory=dict)


@dataclass
class Program:
    steps: list[Step]
    inputs: list[str]
    outputs: list[str]
    # names this graph reads from an enclosing scope
    outer: set[str] = field(default_factory=set)
    # initializers and Constant outputs of this graph: name -> TensorProto (None once a module holds the value)
    constants: dict[str, onnx.TensorProto | None] = field(default_factory=dict)
    initializers: set[str] = field(default_factory=set)
    # path of the graph in the model ("" for the main graph, "node/attribute/" for subgraphs)
    path: str = ""

    def walk(self):
        """This program and every subgraph under it."""
        yield self
        for step in self.steps:
            for sub in step.subgraphs.values():
                yield from sub.walk()


class Compiler:
    """Turns GraphProtos into Programs; `problems` lists what cannot be run (checked before building the module)."""

    def __init__(self, model: onnx.ModelProto, local_ops: dict | None = None, types: dict | None = None):
        self.opsets = {("" if i.domain == "ai.onnx" else i.domain): i.version for i in model.opset_import}
        self.functions: dict[FunctionKey, onnx.FunctionProto] = {(f.domain, f.name): f for f in model.functions}
        self.local_ops = local_ops or {}
        self.types: dict[str, int] = dict(types or {})
        self.problems: list[str] = []
        self.unsupported: list[str] = []

    # ----------------------------------------------------------------------------------------------------------
    def graph(self, graph: onnx.GraphProto, opsets: dict | None = None, path: str = "") -> Program:
        opsets = opsets or self.opsets
        for vi in (*graph.input, *graph.output, *graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        constants = {t.name: t for t in graph.initializer}
        for t in graph.initializer:
            self.types[t.name] = t.data_type
        steps = []
        for index, node in enumerate(graph.node):
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
                value = self._constant(node)
                if value is not None:
                    constants[node.output[0]] = value
                    self.types[node.output[0]] = value.data_type
                    continue
            step = self.node(node, opsets, path, index)
            if step is not None:
                steps.append(step)
        produced = {o for s in steps for o in s.outputs if o} | set(constants) | {i.name for i in graph.input}
        read = set()
        for s in steps:
            read.update(n for n in s.inputs if n)
            for sub in s.subgraphs.values():
                read.update(sub.outer)
        read.update(o.name for o in graph.output)
        return Program(steps, [i.name for i in graph.input], [o.name for o in graph.output], read - produced,
                       constants, {t.name for t in graph.initializer}, path)

    def node(self, node: onnx.NodeProto, opsets: dict, path: str, index: int,
             ref_attrs: dict | None = None) -> Step | None:
        domain = "" if node.domain == "ai.onnx" else node.domain
        name = node.name or f"{path}{node.op_type}_{index}"
        attrs, subgraphs = {}, {}
        for a in node.attribute:
            if a.ref_attr_name:
                if ref_attrs is None or a.ref_attr_name not in ref_attrs:
                    continue
                a = ref_attrs[a.ref_attr_name]
            if a.type == onnx.AttributeProto.GRAPH:
                subgraphs[a.name] = self.graph(a.g, opsets, f"{path}{name}/{a.name}/")
                attrs[a.name] = None
            elif a.type == onnx.AttributeProto.GRAPHS:
                self.unsupported.append(f"{node.op_type} (node {name!r}: graph-list attribute {a.name})")
                return None
            else:
                attrs[a.name] = _decode(a)
        attrs_obj = NodeAttrs(attrs, op_type=node.op_type, domain=domain, name=name,
                              opset=opsets.get(domain, 1), input_types=[self.types.get(i) for i in node.input],
                              outputs=list(node.output))
        op = lookup(node.op_type, domain, self.local_ops)
        if op is None and (domain, node.op_type) in self.functions:
            op = self._function(node, attrs_obj, opsets)
        if op is None:
            label = f"{domain}.{node.op_type}" if domain else node.op_type
            self.unsupported.append(f"{label} (node {name!r})")
            return None
        if op.check is not None:
            try:
                problem = op.check(attrs_obj)
            except Exception as exc:  # a malformed attribute the check could not read
                problem = f"{type(exc).__name__}: {exc}"
            if problem:
                self.problems.append(f"{attrs_obj.where()}: {problem}")
                return None
        return Step(attrs_obj, op, list(node.input), list(node.output), subgraphs)

    # ----------------------------------------------------------------------------------------------------------
    def _constant(self, node: onnx.NodeProto) -> onnx.TensorProto | None:
        a = node.attribute[0] if len(node.attribute) == 1 else None
        if a is None:
            return None
        out = node.output[0]
        if a.name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(a.t)
            t.name = out
            return t
        kinds = {"value_float": onnx.TensorProto.FLOAT, "value_floats": onnx.TensorProto.FLOAT,
                 "value_int": onnx.TensorProto.INT64, "value_ints": onnx.TensorProto.INT64}
        if a.name not in kinds:
            return None  # value_string / sparse_value: left to the Constant op, which refuses them
        value = helper.get_attribute_value(a)
        dims = [len(value)] if isinstance(value, list) else []
        return helper.make_tensor(out, kinds[a.name], dims, value if isinstance(value, list) else [value])

    def _function(self, node: onnx.NodeProto, attrs: NodeAttrs, opsets: dict) -> OpDef | None:
        fn = self.functions[(attrs.domain, node.op_type)]
        fn_opsets = dict(opsets)
        fn_opsets.update({("" if i.domain == "ai.onnx" else i.domain): i.version for i in fn.opset_import})
        refs = {a.name: a for a in fn.attribute_proto}
        refs.update({a.name: a for a in node.attribute})
        steps = []
        for index, inner in enumerate(fn.node):
            step = self.node(inner, fn_opsets, f"{attrs.name}/", index, refs)
            if step is None:
                return None
            steps.append(step)
        body = Program(steps, list(fn.input), list(fn.output))
        return OpDef(_function_op(body))


def _function_op(body: Program) -> Callable:
    def run(attrs: NodeAttrs, inputs: list):
        env = {name: value for name, value in zip(body.inputs, inputs) if value is not None}
        env = execute(body, env, RunContext())
        return tuple(env.get(o) for o in body.outputs)
    return run


def _decode(a: onnx.AttributeProto):
    value = helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    if isinstance(value, onnx.TensorProto):
        return dtypes.tensor_from_proto(value)
    return value


@dataclass
class RunContext:
    """What a run carries into subgraphs: value hooks, and `fetch(program, name)` for a graph's constants."""

    hooks: tuple = ()
    fetch: Callable | None = None


class _Branch:
    """A subgraph bound to the scope of one call: `branch()` runs it and returns its outputs."""

    def __init__(self, program: Program, scope, ctx: RunContext):
        self.program, self.scope, self.ctx = program, scope, ctx

    def __call__(self) -> list:
        fetch = self.ctx.fetch or (lambda program, name: dtypes.tensor_from_proto(program.constants[name]))
        local = {k: fetch(self.program, k) for k in self.program.constants}
        env = execute(self.program, ChainMap({}, local, self.scope), self.ctx)
        return [env[o] for o in self.program.outputs]


def execute(program: Program, env, ctx: RunContext, keep: set | None = None, last_use: dict | None = None):
    """Run the steps of `program` over `env` (name -> tensor). With `last_use` (step index -> names), values no
    longer read are dropped as the run goes, except those in `keep`."""
    for index, step in enumerate(program.steps):
        try:
            inputs = [env[n] if n else None for n in step.inputs]
        except KeyError as exc:
            raise OqError(f"{step.attrs.where()}: input {exc.args[0]!r} has no value (not a graph input, "
                          "initializer or node output)") from None
        attrs = step.attrs
        if step.subgraphs:
            attrs = attrs.derive({k: _Branch(p, env, ctx) for k, p in step.subgraphs.items()})
        try:
            result = step.op.fn(attrs, inputs)
        except OqError:
            raise
        except Exception as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise OqError(f"{attrs.where()} failed: {type(exc).__name__}: {detail}") from exc
        if not isinstance(result, (tuple, list)):
            result = (result,)
        for i, name in enumerate(step.outputs):
            if not name:
                continue
            if i >= len(result) or result[i] is None:
                raise OqError(f"{attrs.where()}: output {i} ({name!r}) is read but the bridge does not produce it")
            value = result[i]
            for hook in ctx.hooks:
                replaced = hook(name, value)
                if replaced is not None:
                    value = replaced
            env[name] = value
        if last_use is not None:
            for name in last_use.get(index, ()):
                if keep is None or name not in keep:
                    env.pop(name, None)
    return env


def last_uses(program: Program) -> dict[int, list[str]]:
    """step index -> names read for the last time by that step (graph outputs are never dropped)."""
    last: dict[str, int] = {}
    for index, step in enumerate(program.steps):
        for n in step.inputs:
            if n:
                last[n] = index
        for sub in step.subgraphs.values():
            for n in sub.outer:
                last[n] = index
        for n in step.outputs:  # an output nobody reads is dropped right away
            if n and n not in last:
                last[n] = index
    keep = set(program.outputs)
    out: dict[int, list[str]] = {}
    for name, index in last.items():
        if name not in keep:
            out.setdefault(index, []).append(name)
    return out

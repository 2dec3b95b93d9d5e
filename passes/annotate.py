"""Turn the target's per-op rules into a quantization plan: which tensors get Q/DQ, with which spec, shared how."""
from __future__ import annotations

import onnx_graphsurgeon as gs

from oq import ir
from oq.opinfo import op_names, weighted_op
from oq.overrides import matches
from oq.target import DTYPE_MIN_OPSET
from oq.passmanager import Context, Pass, PassResult, has_target, unique_node_names
from oq.plan import ALL_CONSUMERS, ActivationQuant, BiasQuant, QuantPlan, WeightQuant
from oq.target import Target


def output_layers(graph: gs.Graph) -> set[str]:
    """Names of the weighted layers (Conv, ConvTranspose, Gemm, MatMul with a constant weight) whose result reaches a
    graph output without passing through another weighted layer: the model's last layers."""
    found: set[str] = set()
    seen: set[str] = set()
    stack = [t for t in graph.outputs]
    while stack:
        tensor = stack.pop()
        node = ir.producer(tensor)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        info = weighted_op(node)
        widx = info.weight_input if info is not None else None
        if widx is not None and len(node.inputs) > widx and ir.constant_value(node.inputs[widx]) is not None:
            found.add(node.name)
            continue
        stack.extend(t for t in node.inputs if ir.is_float(t) and ir.constant_value(t) is None)
    return found


def _input_channels(node: gs.Node) -> int | None:
    """Input channels of a Conv or ConvTranspose, from its weight's static shape."""
    info = weighted_op(node)
    if info is None:
        return None
    shape = node.inputs[info.weight_input].shape if len(node.inputs) > info.weight_input else None
    if not shape or not all(isinstance(d, int) for d in shape[:2]):
        return None
    return info.input_channels(node, shape)


def excluded(node: gs.Node, patterns: list[str]) -> bool:
    """--exclude entries match a node name, an op type, or (as a regex) a node name."""
    return any(matches(node, p) for p in patterns)


class Annotate(Pass):
    name = "annotate"
    requires = (has_target, unique_node_names)

    def __init__(self, exclude=(), overrides=()):
        """exclude: node names, op types or regexes kept in float; overrides: oq.overrides.Override objects."""
        self.exclude = list(exclude)
        self.overrides = list(overrides)

    def run(self, ctx: Context) -> PassResult:
        target: Target = ctx.target
        planner = _Planner(ctx.graph, target, ctx.fusions, self.exclude, self.overrides)
        ctx.plan = planner.build()
        if ctx.report is not None:
            ctx.report.warnings.extend(planner.warnings)
        n_q = sum(1 for q, _ in ctx.plan.status.values() if q)
        return PassResult(False, [f"{n_q} nodes to quantize, {len(ctx.plan.activations)} activation and "
                                  f"{len(ctx.plan.weights)} weight Q/DQ planned"])


class _Planner:
    def __init__(self, graph: gs.Graph, target: Target, fusions, exclude: list[str], overrides=()):
        self.graph, self.target, self.exclude = graph, target, exclude
        self.overrides = list(overrides)
        self.warnings: list[str] = []
        self._used_overrides: set[str] = set()
        self.uses = ir.UseIndex(graph)
        self.last_layers = output_layers(graph) if target.float_output_layers else set()
        self.plan = QuantPlan()
        self.fused_into: dict[str, object] = {}
        self.anchor_group: dict[str, object] = {}
        for g in fusions:
            self.anchor_group[g.anchor.name] = g
            for n in g.nodes[1:]:
                self.fused_into[n.name] = g

    def build(self) -> QuantPlan:
        status = self.plan.status
        for node in self.graph.nodes:
            status[node.name] = (False, self._float_reason(node))
        conditional = []
        for node in self.graph.nodes:
            if node.name in self.fused_into or status[node.name][1] != "":
                continue
            rule = self.target.ops[node.op]
            if rule.output == "shared":
                continue
            if rule.when == "inputs_quantized":
                conditional.append(node)
                continue
            self._plan_node(node, rule)
        self._plan_conditional(conditional)
        self._propagate_shared()
        for node in self.graph.nodes:
            rule = self.target.ops.get(node.op)
            if (rule is not None and rule.output == "shared" and rule.when == "inputs_quantized"
                    and self.plan.status[node.name] == (False, "") and node.outputs[0].name in self.plan.activations):
                self.plan.status[node.name] = (False, "inputs arrive in float (quantized only between quantized ops)")
        self._plan_biases()
        for o in self.overrides:
            if o.text not in self._used_overrides:
                self.warnings.append(f"--override {o.text}: matches no quantized node")
        for name, group in self.fused_into.items():
            anchor_q = status[group.anchor.name][0]
            status[name] = (anchor_q, f"fused into {group.anchor.name} ({group.pattern})"
                            if anchor_q else f"in fusion {group.pattern} with float {group.anchor.name}")
        for name, (q, reason) in list(status.items()):
            if not q and not reason:
                status[name] = (False, "no neighbour is quantized")
        return self.plan

    def _plan_node(self, node: gs.Node, rule) -> None:
        status = self.plan.status
        if self._plan_inputs(node, rule):
            status[node.name] = (True, "")
        group = self.anchor_group.get(node.name)
        if group is not None and status[node.name][0]:
            self._plan_side_inputs(group)
        if rule.output == "quantized" and status[node.name][0]:
            self._request_output(group.output if group is not None else node.outputs[0])

    def _plan_conditional(self, nodes: list[gs.Node]) -> None:
        """Ops quantized only where every run-time float input already carries a Q/DQ for some other reader (so
        reading it quantized adds no new rounding); repeated, since a quantized output can qualify the next op."""
        pending = list(nodes)
        changed = True
        while changed and pending:
            changed = False
            for node in list(pending):
                inputs = [t for t in node.inputs if t.name and ir.is_float(t) and ir.constant_value(t) is None]
                ready = all(t.name in self.plan.activations for t in inputs)
                if inputs and ready:
                    self._plan_node(node, self.target.ops[node.op])
                    pending.remove(node)
                    changed = True
        for node in pending:
            self.plan.status[node.name] = (False, "inputs arrive in float (quantized only between quantized ops)")

    def _float_reason(self, node: gs.Node) -> str:
        if excluded(node, self.exclude):
            return "excluded by --exclude"
        if node.name in self.last_layers:
            return "an output layer (the target keeps the model's last weighted layers in float)"
        if node.op not in self.target.ops:
            if ir.has_subgraph(node):
                return f"control flow ({node.op}): its subgraphs stay float"
            if node.inputs and not any(ir.is_float(t) for t in node.inputs):
                return "shape/index path (no float input)"
            return f"op {node.op} not quantized by target {self.target.name}"
        need = self.target.ops[node.op].min_input_channels
        channels = _input_channels(node) if need else None
        if channels is not None and channels < need:
            return f"{channels} input channels < {need}: the target's int8 kernel is slower than float there"
        return ""

    def _plan_inputs(self, node: gs.Node, rule) -> bool:
        planned = False
        info = weighted_op(node)
        widx, bidx = (info.weight_input, info.bias_input) if info is not None else (None, None)
        for idx, tensor in enumerate(node.inputs):
            spec_name = rule.spec_name_for(idx)
            if spec_name is None or not tensor.name or bidx == idx:
                continue
            spec = self.target.spec(spec_name)
            value = ir.constant_value(tensor)
            if (value is not None and value.dtype.kind != "f") or (value is None and not ir.is_float(tensor)):
                continue
            if value is None and widx == idx:
                spec = self.target.activation  # a weight slot fed at run time (e.g. attention MatMul)
            spec = self._overridden(node, "weight" if value is not None else "activation", spec)
            if value is not None:
                axis = None
                if spec.granularity == "per_channel" and widx == idx:
                    axis = info.output_axis(node, value.ndim)
                elif spec.granularity == "per_block" and widx == idx and value.ndim >= 2:
                    axis = info.input_axis(node, value.ndim)
                elif spec.granularity != "per_tensor":
                    spec = spec.with_(granularity="per_tensor", block_size=None)
                key = (tensor.name, spec, axis)
                wq = self.plan.weights.setdefault(key, WeightQuant(tensor.name, spec, axis))
                wq.consumers.add((node.name, idx))
            else:
                self._request(tensor.name, spec, (node.name, idx))
            planned = True
        return planned

    def _overridden(self, node: gs.Node, role: str, spec):
        """The spec after the --override entries for this node and role; an entry the target cannot honour is
        skipped and reported."""
        for o in self.overrides:
            if not o.applies(node, role):
                continue
            self._used_overrides.add(o.text)
            new = o.apply(spec)
            need = DTYPE_MIN_OPSET.get(new.dtype, 13)
            if need > self.target.opset_min:
                self.warnings.append(f"--override {o.text} not honoured at {node.name}: {new.dtype} Q/DQ needs "
                                     f"opset >= {need}, target {self.target.name} emits opset {self.target.opset_min}")
                continue
            if new.granularity == "per_channel" and not (role == "weight" and weighted_op(node) is not None):
                self.warnings.append(f"--override {o.text} not honoured at {node.name}: per-channel needs a weight "
                                     f"input of {op_names()}")
                continue
            spec = new
        return spec

    def _plan_side_inputs(self, group) -> None:
        if not self.target.quantize_fusion_side_inputs:
            return
        for member, idx in group.side_inputs:
            tensor = member.inputs[idx]
            if ir.is_float(tensor) and ir.constant_value(tensor) is None:
                self._request(tensor.name, self.target.activation, (member.name, idx))

    def _request(self, tensor: str, spec, consumer) -> ActivationQuant:
        aq = self.plan.activations.get(tensor)
        if aq is not None and aq.spec != spec:
            self.warnings.append(f"tensor '{tensor}' is read with different specs ({aq.spec.dtype} and {spec.dtype}); "
                                 f"one Q/DQ can carry only one, kept {aq.spec.dtype}")
        if aq is None:
            aq = self.plan.activations[tensor] = ActivationQuant(tensor, spec, set())
            self.plan.shared.find(tensor)
        if consumer is ALL_CONSUMERS:
            aq.consumers = ALL_CONSUMERS
        elif aq.consumers is not ALL_CONSUMERS:
            aq.consumers.add(consumer)
        return aq

    def _request_output(self, tensor: gs.Tensor) -> None:
        if not ir.is_float(tensor):
            return
        if tensor.name in self.uses.graph_outputs and not self.target.quantize_graph_outputs:
            for use in self.uses.consumers(tensor):
                self._request(tensor.name, self.target.activation, (use.node.name, use.index))
            return
        self._request(tensor.name, self.target.activation, ALL_CONSUMERS)

    def _produced_quantized(self, tensor: gs.Tensor) -> bool:
        node = ir.producer(tensor)
        if node is None:
            return False
        group = self.fused_into.get(node.name)
        return self.plan.status[(group.anchor if group is not None else node).name][0]

    def _propagate_shared(self) -> None:
        """Ops that run on quantized data without changing its scale (pooling, Concat, ...) are quantized only next
        to quantized neighbours: when their output is quantized, their inputs share its qparams. With
        when = "inputs_quantized", only if their inputs also come from quantized ops; else they run in float and
        quantization starts after them."""
        shared_nodes = [n for n in self.graph.nodes
                        if self.plan.status[n.name] == (False, "") and self.target.ops[n.op].output == "shared"]
        changed = True
        while changed:
            changed = False
            for node in shared_nodes:
                out = node.outputs[0]
                if self.plan.status[node.name][0] or out.name not in self.plan.activations:
                    continue
                rule = self.target.ops[node.op]
                if rule.when == "inputs_quantized" and not all(
                        self._produced_quantized(t) or t.name in self.plan.activations
                        for t in node.inputs if t.name and ir.is_float(t) and ir.constant_value(t) is None):
                    continue
                for idx, tensor in enumerate(node.inputs):
                    if rule.spec_name_for(idx) is None or not ir.is_float(tensor) or ir.constant_value(tensor) is not None:
                        continue
                    self._request(tensor.name, self.plan.activations[out.name].spec, (node.name, idx))
                    self.plan.shared.union(out.name, tensor.name)
                self.plan.status[node.name] = (True, "")
                changed = True

    def _plan_biases(self) -> None:
        for node in self.graph.nodes:
            info = weighted_op(node)
            bidx = info.bias_input if info is not None else None
            if bidx is None or len(node.inputs) <= bidx or not self.plan.status[node.name][0]:
                continue
            rule = self.target.ops[node.op]
            mode = rule.bias or self.target.bias
            if mode != "int32" or ir.constant_value(node.inputs[bidx]) is None:
                continue
            widx = info.weight_input
            x, w = node.inputs[0].name, node.inputs[widx].name
            wkey = next((k for k, wq in self.plan.weights.items()
                         if k[0] == w and (node.name, widx) in wq.consumers), None)
            if wkey is None or x not in self.plan.activations or wkey[1].granularity == "per_block":
                continue  # int32 bias needs one weight scale per output channel
            self.plan.biases.append(BiasQuant(node.name, x, wkey))

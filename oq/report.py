"""What a run did: per pass (changed?, time, nodes) and per node (quantized or float, and why)."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class PassRecord:
    name: str
    modified: bool
    seconds: float
    nodes_before: int
    nodes_after: int
    notes: list[str] = field(default_factory=list)


@dataclass
class NodeRecord:
    name: str
    op: str
    quantized: bool
    reason: str = ""


@dataclass
class Report:
    model: str = ""
    target: str = ""
    passes: list[PassRecord] = field(default_factory=list)
    nodes: list[NodeRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)
    # the run record (oq.record): version, target and its spec hash, options, calibration hash, passes
    run: dict = field(default_factory=dict)
    # every option of the run, including those that do not change the result
    options: dict = field(default_factory=dict)
    # with --min-sqnr: the goal, what met it and at what cost (an oq.analysis.fallback.GoalRecord)
    goal: object | None = None

    def node_status(self, name: str) -> NodeRecord | None:
        return next((n for n in self.nodes if n.name == name), None)

    @property
    def quantized_nodes(self) -> list[NodeRecord]:
        return [n for n in self.nodes if n.quantized]

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_table(self, max_float_rows: int = 12) -> str:
        # the pass column is as wide as the longest pass name; "changed" is left-aligned under its header, the
        # numbers right-aligned under theirs
        width = max([len("pass")] + [len(p.name) for p in self.passes])
        digits = max([1] + [len(str(p.nodes_before)) for p in self.passes])
        lines = [f"oq: {self.model} -> target {self.target}", "",
                 f"{'pass':<{width}}  {'changed':<7}{'time':>10}   nodes"]
        for p in self.passes:
            lines.append(f"{p.name:<{width}}  {'yes' if p.modified else 'no':<7}{p.seconds * 1000:>8.0f}ms"
                         f"   {p.nodes_before:>{digits}}->{p.nodes_after}")
            for note in p.notes[:4]:
                lines.append(f"    {note}")
            if len(p.notes) > 4:
                lines.append(f"    ... {len(p.notes) - 4} more")
        q = self.quantized_nodes
        by_op = Counter(n.op for n in q)
        # the nodes the target's plan runs on quantized data, ops fused into a quantized kernel (the ReLU of a
        # Conv+ReLU) included; `oq inspect` counts only the nodes that read a DequantizeLinear output
        lines += ["", f"quantized {len(q)} of {len(self.nodes)} nodes (incl. ops fused into quantized kernels): "
                  + ", ".join(f"{op} x{k}" for op, k in by_op.most_common())]
        reasons = Counter((n.op, n.reason) for n in self.nodes if not n.quantized)
        if reasons:
            lines.append("left in float:")
            shown = reasons.most_common(max_float_rows)
            op_width = max(20, *(len(op) for (op, _), _ in shown))
            for (op, reason), k in shown:
                lines.append(f"  {op:<{op_width}} x{k:<4} {reason}")
            if len(reasons) > max_float_rows:
                lines.append(f"  ... {len(reasons) - max_float_rows} more (see --report)")
        if self.calibration:
            c = self.calibration
            lines.append("")
            lines.append(f"calibration: {c.get('samples', '?')} samples, {c.get('tensors', '?')} tensors observed, "
                         f"method {c.get('method', '?')}, {c.get('seconds', 0):.2f}s")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        for f in self.side_files:
            lines.append(f"wrote {f}")
        return "\n".join(line.rstrip() for line in lines)

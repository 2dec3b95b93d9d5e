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
        lines = [f"oq: {self.model} -> target {self.target}", "",
                 f"{'pass':<22}{'changed':>8}{'time':>10}{'nodes':>14}"]
        for p in self.passes:
            lines.append(f"{p.name:<22}{'yes' if p.modified else 'no':>8}{p.seconds * 1000:>8.0f}ms"
                         f"{p.nodes_before:>7}->{p.nodes_after:<6}")
            for note in p.notes[:4]:
                lines.append(f"    {note}")
            if len(p.notes) > 4:
                lines.append(f"    ... {len(p.notes) - 4} more")
        q = self.quantized_nodes
        by_op = Counter(n.op for n in q)
        lines += ["", f"quantized {len(q)} of {len(self.nodes)} nodes: "
                  + ", ".join(f"{op} x{k}" for op, k in by_op.most_common())]
        reasons = Counter((n.op, n.reason) for n in self.nodes if not n.quantized)
        if reasons:
            lines.append("left in float:")
            for (op, reason), k in reasons.most_common(max_float_rows):
                lines.append(f"  {op:<20} x{k:<4} {reason}")
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
        return "\n".join(lines)

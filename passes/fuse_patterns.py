"""Fusion grouping: mark the op chains the target runs as one kernel (patterns live in oq.fusions)."""
from __future__ import annotations

from oq.fusions import find_fusions
from oq.passmanager import Context, Pass, PassResult, has_target


class FusePatterns(Pass):
    name = "fuse-patterns"
    requires = (has_target,)

    def run(self, ctx: Context) -> PassResult:
        ctx.fusions, misses = find_fusions(ctx.graph, ctx.target.fusions)
        by_pattern: dict[str, int] = {}
        for g in ctx.fusions:
            by_pattern[g.pattern] = by_pattern.get(g.pattern, 0) + 1
        notes = [", ".join(f"{k} x{v}" for k, v in by_pattern.items())] if by_pattern else []
        return PassResult(False, notes + [f"not fused: {m}" for m in misses])

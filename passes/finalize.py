"""Last touches before export: drop what no output needs and put nodes in topological order."""
from __future__ import annotations

from oq import ir
from oq.passmanager import Context, Pass, PassResult


class Finalize(Pass):
    name = "finalize"

    def run(self, ctx: Context) -> PassResult:
        before = len(ctx.graph.nodes)
        ctx.graph.cleanup(remove_unused_graph_inputs=False)
        ir.toposort(ctx.graph)
        return PassResult(len(ctx.graph.nodes) != before)

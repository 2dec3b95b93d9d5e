"""Remove nodes and tensors that no graph output depends on."""
from __future__ import annotations

from oq.passmanager import Context, Pass, PassResult


class RemoveDeadNodes(Pass):
    name = "dead-nodes"

    def run(self, ctx: Context) -> PassResult:
        before = len(ctx.graph.nodes)
        ctx.graph.cleanup(remove_unused_graph_inputs=False)
        removed = before - len(ctx.graph.nodes)
        return PassResult(removed > 0, [f"removed {removed} nodes"] if removed else [])

"""Pass infrastructure: passes declare requires/ensures checks and report whether they changed the graph.

Graph representations, one per layer: passes that rewrite or analyse the graph work on the onnx-graphsurgeon graph
(`ctx.graph`); the export passes turn it into an `onnx.ModelProto` (`ctx.model`) and work on that; loading, saving
and onnxruntime sessions take ModelProto.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import onnx
import onnx_graphsurgeon as gs

from .errors import InternalError, OqError, PassError
from .plan import FusionGroup, QuantPlan
from .report import PassRecord, Report

if TYPE_CHECKING:  # pragma: no cover
    from .target import Target

# A check looks at the context and returns None when it holds, or a sentence saying what is wrong.
Check = Callable[["Context"], "str | None"]


@dataclass
class Context:
    """What passes share: the graph, the target, and what earlier passes made of them."""

    graph: gs.Graph
    report: Report = field(default_factory=Report)
    target: "Target | None" = None
    # fusion groups found by the fuse-patterns pass
    fusions: list[FusionGroup] = field(default_factory=list)
    # the quantization plan made by the annotate pass, filled in by calibration
    plan: QuantPlan | None = None
    # model-level fields of the input (doc string, metadata) carried to the exported model
    template: onnx.ModelProto | None = None
    # the exported model, made from the graph by the export passes
    model: onnx.ModelProto | None = None
    # side files emitted by the target, keyed by the suffix appended to the output's stem (".calib.cache")
    side_files: dict[str, bytes] = field(default_factory=dict)
    # the model as given (a path or the caller's ModelProto): a failing check of the output is blamed on it when it
    # fails the check too, which is looked at only then
    input_model: "onnx.ModelProto | str | os.PathLike | None" = None

    def node_count(self) -> int:
        return len(self.model.graph.node) if self.model is not None else len(self.graph.nodes)


@dataclass
class PassResult:
    modified: bool
    notes: list[str] = field(default_factory=list)


class Pass:
    """One graph rewrite or analysis. Subclasses set `name` and implement `run`."""

    name: str = "pass"
    requires: Sequence[Check] = ()
    ensures: Sequence[Check] = ()

    def run(self, ctx: Context) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError


class FixedPoint(Pass):
    """Runs a group of passes again and again until none of them changes the graph."""

    def __init__(self, name: str, passes: Sequence[Pass], max_rounds: int = 8):
        self.name = name
        self.passes = list(passes)
        self.max_rounds = max_rounds

    def run(self, ctx: Context) -> PassResult:
        any_change = False
        notes: list[str] = []
        for _ in range(self.max_rounds):
            round_change = False
            for p in self.passes:
                result = _run_checked(p, ctx)
                round_change |= result.modified
                notes.extend(result.notes)
            any_change |= round_change
            if not round_change:
                break
        return PassResult(any_change, notes)


def _run_checked(p: Pass, ctx: Context) -> PassResult:
    for check in p.requires:
        problem = check(ctx)
        if problem:
            raise PassError(f"pass '{p.name}' cannot run: {problem}", p.name)
    try:
        result = p.run(ctx)
    except (OqError, InternalError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise PassError(f"pass '{p.name}' failed: {type(exc).__name__}: {exc}", p.name) from exc
    if not isinstance(result, PassResult):
        raise PassError(f"pass '{p.name}' returned {type(result).__name__}, expected PassResult", p.name)
    for check in p.ensures:
        problem = check(ctx)
        if problem:
            raise PassError(f"pass '{p.name}' broke its promise: {problem}", p.name)
    return result


class PassManager:
    """Runs passes in order, timing each and recording it in the report."""

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)

    def run(self, ctx: Context) -> Context:
        for p in self.passes:
            nodes_before = ctx.node_count()
            start = time.perf_counter()
            result = _run_checked(p, ctx)
            elapsed = time.perf_counter() - start
            ctx.report.passes.append(PassRecord(p.name, result.modified, elapsed, nodes_before, ctx.node_count(),
                                                list(result.notes)))
        return ctx


# Checks shared by several passes.
def no_op(op_type: str) -> Check:
    def check(ctx: Context) -> str | None:
        left = [n.name for n in ctx.graph.nodes if n.op == op_type]
        return f"{len(left)} {op_type} node(s) remain ({', '.join(left[:3])})" if left else None
    check.__name__ = f"no_{op_type}"
    return check


def unique_node_names(ctx: Context) -> str | None:
    seen: set[str] = set()
    for n in ctx.graph.nodes:
        if not n.name or n.name in seen:
            return f"node names are not unique/non-empty (e.g. {n.name!r})"
        seen.add(n.name)
    return None


def has_target(ctx: Context) -> str | None:
    return None if ctx.target is not None else "no target set"


def has_plan(ctx: Context) -> str | None:
    return None if ctx.plan is not None else "no quantization plan (run the annotate pass first)"


def has_model(ctx: Context) -> str | None:
    return None if ctx.model is not None else "no exported model (run the export-graph pass first)"

"""Quantize to an accuracy goal: keep the fewest nodes in float that bring the model output SQNR up to --min-sqnr.

The nodes are ranked by `oq analyze`'s layerwise numbers (one quantization, one run per node); oq.analysis.search
then picks the set, each evaluation being one quantization with those nodes excluded and one run over the
evaluation data. Results go to the --state file as they come, so a killed search resumes without re-measuring.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ..api import QuantResult, _load, _resolve_target, run as quantize_run
from ..config import RunConfig, keyword_names
from ..emit import SIDE_FILE_SUFFIX
from ..errors import OqError
from ..outputs import OutputPlan, calibration_files
from ..record import target_hash
from .evaldata import Evaluator, split
from .files import check_outputs
from .latency import RUNS, median_ms
from .parallel import check_jobs
from .run import analyze_config
from .search import Excluded, key, search
from .state import Measured, RankedNode, SearchState, digest

MAX_PRUNING = 8  # evaluations spent, at most, putting nodes back after the prefix search
# options that change how the work runs, not its numbers (the state file is valid across them)
_EXECUTION_ONLY = ("batch_size", "max_memory_mb", "progress", "calib")


@dataclass
class FloatNode:
    name: str
    op: str
    layerwise_sqnr_db: float | None  # None: exact


@dataclass
class GoalRecord:
    """What --min-sqnr found, in the run report (`report.goal`). dB values of None mean exact (no error)."""

    goal_db: float
    achieved_db: float | None
    quantized_db: float | None  # nothing kept in float by the search
    measured_on: str
    float_nodes: list[FloatNode]  # kept in float, worst layerwise first
    naive_float_nodes: int  # the smallest prefix of the ranking that meets the goal, before pruning
    ranked_nodes: int  # nodes reading quantized inputs with nothing excluded: the candidates
    evaluations: int  # quantization + evaluation run, each for one set of float nodes (the ranking not counted)
    pruning_evaluations: int
    reused: int  # of the evaluations, read back from the state file
    quantized_before: int
    quantized_after: int
    planned_nodes: int
    only_float: bool  # nothing is left quantized: only the float model meets the goal
    latency_ms: dict = field(default_factory=dict)  # {"fp32": ms, "quantized": ms} in onnxruntime, when measured
    latency_note: str = ""
    state: str | None = None

    def summary(self) -> str:
        return summary(self)


def _db(value: float | None) -> float | None:
    return None if value is not None and math.isinf(value) and value > 0 else value


def check_goal(value, flag: str = "--min-sqnr (min_sqnr)") -> float:
    """A goal in dB: a finite number above 0 (text from the command line is parsed here, so errors are one line)."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise OqError(f"{flag}: must be a number of dB above 0 (output SQNR against fp32), got {value!r}")
    return float(number)


def exclude_pattern(name: str) -> str:
    """An --exclude entry matching the node called `name` and nothing else: patterns also match op types and, as
    regexes, other names, so the name is escaped and grouped (no op type or plain name looks like that)."""
    return f"(?:{re.escape(name)})"


def quantize_to_goal(model, min_sqnr: float, target="tensorrt", calib=None, *, eval=None,
                     eval_size: int | None = None, state: "str | os.PathLike | None" = None,
                     max_pruning: int = MAX_PRUNING, output: "str | os.PathLike | None" = None,
                     jobs: int | None = None, **options) -> QuantResult:
    """oq.quantize(model, target, calib, **options) keeping in float the fewest nodes that bring the model output
    SQNR against fp32 (all outputs together) to `min_sqnr` dB, measured on `eval` (None: the last quarter of the
    calibration samples, held back from calibration). `state`: a JSON file keeping the search's results, so a rerun
    resumes. `jobs`: worker processes for the layerwise ranking (None: one per usable CPU when it is long enough to
    gain; 1: in this process).
    Returns the QuantResult of the chosen exclusions, its `report.goal` a GoalRecord; with `output`, saved."""
    unknown = sorted(set(options) - set(keyword_names()))
    if unknown:
        raise OqError(f"quantize_to_goal: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    config = RunConfig(target=target, calib=calib, **options)
    result = goal_config(model, config, min_sqnr, eval, eval_size=eval_size, state=state, max_pruning=max_pruning,
                         output=output, jobs=jobs)
    if output is not None:
        result.save(output)
    return result


def goal_config(model, config: RunConfig, min_sqnr, eval_data=None, *, eval_size: int | None = None,
                state: "str | os.PathLike | None" = None, max_pruning: int = MAX_PRUNING,
                output: "str | os.PathLike | None" = None, report: "str | os.PathLike | None" = None,
                jobs: int | None = None) -> QuantResult:
    """The search for a RunConfig; `output` and `report`, the paths the caller will save to, are checked first."""
    goal = check_goal(min_sqnr)
    jobs = check_jobs(jobs)
    if isinstance(max_pruning, bool) or not isinstance(max_pruning, int) or max_pruning < 0:
        raise OqError(f"--prune-evals (max_pruning): must be an integer >= 0, got {max_pruning!r}")
    if config.export_format != "qdq":
        raise OqError("--min-sqnr measures Q/DQ models: leave --format at qdq")
    tgt = _resolve_target(config)
    proto, _, model_files = _load(model)
    inputs = model_files + calibration_files(config.calib) + calibration_files(eval_data)
    if output is not None:
        suffixes = [SIDE_FILE_SUFFIX[side] for side in tgt.side_files]
        OutputPlan(Path(output), inputs, suffixes, Path(report) if report else None).validate()
    check_outputs({"--state file": state, "output (-o)": output, "report": report}, inputs)
    data = split(config, proto, eval_data, eval_size)
    evaluator = Evaluator(proto, data.eval_feeds, config.batch_size, config.progress)
    book = SearchState.open(state, _run_key(proto, model_files, data.config, tgt, data.data_hash))
    source = model if not isinstance(model, onnx.ModelProto) else proto
    if book.ranking is None:
        analysis = analyze_config(source, data.config, data.eval_feeds, layerwise=True, jobs=jobs)
        book.set_ranking([RankedNode(n.name, n.op, n.layerwise_sqnr_db) for n in analysis.nodes])
    ranking = book.ranking
    session = _Session(source, data.config, evaluator, book)
    outcome = search([r.name for r in ranking], goal, session.sqnr_of, max_pruning)
    chosen = key(outcome.excluded)
    result = session.last[1] if session.last and session.last[0] == chosen else session.quantize(chosen)
    ops = {r.name: r for r in ranking}
    before, after = book.results[()], book.results[chosen]
    record = GoalRecord(
        goal_db=goal, achieved_db=_db(outcome.sqnr_db), quantized_db=_db(before.sqnr_db),
        measured_on=data.description,
        float_nodes=[FloatNode(n, ops[n].op, _db(ops[n].layerwise_sqnr_db)) for n in outcome.excluded],
        naive_float_nodes=outcome.naive, ranked_nodes=len(ranking), evaluations=outcome.evaluations,
        pruning_evaluations=outcome.pruning_evaluations, reused=outcome.evaluations - session.measured,
        quantized_before=before.quantized_nodes, quantized_after=after.quantized_nodes,
        planned_nodes=before.planned_nodes, only_float=after.quantized_nodes == 0,
        state=None if state is None else str(state))
    _time(record, tgt.name, proto, result.model, evaluator.batches[0])
    result.report.goal = record
    return result


def _time(record: GoalRecord, target: str, fp32: onnx.ModelProto, quantized: onnx.ModelProto, batch) -> None:
    """Latency in onnxruntime, only where the target's models are meant to run there."""
    if target != "onnxruntime":
        record.latency_note = f"not measured: target {target} does not run in onnxruntime"
        return
    count, feed = batch
    record.latency_ms = {"fp32": median_ms(fp32, feed), "quantized": median_ms(quantized, feed)}
    record.latency_note = f"onnxruntime CPU, one batch of {count}, median of {RUNS} runs after a warm-up"


class _Session:
    """Measures sets of float nodes for the search, reading known results from the state file first."""

    def __init__(self, model, config: RunConfig, evaluator: Evaluator, book: SearchState):
        self.model, self.config, self.evaluator, self.book = model, config, evaluator, book
        self.measured = 0
        self.last: tuple[Excluded, QuantResult] | None = None  # the latest quantization, reused when it is chosen

    def quantize(self, excluded: Excluded) -> QuantResult:
        exclude = self.config.exclude + tuple(exclude_pattern(n) for n in excluded)
        return quantize_run(self.model, dataclasses.replace(self.config, exclude=exclude))

    def sqnr_of(self, excluded: Excluded) -> float:
        known = self.book.results.get(excluded)
        if known is not None:
            return known.sqnr_db
        return self.measure(excluded)

    def measure(self, excluded: Excluded) -> float:
        result = self.quantize(excluded)
        sqnr = self.evaluator.sqnr(result.model, f"min-sqnr: measuring with {len(excluded)} nodes in float")
        report = result.report
        self.book.record(excluded, Measured(sqnr, len(report.quantized_nodes), len(report.nodes)))
        self.measured += 1
        self.last = (excluded, result)
        return sqnr


def _run_key(proto: onnx.ModelProto, files: list[Path], config: RunConfig, tgt, data_hash: dict) -> str:
    """What the numbers depend on: the model, the options (those that change results), the target's spec, the data
    and oq's version."""
    from .. import __version__

    h = hashlib.sha256()
    if files:
        for path in files:
            h.update(Path(path).read_bytes())
    else:
        h.update(proto.SerializeToString(deterministic=True))
    options = {k: v for k, v in config.as_dict().items() if k not in _EXECUTION_ONLY}
    options["target"] = f"{tgt.name}:{target_hash(tgt)}"
    return digest({"oq": __version__, "model": h.hexdigest(), "options": options, "data": data_hash})


def _fmt(value: float | None) -> str:
    return "exact" if value is None else f"{value:.2f} dB"


def summary(g: GoalRecord) -> str:
    lines = [f"--min-sqnr {g.goal_db:g}: measured on {g.measured_on}",
             f"goal {g.goal_db:.2f} dB met: {_fmt(g.achieved_db)} (fully quantized: {_fmt(g.quantized_db)})"]
    if not g.float_nodes:
        lines.append("kept in float: none (the fully quantized model meets the goal)")
    else:
        lines.append(f"kept in float ({len(g.float_nodes)} of the {g.ranked_nodes} ranked nodes): "
                     + ", ".join(f"{n.name} ({n.op})" for n in g.float_nodes))
        lines.append(f"  dropping the worst layerwise nodes needs {g.naive_float_nodes} in float; pruning put "
                     f"{g.naive_float_nodes - len(g.float_nodes)} back ({g.pruning_evaluations} evaluations)")
    if g.only_float:
        lines.append("only the float model meets the goal: nothing is left quantized")
    share = (lambda k: f"{k} of {g.planned_nodes} ({100 * k / g.planned_nodes:.0f} %)") if g.planned_nodes else str
    lines.append(f"quantized nodes (fused ops included): {share(g.quantized_after)}, fully quantized "
                 f"{share(g.quantized_before)}")
    reused = f", {g.reused} read from the state file" if g.reused else ""
    lines.append(f"evaluations: {g.evaluations} (one quantization and one run each{reused}) for {g.ranked_nodes} "
                 f"ranked nodes (those reading quantized inputs; ranking them: one quantization, one run per node)")
    if g.latency_ms:
        lines.append(f"latency: fp32 {g.latency_ms['fp32']:.2f} ms, quantized {g.latency_ms['quantized']:.2f} ms "
                     f"({g.latency_note})")
    else:
        lines.append(f"latency: {g.latency_note}")
    return "\n".join(lines)


__all__ = ["quantize_to_goal", "goal_config", "GoalRecord", "FloatNode", "check_goal", "exclude_pattern", "summary"]

"""The `oq` command line. User-fixable problems print one `oq: error: ...` line and exit with code 2."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import traceback
from pathlib import Path

from .config import CPU_CHOICES, RunConfig
from .errors import InternalError, OqError


def _quantize_options(p: argparse.ArgumentParser) -> None:
    """The options that shape a quantization, shared by `oq run` and `oq analyze`."""
    p.add_argument("--target", "-t", default="tensorrt", help="built-in target name or a target .toml file")
    p.add_argument("--calib", "-c", required=True,
                   help=".npz of stacked samples, a folder of .npz feeds or of images, module:function, or random")
    p.add_argument("--preprocess", help="for image folders: resize=256,crop=224,scale=1/255,"
                   "mean=0.485/0.456/0.406,std=0.229/0.224/0.225,order=rgb,layout=nchw")
    p.add_argument("--batch-size", type=int, default=16, help="samples per onnxruntime call (default 16)")
    p.add_argument("--calib-size", type=int, help="use at most this many calibration samples")
    p.add_argument("--calib-method", metavar="METHOD",
                   help="observer for activations: minmax, ema, percentile, entropy, mse, or one registered by a "
                        "--plugin (default: the target's)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it may register observers with oq.register_observer); repeatable")
    p.add_argument("--percentile", type=float, help="for --calib-method percentile (default 99.99)")
    p.add_argument("--max-memory", type=float, metavar="MB",
                   help="bound on observed activations held per batch; more passes over the data if needed")
    p.add_argument("--exclude", action="append", default=[],
                   help="keep nodes in float: node name, op type or regex over node names (repeatable)")
    p.add_argument("--weight-bits", type=int, metavar="N", help="N-bit weights (2..16)")
    p.add_argument("--act-bits", type=int, metavar="N", help="N-bit activations (2..16)")
    p.add_argument("--override", action="append", default=[], metavar="NODE_OR_OP=SPEC",
                   help="change the spec on some nodes, e.g. Conv=weight.granularity:per_tensor or "
                        "head=dtype:uint8,symmetric:false (repeatable)")
    p.add_argument("--cpu", choices=CPU_CHOICES, default="auto",
                   help="deployment CPU for the onnxruntime target: without VNNI (avx2, avx512) weight channels "
                        "whose int16 product pairs saturate get coarser scales (down to 7 bits); a model made for "
                        "avx2 is safe everywhere (default: auto, this machine)")
    p.add_argument("--equalize", action=argparse.BooleanOptionalAction, default=None,
                   help="cross-layer equalization before quantizing (default: as the target says; on for vitis and "
                        "qnn, whose weights are per tensor)")
    p.add_argument("--algo", metavar="ALGO",
                   help="weight rounding: rtn (round to nearest, default); adaround (learned per layer), brecq "
                        "(learned per block, with activation steps), qdrop (brecq with random dropping of "
                        "activation quantization); learned from the calibration data, needs torch: "
                        "pip install 'oq-quant[torch]'. Combine with smoothquant and bias-correction using '+', "
                        "e.g. smoothquant+qdrop+bias-correction")
    p.add_argument("--device", default="cpu", help="where --algo adaround/brecq/qdrop runs: cpu (default) or cuda")
    p.add_argument("--algo-iters", type=int, metavar="N",
                   help="--algo: optimisation steps per layer (adaround, default 1000) or per block (brecq, "
                        "qdrop, default 500)")
    p.add_argument("--smoothquant-alpha", type=float, metavar="A",
                   help="--algo smoothquant: migration strength, 0 < A < 1 (default: searched per layer over "
                        "0.3..0.8)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oq", description="ONNX-graph-first post-training quantizer")
    p.add_argument("--debug", action="store_true", help="on an internal error, show the traceback")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="quantize a model for a target")
    run.add_argument("model", help="input .onnx model (never modified)")
    _quantize_options(run)
    run.add_argument("-o", "--output", required=True, help="output .onnx (written atomically)")
    run.add_argument("--report", help="also write the run report as JSON here")
    run.add_argument("--format", choices=["qdq", "qoperator"], default="qdq",
                     help="qoperator: QLinearConv/QLinearMatMul... as onnxruntime fuses them (onnxruntime target)")
    run.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no report table")
    run.add_argument("--min-sqnr", metavar="DB",
                     help="accuracy goal: keep in float the fewest nodes (ranked by oq analyze's layerwise numbers) "
                          "that bring the model output SQNR against fp32 to DB")
    run.add_argument("--eval", help="with --min-sqnr: data to measure on, in the forms --calib takes (default: the "
                                    "last quarter of the calibration samples, then not calibrated on)")
    run.add_argument("--eval-size", type=int, metavar="N", help="with --eval: use at most N evaluation samples")
    run.add_argument("--state", metavar="FILE",
                     help="with --min-sqnr: JSON file keeping the search's results, updated after each evaluation; "
                          "a rerun with it resumes without measuring again")
    run.add_argument("--prune-evals", type=int, default=8, metavar="K",
                     help="with --min-sqnr: at most K evaluations trying to put float nodes back (default 8)")
    run.add_argument("--jobs", "-j", metavar="N",
                     help="with --min-sqnr: worker processes for the layerwise ranking (default: one per usable CPU, "
                          "when the sweep is long enough to gain; 1: no workers)")

    an = sub.add_parser("analyze", help="quantize as `oq run` would, then rank the tensors and nodes by the error "
                                         "they cause")
    an.add_argument("model", help="input .onnx model (never modified)")
    _quantize_options(an)
    an.add_argument("--eval", help="evaluation data, in the forms --calib takes (default: the calibration samples)")
    an.add_argument("--eval-size", type=int, metavar="N", help="use at most N evaluation samples")
    an.add_argument("-o", "--output", help="write the HTML report here (needs matplotlib)")
    an.add_argument("--json", help="write the numbers as JSON here")
    an.add_argument("--top", type=int, default=20, metavar="N", help="nodes listed in the summary (default 20)")
    an.add_argument("--no-layerwise", dest="layerwise", action="store_false",
                    help="skip the per-node runs (one model run per quantized node)")
    an.add_argument("--jobs", "-j", metavar="N",
                    help="worker processes for the per-node runs (default: one per usable CPU, when the sweep is long "
                         "enough to gain; 1: no workers)")
    an.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    an.set_defaults(format="qdq")

    tg = sub.add_parser("targets", help="list built-in targets, or show one")
    tg.add_argument("action", nargs="?", choices=["show"])
    tg.add_argument("name", nargs="?")

    ins = sub.add_parser("inspect", help="summarise a model: ops, inputs/outputs, opset, quantized nodes")
    ins.add_argument("model")
    ins.add_argument("--saturation", action="store_true",
                     help="u8 x s8 int16 pair saturation per layer (onnxruntime on x86 without VNNI): analytic worst "
                          "case, or emulated on --calib data")
    ins.add_argument("--calib", help="with --saturation: .npz (or folder) of inputs to emulate the layers on")
    return p


def _config(args) -> RunConfig:
    return RunConfig(target=args.target, calib=args.calib, batch_size=args.batch_size, calib_size=args.calib_size,
                     calib_method=args.calib_method, percentile=args.percentile, max_memory_mb=args.max_memory,
                     preprocess=args.preprocess, exclude=args.exclude, overrides=args.override,
                     weight_bits=args.weight_bits, act_bits=args.act_bits, cpu=args.cpu, equalize=args.equalize,
                     export_format=args.format, progress=False if args.quiet else None, plugins=args.plugin,
                     algo=args.algo, device=args.device, algo_iters=args.algo_iters,
                     smoothquant_alpha=args.smoothquant_alpha)


def _run(args) -> int:
    from .api import run

    if args.min_sqnr is not None:
        return _run_to_goal(args)
    for flag, value in (("--eval", args.eval), ("--eval-size", args.eval_size), ("--state", args.state),
                        ("--jobs", args.jobs)):
        if value is not None:
            raise OqError(f"{flag} goes with --min-sqnr")
    # every output path is checked before any work: a run never fails after writing, nor writes over an input
    result = run(args.model, _config(args), output=args.output, report=args.report)
    if args.interrupted:  # a Ctrl-C that Python swallowed (e.g. inside a weakref callback): write nothing
        raise KeyboardInterrupt
    result.save(args.output, report=args.report)
    for warning in result.report.warnings:
        print(f"oq: warning: {warning}", file=sys.stderr)
    if not args.quiet:
        print(result.report.format_table())
        print(f"\nwrote {args.output}")
    return 0


def _run_to_goal(args) -> int:
    from .analysis.fallback import check_goal, goal_config
    from .analysis.parallel import check_jobs

    goal = check_goal(args.min_sqnr, "--min-sqnr")
    jobs = check_jobs(args.jobs, "--jobs")
    # checked before any work, as `oq run` does: the outputs, the state file, and the goal itself
    result = goal_config(args.model, _config(args), goal, args.eval, eval_size=args.eval_size, state=args.state,
                         max_pruning=args.prune_evals, output=args.output, report=args.report, jobs=jobs)
    if args.interrupted:
        raise KeyboardInterrupt
    result.save(args.output, report=args.report)
    for warning in result.report.warnings:
        print(f"oq: warning: {warning}", file=sys.stderr)
    if not args.quiet:
        print(result.report.format_table() + "\n")
    print(result.report.goal.summary())
    print(f"\nwrote {args.output}")
    return 0


def _analyze(args) -> int:
    from .analysis.files import check_outputs, write_outputs
    from .analysis.parallel import check_jobs
    from .analysis.plots import pyplot
    from .analysis.run import analyze_config
    from .outputs import calibration_files

    if args.top < 1:
        raise OqError(f"--top must be >= 1, got {args.top}")
    jobs = check_jobs(args.jobs, "--jobs")
    if args.output:
        pyplot()  # before any work: the HTML report cannot be made without matplotlib
    config = _config(args)
    # checked before any work: the model, calibration and evaluation files are never written over
    reports = {"HTML report (-o)": args.output, "JSON report (--json)": args.json}
    inputs = [Path(args.model)] + calibration_files(args.calib) + calibration_files(args.eval)
    check_outputs(reports, inputs)
    analysis = analyze_config(args.model, config, args.eval, layerwise=args.layerwise, eval_size=args.eval_size,
                              jobs=jobs)
    if args.interrupted:
        raise KeyboardInterrupt
    files = {}
    if args.output:
        files[args.output] = analysis.to_html_text().encode()
    if args.json:
        files[args.json] = analysis.to_json_text().encode()
    write_outputs(files)
    print(analysis.summary(args.top))
    for path in files:
        print(f"wrote {path}")
    return 0


def _targets(args) -> int:
    from .target import builtin_names, load_target

    if args.action == "show":
        if not args.name:
            raise OqError("usage: oq targets show NAME")
        print(load_target(args.name).describe())
        return 0
    for name in builtin_names():
        print(f"{name:<14} {load_target(name).summary()}")
    return 0


def _inspect(args) -> int:
    from .describe import describe
    from .ir import load_model

    model = load_model(args.model)
    if args.calib and not args.saturation:
        raise OqError("--calib is used with --saturation")
    if args.saturation:
        from .data import model_inputs, open_calibration
        from .saturation import inspect_saturation

        feeds = None
        if args.calib:
            data = open_calibration(args.calib, model_inputs(model), 32)
            feeds = [feed for _, feed in data.batches(16)]
        print(f"model {args.model}")
        print(inspect_saturation(model, feeds))
        return 0
    print(describe(model, args.model))
    return 0


def _watch_interrupts(args):
    """Remember every Ctrl-C, so one that Python discards on its way (exceptions in some callbacks are only
    printed) still stops the run before it writes."""
    args.interrupted = []
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigint(signum, frame):
        args.interrupted.append(signum)
        raise KeyboardInterrupt

    return signal.signal(signal.SIGINT, on_sigint)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    previous_handler = _watch_interrupts(args)
    try:
        status = {"run": _run, "analyze": _analyze, "targets": _targets, "inspect": _inspect}[args.command](args)
        if args.interrupted:
            raise KeyboardInterrupt
        return status
    except OqError as exc:
        print(f"oq: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `oq targets show X | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("oq: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in oq, not the user's input
        if args.debug:
            traceback.print_exc()
        where = f" in pass '{exc.pass_name}'" if isinstance(exc, InternalError) and exc.pass_name else ""
        detail = str(exc) if isinstance(exc, InternalError) else f"{type(exc).__name__}: {exc}"
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(f"oq: internal error{where}: {detail.splitlines()[0] if detail else ''}\n"
              f"oq: this is a bug in oq, not a problem with your input{hint}", file=sys.stderr)
        return 1
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)


if __name__ == "__main__":
    sys.exit(main())

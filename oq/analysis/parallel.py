"""The layerwise sweep on local worker processes (--jobs N).

Each node's run is independent of every other node's, so nodes are handed out by index to N processes that each
received the models and the evaluation data once (the pool's initializer). Workers are started with 'spawn':
onnxruntime is not fork-safe once sessions exist. Each runs its sessions on cpus // N intra-op threads, so together
they use the machine once rather than N times. A node's numbers come from one worker walking the batches in the
serial order (oq.analysis.measure.node_stats), so they equal the serial run's to the bit.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from .. import ir
from ..errors import OqError
from ..runtime import PROVIDERS, options
from .quantizers import Quantizer
from .stats import ErrorStats
from .variants import single_node

# what a worker process holds for its whole life, set once by its pool's initializer (never set in the caller)
_worker: dict = {}


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def check_jobs(value, flag: str = "--jobs (jobs)") -> int | None:
    """Worker processes for the layerwise sweep: an integer >= 1, or None (automatic: one per usable CPU when the
    sweep is long enough to gain, see oq.analysis.measure.layerwise). Text from the command line is parsed here, so
    errors are one line."""
    if value is None:
        return None
    number = value
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number < 1:
        raise OqError(f"{flag}: must be an integer >= 1 (worker processes; 1 runs in this process), got {value!r}")
    return int(number)


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    """As oq.runtime.session(model, "disable"), on `threads` intra-op threads."""
    so = options("disable")
    so.intra_op_num_threads = threads
    if ir.model_size(model) > ir.EXTERNAL_DATA_THRESHOLD:
        with tempfile.TemporaryDirectory(prefix="oq-session-") as tmp:
            path = ir.save_model(model, Path(tmp) / "model.onnx", external_data=True)
            return ort.InferenceSession(str(path), so, providers=PROVIDERS)
    return ort.InferenceSession(model.SerializeToString(), so, providers=PROVIDERS)


def _shipped(model: onnx.ModelProto, folder: Path, name: str) -> "bytes | str":
    """The model as a worker can receive it: its bytes, or past the protobuf limit a file with external data."""
    if ir.model_size(model) > ir.EXTERNAL_DATA_THRESHOLD:
        return str(ir.save_model(model, folder / f"{name}.onnx", external_data=True))
    return model.SerializeToString()


def _received(model: "bytes | str") -> onnx.ModelProto:
    return onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)


def _start(twin, quantized, quantizers, nodes, batches, fp32, threads) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the caller stops the pool
    _worker.update(twin=_received(twin), quantized=_received(quantized), quantizers=quantizers, nodes=nodes,
                   batches=batches, fp32=fp32, threads=threads)


def _measure(index: int) -> ErrorStats:
    from .measure import node_stats

    w = _worker
    node = w["nodes"][index]
    try:
        variant = _session(single_node(w["twin"], w["quantized"], node, w["quantizers"]), w["threads"])
        return node_stats(variant, w["batches"], w["fp32"])
    except OqError:
        raise
    except Exception as exc:  # one line naming the node: the traceback lives in another process
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise OqError(f"layerwise run of node {node}: {type(exc).__name__}: {detail}") from None


def _stop(pool: ProcessPoolExecutor) -> None:
    """Drop the queued nodes and end the workers now, mid-run included (Ctrl-C, an error)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5)


def sweep(twin: onnx.ModelProto, quantized: onnx.ModelProto, quantizers: list[Quantizer], nodes: list[str],
          batches: list, fp32: list[dict[str, np.ndarray]], jobs: int, on_node) -> dict[str, ErrorStats]:
    """Per node, ErrorStats of the model outputs with only that node quantized, on min(jobs, len(nodes)) processes;
    `on_node(name)` is called in the caller as each result arrives. Returned in the order of `nodes`."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise OqError("--jobs (jobs): worker processes re-run the calling script; put the call under "
                      "`if __name__ == '__main__':`, or pass jobs=1")
    workers = min(jobs, len(nodes))
    threads = max(1, usable_cpus() // workers)
    out: dict[str, ErrorStats] = {}
    with tempfile.TemporaryDirectory(prefix="oq-jobs-") as tmp:
        args = (_shipped(twin, Path(tmp), "twin"), _shipped(quantized, Path(tmp), "quantized"), quantizers, nodes,
                batches, fp32, threads)
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                                   initargs=args)
        try:
            futures = {pool.submit(_measure, index): index for index in range(len(nodes))}
            for future in as_completed(futures):
                node = nodes[futures[future]]
                try:
                    out[node] = future.result()
                except BrokenProcessPool:
                    raise OqError(f"layerwise: a worker process died while measuring node {node} (out of memory? "
                                  f"try fewer --jobs)") from None
                on_node(node)
        except BaseException:
            _stop(pool)
            raise
        pool.shutdown()
    return {node: out[node] for node in nodes}

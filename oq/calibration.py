"""Streaming calibration: one onnxruntime session, each batch reduced into observers, nothing else kept."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from tqdm import tqdm

from . import runtime
from .data import CalibrationData
from .errors import OqError
from .observers import Observer
from .probes import add_probes, deliver, plan_probes


def _session(model: onnx.ModelProto, workdir: Path) -> ort.InferenceSession:
    # onnxruntime's default (highest) level, as the model will run: its blocked NCHWc convolutions are about twice
    # as fast here, and the probes pool on the blocked layout, so only their small outputs are reordered.
    # No memory pattern: it reserves a block for the whole plan on top of the arena; without it calibration ran at
    # the same speed with about half the peak memory (mobilenet_mini at 224x224, batch 16).
    return runtime.session(model, "all", mem_pattern=False)


def feed_symbols(input_types: dict, feed: dict[str, np.ndarray]) -> dict[str, int]:
    """Symbolic dims of the graph inputs (name -> TypeProto.Tensor) resolved to the sizes in a feed."""
    symbols: dict[str, int] = {}
    for name, tt in input_types.items():
        if name in feed:
            for d, size in zip(tt.shape.dim, feed[name].shape):
                if d.dim_param:
                    symbols[d.dim_param] = size
    return symbols


def _elements_per_sample(model: onnx.ModelProto, names: list[str], feed: dict[str, np.ndarray]) -> dict[str, int]:
    """Estimated elements of each tensor for one sample, from inferred shapes with symbolic dims resolved from a
    feed; unknown dims count as 1 (an underestimate only for data-dependent shapes)."""
    dims = feed_symbols({vi.name: vi.type.tensor_type for vi in model.graph.input}, feed)
    batch_dims = {vi.type.tensor_type.shape.dim[0].dim_param for vi in model.graph.input
                  if vi.type.tensor_type.shape.dim and vi.type.tensor_type.shape.dim[0].dim_param}
    shapes = {vi.name: vi.type.tensor_type.shape.dim for vi in model.graph.value_info}
    out = {}
    for name in names:
        n = 1
        for d in shapes.get(name, []):
            if d.HasField("dim_value"):
                n *= d.dim_value
            elif d.dim_param and d.dim_param not in batch_dims:
                n *= dims.get(d.dim_param, 1)
        out[name] = n
    return out


def plan_passes(sizes: dict[str, int], batch_size: int, max_bytes: int | None) -> list[list[str]]:
    """Split the observed tensors into groups whose fetched outputs fit in max_bytes (float32) for two batches:
    one is reduced while the next runs."""
    names = list(sizes)
    if not max_bytes:
        return [names]
    groups, current, used = [], [], 0
    for name in sorted(names, key=lambda n: -sizes[n]):
        need = sizes[name] * 4 * batch_size * 2
        if current and used + need > max_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += need
    if current:
        groups.append(current)
    return groups


class BoundRunner:
    """Runs the session into output buffers allocated once per input-shape signature and reused.

    Fetching many large intermediate tensors with session.run allocates (and page-faults) fresh memory for each
    batch, which costs several times the inference itself; binding reused buffers removes that cost. Buffers are
    sized from the inferred shapes when every dim resolves from the feed, else from a first plain run. Two sets
    alternate, so the outputs of one batch stay intact while the next one runs (the caller reduces batch k during
    run k + 1, and must be done with it before run k + 2). A new signature (inputs whose shapes vary per sample)
    replaces the buffers, so memory stays two batches' worth."""

    def __init__(self, session: ort.InferenceSession, model: onnx.ModelProto, names: list[str]):
        self.session, self.names = session, names
        self.signature = None
        self.buffers: list[np.ndarray] = []
        self.spare: list[np.ndarray] = []  # the other set
        self.dims = {vi.name: vi.type.tensor_type for vi in model.graph.value_info}
        self.inputs = {vi.name: vi.type.tensor_type for vi in model.graph.input}

    def _planned_buffers(self, feed: dict[str, np.ndarray]) -> list[np.ndarray] | None:
        symbols = feed_symbols(self.inputs, feed)
        buffers = []
        for name in self.names:
            if name in feed:
                buffers.append(feed[name])
                continue
            tt = self.dims.get(name)
            if tt is None or not tt.HasField("shape") or not tt.elem_type:
                return None
            shape = []
            for d in tt.shape.dim:
                if d.HasField("dim_value"):
                    shape.append(d.dim_value)
                elif d.dim_param in symbols:
                    shape.append(symbols[d.dim_param])
                else:
                    return None
            buffers.append(np.empty(shape, helper.tensor_dtype_to_np_dtype(tt.elem_type)))
        return buffers

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if all(name in feed for name in self.names):
            return [feed[name] for name in self.names]
        signature = tuple((k, v.shape, v.dtype.str) for k, v in sorted(feed.items()))
        if signature != self.signature:
            self.buffers, self.spare = [], []  # free the old ones before allocating new
            planned = self._planned_buffers(feed)
            if planned is None:
                outputs = self.session.run(self.names, feed)
                self.signature = signature
                self.buffers, self.spare = outputs, [np.empty_like(o) for o in outputs]  # written again in two runs
                return outputs
            self.signature, self.buffers, self.spare = signature, planned, self._planned_buffers(feed)
        else:
            self.buffers, self.spare = self.spare, self.buffers
        binding = self.session.io_binding()
        for k, v in feed.items():
            binding.bind_cpu_input(k, np.ascontiguousarray(v))
        for name, buf in zip(self.names, self.buffers):
            if name not in feed:  # a graph input passed through is read from the feed itself
                binding.bind_output(name, "cpu", element_type=buf.dtype, shape=buf.shape, buffer_ptr=buf.ctypes.data)
        self.session.run_with_iobinding(binding)
        return [feed[name] if name in feed else buf for name, buf in zip(self.names, self.buffers)]


class _FinalLine:
    """Progress for a stream that is not a terminal (a log file, a pipe): nothing while running, then one plain line
    per streaming pass, with no carriage returns and no padding."""

    def __init__(self, desc: str, stream):
        self.desc, self.stream, self.n, self.start = desc, stream, 0, time.perf_counter()

    def update(self, count: int) -> None:
        self.n += count

    def close(self) -> None:
        seconds = time.perf_counter() - self.start
        rate = f" ({self.n / seconds:.0f} samples/s)" if seconds > 0 and self.n else ""
        self.stream.write(f"{self.desc}: {self.n} samples in {seconds:.2f}s{rate}\n")
        self.stream.flush()


class _NoProgress:
    def update(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


def _isatty(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress_reporter(progress: "bool | str | None", desc: str, total: int | None):
    """What shows calibration progress on sys.stderr (looked up now, so a redirected stderr is honoured).

    progress: None or "auto" (the default): a live tqdm bar when stderr is a terminal, else nothing at all.
    True: always report; a live bar on a terminal, else a single final line per streaming pass (no carriage
    returns). False: never. The live bar is cleared when it closes (leave=False)."""
    if progress is None or (isinstance(progress, str) and progress == "auto"):
        wanted = None
    elif isinstance(progress, (bool, np.bool_)):
        wanted = bool(progress)
    else:
        raise OqError(f"progress must be None or 'auto' (a bar on a terminal only), True or False, got {progress!r}")
    stream = sys.stderr
    if wanted is False or stream is None:
        return _NoProgress()
    if _isatty(stream):
        return tqdm(total=total, unit="sample", desc=desc, file=stream, leave=False, dynamic_ncols=True)
    return _FinalLine(desc, stream) if wanted else _NoProgress()


def observe(model: onnx.ModelProto, observers: dict[str, Observer], data: CalibrationData, batch_size: int = 1,
            progress: "bool | str | None" = None, max_memory_mb: float | None = None) -> dict:
    """Stream `data` through one onnxruntime session, updating observers[tensor] with every batch.

    With max_memory_mb, the observed tensors are split into groups whose outputs for one batch fit the budget, and
    the data is streamed once per group (observers see the same values either way). progress: None or "auto" (a
    bar only when stderr is a terminal), True (always: a bar on a terminal, one final line per pass otherwise) or
    False (never); see progress_reporter."""
    names = list(observers)
    start = time.perf_counter()
    probes = plan_probes(model, observers)
    with tempfile.TemporaryDirectory(prefix="oq-calib-") as workdir:
        try:
            session = _session(add_probes(model, probes), Path(workdir))
        except Exception as exc:
            raise OqError(f"onnxruntime cannot load the model for calibration: {str(exc).splitlines()[0][:300]}") from None
        groups = [names]
        if max_memory_mb:
            first = next(iter(data.samples()), None)
            if first is not None:
                sizes = _elements_per_sample(model, names, first)
                sizes.update({n: p.fetch_per_sample or 1 for n, p in probes.items() if p.kind != "full"})
                groups = plan_passes(sizes, batch_size, int(max_memory_mb * 2**20))
        samples = 0
        pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))
        for k, group in enumerate(groups):
            desc = "calibrating" if len(groups) == 1 else f"calibrating {k + 1}/{len(groups)}"
            bar = progress_reporter(progress, desc, len(data) or None)
            samples = 0
            fetch = list(dict.fromkeys(f for name in group for f in probes[name].fetch))
            runner = BoundRunner(session, model, fetch)
            pending: list = []
            for count, feed in data.batches(batch_size):
                try:
                    outputs = dict(zip(fetch, runner.run(feed)))
                except Exception as exc:
                    raise OqError(f"{data.where}: onnxruntime failed on samples {samples}..{samples + count - 1}: "
                                  f"{str(exc).splitlines()[0][:300]}") from None
                # The previous batch was reduced while this one ran (numpy releases the GIL in most of its work);
                # waiting here keeps one batch in flight, so an observer never sees two updates at once.
                for job in pending:
                    job.result()
                pending = [pool.submit(deliver, observers[name], probes[name], outputs) for name in group]
                del outputs
                samples += count
                bar.update(count)
            for job in pending:
                job.result()
            bar.close()
        pool.shutdown()
    return {"samples": samples, "tensors": len(names), "passes": len(groups),
            "seconds": time.perf_counter() - start}

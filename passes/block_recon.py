"""Reconstruct the quantized model block by block from calibration data (--algo brecq, --algo qdrop).

Runs after calibrate (and the saturation guard), before insert-qdq, so every target gets it. The graph is cut into
blocks where the fewest tensors cross (oq.blocks: residual blocks, inverted-residual blocks, attention and MLP
halves of a transformer layer, a few layers of a plain chain). Each block, in order, learns the rounding of its
weights and the step sizes of the activation quantizers inside it (oq.bridge.blockrecon) so that its output, fed
with what the already-reconstructed quantized blocks before it produce, matches the float block's output on the
float model's values. `qdrop` also drops activation quantization at random while learning (the QDrop paper's 0.5).

Write-back keeps the target's rules: weights become the dequantized grid points of the learned codes (insert-qdq
quantizes them back to exactly those codes, as for AdaRound); a learned activation scale replaces the calibrated one
for its whole scale-sharing group, zero-points stay, power-of-two grids stay powers of two, min_scale holds, and
int32 biases are derived from the new scales by insert-qdq as usual. The calibration chunks (16 samples each) are
split: an eighth of them (at least one) is held out, and each block keeps, of round-to-nearest, its learned rounding
with learned scales and its learned rounding with calibrated scales, whichever gives the lowest output error there.

Block inputs and outputs for every calibration chunk (float and quantized versions) are held by oq.spill: in memory
up to --max-memory (default 1024 MB) and in a temporary folder beyond it, so depth and sample count are bounded by
disk, not memory. Blocks are built as torch modules before any learning starts, so an op the torch bridge cannot run
is reported at once.
"""
from __future__ import annotations

import time

import numpy as np
import onnx_graphsurgeon as gs

from oq import ir
from oq.blocks import partition
from oq.calibration import progress_reporter
from oq.errors import OqError
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.plan import ALL_CONSUMERS
from oq.spec import quantize_array
from oq.spill import SpillStore

from .reconstruct import _grid_values, _nearest_range, capped_batches, explained_capture

DEFAULTS = {"brecq": dict(drop=0.0), "qdrop": dict(drop=0.5)}


class BlockReconstruction(Pass):
    name = "block-reconstruction"
    requires = (has_plan,)

    def __init__(self, data, algo: str = "qdrop", iters: int | None = None, device: str = "cpu",
                 max_samples: int = 256, chunk: int = 16, max_memory_mb: float | None = None,
                 block_layers: int = 2, max_layers: int = 4, progress=None, seed: int = 0, **settings):
        if algo not in DEFAULTS:
            raise OqError(f"unknown block reconstruction {algo!r}; choose {' or '.join(DEFAULTS)}")
        self.data, self.algo, self.device, self.seed = data, algo, device, seed
        self.iters, self.max_samples, self.chunk = iters, max_samples, chunk
        self.budget = int((1024.0 if max_memory_mb is None else max_memory_mb) * 2**20)
        self.block_layers, self.max_layers, self.progress = block_layers, max_layers, progress
        self.settings = {**DEFAULTS[algo], **settings}

    def run(self, ctx: Context) -> PassResult:
        from oq.bridge import require_torch

        require_torch()
        from oq.bridge import blockrecon, to_torch
        from oq.bridge.blockgraph import block_model

        settings = blockrecon.Settings(device=self.device, seed=self.seed, **self.settings,
                                       **({} if self.iters is None else {"iters": self.iters}))
        graph, plan = ctx.graph, ctx.plan
        weights, wpoints, notes = _weights(graph, plan)
        acts, apoints = _activations(graph, plan)
        record = {"algorithm": self.algo, "iterations": settings.iters, "drop": settings.drop,
                  "device": self.device, "blocks": [], "left_at_nearest": notes}
        if ctx.report is not None:
            ctx.report.calibration["reconstruction"] = record
        learnable = {n for (n, _), key in wpoints.items() if weights[key].learn}
        blocks = partition(graph, learnable, self.block_layers, self.max_layers)
        if not blocks:
            return PassResult(False, notes + ["no weight to reconstruct"])
        start = time.perf_counter()
        quant = blockrecon.Quantizers(weights, acts, set(acts) if settings.learn_scales else set(), self.device)
        model = ir.to_model(graph)
        modules = []
        for block in blocks:
            names = [n.name for n in block.nodes]
            inside = set(names)
            bact = {k: v for k, v in apoints.items() if k[0] in inside}
            bweight = {k: v for k, v in wpoints.items() if k[0] in inside}
            sub = block_model(model, names, block.inputs, block.outputs, bact, bweight)
            module = to_torch(sub, ops=quant.ops()).to(self.device)
            module.requires_grad_(False)
            modules.append((module, list(dict.fromkeys(bweight.values())), list(dict.fromkeys(bact.values()))))
        last_read = _last_reads(blocks)
        bar = progress_reporter(self.progress, f"{self.algo} ({len(blocks)} blocks)", len(blocks))
        with SpillStore(self.budget) as store:
            chunks = self._first_inputs(model, blocks, store)
            lines = []
            for k, (block, (module, wkeys, akeys)) in enumerate(zip(blocks, modules)):
                entry, line = self._block(k, block, module, wkeys, akeys, quant, store, chunks, settings,
                                          blockrecon)
                record["blocks"].append(entry)
                lines.append(line)
                bar.update(1)
                for name, last in last_read.items():
                    if last == k:
                        store.drop("fp:" + name)
                        store.drop("q:" + name)
            bar.close()
            record["peak_spilled_mb"] = round(store.peak_disk / 2**20, 3)
            record["peak_cached_mb"] = round(store.peak_memory / 2**20, 3)
        changed = _write_back(graph, plan, weights, acts, quant, record)
        record["seconds"] = round(time.perf_counter() - start, 3)
        kept = sum(1 for b in record["blocks"] if b["kept"] == "learned")
        head = (f"{self.algo}: {len(blocks)} blocks ({kept} improved), {settings.iters} steps each on {self.device}, "
                f"{changed['weights']} weights and {changed['scales']} activation scales rewritten, "
                f"{record['seconds']:.1f}s")
        return PassResult(bool(changed["weights"] or changed["scales"]), [head] + lines + notes)

    # -----------------------------------------------------------------------------------------------------------
    def _block(self, k, block, module, wkeys, akeys, quant, store, chunks, settings, blockrecon):
        """Targets, learning and the quantized outputs of block k; (report entry, note)."""
        float_out = [i for i, name in enumerate(block.outputs) if _is_float(store, name, chunks)]
        quant.mode = "float"
        for c in range(chunks):
            fp_in = [store.get("fp:" + n, c) for n in block.inputs]
            for name, value in zip(block.outputs, blockrecon.run_block(module, fp_in, self.device)):
                store.put("fp:" + name, c, value)

        def data(c):
            fp_in = [store.get("fp:" + n, c) for n in block.inputs]
            q_in = [store.get("q:" + n, c) if ("q:" + n, c) in store else fp_in[i]
                    for i, n in enumerate(block.inputs)]
            return fp_in, q_in, [store.get("fp:" + n, c) for n in block.outputs]

        float_out = float_out or list(range(len(block.outputs)))
        outcome = blockrecon.train_block(module, quant, wkeys, akeys, data, chunks, float_out, settings,
                                         self.seed + k)
        quant.mode = "hard"
        for c in range(chunks):
            _, q_in, _ = data(c)
            for name, value in zip(block.outputs, blockrecon.run_block(module, q_in, self.device)):
                store.put("q:" + name, c, value)
        n, lrn = outcome.loss_nearest, outcome.loss_learned
        gain = 10 * np.log10(n / lrn) if lrn > 0 and n > 0 else 0.0
        entry = {"block": k, "nodes": [x.name for x in block.nodes], "layers": block.layers,
                 "inputs": block.inputs, "outputs": block.outputs, "loss_nearest": n, "loss_learned": lrn,
                 "kept": "learned" if outcome.kept else "nearest", "scales_kept": outcome.scales_kept,
                 "validation_chunks": outcome.validation_chunks, "seconds": round(outcome.seconds, 3)}
        scales = "learned" if outcome.scales_kept else "calibrated"
        what = (f"loss {n:.4g} -> {lrn:.4g} ({gain:+.1f} dB, {scales} activation scales)" if outcome.kept else
                f"kept round-to-nearest (learned {lrn:.4g} vs {n:.4g})")
        return entry, f"block {k} ({len(block.layers)} layers, {block.name}): {what}, {outcome.seconds:.1f}s"

    def _first_inputs(self, model, blocks, store) -> int:
        """Capture, from the float model in onnxruntime, every block input no block produces; returns the number
        of chunks."""
        produced = {t for b in blocks for t in b.outputs} | {t.name for b in blocks for n in b.nodes
                                                            for t in n.outputs}
        names = list(dict.fromkeys(n for b in blocks for n in b.inputs if n not in produced))
        chunks = 0
        feeds = (feed for _, feed in capped_batches(self.data, self.chunk, self.max_samples))
        for values in explained_capture(model, names, feeds, self.data,
                                        "collecting block inputs for reconstruction"):
            for name in names:
                store.put("fp:" + name, chunks, np.asarray(values[name]))
            chunks += 1
        if chunks == 0:
            raise OqError("reconstruction needs calibration samples; the calibration data gave none")
        return chunks


# ---------------------------------------------------------------------------------------------------------------
def _weights(graph: gs.Graph, plan):
    """Every quantized integer-grid weight as a WeightPoint keyed by its tensor name, the (node, input) pairs
    reading it, and notes on those whose rounding stays at nearest."""
    from oq.bridge.blockrecon import WeightPoint

    tensors = graph.tensors()
    readers: dict[str, int] = {}
    for wq in plan.weights.values():
        readers[wq.tensor] = readers.get(wq.tensor, 0) + len(wq.consumers)
    weights, points, notes = {}, {}, []
    for wq in plan.weights.values():
        tensor, qp = tensors.get(wq.tensor), wq.qparams
        if qp is None or wq.spec.is_float or not isinstance(tensor, gs.Constant):
            if qp is not None and not wq.spec.is_float:
                notes.append(f"{wq.tensor}: not reconstructed (not an initializer)")
            continue
        w = np.asarray(tensor.values)
        if w.dtype.kind != "f" or w.size == 0:
            continue
        if wq.tensor in weights:  # the same tensor quantized for several layers with different grids
            notes.append(f"{wq.tensor}: left at round-to-nearest (several grids for one tensor)")
            weights[wq.tensor].learn = False
            continue
        plain = {(n.name, i) for n in tensor.outputs for i, t in enumerate(n.inputs) if t is tensor}
        learn = readers[wq.tensor] == 1 and plain == set(wq.consumers)
        if not learn:
            notes.append(f"{wq.tensor}: left at round-to-nearest (read by several layers or by a float node)")
        w32 = w.astype(np.float32)
        nearest = quantize_array(w32, qp).astype(np.int64)
        scale, zp = qp.expanded(w32.shape)
        qmin, qmax = _nearest_range(nearest, qp)
        weights[wq.tensor] = WeightPoint(w32, np.asarray(scale, np.float32), np.asarray(zp, np.float64),
                                         np.broadcast_to(qmin, w32.shape), np.broadcast_to(qmax, w32.shape),
                                         nearest, learn)
        for consumer in wq.consumers:
            points[tuple(consumer)] = wq.tensor
    return weights, points, notes


def _activations(graph: gs.Graph, plan):
    """Integer-grid activation quantizers keyed by their scale-sharing group, and the (node, input) pairs that read
    each through a quantizer."""
    tensors = graph.tensors()
    acts, points = {}, {}
    for act in plan.activations.values():
        if act.qparams is None or act.spec.is_float or act.tensor not in tensors:
            continue
        key = plan.shared.find(act.tensor)
        acts.setdefault(key, act.qparams)
        if act.consumers == ALL_CONSUMERS:
            tensor = tensors[act.tensor]
            pairs = {(n.name, i) for n in tensor.outputs for i, t in enumerate(n.inputs) if t is tensor}
        else:
            pairs = set(act.consumers)
        for pair in pairs:
            points[tuple(pair)] = key
    return acts, points


def _last_reads(blocks) -> dict[str, int]:
    """Tensor -> index of the last block reading it (block outputs nobody reads later go with their own block)."""
    last: dict[str, int] = {}
    for k, block in enumerate(blocks):
        for name in (*block.inputs, *block.outputs):
            last[name] = max(last.get(name, -1), k)
    return last


def _is_float(store: SpillStore, name: str, chunks: int) -> bool:
    return chunks > 0 and ("fp:" + name, 0) in store and np.asarray(store.get("fp:" + name, 0)).dtype.kind == "f"


def _write_back(graph: gs.Graph, plan, weights, acts, quant, record) -> dict:
    """Learned codes into the weight initializers, learned scales into the plan; counts of what changed."""
    tensors = graph.tensors()
    changed = {"weights": 0, "scales": 0}
    fallback = 0
    for key, point in weights.items():
        codes = quant.codes(key)
        if codes is None:
            continue
        wq = next(w for w in plan.weights.values() if w.tensor == key)
        original = np.asarray(tensors[key].values)
        value, back, bad = _grid_values(codes, wq.qparams, original.dtype, original)
        fallback += bad
        if not np.array_equal(back, point.nearest):
            tensors[key].values = value
            changed["weights"] += 1
    groups = plan.shared.groups()
    for key in acts:
        qp = quant.qparams(key)
        if qp is None:
            continue
        for member in groups.get(key, [key]):
            if member in plan.activations:
                plan.activations[member].qparams = qp
        changed["scales"] += 1
    record["grid_fallbacks"] = fallback
    return changed

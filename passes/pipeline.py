"""The built-in pass pipeline: which passes a run is made of, in order, each built from the run's options.

oq's core finds this module by name (RunConfig.pipeline), so core never imports a pass; another pipeline module
with the same two functions can stand in for it.
"""
from __future__ import annotations

from oq.config import RunConfig
from oq.passmanager import FixedPoint, Pass
from oq.record import run_record
from oq.runtime import max_qdq_opset
from oq.target import Target

from .annotate import Annotate
from .bias_correction import BiasCorrection, FloatOutputMeans
from .block_recon import BlockReconstruction
from .calibrate import Calibrate
from .canonicalize import Canonicalize
from .dead_code import RemoveDeadNodes
from .equalize import CrossLayerEqualization
from .export import AttachFunctions, EmitSideFiles, ExportGraph, PackInt4, StampModel, ToQOperator
from .finalize import Finalize
from .fold_bn import FoldBatchNorm
from .fold_constants import FoldConstants
from .fuse_patterns import FusePatterns
from .insert_qdq import InsertQDQ
from .reconstruct import AdaRound
from .saturation import GuardSaturation
from .shape_inference import InferShapes
from .sink_activation import SinkActivationBelowMaxPool
from .smoothquant import SmoothQuant


def preparation(min_opset: int = 13) -> list[Pass]:
    """Graph clean-up every run starts with; the target only sets the minimum opset, the installed onnxruntime
    the maximum."""
    return [Canonicalize(min_opset, max_qdq_opset()), InferShapes(),
            FixedPoint("fold", [FoldConstants(), FoldBatchNorm(), RemoveDeadNodes()]),
            InferShapes()]


def quantization(config: RunConfig, target: Target, data, *, min_opset: int, version: str,
                 calib_files=()) -> list[Pass]:
    """Preparation, then quantization for `target` on calibration `data`, then export."""
    equalize = target.cross_layer_equalization if config.equalize is None else config.equalize
    passes: list[Pass] = preparation(min_opset)
    if equalize:
        passes.append(CrossLayerEqualization())
    algos, rounding = config.algos, config.rounding_algo
    if "smoothquant" in algos:  # before calibration: activation ranges are taken on the smoothed graph
        passes.append(SmoothQuant(data, target, config.exclude, config.smoothquant_alpha, config.batch_size))
    passes += [FusePatterns(), Annotate(config.exclude, config.parsed_overrides),
               Calibrate(data, config.batch_size, config.calib_method, config.progress, config.max_memory_mb,
                         config.observer_args),
               GuardSaturation(data, config.cpu, config.batch_size)]
    reference = None
    if "bias-correction" in algos:  # the float outputs, before a rounding pass overwrites the float weights
        reference = FloatOutputMeans(data, config.batch_size)
        passes.append(reference)
    if rounding == "adaround":
        passes.append(AdaRound(data, config.batch_size, config.algo_iters, config.device,
                               max_memory_mb=config.max_memory_mb))
    elif rounding in ("brecq", "qdrop"):
        passes.append(BlockReconstruction(data, rounding, config.algo_iters, config.device,
                                          max_memory_mb=config.max_memory_mb, progress=config.progress))
    if reference is not None:  # after the weights are final, before insert-qdq quantizes the biases
        passes.append(BiasCorrection(reference))
    passes += [InsertQDQ(), SinkActivationBelowMaxPool(), Finalize(),
               ExportGraph(), PackInt4()]
    stamp = StampModel(version)
    passes += [stamp, AttachFunctions()]
    if config.export_format == "qoperator":
        passes.append(ToQOperator())
    passes.append(EmitSideFiles())
    stamp.record = run_record(config, target, list(calib_files), [p.name for p in passes], version)
    return passes

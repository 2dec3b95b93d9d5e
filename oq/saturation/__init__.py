"""onnxruntime's u8 x s8 integer kernels on x86 CPUs without VNNI: emulation, analysis and a check of QDQ models.

What the kernels do (read from the MLAS sources of onnxruntime, `onnxruntime/core/mlas/lib`; it cannot be observed on
a VNNI host, so everything here is emulated in numpy and never depends on the CPU it runs on):

- On AVX2 and AVX-512 without VNNI, the u8 activation x s8 weight GEMM kernels (`QgemmU8S8KernelAvx2`,
  `QgemvU8S8KernelAvx2`, the AVX512Core variants) and the symmetric convolution kernel (`ConvSymKernelAvx2`, used by
  QLinearConv when the weight zero point is 0) broadcast 4 consecutive K values of the activation row, multiply them
  with 4 consecutive K values of the packed weight column with VPMADDUBSW, which adds the products of the pairs
  (k, k+1), k even, into int16 *with saturation*, then widen with VPMADDWD and accumulate in int32. Raw u8 values are
  multiplied (the activation zero point is corrected afterwards through the weight column sums), so the magnitude of
  a pair is `a[k]*w[k] + a[k+1]*w[k+1]` with `a` in [0, 255].
- The K order is the GEMM's: for MatMul / Gemm it is the row index of B ([K, N]; with Gemm transB=1, the column
  index of B [N, K]); for Conv it is NOT the weight's memory order (c_in, kh, kw): QLinearConv transposes the input
  to NHWC and reorders the filter to [kernel position][c_in][c_out] (`ReorderFilter`, `MlasConvSymPackW`), so
  K = (kh, kw, c_in) with c_in fastest, per group. Pairs are two neighbouring input channels at the same tap (or,
  when c_in per group is odd, can straddle two taps). K is zero-padded to a multiple of 4.
- Depthwise convolutions (one input and one output channel per group) use other kernels
  (`ConvSymDepthwiseKernelAvx2`: VPMOVZXBD/VPMOVSXBD + VPMADDWD on 32-bit lanes; `MlasConvDepthwise` in C): exact.
- u8 x u8 (activation x activation MatMuls) widens to int16 before VPMADDWD: exact. VNNI (VPDPBUSD), AMX and ARM64
  (UDOT/SDOT, or UMULL/SMLAL) accumulate exactly in int32.
- QDQ graphs with int8 activations (onnxruntime.quantization's default) are rewritten on x86 to uint8 activations
  (value + 128, zero point + 128) before fusion, so the kernel sees x + 128. QLinear ops with int8 activations
  (QOperator format) run s8 x s8 kernels that do not saturate.
- Not every QDQ layer is fused: onnxruntime leaves some DQ -> Conv -> Q groups in float (they cannot saturate);
  `fused_layers` asks onnxruntime's optimiser which ones it fuses.

Verified, not just read: with onnxruntime 1.32 run under `qemu-x86_64 -cpu Haswell` (AVX2, no VNNI), MatMulInteger
u8 x s8 returns exactly `pair_sums(...).saturated`, and `emulate` reproduces the fused outputs of oq's and
quantize_static's QDQ models (QLinearConv through both the symmetric-conv and the GEMM paths, depthwise, QGemm,
QLinearMatMul, batch 1 GEMV) to float rounding (tests/test_saturation.py runs one such check when qemu is
installed). s8 x s8 QLinearConv / QLinearMatMul / MatMulInteger gave identical results on AVX2 and VNNI. Assumed
from the sources only: AVX-512 without VNNI (AVX512Core kernels, same 4-byte K packing; qemu does not emulate
AVX-512) and the Windows-only SSE4.1 kernel.

Only same-sign pairs can saturate: |a0*w0 + a1*w1| <= max(a0*|w0|, a1*|w1|) <= 255*128 < 32767 otherwise. With
8-bit per-channel weights some weight of every channel is +-127, so with a=255 a neighbour of the same sign with
|w| >= 2 is enough: the analytic worst case flags nearly every layer. Weights with |w| <= 64 can never saturate
(255 * (64 + 64) = 32640; onnxruntime's own `reduce_range` uses the same [-64, 64]), which is the floor of the
scales the guard (oq/passes/saturation.py) chooses from for the channels that saturate on calibration data.

A model guarded for `avx2` runs correctly on every CPU (VNNI and ARM just lose the small 7-bit cost on the guarded
channels); a model made for `vnni` can lose a lot on an AVX2 machine.
"""
# One module a job: cpu (the deployment CPU), pairs (the VPMADDUBSW arithmetic and its bounds), layers (u8 x s8
# layers in the kernels' form, found in a model), runtime (onnxruntime sessions and captured tensors), check
# (per-layer checks, fused layers, whole-model emulation), guard (the per-channel scale decision), report (tables).
from .check import (FUSED_OPS, AnalyticRow, LayerCheck, analyze_layer, analyze_model, check_model_saturation,
                    check_rows, emulate, fused_layers)
from .cpu import CPU_CHOICES, CPU_WORDS, SATURATING_CPUS, detect_cpu, resolve_cpu
from .guard import QMAX_LADDER, GuardDecision, guard_decision
from .layers import ConvGeometry, IntLayer, find_layers, gemm_weights
from .pairs import (INT16_MAX, INT16_MIN, SAFE_WEIGHT_QMAX, PairSums, exceeds_int16, order_free_bounds, pair_bounds,
                    pair_excess, pair_sums)
from .report import format_analytic, format_checks, inspect_saturation
from .runtime import capture

__all__ = [
    "AnalyticRow", "CPU_CHOICES", "CPU_WORDS", "ConvGeometry", "FUSED_OPS", "GuardDecision", "INT16_MAX", "INT16_MIN",
    "IntLayer", "LayerCheck", "PairSums", "QMAX_LADDER", "SAFE_WEIGHT_QMAX", "SATURATING_CPUS", "analyze_layer",
    "analyze_model", "capture", "check_model_saturation", "check_rows", "detect_cpu", "emulate", "exceeds_int16",
    "find_layers", "format_analytic", "format_checks", "fused_layers", "gemm_weights", "guard_decision",
    "inspect_saturation", "order_free_bounds", "pair_bounds", "pair_excess", "pair_sums", "resolve_cpu",
]

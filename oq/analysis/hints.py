"""One suggestion per node, from what its numbers say hurts most."""
from __future__ import annotations

from .records import NodeRecord

FINE_SHARE = 0.05  # a node causing less than this share of the whole model's output noise needs nothing
CLIP_NOTABLE = 0.001  # 0.1 % of values clipped...
CLIP_DOMINANT = 0.25  # ...causing at least a quarter of the tensor's error
COARSE_DB = 35.0  # an input or weight SQNR below this is worth a finer grid


def _methods(calib_method: str) -> str:
    return "/".join(m for m in ("mse", "percentile") if m != calib_method)


def hint(node: NodeRecord, calib_method: str) -> str:
    if node.noise_share is not None and node.noise_share < FINE_SHARE:
        return "fine"
    if node.clip_ratio >= CLIP_NOTABLE and node.clip_noise_share >= CLIP_DOMINANT:
        pct = f"clipping {100 * node.clip_ratio:.1f} % of values"
        if calib_method == "minmax":
            return f"{pct} beyond the calibrated range: calibrate on data like the evaluation data"
        return f"{pct}: try --calib-method {_methods(calib_method)} (a higher --percentile clips less)"
    w, a = node.weight_sqnr_db, node.input_sqnr_db
    if w is not None and w < COARSE_DB and (a is None or w <= a):
        return f"weights lose {w:.1f} dB: try --algo adaround or more --weight-bits"
    if a is not None and a < COARSE_DB:
        return f"input grid is coarse ({a:.1f} dB): try --calib-method {_methods(calib_method)} or more --act-bits"
    return f"sensitive layer: keep in float with --exclude {node.name}"

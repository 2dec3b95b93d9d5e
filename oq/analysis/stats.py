"""Streaming error measures: batches are folded into sums, so memory does not grow with the number of samples."""
from __future__ import annotations

import math

import numpy as np

SAMPLE_PER_BATCH = 8192  # values kept per batch of a tensor, for its histogram
SAMPLE_TOTAL = 65536  # values kept per tensor over all batches


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); +inf when there is no noise."""
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


class ErrorStats:
    """SQNR and cosine similarity of `test` against `ref` over everything added."""

    def __init__(self):
        self.signal = self.noise = self.dot = self.test_energy = 0.0
        self.count = 0

    def add(self, ref: np.ndarray, test: np.ndarray) -> None:
        ref = np.asarray(ref, np.float64).ravel()
        test = np.asarray(test, np.float64).ravel()
        diff = ref - test
        self.signal += float(ref @ ref)
        self.noise += float(diff @ diff)
        self.dot += float(ref @ test)
        self.test_energy += float(test @ test)
        self.count += ref.size

    @property
    def sqnr_db(self) -> float:
        return sqnr_db(self.signal, self.noise)

    @property
    def cosine(self) -> float:
        norm = math.sqrt(self.signal * self.test_energy)
        return 1.0 if norm == 0 and self.noise == 0 else (self.dot / norm if norm else 0.0)


class TensorStats(ErrorStats):
    """ErrorStats plus the share of reference values outside the quantizer's range, the reference's extent, and a
    strided sample of its values for a histogram."""

    def __init__(self):
        super().__init__()
        self.clipped = 0
        self.clip_energy = 0.0  # squared distance of clipped values to the range: the error clipping alone causes
        self.lo, self.hi = math.inf, -math.inf
        self.samples: list[np.ndarray] = []
        self.kept = 0
        self.shape: list[int] | None = None

    def add_clipped(self, ref: np.ndarray, test: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        self.add(ref, test)
        if self.shape is None:
            self.shape = list(ref.shape)
        self.clipped += int(np.count_nonzero((ref < lo) | (ref > hi)))
        excess = np.maximum(lo - ref, 0) + np.maximum(ref - hi, 0)
        self.clip_energy += float(np.square(excess, dtype=np.float64).sum())
        if ref.size:
            self.lo, self.hi = min(self.lo, float(ref.min())), max(self.hi, float(ref.max()))
        if self.kept < SAMPLE_TOTAL:
            flat = np.asarray(ref, np.float32).ravel()
            step = max(1, -(-flat.size // SAMPLE_PER_BATCH))
            part = flat[::step][:SAMPLE_TOTAL - self.kept].copy()
            self.samples.append(part)
            self.kept += part.size

    @property
    def clip_ratio(self) -> float:
        return self.clipped / self.count if self.count else 0.0

    @property
    def clip_noise_share(self) -> float:
        """How much of the quantization noise clipping accounts for (0..1)."""
        return min(1.0, self.clip_energy / self.noise) if self.noise else 0.0

    def sample(self) -> np.ndarray:
        return np.concatenate(self.samples) if self.samples else np.zeros(0, np.float32)

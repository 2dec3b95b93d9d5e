"""Observers reduce streamed tensors into the statistics qparams are computed from.

Every observer is mergeable, so calibration can be split (over batches, processes, machines) and give the same
result as one pass. Register your own with `register_observer`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .errors import OqError


class Observer:
    """Base: `update` with each batch, `merge` with another observer of the same kind, `range` for the qparams."""

    name = "base"

    def update(self, x: np.ndarray) -> None:
        raise NotImplementedError

    def merge(self, other: "Observer") -> None:
        raise NotImplementedError

    def range(self) -> tuple[float, float]:
        raise NotImplementedError


class MinMaxObserver(Observer):
    """Running min and max: exact, order- and batching-independent."""

    name = "minmax"

    def __init__(self):
        self.lo = np.inf
        self.hi = -np.inf
        self.count = 0

    def update(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        self.lo = min(self.lo, float(x.min()))
        self.hi = max(self.hi, float(x.max()))
        self.count += x.size

    def merge(self, other: "MinMaxObserver") -> None:
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)
        self.count += other.count

    def range(self) -> tuple[float, float]:
        if self.count == 0:
            return 0.0, 0.0
        return self.lo, self.hi


_REGISTRY: dict[str, Callable[[], Observer]] = {"minmax": MinMaxObserver}


def register_observer(name: str, factory: Callable[[], Observer]) -> None:
    """Make an observer available to targets and --calib-method under `name`."""
    _REGISTRY[name] = factory


def observer_names() -> list[str]:
    return sorted(_REGISTRY)


def make_observer(name: str) -> Observer:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise OqError(f"unknown calibration method {name!r}; available: {', '.join(observer_names())}") from None

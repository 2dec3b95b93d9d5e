"""Arrays kept in memory up to a budget and on disk beyond it, for data that is read many times (block inputs and
outputs during reconstruction).

Arrays are stored per (key, chunk). Once the bytes held in memory would pass the budget, new arrays go to .npy
files in a private temporary folder and are read back memory-mapped, so the process holds at most the budget plus
what the page cache lends. `close()` (or leaving a `with` block) removes the folder.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np


class SpillStore:
    def __init__(self, budget_bytes: int, folder: str | os.PathLike | None = None):
        self.budget = max(int(budget_bytes), 0)
        self.parent = folder
        self._dir: str | None = None
        self._memory: dict[tuple[str, int], np.ndarray] = {}
        self._files: dict[tuple[str, int], tuple[str, int]] = {}  # -> (path, bytes)
        self.in_memory = 0  # bytes
        self.on_disk = 0
        self.peak_memory = 0
        self.peak_disk = 0
        self._count = 0  # files written, for unique names

    def __enter__(self) -> "SpillStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def put(self, key: str, chunk: int, value: np.ndarray) -> None:
        self.drop_one(key, chunk)
        value = np.asarray(value)
        if not value.flags.c_contiguous:  # not np.ascontiguousarray: it turns a 0-d array (a shape scalar) into 1-d
            value = value.copy(order="C")
        if self.in_memory + value.nbytes <= self.budget:
            self._memory[key, chunk] = value
            self.in_memory += value.nbytes
            self.peak_memory = max(self.peak_memory, self.in_memory)
            return
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="oq-spill-", dir=self.parent)
        self._count += 1
        path = os.path.join(self._dir, f"{self._count}.npy")
        np.save(path, value)
        self._files[key, chunk] = (path, value.nbytes)
        self.on_disk += value.nbytes
        self.peak_disk = max(self.peak_disk, self.on_disk)

    def get(self, key: str, chunk: int) -> np.ndarray:
        if (key, chunk) in self._memory:
            return self._memory[key, chunk]
        if (key, chunk) in self._files:
            return np.load(self._files[key, chunk][0], mmap_mode="r")
        raise KeyError((key, chunk))

    def __contains__(self, item: tuple[str, int]) -> bool:
        return item in self._memory or item in self._files

    def drop_one(self, key: str, chunk: int) -> None:
        value = self._memory.pop((key, chunk), None)
        if value is not None:
            self.in_memory -= value.nbytes
        stored = self._files.pop((key, chunk), None)
        if stored is not None:
            self.on_disk -= stored[1]
            try:
                os.remove(stored[0])
            except OSError:
                pass

    def drop(self, key: str) -> None:
        """Forget every chunk of `key`."""
        for k, c in [kc for kc in (*self._memory, *self._files) if kc[0] == key]:
            self.drop_one(k, c)

    def close(self) -> None:
        self._memory.clear()
        self._files.clear()
        self.in_memory = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


__all__ = ["SpillStore"]

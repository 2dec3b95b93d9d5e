"""The --state file of a --min-sqnr search: the ranking and every (nodes in float -> SQNR) result, so a killed search
resumes where it stopped and reaches the same answer without measuring anything twice.

The file is keyed by a hash of everything the numbers depend on (model, options, target spec, calibration and
evaluation data, oq version), and rewritten atomically after every result: it is always a complete JSON document.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OqError
from .files import write_outputs
from .search import Excluded, key

FORMAT = "oq-min-sqnr-state"
VERSION = 1


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _db_in(value) -> float:
    return math.inf if value is None else float(value)


def _db_out(value: float):
    return None if math.isinf(value) and value > 0 else value  # JSON has no infinity: an exact match is null


@dataclass
class RankedNode:
    name: str
    op: str
    layerwise_sqnr_db: float


@dataclass(frozen=True)
class Measured:
    """One evaluation: the output SQNR, and how many nodes the run quantized of those it planned."""

    sqnr_db: float
    quantized_nodes: int
    planned_nodes: int


@dataclass
class SearchState:
    """What is known so far; `path` None keeps it in memory only."""

    key: str
    path: Path | None = None
    ranking: list[RankedNode] | None = None
    results: dict[Excluded, Measured] = field(default_factory=dict)

    @classmethod
    def open(cls, path: "str | os.PathLike | None", run_key: str) -> "SearchState":
        """A new state, or the one in `path` when it was made by the same model, options and data."""
        if path is None:
            return cls(run_key)
        path = Path(path)
        if not path.exists():
            return cls(run_key, path)
        where = f"--state {path}"
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != FORMAT:
                raise ValueError
        except (OSError, ValueError, AttributeError):
            raise OqError(f"{where}: not an oq --min-sqnr state file; give another path or delete it") from None
        if doc.get("version") != VERSION or doc.get("key") != run_key:
            raise OqError(f"{where}: made for another model, options or data (state {doc.get('key')}, this run "
                          f"{run_key}); give another path or delete it")
        try:
            ranking = None if doc.get("ranking") is None else [RankedNode(r["name"], r["op"],
                                                                          _db_in(r["layerwise_sqnr_db"]))
                                                               for r in doc["ranking"]]
            results = {key(r["excluded"]): Measured(_db_in(r["sqnr_db"]), int(r["quantized_nodes"]),
                                                    int(r["planned_nodes"])) for r in doc.get("results", [])}
            return cls(run_key, path, ranking, results)
        except (KeyError, TypeError, ValueError):
            raise OqError(f"{where}: damaged state file; delete it to start over") from None

    def set_ranking(self, ranking: list[RankedNode]) -> None:
        self.ranking = ranking
        self.save()

    def record(self, excluded: Excluded, measured: Measured) -> None:
        self.results[key(excluded)] = measured
        self.save()

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "key": self.key,
                "ranking": None if self.ranking is None else
                [{"name": r.name, "op": r.op, "layerwise_sqnr_db": _db_out(r.layerwise_sqnr_db)}
                 for r in self.ranking],
                "results": [{"excluded": list(k), "sqnr_db": _db_out(v.sqnr_db), "quantized_nodes": v.quantized_nodes,
                             "planned_nodes": v.planned_nodes} for k, v in self.results.items()]}

    def save(self) -> None:
        if self.path is not None:
            write_outputs({self.path: (json.dumps(self.to_dict(), indent=1) + "\n").encode()})

"""Which nodes to keep in float to meet an SQNR goal, given a sensitivity ranking and a way to measure a choice.

The search only sees `sqnr_of(excluded)`, so it is the same whether a result is measured now or read back from a
state file: a resumed search asks the same questions in the same order and ends with the same answer. Evaluations are
counted as the distinct sets asked about, which is what a run costs when nothing is known in advance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import OqError

Excluded = tuple[str, ...]


def key(names) -> Excluded:
    """One spelling per set of nodes, whatever the order they were chosen in."""
    return tuple(sorted(names))


@dataclass
class Outcome:
    excluded: list[str]  # the nodes kept in float, worst layerwise first
    naive: int  # the smallest prefix of the ranking that meets the goal (before pruning)
    sqnr_db: float  # of the chosen set
    evaluations: int  # distinct sets measured (or read back) during this search
    pruning_evaluations: int  # of those, spent trying to put nodes back


class _Asker:
    """Memoises `sqnr_of` and counts the distinct sets asked about."""

    def __init__(self, sqnr_of: Callable[[Excluded], float], goal: float):
        self.sqnr_of, self.goal = sqnr_of, goal
        self.seen: dict[Excluded, float] = {}

    def sqnr(self, names) -> float:
        k = key(names)
        if k not in self.seen:
            self.seen[k] = self.sqnr_of(k)
        return self.seen[k]

    def meets(self, names) -> bool:
        return self.sqnr(names) >= self.goal

    def known(self, names) -> bool:
        return key(names) in self.seen


def search(ranking: list[str], goal: float, sqnr_of: Callable[[Excluded], float], max_pruning: int = 8) -> Outcome:
    """Nothing excluded first; then prefixes of `ranking` of length 1, 2, 4, ... until one meets `goal`, and a
    binary search below it for the smallest; then up to `max_pruning` new evaluations putting the prefix's nodes back,
    least sensitive first, each kept quantized when the goal still holds."""
    ask = _Asker(sqnr_of, goal)
    if ask.meets(()):
        return Outcome([], 0, ask.sqnr(()), len(ask.seen), 0)
    n = len(ranking)
    lo, k = 0, 1  # ranking[:lo] is known to miss the goal
    while True:
        k = min(k, n)
        if ask.meets(ranking[:k]):
            hi = k
            break
        if k == n:
            raise OqError(f"--min-sqnr {goal:g}: not reachable: with all {n} quantized nodes kept in float the model "
                          f"gives {ask.sqnr(ranking):.2f} dB against fp32 (rounding in the graph passes); lower the "
                          f"goal")
        lo, k = k, 2 * k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ask.meets(ranking[:mid]):
            hi = mid
        else:
            lo = mid
    chosen = list(ranking[:hi])
    before = len(ask.seen)
    for name in reversed(ranking[:hi]):
        candidate = [c for c in chosen if c != name]
        if not ask.known(candidate) and len(ask.seen) - before >= max_pruning:
            break
        if ask.meets(candidate):
            chosen = candidate
    return Outcome(chosen, hi, ask.sqnr(chosen), len(ask.seen), len(ask.seen) - before)

"""Interval arithmetic on ``(start, end)`` pairs (half-open), shared by the comm probe (what a
wait hides of a collective in flight) and the trace export (compute lanes with the exposed
waits cut out). Pure functions, no tpkit imports."""

from __future__ import annotations

Interval = tuple[int, int]


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals``, sorted, with overlapping or touching ones joined."""
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def subtract(start: int, end: int, holes: list[Interval]) -> list[Interval]:
    """``[start, end)`` minus merged, sorted ``holes``: the pieces left, in order."""
    pieces, cur = [], start
    for hs, he in holes:
        if he <= cur:
            continue
        if hs >= end:
            break
        if hs > cur:
            pieces.append((cur, hs))
        cur = max(cur, he)
    if cur < end:
        pieces.append((cur, end))
    return pieces

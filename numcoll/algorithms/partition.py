"""How algorithms cut a buffer: into per-rank chunks, and chunks into segments."""

from __future__ import annotations

__all__ = ["chunk_bounds", "segments"]


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, count) chunks covering ``count`` elements;
    sizes differ by at most one (the first ``count % parts`` get the extra)."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        bounds.append((start, n))
        start += n
    return bounds


def segments(start: int, count: int, segment_count: int) -> list[tuple[int, int]]:
    """(start, count) pieces of at most ``segment_count`` elements; none for an
    empty range, so both ends of a transfer agree on the number of messages."""
    return [(s, min(segment_count, start + count - s))
            for s in range(start, start + count, segment_count)]

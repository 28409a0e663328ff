"""Token buckets: the plan holds one (strategy, variant) per power-of-two range of T."""

from __future__ import annotations

from typing import Optional


def bucket_index(tokens: int) -> int:
    """Token buckets are powers of two: bucket i holds 2^(i-1) < T <= 2^i. O(1), no allocation."""
    return (tokens - 1).bit_length()


def bucket_ranges(max_tokens: int) -> tuple[tuple[int, int], ...]:
    """(fewest, most) T of each bucket up to max_tokens: (1, 1), (2, 2), (3, 4), (5, 8), ..."""
    bounds = bucket_bounds(max_tokens)
    return tuple(zip((1,) + tuple(b + 1 for b in bounds[:-1]), bounds))


def bucket_bounds(max_tokens: int) -> tuple[int, ...]:
    """Upper bounds 1, 2, 4, ... of the buckets up to max_tokens (the last one clamped to it)."""
    bounds, b = [], 1
    while b < max_tokens:
        bounds.append(b)
        b *= 2
    bounds.append(max_tokens)
    return tuple(bounds)


def tokens_text(low: int, high: Optional[int]) -> str:
    """A token range for messages: 'T in 3..8' or 'T >= 3'."""
    return f"T >= {low}" if high is None else f"T in {low}..{high}"

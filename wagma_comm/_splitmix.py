"""SplitMix64: a tiny, well-mixed 64-bit hash (Steele, Lea, Flood, OOPSLA 2014),
used where every rank must derive the same pseudo-random choice with no
communication."""

from __future__ import annotations

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """Hash a 64-bit integer to a uniformly mixed 64-bit integer."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)

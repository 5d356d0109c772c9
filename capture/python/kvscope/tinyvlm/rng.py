"""splitmix64, the one random generator used for scenes and datasets (bit-exact with the C++ runner).

next(): state += 0x9E3779B97F4A7C15; z = state; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31)   (all arithmetic mod 2^64)
uniform(n) = next() % n.
"""

MASK64 = (1 << 64) - 1


class SplitMix64:
    """splitmix64 stream seeded with an unsigned 64-bit integer (other ints are reduced mod 2^64)."""

    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self, n: int) -> int:
        """next() % n for n >= 1 (plain modulo, no rejection: the spec fixes this)."""
        if n < 1:
            raise ValueError(f"uniform(n): n must be >= 1, got {n}")
        return self.next() % n

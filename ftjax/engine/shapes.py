"""Shape buckets: the lengths programs are compiled for.

Every distinct shape is a compile, so lengths are rounded up to a small set: prompt
chunks to powers of two (at least MIN_PROMPT_BUCKET), state capacities to powers of
two of at least MIN_CAPACITY (the scheduler uses MIN_CAPACITY x 4^i).
"""

MIN_PROMPT_BUCKET = 16
MIN_CAPACITY = 128


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum): one compile serves a range of lengths."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())

"""Shape buckets: the lengths programs are compiled for.

Every distinct shape is a compile, so lengths are rounded up to a small set: prompt
chunks to powers of two (at least MIN_PROMPT_BUCKET), state capacities to powers of
two of at least MIN_CAPACITY (the scheduler uses MIN_CAPACITY x 4^i).

Padding is compute thrown away: a 2,100-token prompt padded to 4,096 costs nearly
twice its tokens. `prefill_pieces` cuts a prompt into calls whose padded lengths stay
within MAX_PAD_WASTE of the real count (or PAD_ALLOWANCE tokens, about what one more
call costs), still from the same power-of-two shapes: full chunks, then power-of-two
pieces while padding the rest would waste more.
"""

MIN_PROMPT_BUCKET = 16
MIN_CAPACITY = 128
MAX_PAD_WASTE = 0.125  # padded tokens / real tokens a prefill may spend on padding
PAD_ALLOWANCE = 64  # padded tokens always accepted: fewer than one more call costs


def bucket(n: int, minimum: int = MIN_PROMPT_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum): one compile serves a range of lengths."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def prefill_pieces(n: int, chunk: int) -> list[int]:
    """Split a prompt of n >= 1 tokens into prefill calls of at most `chunk` tokens ->
    their lengths. Every piece but the last is a power of two (no padding); the last is
    padded to `bucket`, wasting at most max(MAX_PAD_WASTE * n, PAD_ALLOWANCE) tokens.
    3,000 tokens with chunk 4,096: [2048, 952] (padded 3,072)."""
    full = 1 << (max(chunk, 1).bit_length() - 1)  # a power of two: full chunks need no padding
    pieces, left = [], n
    while left > full:
        pieces.append(full)
        left -= full
    while left:
        padded = bucket(left)
        if padded - left <= max(MAX_PAD_WASTE * n, PAD_ALLOWANCE):
            pieces.append(left)
            break
        pieces.append(padded // 2)
        left -= padded // 2
    return pieces

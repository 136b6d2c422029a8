"""Prompt cost follows the real token count: `prefill_pieces` keeps padding within its
bound, uses only power-of-two shapes, and a prompt fed in pieces gives the logits of the
same prompt fed at once."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ftjax
from ftjax.engine.shapes import MAX_PAD_WASTE, PAD_ALLOWANCE, bucket, prefill_pieces


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 70_000), chunk=st.integers(1, 9_000))
def test_pieces_cover_the_prompt_with_bounded_padding(n, chunk):
    pieces = prefill_pieces(n, chunk)
    assert sum(pieces) == n and all(0 < p <= chunk for p in pieces)
    assert all(p & (p - 1) == 0 for p in pieces[:-1])  # powers of two: no padding but the last piece's
    padded = sum(pieces[:-1]) + bucket(pieces[-1])
    assert padded - n <= max(MAX_PAD_WASTE * n, PAD_ALLOWANCE)
    assert len(pieces) <= -(-n // (1 << (chunk.bit_length() - 1))) + chunk.bit_length()


def test_known_splits():
    assert prefill_pieces(3000, 4096) == [2048, 952]
    assert prefill_pieces(2100, 4096) == [2048, 52]  # was one call padded to 4,096
    assert prefill_pieces(3945, 4096) == [3945]
    assert prefill_pieces(1000, 300) == [256, 256, 256, 232]  # a chunk that is not a power of two


def test_a_prompt_in_pieces_gives_the_logits_of_one_call():
    """A prefill_chunk that forces pieces ([64, 36] for 100 tokens with chunk 64) against
    one call of 100 tokens."""
    whole = ftjax.load(prefill_chunk=4096, numerics="exact")  # f32 K/V: pieces read back what one call computed
    pieces = ftjax.load(prefill_chunk=64, numerics="exact")
    ids = np.random.default_rng(0).integers(0, whole.config.vocab_size, 100)
    a, b = whole.logits(ids), pieces.logits(ids)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    assert whole.generate(ids, 6) == pieces.generate(ids, 6)

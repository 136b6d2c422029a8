"""The host halves of sampling (`ftjax.engine.sampling`): a request's key data and a
greedy first token computed in numpy equal what JAX's programs give, so the first token
of a greedy request needs no program (none to compile, or to read back in a restarted
process)."""

import jax
import numpy as np
import pytest

from ftjax.engine.sampling import bias_arrays, greedy_token, key_data
from ftjax.engine.session import _first_tokens


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**31 - 1, 2**31, 2**32 + 5, 2**63 - 1, -1, -(2**31), -(2**40),
                                  -(2**63)])
def test_key_data_is_prng_keys(seed):
    want = np.asarray(jax.random.PRNGKey(seed))
    got = key_data(seed)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_greedy_token_is_the_programs_greedy_sample():
    rng = np.random.default_rng(0)
    V = 300
    biases = [None, {}, {5: 3.0}, {7: -np.inf, 9: 0.5}, {V + 3: 100.0, 11: 1e-3}]  # an id past V is dropped
    for trial in range(40):
        logits = rng.standard_normal(V).astype(np.float32)
        if trial % 4 == 1:  # ties: the first index wins in both
            logits[[17, 40, 250]] = logits.max() + 1
        bias = biases[trial % len(biases)]
        if trial % 5 == 3:  # the bias decides: the row's max banned, another raised to it
            top = int(np.argmax(logits))
            bias = {top: -np.inf, (top + 1) % V: float(logits[top] - logits[(top + 1) % V])}
        ids, values = bias_arrays([bias], V)
        want = int(np.asarray(_first_tokens(logits[None], key_data(0)[None], np.zeros(1, np.int32),
                                            np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                                            ids, values))[0])
        assert greedy_token(logits, bias) == want, (trial, bias)
    assert greedy_token(np.zeros(V, np.float32), {-1: 1.0}) is None  # a negative id: left to the program

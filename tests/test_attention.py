"""Attention over the state a layer kind owns: the blocked (flash-style) form equals the
direct reference across block, chunk and window boundaries; chunked prefill equals one
pass; decode far into the context equals a full forward; the decode step updates its
state in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.engine.sampling import bias_arrays
import hf_models
from ftjax.models.layers import blocked_attention, reference_attention
from test_amx import TILE_ISAS  # the bf16 tiles' engines, each skipped where this CPU lacks it

CASES = [  # B, T, H, G, hd, S, start per row, window, block
    (1, 7, 4, 2, 8, 64, 0, 0, 16),
    (2, 5, 4, 2, 8, 64, [3, 40], 0, 16),  # rows at different positions
    (1, 33, 4, 4, 8, 128, 50, 20, 16),  # window smaller than a block, queries across blocks
    (3, 1, 8, 2, 16, 256, [0, 100, 255], 0, 64),  # batched decode
    (1, 16, 4, 2, 8, 48, 10, 0, 512),  # capacity not a multiple of the block: one block
    (2, 9, 6, 3, 8, 96, [0, 70], 37, 32),  # GQA 2 heads per group, window across blocks
]


@pytest.mark.parametrize("B,T,H,G,hd,S,start,window,block", CASES)
def test_blocked_equals_reference(B, T, H, G, hd, S, start, window, block):
    rng = np.random.default_rng(0)
    start = np.broadcast_to(np.asarray(start), (B,)).astype(np.int32)
    q = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    k, v = (rng.standard_normal((B, G, S, hd)).astype(np.float32) for _ in range(2))
    positions = np.minimum(start[:, None] + np.arange(T)[None], S - 1)
    out = blocked_attention(q, k, v, positions, jnp.asarray(start + T), window, block)
    ref = reference_attention(q, k, v, positions, window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=0)


def test_blocked_reads_only_the_keys_in_use():
    """Garbage (NaN) past the keys in use must not reach the output."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 64, 8)).astype(np.float32) for _ in range(2))
    k[:, :, 20:], v[:, :, 20:] = np.nan, np.nan
    out = blocked_attention(q, k, v, np.array([[19]]), jnp.array([20]), 0, 16)
    ref = reference_attention(q, k[:, :, :20], v[:, :, :20], np.array([[19]]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=0)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """qwen2_moe with sliding-window layers (window 6) next to full-attention ones."""
    hf = hf_models.build("qwen2_moe", seed=13, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                         max_position_embeddings=256)
    assert set(hf.config.layer_types) == {"full_attention", "sliding_attention"}  # both kinds side by side
    return hf, hf_models.save(hf, tmp_path_factory.mktemp("windowed"))


def test_chunked_prefill_and_long_decode_match_transformers(windowed):
    hf, path = windowed
    ids = [int(t) for t in np.random.RandomState(2).randint(0, 96, size=50)]
    ref = hf_models.hf_logits(hf, ids).numpy()
    tol = 2e-5 * np.abs(ref).max()
    for chunk in (7, 16, 4096):  # chunks across the window and across the 16-token prompt buckets
        model = ftjax.load(path, prefill_chunk=chunk)
        np.testing.assert_allclose(model.logits(ids), ref, atol=tol, rtol=0)
    # decode one token at a time far past the window == the full forward
    s = model.session()
    s.append(ids[:3])
    steps = [s.append([t]) for t in ids[3:]]
    np.testing.assert_allclose(np.stack(steps), ref[3:], atol=tol, rtol=0)


def test_window_layers_keep_only_their_window(windowed):
    """A window layer's state is a ring of W rows whatever the context (the full layers'
    grows with it); sessions at different positions decoded together in one batch (some
    rows padded or finished early), forked, snapshotted and resumed give the tokens each
    gives alone; the state cache resumes such a model only at a saved state."""
    from ftjax.engine.scheduler import Job, Scheduler
    from ftjax.engine.session import Sampling
    from ftjax.engine.state_cache import StateCache

    _, path = windowed
    model = ftjax.load(path, policy="host")
    kinds = [model.config.layer_kind(i) for i in range(model.config.num_layers)]
    assert kinds.count("sliding_attention") >= 1 and kinds.count("attention") >= 1
    s = model.session()
    s.append([int(t) for t in np.random.RandomState(5).randint(0, 96, size=40)])
    for kind, layer in zip(kinds, s._state):
        rows = {a.shape[2] for a in layer.values()}
        assert rows == ({6} if kind == "sliding_attention" else {s.capacity}), (kind, rows)
    prompts = [[int(t) for t in np.random.RandomState(i).randint(0, 96, size=n)] for i, n in enumerate((3, 11, 29))]
    alone = [model.generate(p, 12) for p in prompts]
    assert model.generate_many(prompts, 12) == alone
    # continuous batching: rows join and leave (3 rows in a bucket of 4: a padding row)
    sch, outs = Scheduler(model, max_batch=4, prefill_chunk=4), []
    for p, n in zip(prompts, (12, 5, 9)):
        outs.append([])
        sch.submit(Job(np.asarray(p, np.int32), n, Sampling(), on_token=lambda t, o=outs[-1]: o.append(t) and False,
                       on_done=lambda r: None))
        sch.step()
    while sch.busy():
        sch.step()
    assert outs == [a[:n] for a, n in zip(alone, (12, 5, 9))]
    t = s.fork()
    snap = s.snapshot()
    expected = s.generate(10)
    assert t.generate(10) == expected and model.session(snap).generate(10) == expected
    cache = StateCache(model, "semantic")
    assert not cache.cuttable
    turn = prompts[2] + alone[2]
    first, reused = cache.prefill(turn)
    assert reused == 0
    again, reused = cache.prefill(turn + [7, 8])
    assert reused == len(turn) and again.generate(5) == model.generate(turn + [7, 8], 5)
    cache.close()


def test_an_inactive_row_leaves_its_window_alone(windowed):
    """Decode of a batch where row 1 is inactive (a padding or paused row): row 0's new
    key lands at row start mod W of its ring; row 1's ring is left exactly as it was
    (its slot still holds a key inside its window)."""
    from flax import nnx

    from ftjax.models.ops import Step, rope_cos_sin

    _, path = windowed
    model = ftjax.load(path)
    cfg = model.config
    i = next(i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "sliding_attention")
    attn = nnx.merge(model._graphdef, model._params).layers[i].attn
    rng = np.random.default_rng(0)
    ring = {n: jnp.asarray(rng.standard_normal((2, cfg.num_kv_heads, 6, cfg.head_dim)), jnp.float32) for n in "kv"}
    start = jnp.array([9, 14], jnp.int32)
    positions = start[:, None]
    step = Step(positions, start, jnp.array([[True], [False]]), rope_cos_sin(positions, cfg.rope_dim, cfg.rope_theta))
    _, out = attn(jnp.asarray(rng.standard_normal((2, 1, cfg.d_model)), jnp.float32), step, ring)
    for n in "kv":
        changed = np.any(np.asarray(out[n]) != np.asarray(ring[n]), axis=(1, 3))  # [B, W]
        assert changed[0].tolist() == [r == 9 % 6 for r in range(6)] and not changed[1].any(), (n, changed)


def test_prompt_longer_than_the_context_is_a_clear_error(windowed):
    _, path = windowed
    model = ftjax.load(path, max_seq_len=64)
    with pytest.raises(ValueError, match="does not fit the context of 64"):
        model.generate(list(range(64)), 1)
    with pytest.raises(ValueError, match="max_seq_len must be in 2..256"):
        ftjax.load(path, max_seq_len=1000)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_decode_step_updates_the_state_in_place(tmp_path, kv_dtype):
    """The step donates the state: the old buffers are consumed, and the compiled step
    needs no second copy of the KV cache as scratch (bf16: nor an f32 widening of it,
    which XLA's CPU backend inserts around a bf16 dynamic-update-slice)."""
    path = hf_models.save(hf_models.build("qwen3_moe", seed=2, max_position_embeddings=8192), tmp_path)
    model = ftjax.load(path, policy="host", kv_dtype=kv_dtype)
    cap = 8192
    state = model.new_state(1, cap)
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state))
    args = (model._param_leaves, state, model._xstate, model._pool_dev, jnp.zeros(1, jnp.int32), np.array([5], np.int32),
            np.ones(1, bool), jax.random.PRNGKey(0)[None], np.zeros(1, np.int32), jnp.zeros(1), jnp.zeros(1, jnp.int32),
            jnp.ones(1), *bias_arrays([None], model.config.vocab_size))
    compiled = model._steps.decode.lower(*args).compile()
    assert f"f32[1,{model.config.num_kv_heads},{cap}," not in compiled.as_text() or kv_dtype == "float32"
    mem = compiled.memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < state_bytes / 2
        assert mem.alias_size_in_bytes >= state_bytes
    out = model._steps.decode(*args)
    assert all(a.is_deleted() for a in jax.tree.leaves(state))
    assert all(not a.is_deleted() for a in jax.tree.leaves(out[2]))


def test_bf16_kv_cache(windowed):
    """kv_dtype="bfloat16" stores K/V as bf16 (half the bytes a decode step reads); the
    logits stay within bf16 rounding of the f32 cache's, and a snapshot of one does not
    restore into the other."""
    _, path = windowed
    ids = [int(t) for t in np.random.RandomState(4).randint(0, 96, size=40)]
    f32, bf16 = ftjax.load(path), ftjax.load(path, kv_dtype="bfloat16")
    s = bf16.session()
    s.append(ids[:30])
    assert {a.dtype for a in jax.tree.leaves(s._state)} == {jnp.dtype(jnp.bfloat16)}
    ref, got = f32.logits(ids), np.stack([s.append([t]) for t in ids[30:]])
    np.testing.assert_allclose(got, ref[30:], atol=2e-2 * np.abs(ref).max(), rtol=0)
    with pytest.raises(ValueError, match="another model"):
        f32.session(s.snapshot())
    with pytest.raises(ValueError, match="kv_dtype"):
        ftjax.load(path, kv_dtype="float16")


KERNEL_CASES = [  # B, T, H, G, hd, S, kv_len per row, window
    (1, 1, 4, 2, 8, 64, [30], 0),
    (2, 3, 6, 3, 16, 700, [700, 5], 0),  # several chunks, rows of different lengths
    (1, 1, 32, 4, 128, 2048, [1500], 0),  # Qwen3-30B-A3B head shape
    (3, 2, 4, 4, 8, 1100, [1100, 600, 3], 100),  # window across chunks
    (2, 1, 2, 2, 8, 32, [0, 7], 0),  # a row with no key in use: zeros
    (2, 2, 16, 16, 32, 1300, [1300, 517], 37),  # hd % 16 == 0: 8-key groups, window and tails inside them
    (2, 2, 8, 2, 64, 1100, [1100, 333], 300),  # hd % 32 == 0 (AVX-512 bf16 even/odd path), GQA 4, window
    (1, 1, 4, 2, 48, 900, [900], 0),  # hd % 16 == 0 but not % 32: AVX2 even/odd, AVX-512 plain groups
]


def random_attention_inputs(rng, B, T, H, G, hd, S, kv_len):
    """q [B, T, H, hd] (scale 3: peaked softmaxes), f32 k, v [B, G, S, hd], each row's T
    queries at the end of its kv_len keys (positions [B, T]), kv_len [B]."""
    q = 3 * rng.standard_normal((B, T, H, hd)).astype(np.float32)
    k, v = (rng.standard_normal((B, G, S, hd)).astype(np.float32) for _ in range(2))
    kv_len = np.array(kv_len, np.int32)
    positions = np.maximum(kv_len[:, None] - T + np.arange(T)[None], 0).astype(np.int32)
    return q, k, v, positions, kv_len


@pytest.mark.parametrize("B,T,H,G,hd,S,kv_len,window", KERNEL_CASES)
def test_host_attention_kernel_equals_its_reference(B, T, H, G, hd, S, kv_len, window):
    """The C++ decode-attention kernel (every ISA, f32 and bf16 caches, numpy entry and
    the FFI path inside jit) against the float64 numpy reference."""
    from ftjax import host
    from ftjax.experts.storage import to_bf16_bits

    q, k, v, positions, kv_len = random_attention_inputs(np.random.default_rng(3), B, T, H, G, hd, S, kv_len)
    for kk, vv, dtype in ((k, v, jnp.float32), (to_bf16_bits(k), to_bf16_bits(v), jnp.bfloat16)):
        ref = host.reference_attention(q, kk, vv, positions, kv_len, window)
        if (kv_len == 0).any():
            assert not ref[kv_len == 0].any()
        tol = 1e-5 * max(1.0, np.abs(ref).max())
        for isa in [i for i in host.available_isas() if i is not host.Isa.AMX_BF16]:  # AMX: AUTO's
            np.testing.assert_allclose(host.attention_numpy(q, kk, vv, positions, kv_len, window, isa=isa), ref,
                                       atol=tol, rtol=0)
        dev = lambda a: jnp.asarray(a.view(jnp.bfloat16) if a.dtype == np.uint16 else a, dtype)  # noqa: E731
        out = jax.jit(lambda *a: host.attention(*a, window=window))(q, dev(kk), dev(vv), positions, kv_len)
        np.testing.assert_allclose(np.asarray(out), ref, atol=tol, rtol=0)
    with pytest.raises(ValueError, match="kv_len"):
        host.attention_numpy(q, k, v, positions, np.full(B, S + 1, np.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_host_write_rows(dtype):
    """The in-place row write equals dynamic_update_slice (starts clamped as it clamps),
    per row of a batch; called on an array that is not donated, the input is untouched."""
    from ftjax import host

    rng = np.random.default_rng(5)
    cache = jnp.asarray(rng.standard_normal((3, 2, 40, 32)), dtype)
    rows = jnp.asarray(rng.standard_normal((3, 2, 4, 32)), jnp.float32)
    start = jnp.array([0, 17, 39], jnp.int32)  # the last is clamped to 36, as dynamic_update_slice does
    before = np.asarray(cache).copy()
    got = jax.jit(host.write_rows)(cache, rows, start)
    want = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n.astype(dtype), s, axis=1))(
        cache, rows, start)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(cache), before)
    with pytest.raises(Exception, match="more rows than the cache holds"):
        jax.jit(host.write_rows)(cache[:, :, :3], rows, start)


# ---- prompt attention on the bf16 tiles (host_kernels/attention_tiles.cc): AMX, or their
# vector form on AVX512-BF16 -----------------------------------------------------------------

TILE_STATUS = ftjax.host.amx_bf16_status()
VECTOR_STATUS = ftjax.host.bf16_vector_status()

TILE_CASES = [  # B, T, H, G, hd, S, kv_len per row, window
    (1, 16, 4, 2, 64, 64, [16], 0),  # the fewest tokens the tiles take
    (2, 37, 8, 2, 128, 200, [37, 120], 0),  # rows of different lengths, the second a later chunk
    (1, 100, 4, 1, 64, 160, [130], 0),  # one KV head for four query heads
    (1, 64, 4, 2, 64, 256, [64], 20),  # sliding window: blocks before it skipped, edges masked
    (1, 40, 2, 2, 96, 77, [77], 0),  # S and kv_len not whole key blocks; 6 groups of 16 dimensions
    (1, 18, 2, 1, 256, 40, [40], 0),  # the widest head: 16 groups, 8 steps of 32
    (2, 20, 4, 2, 32, 64, [20, 0], 0),  # a row with no key in use: zeros
]


def rounded_reference(q, k, v, positions, kv_len, window):
    """The tiles' inputs as they round them (q * log2(e) / sqrt(hd): scores in log2 units;
    k, v to bf16), the rest in float64."""
    from ftjax import host
    from ftjax.experts.storage import bf16_bits_to_f32

    hd = q.shape[-1]
    widen = lambda a: host.round_to_bf16(bf16_bits_to_f32(a) if a.dtype == np.uint16 else a)  # noqa: E731
    scale = np.float32(np.log2(np.e) / np.sqrt(hd))
    qs = host.round_to_bf16(q * scale).astype(np.float64) * np.log(2) * np.sqrt(hd)
    return host.reference_attention(qs, widen(k), widen(v), positions, kv_len, window)


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("B,T,H,G,hd,S,kv_len,window", TILE_CASES)
def test_prompt_attention_on_the_tiles_matches_the_rounded_reference(isa, B, T, H, G, hd, S, kv_len, window):
    """Under a tile ISA a prompt chunk's attention runs on the tiles (f32 and bf16 caches,
    numpy entry and the FFI path inside jit): within the bf16 rounding of the softmax
    weights of the reference on bf16-rounded q, k, v; zeros where no key is visible; the
    same bits at any thread count."""
    from ftjax import host
    from ftjax.experts.storage import to_bf16_bits

    assert host.attention_takes_tiles(isa, T, hd)
    q, k, v, positions, kv_len = random_attention_inputs(np.random.default_rng(5), B, T, H, G, hd, S, kv_len)
    for kk, vv, dtype in ((k, v, jnp.float32), (to_bf16_bits(k), to_bf16_bits(v), jnp.bfloat16)):
        ref = rounded_reference(q, kk, vv, positions, kv_len, window)
        runs = [host.attention_numpy(q, kk, vv, positions, kv_len, window, threads=n, isa=isa)
                for n in (1, 3)]
        np.testing.assert_array_equal(runs[0], runs[1])
        np.testing.assert_allclose(runs[0], ref, atol=6e-3, rtol=0)  # measured: up to 3.4e-3
        exact = host.reference_attention(q, kk, vv, positions, kv_len, window)
        assert np.abs(runs[0] - exact).max() > 1e-5  # the tiles really ran (they round)
        if (kv_len == 0).any():
            assert not runs[0][kv_len == 0].any()
        dev = lambda a: jnp.asarray(a.view(jnp.bfloat16) if a.dtype == np.uint16 else a, dtype)  # noqa: E731
        with host.dense_settings(3, isa):
            out = jax.jit(lambda *a: host.attention(*a, window=window))(q, dev(kk), dev(vv), positions, kv_len)
        np.testing.assert_array_equal(np.asarray(out), runs[0])


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("T,hd", [(15, 64), (1, 64), (32, 48), (32, 320)])
def test_calls_the_attention_tiles_do_not_take_keep_the_exact_kernels(isa, T, hd):
    """Decode-sized calls (< 16 tokens) and head dims the tiles do not hold (not a multiple
    of 32, wider than 256) run the exact kernels under a tile ISA, to the bit."""
    from ftjax import host

    assert not host.attention_takes_tiles(isa, T, hd)
    assert not host.attention_takes_tiles(host.Isa.AUTO, 64, 64)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, T, 4, hd)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 40, hd)).astype(np.float32) for _ in range(2))
    positions, kv_len = (np.arange(T, dtype=np.int32) + 40 - T)[None], np.array([40], np.int32)
    np.testing.assert_array_equal(host.attention_numpy(q, k, v, positions, kv_len, isa=isa),
                                  host.attention_numpy(q, k, v, positions, kv_len, isa=host.Isa.AUTO))


def test_the_attention_tile_rule_refuses_without_the_tiles():
    """Where the CPU has no AMX-BF16 tiles (or they failed their self-check) no call takes
    them, nor their vector form without AVX512-BF16, so every prompt keeps the XLA
    attention; no other ISA takes either."""
    from ftjax import host

    assert host.attention_takes_tiles(host.Isa.AMX_BF16, 64, 64) == (TILE_STATUS == "")
    assert host.attention_takes_tiles(host.Isa.AVX512_BF16_TILES, 64, 64) == (VECTOR_STATUS == "")
    for isa in host.Isa:
        if isa not in host.tile_isas():
            assert not host.attention_takes_tiles(isa, 64, 64)

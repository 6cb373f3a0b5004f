"""Quantized K/V in the slot pool (`nn.kv_quant`, `init_pool(..., kv_cache=...)`).

* quantize -> dequantize of random K/V stays within `nn.quant.error_bound` per entry (int8: scale / 2; fp8:
  2^-4 |x| + scale 2^-10), with `nn.quant`'s scales (heads 8 orders of magnitude apart, an all-zero head);
* "float" is the program without the option: the float write is the plain scatter, bit for bit, and a pool
  built with kv_cache="float" decodes the same arrays as one built without the argument;
* a tiny π0.5 pool decoding with int8 / fp8 K/V agrees with float within the bounds of docs/quantization.md:
  int8 the same greedy tokens for the first steps and logits within 0.25 of the float logits' RMS, fp8 within
  1.5 of it (random tiny weights, scaled for diverse text: the worst case; measured in the docs);
* the actions never read the pool (traced, not run): quantized K/V cannot change them;
* a bad storage name, one a decoder cannot take, or quantized K/V for π0-FAST (whose chunks decode in the pool) is
  refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import diverse_text_params, make_obs
from oxygen_jax import cli
from oxygen_jax.models.pi05.model import as_vla
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn import kv_quant, quant
from oxygen_jax.runtime import decode
from oxygen_jax.runtime.engine import Engine, EngineConfig

Q, M, NS, STEPS = 2, 4, 2, 3  # prompt capacity, new tokens, slots, decode steps compared


def _host_dequantize(cache) -> np.ndarray:
    """float32 entries of a float array or a `QuantKV` (numpy: no device program per operation)."""
    if isinstance(cache, kv_quant.QuantKV):
        return np.asarray(cache.values).astype(np.float32) * np.asarray(cache.scale)
    return np.asarray(cache, np.float32)


def _kv(seed=0):
    """Random K/V [Lk, Ns, C, K, H] with heads of very different magnitudes and one all-zero head."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 2, 3, 2, 16)) * np.exp(rng.uniform(-9, 9, (2, 2, 3, 2, 1)))
    x[0, 0, 0, 1] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_round_trip_is_within_the_weight_quantizers_bound_with_its_scales(kind):
    x = _kv()
    q = jax.jit(kv_quant.quantize, static_argnums=1)(x, kind)  # one program, not one per operation
    back = _host_dequantize(q)
    ref = quant.quantize(x, kind, axes=(-1,))  # the weights' host quantizer, H the reduced axis
    assert q.values.dtype == quant.STORED_DTYPE[kind] and q.scale.shape == x.shape[:-1] + (1,)
    np.testing.assert_allclose(np.asarray(q.scale), ref.scale, rtol=2 ** -23, atol=0)
    err = np.abs(back - x)
    assert np.all(err <= quant.error_bound(ref, x)), float(np.max(err / quant.error_bound(ref, x)))
    assert not np.any(back[0, 0, 0, 1])  # a zero head stays zero


def test_the_float_write_is_the_plain_scatter_bit_for_bit():
    x, new = _kv(0), _kv(1)[:1, :, :2]  # one layer's entries [B, T, K, H] for B = 2 rows, T = 2
    rows, index = jnp.arange(2)[:, None], jnp.asarray([[0, 1], [2, 3]])  # row 1's second write (3) is dropped
    cache, read, plain = jax.jit(lambda c, n: (*kv_quant.write_layer(c, 1, rows, index, n),
                                               c.at[1, rows, index].set(n, mode="drop")))(x, new[0])
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(read), np.asarray(plain[1]))


@pytest.fixture(scope="module")
def tiny(tiny_params):
    """The tiny π0.5's language decoder (scaled for diverse text) and a random prefix of 2 rows (P = 8, the
    second row with 3 invalid entries): the pool is under test, not the prefix pass, which is not compiled."""
    lm = as_vla(jax.jit(diverse_text_params)(tiny_params)).language()  # one program, not one per operation
    rng = np.random.default_rng(0)
    kv = (rng.standard_normal((2, len(lm.kv_layers), 2, 8, lm.num_kv_heads, lm.head_dim)) * 2).astype(np.float32)
    mask = np.arange(8)[None] < np.array([8, 5])[:, None]
    hidden = rng.standard_normal((2, tiny_params.config.vlm.width)).astype(np.float32)  # as if final-normed
    return lm, Prefix.every_layer(kv[0], kv[1], mask, np.cumsum(mask, axis=1) - 1, hidden)


def _decode(lm, prefix, kv_cache=None):
    """Two requests (one with a prompt) decoded STEPS steps: (K [Lk, Ns, C, K, H] read back as float32,
    tokens [Ns, M], logits [STEPS, Ns, V])."""
    kw = {} if kv_cache is None else dict(kv_cache=kv_cache)
    pool = decode.init_pool(lm, NS, decode.prefix_length(prefix), M, Q, **kw)
    req = decode.make_requests(NS, Q, [0, 1], rows=[0, 1], prompts=[[11, 12], []], budgets=[M, M], stop_ids=[-1, -1])
    pool, _, _ = decode.admit(lm, pool, prefix, req)
    logits = []
    for _ in range(STEPS):
        pool, _, lg = decode.decode_step(lm, pool)
        logits.append(np.asarray(lg))
    assert pool.kv_cache == (kv_cache or "float")
    return _host_dequantize(pool.k), np.asarray(pool.tokens), np.stack(logits)


@pytest.fixture(scope="module")
def float_run(tiny):
    return _decode(*tiny)


def test_a_float_pool_is_the_pool_without_the_option(tiny, float_run):
    for got, want in zip(_decode(*tiny, "float"), float_run):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind, bound", [("int8", 0.25), ("fp8", 1.5)])
def test_a_quantized_pool_decodes_like_float_within_the_documented_bound(tiny, float_run, kind, bound):
    k_f, tok_f, lg_f = float_run
    k_q, tok_q, lg_q = _decode(*tiny, kind)
    copied = k_f[:, :, :8]  # the prefix rows admission copied: stored quantized, within the per-entry bound
    ref = quant.quantize(copied, kind, axes=(-1,))
    assert np.all(np.abs(k_q[:, :, :8] - copied) <= quant.error_bound(ref, copied) * 1.0001)
    rms = np.sqrt(np.mean(lg_f ** 2))
    assert np.abs(lg_q[0] - lg_f[0]).max() <= bound * rms  # the first step after admission
    if kind == "int8":
        np.testing.assert_array_equal(tok_q[:, :STEPS], tok_f[:, :STEPS])
        assert np.abs(lg_q - lg_f).max() <= bound * rms
    assert len(set(tok_f[:, :STEPS].ravel().tolist())) > 2  # diverse text, not one repeated token


def test_the_actions_never_read_the_pool(tiny_params):
    """Traced only: in the frame program, the actions' outputs depend on no leaf of the (int8) pool."""
    from jax._src.interpreters import partial_eval as pe

    from oxygen_jax.runtime.frame import frame_step

    vla = as_vla(tiny_params)
    obs = make_obs(tiny_params.config, batch=1, cameras=1, prompt_len=8)
    p = decode.prefix_length(jax.eval_shape(lambda v, x: v.prefix(x), vla, obs))
    pool = jax.eval_shape(lambda: decode.init_pool(vla.language(), NS, p, M, Q, kv_cache="int8"))
    req = decode.make_requests(NS, Q, [0], budgets=[M])
    noise = {"actions": jnp.zeros((1, *vla.action_shape("actions", 10)))}
    args = (vla, pool, obs, noise, req, jnp.zeros((NS,), bool))
    closed, out_shape = jax.make_jaxpr(lambda *a: frame_step(*a, tokens_per_frame=1), return_shape=True)(*args)
    outs = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    used_out = ["actions" in jax.tree_util.keystr(path) for path, _ in outs]
    assert any(used_out)
    _, used_in = pe.dce_jaxpr(closed.jaxpr, used_out)
    n_vla, n_pool = len(jax.tree.leaves(vla)), len(jax.tree.leaves(pool))
    assert not any(used_in[n_vla:n_vla + n_pool])  # pool leaves
    assert any(used_in[:n_vla])  # but the weights, as a check that the analysis sees something


def test_bad_storages_are_refused_in_one_line(tiny, monkeypatch):
    lm, _ = tiny
    assert cli.KV_CACHES == kv_quant.KV_CACHES and cli.QUANT_MATMULS == ("auto", *quant.MATMUL_MODES)  # --help's choices
    for call in (lambda: EngineConfig(kv_cache="int4"), lambda: decode.init_pool(lm, 1, 4, 2, kv_cache="bf16")):
        with pytest.raises(ValueError, match="kv_cache must be one of float, int8, fp8") as e:
            call()
        assert "\n" not in str(e.value)
    # A decoder whose attention stores K/V by itself lists float only: int8 is refused, float still built.
    monkeypatch.setattr(type(lm), "kv_caches", property(lambda self: ("float",)))
    with pytest.raises(ValueError, match="stores K/V as float only, not int8: serve it with kv_cache='float'") as e:
        decode.init_pool(lm, 1, 4, 2, kv_cache="int8")
    assert "\n" not in str(e.value)
    assert decode.init_pool(lm, 1, 4, 2).kv_cache == "float"


def test_a_model_whose_action_chunks_decode_in_the_pool_refuses_quantized_kv():
    """π0-FAST's chunks are tokens of the pool: quantized K/V would change its actions (refused before compiling)."""
    from oxygen_jax.models.decoded_actions import ActionStream
    from oxygen_jax.models.pi05 import pi0_fast
    from oxygen_jax.models.pi05.config import fast_config
    from oxygen_jax.models.pi05.params import init_params

    stream = ActionStream(horizon=2, action_dim=3, stop_ids=(1,), max_tokens=4, decode=lambda tokens: None)
    vla = pi0_fast.as_vla(init_params(fast_config("pi0_fast_tiny"), seed=0), stream)
    with pytest.raises(ValueError, match="decodes its action chunks in the slot pool, whose K/V stay float") as e:
        Engine(vla, EngineConfig(num_slots=2, max_new_tokens=4, kv_cache="int8"))
    assert "\n" not in str(e.value)

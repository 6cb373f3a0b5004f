"""π0.5 model: pure pieces against naive references, full-size shapes, compile-once, bad inputs."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_obs
from oxygen_jax.models import backbone as bb
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.vision import siglip
from oxygen_jax.models.pi05.config import model_config
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.masks import last_valid_index, make_attn_mask, positions_from_mask
from oxygen_jax.models.pi05.observation import Observation, validate_observation
from oxygen_jax.nn.layers import RMSNorm, AdaRMSNorm, Dense, apply_rope, attention, dense, param_count
from oxygen_jax.models.pi05.params import abstract_params
from oxygen_jax.models.pi05.spec import pi05_spec
from reference_mot import attn_mask as naive_mask, joint_forward


# --- masks and positions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "ar",
    [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]],
    ids=["prefix_lm", "causal", "two_blocks", "bidirectional"],
)
def test_attn_mask_matches_double_loop_definition(ar):
    input_mask = np.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]], bool)
    got = np.asarray(make_attn_mask(jnp.asarray(input_mask), jnp.asarray(ar, bool)))
    for b in range(2):
        np.testing.assert_array_equal(got[b], naive_mask(input_mask[b], np.asarray(ar)))


def test_prefix_lm_worked_example():
    m = np.asarray(make_attn_mask(jnp.ones((1, 6), bool), jnp.array([0, 0, 0, 1, 1, 1], bool)))[0]
    assert m[:3, :3].all() and not m[:3, 3:].any()  # the prefix never sees the continuation
    assert m[3, :4].all() and not m[3, 4:].any()  # continuation is causal
    assert m[5].all()


def test_positions_skip_invalid_tokens_and_last_valid_index_handles_gaps():
    mask = jnp.array([[1, 1, 0, 0, 1, 1, 0]], bool)
    np.testing.assert_array_equal(positions_from_mask(mask), [[0, 1, 1, 1, 2, 3, 3]])
    assert int(last_valid_index(mask)[0]) == 5  # not sum(mask) - 1 == 3


# --- RoPE, norms, attention (backbone's, with π0.5's spec) ------------------------------------

_PI05 = pi05_spec(model_config("tiny"))


def _rope(x, positions):
    """π0.5's RoPE of x [B, T, N, H] at int positions [B, T]."""
    radians = bb.rope_angles(_PI05.rope, positions, x.shape[-1])[..., None, :]
    return apply_rope(x, jnp.sin(radians), jnp.cos(radians))


def _rms_norm(x, norm, cond=None):
    return bb.rms_norm(_PI05, x, norm, cond)


def test_rope_matches_angle_formula_half_split():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
    pos = np.array([[0, 1, 7, 30, 500]])
    got = np.asarray(_rope(jnp.asarray(x), jnp.asarray(pos)))
    for t in range(5):
        for i in range(4):
            a = pos[0, t] / 10000 ** (2 * i / 8)
            x1, x2 = x[0, t, :, i], x[0, t, :, i + 4]
            np.testing.assert_allclose(got[0, t, :, i], x1 * np.cos(a) - x2 * np.sin(a), atol=2e-5)
            np.testing.assert_allclose(got[0, t, :, i + 4], x2 * np.cos(a) + x1 * np.sin(a), atol=2e-5)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))
    score = lambda pq, pk: float(  # noqa: E731
        jnp.sum(_rope(q, jnp.array([[pq]])) * _rope(k, jnp.array([[pk]])))
    )
    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)


def test_rms_norm_plain_uses_one_plus_scale():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 8)), jnp.float32)
    scale = jnp.linspace(-0.5, 0.5, 8)
    got, gate = _rms_norm(x, RMSNorm(scale=scale))
    xn = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, xn * (1 + np.asarray(scale)), rtol=1e-5, atol=1e-6)
    assert gate is None


def test_ada_rms_norm_splits_scale_shift_gate_in_that_order():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    cond = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
    kern, bias = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((5, 12), (12,)))
    got, gate = _rms_norm(x, AdaRMSNorm(modulation=Dense(kernel=kern, bias=bias)), cond)
    mod = np.asarray(cond) @ np.asarray(kern) + np.asarray(bias)
    xn = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, xn * (1 + mod[:, None, :4]) + mod[:, None, 4:8], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate, mod[:, None, 8:], rtol=1e-6)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_per_head_reference(kv_heads):
    rng = np.random.default_rng(kv_heads)
    b, t, s, n, h = 2, 3, 5, 4, 8
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, kv_heads, h)).astype(np.float32) for _ in range(2))
    mask = rng.uniform(size=(b, t, s)) > 0.3
    mask[..., 0] = True
    got = np.asarray(attention(*(jnp.asarray(a) for a in (q, k, v, mask))))
    for bi in range(b):
        for head in range(n):
            kvh = head // (n // kv_heads)
            logits = np.where(mask[bi], q[bi, :, head] @ k[bi, :, kvh].T, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(got[bi, :, head], p @ v[bi, :, kvh], rtol=1e-5, atol=1e-5)


class PureFunctionsAgreeWithAndWithoutJit(chex.TestCase):
    """The layer pieces are pure functions: traced or eager, they give the same values and shapes."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention_rope_norm_and_mask(self):
        rng = np.random.default_rng(7)
        q = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(2, 5, 2, 8)), jnp.float32) for _ in range(2))
        input_mask = jnp.asarray([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]], bool)
        mask = make_attn_mask(input_mask, jnp.asarray([0, 0, 1, 1, 1], bool))[:, 2:]  # 3 queries over 5 keys
        pos = positions_from_mask(input_mask)[:, 2:]

        def layer(q, k, v, mask, pos):
            qr = _rope(q, pos)
            out = attention(qr, k, v, mask)
            normed, _ = _rms_norm(out.reshape(2, 3, 32), RMSNorm(scale=jnp.full((32,), 0.1)))
            return out, normed

        out, normed = self.variant(layer)(q, k, v, mask, pos)
        chex.assert_shape(out, (2, 3, 4, 8))
        chex.assert_shape(normed, (2, 3, 32))
        chex.assert_tree_all_finite((out, normed))
        ref = layer(q, k, v, mask, pos)  # eager reference
        chex.assert_trees_all_close((out, normed), ref, atol=1e-6, rtol=1e-6)


def test_attention_rejects_mask_of_wrong_shape():
    q = jnp.zeros((1, 2, 2, 4))
    k = jnp.zeros((1, 3, 1, 4))
    with pytest.raises(ValueError, match="mask must be"):
        attention(q, k, k, jnp.ones((1, 2, 2), bool))


def test_siglip_patch_embedding_equals_strided_convolution(tiny_params):
    sp = tiny_params.siglip
    images = jnp.asarray(np.random.default_rng(4).uniform(-1, 1, (2, 56, 56, 3)), jnp.float32)
    ours = siglip.stem(sp, images)
    conv = jax.lax.conv_general_dilated(
        images, sp.patch.kernel, window_strides=(14, 14), padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    ) + sp.patch.bias
    np.testing.assert_allclose(ours, conv.reshape(2, -1, conv.shape[-1]), rtol=1e-5, atol=1e-5)


# --- the mixture of transformers ---------------------------------------------------------------


@pytest.mark.parametrize("prompt_attention", ["bidirectional", "causal"])
def test_prefill_then_cached_velocity_equals_joint_forward(tiny_params, prompt_attention):
    params = tiny_params.with_config(prompt_attention=prompt_attention)
    obs = make_obs(params.config, batch=2, cameras=2, image_masks=[[True, True], [True, False]])
    x_t = jax.random.normal(jax.random.key(0), (2, 4, 32))
    t = jnp.array([0.7, 0.2])
    fast = np.asarray(model.velocity(params, model.prefill(params, obs), x_t, t))
    tokens, input_mask, ar = model.embed_prefix(params, obs)
    cond = model.time_condition(params, t)
    suffix = dense(params.action_in, x_t)
    for b in range(2):
        full_mask = np.concatenate([np.asarray(input_mask[b]), np.ones(4, bool)])
        full_ar = np.concatenate([np.asarray(ar), [True, False, False, False]])
        _, out = joint_forward(params, [tokens[b], suffix[b]], full_mask, full_ar, cond[b])
        ref = out @ np.asarray(params.action_out.kernel) + np.asarray(params.action_out.bias)
        np.testing.assert_allclose(fast[b], ref, rtol=2e-4, atol=2e-4)


def test_next_position_is_the_largest_valid_position_plus_one_on_any_rope_axis():
    """π0.5 / text prefixes (positions cumsum(mask) - 1): next_position == num_valid for any mask. An
    M-RoPE prefix, whose image tokens share positions, continues after its largest valid position."""
    mask = jnp.asarray([[1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], bool)
    kv, hidden = jnp.zeros((1, 3, 6, 1, 2)), jnp.zeros((3, 4))
    text = Prefix.every_layer(kv, kv, mask, positions_from_mask(mask), hidden)
    np.testing.assert_array_equal(text.next_position, text.num_valid)
    np.testing.assert_array_equal(text.next_position, [3, 4, 0])
    # Row 0: text 0, a 2x2 image at t = 1 (h, w in 1..2), text 3. Row 1: its first five tokens,
    # left-padded; the padding slot holds a position (99) that must not count.
    t, h, w = [0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]
    pad = lambda a: [99] + a[:-1]  # noqa: E731
    positions = jnp.asarray([[t, pad(t)], [h, pad(h)], [w, pad(w)]], jnp.int32)  # [R, B, P]
    mrope = Prefix.every_layer(kv[:, :2], kv[:, :2], jnp.asarray([[True] * 6, [False] + [True] * 5]), positions,
                               hidden[:2])
    np.testing.assert_array_equal(mrope.next_position, [4, 3])  # < num_valid = [6, 5]
    chex.assert_shape(mrope.row(1).positions, (3, 1, 6))
    np.testing.assert_array_equal(mrope.row(1).next_position, [3])


def test_loss_is_mean_squared_velocity_error(tiny_params):
    obs = make_obs(tiny_params.config, batch=2)
    keys = jax.random.split(jax.random.key(1), 2)
    actions, noise = jax.random.normal(keys[0], (2, 4, 32)), jax.random.normal(keys[1], (2, 4, 32))
    time = jnp.array([0.3, 0.9])
    loss = model.compute_loss(tiny_params, obs, actions, noise, time)
    x_t = time[:, None, None] * noise + (1 - time[:, None, None]) * actions
    v = model.velocity(tiny_params, model.prefill(tiny_params, obs), x_t, time)
    np.testing.assert_allclose(loss, jnp.mean((v - (noise - actions)) ** 2, -1), rtol=1e-5)
    assert loss.shape == (2, 4)


def test_denoise_is_euler_integration_of_velocity(tiny_params):
    obs = make_obs(tiny_params.config, batch=1)
    cache = model.prefill(tiny_params, obs)
    noise = jax.random.normal(jax.random.key(2), (1, 4, 32))
    x, t = noise, 1.0
    for _ in range(3):
        x = x - (1 / 3) * model.velocity(tiny_params, cache, x, jnp.full((1,), t))
        t -= 1 / 3
    np.testing.assert_allclose(model.denoise(tiny_params, cache, noise, 3), x, rtol=1e-4, atol=5e-5)


def test_padding_camera_dropped_gives_same_actions_and_cache_as_keep_and_mask(tiny_params):
    obs3 = make_obs(tiny_params.config, batch=2, cameras=3, image_masks=[[True, True, False], [True, True, False]])
    obs2 = dataclasses.replace(obs3, images=obs3.images[:, :2], image_masks=obs3.image_masks[:, :2])
    noise = jax.random.normal(jax.random.key(3), (2, 5, 32))
    a3 = model.sample_actions(tiny_params, obs3, noise, 4)
    a2 = model.sample_actions(tiny_params, obs2, noise, 4)
    np.testing.assert_allclose(a2, a3, rtol=1e-5, atol=1e-5)
    c3, c2 = model.prefill(tiny_params, obs3), model.prefill(tiny_params, obs2)
    keep = np.asarray(c3.mask[0])
    np.testing.assert_allclose(np.asarray(c3.k)[:, 0, keep], np.asarray(c2.k)[:, 0, np.asarray(c2.mask[0])], atol=1e-5)
    assert c2.length == c3.length - tiny_params.config.siglip.num_patches  # a third less prefix


def test_per_row_camera_masks_match_dropping_that_camera_for_that_row(tiny_params):
    obs = make_obs(tiny_params.config, batch=2, cameras=2, image_masks=[[True, True], [True, False]])
    noise = jax.random.normal(jax.random.key(4), (2, 5, 32))
    both = model.sample_actions(tiny_params, obs, noise, 3)
    row1 = Observation(obs.images[1:, :1], obs.image_masks[1:, :1], obs.tokens[1:], obs.token_mask[1:])
    alone = model.sample_actions(tiny_params, row1, noise[1:], 3)
    np.testing.assert_allclose(both[1:], alone, rtol=1e-5, atol=1e-5)


# --- shapes, compilation, errors ---------------------------------------------------------------


def test_full_size_pi05_shapes_via_eval_shape():
    cfg = model_config("pi05")
    params = abstract_params(cfg)
    assert param_count(params) == 3_353_433_872
    obs = jax.ShapeDtypeStruct
    observation = Observation(
        images=obs((1, 2, 224, 224, 3), jnp.float32), image_masks=obs((1, 2), jnp.bool_),
        tokens=obs((1, 200), jnp.int32), token_mask=obs((1, 200), jnp.bool_),
    )
    cache = jax.eval_shape(model.prefill, params, observation)
    assert cache.k.shape == (18, 1, 2 * 256 + 200, 1, 256)
    assert cache.last_hidden.shape == (1, 2048)
    actions = jax.eval_shape(lambda p, c, n: model.denoise(p, c, n, 10), params, cache, obs((1, 10, 32), jnp.float32))
    assert actions.shape == (1, 10, 32)


def test_bench_preset_dimensions_are_exact():
    cfg = model_config("bench")
    assert (cfg.vlm.width, cfg.vlm.depth, cfg.vlm.mlp_dim, cfg.vlm.num_heads, cfg.vlm.num_kv_heads, cfg.vlm.head_dim) == (1024, 8, 4096, 8, 1, 128)
    a = cfg.action_expert
    assert (a.width, a.depth, a.mlp_dim, a.num_heads, a.num_kv_heads, a.head_dim) == (512, 8, 2048, 8, 1, 128)
    s = cfg.siglip
    assert (s.width, s.depth, s.mlp_dim, s.num_heads, s.patch_size, s.image_size) == (384, 6, 1536, 6, 14, 224)
    assert cfg.vocab_size == 257_152


def test_prefill_and_denoise_trace_once_for_a_fixed_shape(tiny_params):
    traces = {"prefill": 0, "denoise": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            traces[name] += 1  # runs only while tracing
            return fn(*args, **kwargs)
        return wrapper

    prefill = jax.jit(counted("prefill", model.prefill.__wrapped__))
    denoise = jax.jit(counted("denoise", model.denoise.__wrapped__), static_argnames=("num_steps",))
    for seed in range(3):  # new values (prompts, images, masks, noise), same shapes
        obs = make_obs(tiny_params.config, batch=1, seed=seed, lengths=[3 + seed], image_masks=[[True, seed % 2 == 0]])
        cache = prefill(tiny_params, obs)
        denoise(tiny_params, cache, jax.random.normal(jax.random.key(seed), (1, 4, 32)), num_steps=2)
    assert traces == {"prefill": 1, "denoise": 1}


def test_unknown_presets_and_bad_config_values_are_named():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        model_config("huge")
    with pytest.raises(ValueError, match="prompt_attention"):
        model_config("tiny", prompt_attention="sideways")
    with pytest.raises(ValueError, match="num_kv_heads"):
        model_config("tiny").vlm.__class__(width=8, depth=1, mlp_dim=8, num_heads=3, num_kv_heads=2, head_dim=4)


def test_bad_observations_raise_errors_naming_the_problem(tiny_params):
    cfg = tiny_params.config
    good = make_obs(cfg, batch=1)
    with pytest.raises(ValueError, match="image_size=56"):
        model.prefill(tiny_params, dataclasses.replace(good, images=jnp.zeros((1, 2, 64, 64, 3))))
    with pytest.raises(ValueError, match="floating point"):
        validate_observation(dataclasses.replace(good, images=good.images.astype(jnp.uint8)), cfg)
    with pytest.raises(ValueError, match="image_masks"):
        model.prefill(tiny_params, dataclasses.replace(good, image_masks=jnp.ones((1, 3), bool)))
    with pytest.raises(ValueError, match="2 real camera slots"):
        validate_observation(make_obs(cfg, batch=1, cameras=1), cfg, num_cameras=2)
    with pytest.raises(ValueError, match="token_mask"):
        model.prefill(tiny_params, dataclasses.replace(good, token_mask=good.token_mask.astype(jnp.int32)))
    with pytest.raises(ValueError, match="NaN"):
        validate_observation(dataclasses.replace(good, images=good.images.at[0, 0, 0, 0, 0].set(jnp.nan)), cfg)
    with pytest.raises(ValueError, match="token ids must lie"):
        validate_observation(dataclasses.replace(good, tokens=good.tokens.at[0, 0].set(cfg.vocab_size)), cfg)


def test_trimming_prompt_padding_changes_no_output(tiny_params):
    from oxygen_jax.models.pi05.observation import trim_prompt_padding

    obs = make_obs(tiny_params.config, batch=2, prompt_len=40, lengths=[5, 9])
    short = trim_prompt_padding(obs, bucket=8)
    assert short.tokens.shape == (2, 16)
    noise = jax.random.normal(jax.random.key(6), (2, 4, 32))
    np.testing.assert_allclose(model.sample_actions(tiny_params, short, noise, 2),
                               model.sample_actions(tiny_params, obs, noise, 2), atol=1e-5)


def test_unstacked_layer_loop_gives_the_same_outputs_and_checkpoint_tree(tiny_params):
    from oxygen_jax.runtime import decode
    from oxygen_jax.models.pi05.params import stack_layers, to_openpi_dict, unstack_layers

    unstacked = unstack_layers(tiny_params)
    obs = make_obs(tiny_params.config, batch=1, image_masks=[[True, False]])
    noise = jax.random.normal(jax.random.key(7), (1, 4, 32))
    np.testing.assert_allclose(model.sample_actions(unstacked, obs, noise, 2),
                               model.sample_actions(tiny_params, obs, noise, 2), atol=1e-6)
    tokens = []
    for p in (tiny_params, unstacked):
        cache = model.prefill(p, obs)
        pool = decode.init_pool(model.language_model(p), 1, cache.length, 5)
        pool, _, _ = decode.admit(model.language_model(p), pool, cache, decode.make_requests(1, 0, [0], budgets=[5], stop_ids=[-1]))
        tokens.append(np.asarray(decode.decode_to_completion(model.language_model(p), pool).tokens).tolist())
    assert tokens[0] == tokens[1]
    chex.assert_trees_all_equal(to_openpi_dict(unstacked), to_openpi_dict(tiny_params))
    chex.assert_trees_all_equal_structs(stack_layers(unstacked), tiny_params)

"""The spec-driven backbone: π0.5's Gemma is one instance of it, Qwen3 / Qwen3-VL invariants, full-size shapes."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.lora import layer_dims
from oxygen_jax.models.pi05 import model
from oxygen_jax.models.vision import qwen3_vl
from oxygen_jax.models.pi05.spec import from_expert_layers, pi05_spec
from oxygen_jax.nn.layers import Unstacked

_prefill = jax.jit(bb.forward_prefill, static_argnames=("return_hidden",))
_write = jax.jit(bb.forward_write)


# --------------------------------------------------------------------------------------------------
# π0.5 as an instance of the spec


def test_pi05_experts_are_instances_of_the_spec_and_the_weights_carry_its_dims(tiny_params):
    """π0.5 runs on backbone (pi05/model.py, decode.py: `pi05.spec.pi05_spec`); the dims read off the
    weights (`lora.layer_dims`, what LoRA banks are checked against) are the spec's, for stacked and
    unstacked layers. The numbers themselves are pinned by the plain joint forward (test_model), cached
    decode == recompute (test_decode) and openpi parity."""
    cfg, p = tiny_params.config, tiny_params
    vlm = pi05_spec(cfg)
    assert (vlm.mlp, vlm.norm_plus_one, vlm.qk_norm, vlm.embed_scale, vlm.tie_embeddings) == ("geglu_tanh", True, False, True, True)
    assert vlm.vision == cfg.siglip and pi05_spec(cfg, "action_expert").vision is None
    assert pi05_spec(cfg.replace(prompt_attention="causal")).prefix_attention == "causal"
    for name in ("vlm", "action_expert"):
        stacked = getattr(p, name).layers
        unstacked = Unstacked(layers=tuple(_numpy_layers(stacked, i) for i in range(cfg.vlm.depth)))
        want = pi05_spec(cfg, name)
        dims = (want.width, want.depth, want.mlp_dim, want.num_heads, want.num_kv_heads, want.head_dim)
        assert layer_dims(stacked) == dims and layer_dims(unstacked) == dims
    with pytest.raises(ValueError, match="expert must be 'vlm' or 'action_expert'"):
        pi05_spec(cfg, "vision")
    converted = from_expert_layers(p.vlm.layers)
    assert converted.q is p.vlm.layers.q and converted.q_norm is None
    decoder = model.vlm_decoder(p)
    assert decoder.embedding is p.embedding and decoder.layers is p.vlm.layers and decoder.lm_head is None


# --------------------------------------------------------------------------------------------------
# Qwen3 / Qwen3-VL stacks on random weights


def _numpy_layers(layers, index):
    """One layer (int index: unstacked) or a stacked slice (slice index) as host arrays: no eager device ops."""
    return jax.tree.map(lambda a: np.asarray(a)[index], layers)


def test_qwen3_cached_decode_equals_a_full_forward_over_the_longer_sequence():
    """Untied head, q/k-norm, 1-D RoPE, a left-padded row; M-RoPE decoding is checked the same way in
    test_qwen3_parity (cached greedy tokens == cache-free recompute)."""
    spec = bb.preset("qwen3_tiny")
    decoder = bb.init_decoder(spec, seed=2)
    ids = np.asarray([[7, 8, 9, 10, 11, 12, 5, 6], [0, 0, 0, 13, 14, 15, 7, 8]], np.int32)
    full_mask = ids > 0
    b, t, extra = 2, 6, 2
    x_full = bb.embed_tokens(spec, decoder, jnp.asarray(ids))
    full_pos = np.cumsum(full_mask, -1, dtype=np.int32) - 1
    h_full, (k_full, v_full) = _prefill(spec, decoder.layers, x_full, full_pos, bb.prefix_mask(spec, jnp.asarray(full_mask)))

    # The cache holds the prefix only (causal: its K/V do not depend on later tokens); then one token at a time.
    ck, cv = k_full.at[:, :, t:].set(0.0), v_full.at[:, :, t:].set(0.0)
    cached = []
    for j in range(extra):
        cache_mask = np.concatenate([full_mask[:, :t], np.arange(extra)[None].repeat(b, 0) <= j], 1)
        h, (ck, cv) = _write(spec, decoder.layers, x_full[:, t + j:t + j + 1], full_pos[:, t + j:t + j + 1],
                             cache_mask[:, None], ck, cv, np.full((b, 1), t + j, np.int32))
        cached.append(h[:, 0])
    chex.assert_trees_all_close(jnp.stack(cached, 1), h_full[:, t:], atol=1e-5)
    chex.assert_trees_all_close(ck[:, :, t:], k_full[:, :, t:], atol=1e-5)  # K stored after q/k-norm and RoPE
    normed = bb.final_norm(spec, decoder, cached[-1])
    chex.assert_trees_all_close(bb.lm_logits_vocab_major(spec, decoder, normed), bb.lm_logits(spec, decoder, normed).T, atol=1e-5)
    assert decoder.lm_head is not None  # the untied head is the one used
    assert not np.allclose(bb.lm_logits(spec, decoder, normed), normed @ decoder.embedding.T, atol=1e-2)


def test_deepstack_is_added_after_the_first_layers_and_hidden_states_are_recorded_before_it():
    """x_{l+1} = layer_l(x_l) + deepstack_l for l < E, HF records layer_l(x_l); checked layer by layer on
    M-RoPE positions of a prompt with an image. The stack runs on `Unstacked` layers (the CPU form, a
    static layer index); the scanned form with a traced index is what the parity tests run."""
    spec = bb.preset("qwen3vl_tiny")
    decoder = bb.init_decoder(spec, seed=1)
    img = 500
    ids = np.asarray([[7, 8, 502, img, img, img, img, 503, 9, 10],
                      [0, 0, 0, 11, 12, 13, 14, 15, 16, 17]], np.int32)
    input_mask = ids > 0
    positions, _ = qwen3_vl.mrope_positions(ids, input_mask, [(1, 4, 4)], image_token_id=img, spatial_merge_size=2)
    assert not np.array_equal(positions[0], positions[2])  # the axes really differ
    x = bb.embed_tokens(spec, decoder, jnp.asarray(ids))
    e = len(spec.vision.deepstack_layers)
    ds = 3.0 * np.random.default_rng(3).standard_normal((e,) + x.shape, np.float32) * (ids == img)[None, ..., None]
    mask = bb.prefix_mask(spec, jnp.asarray(input_mask))
    unstacked = Unstacked(layers=tuple(_numpy_layers(decoder.layers, i) for i in range(spec.depth)))
    h, _, layer_out = _prefill(spec, unstacked, x, positions, mask, deepstack=ds, return_hidden=True)

    xi, recorded = x, []
    for i in range(spec.depth):
        xi, _ = _prefill(spec, _numpy_layers(decoder.layers, slice(i, i + 1)), xi, positions, mask)
        recorded.append(xi)
        xi = xi + ds[i] if i < e else xi
    chex.assert_trees_all_close(layer_out, jnp.stack(recorded), atol=1e-5)
    chex.assert_trees_all_close(h, xi, atol=1e-5)
    assert e == 2 < spec.depth and float(jnp.max(jnp.abs(layer_out[2] - recorded[2]))) < 1e-5


def test_interleaved_mrope_with_equal_axes_is_1d_rope_and_follows_the_qwen3vl_layout():
    rope = bb.RopeSpec(theta=5e6, kind="mrope_interleaved", mrope_section=(24, 20, 20))
    pos = jnp.asarray([[0, 3, 17, 4000]], jnp.int32)
    np.testing.assert_array_equal(bb.rope_angles(rope, pos, 128), bb.rope_angles(bb.RopeSpec(theta=5e6), pos, 128))
    axis = bb._mrope_axis_map((24, 20, 20), 128)
    assert list(np.flatnonzero(axis == 1)) == list(range(1, 60, 3))
    assert list(np.flatnonzero(axis == 2)) == list(range(2, 60, 3))
    # distinct axes: frequency 1 follows h, frequency 2 follows w, frequency 0 and 60+ follow t
    angles = np.asarray(bb.rope_angles(rope, jnp.asarray([[[10]], [[20]], [[30]]]), 128)[0, 0])
    timescale = 5e6 ** ((2.0 / 128) * np.arange(64, dtype=np.float32))
    np.testing.assert_allclose(angles[[0, 1, 2, 60, 63]], np.asarray([10, 20, 30, 10, 10]) / timescale[[0, 1, 2, 60, 63]], rtol=1e-6)


def test_specs_reject_inconsistent_dimensions_with_a_message_naming_the_field():
    with pytest.raises(ValueError, match="mrope_section"):
        bb.preset("qwen3vl_tiny").replace(rope=bb.RopeSpec(theta=1e4, kind="mrope_interleaved", mrope_section=(4, 4, 4)))
    with pytest.raises(ValueError, match="num_kv_heads"):
        bb.preset("qwen3_tiny").replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="out_width"):
        bb.preset("qwen3vl_tiny").replace(width=32)
    with pytest.raises(ValueError, match="unknown backbone preset"):
        bb.preset("qwen4")


# --------------------------------------------------------------------------------------------------
# Qwen3-VL positions and patches (host-side geometry)


def test_mrope_positions_worked_example_with_left_padding():
    img = 9
    ids = np.asarray([[1, 2, 3, img, img, img, img, 4, 5, 6],
                      [0, 0, 3, img, img, img, img, img, img, 4]])
    pos, nxt = qwen3_vl.mrope_positions(ids, ids > 0, [(1, 4, 4), (1, 4, 6)], image_token_id=img, spatial_merge_size=2)
    #                 a  b  <s> 2x2 image    <e> c  d
    np.testing.assert_array_equal(pos[:, 0], [[0, 1, 2, 3, 3, 3, 3, 5, 6, 7],
                                              [0, 1, 2, 3, 3, 4, 4, 5, 6, 7],
                                              [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]])
    #                 pad  <s> 2x3 image           <e>
    np.testing.assert_array_equal(pos[:, 1], [[0, 0, 0, 1, 1, 1, 1, 1, 1, 4],
                                              [0, 0, 0, 1, 1, 1, 2, 2, 2, 4],
                                              [0, 0, 0, 1, 2, 3, 1, 2, 3, 4]])
    np.testing.assert_array_equal(nxt, [8, 5])
    np.testing.assert_array_equal(qwen3_vl.decode_positions(nxt, 3), [[8, 9, 10], [5, 6, 7]])
    with pytest.raises(ValueError, match="consecutive image tokens"):
        qwen3_vl.mrope_positions(ids, ids > 0, [(1, 4, 6), (1, 4, 6)], image_token_id=img, spatial_merge_size=2)
    with pytest.raises(ValueError, match="3 image grids given but the prompts hold 2"):
        qwen3_vl.mrope_positions(ids, ids > 0, [(1, 4, 4), (1, 4, 6), (1, 2, 2)], image_token_id=img, spatial_merge_size=2)


def test_patchify_orders_patches_by_merge_window_and_repeats_the_frame():
    vspec = bb.preset("qwen3vl_tiny").vision
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    pv, grid = qwen3_vl.patchify(image, vspec)
    assert grid == (1, 4, 6) and pv.shape == (24, 3 * 2 * 16 * 16)
    norm = (image.astype(np.float32) / 255 - 0.5) / 0.5
    patch = pv.reshape(24, 3, 2, 16, 16)
    # LLM token 1 = merge window (row 0, col 1) = patches (0,2) (0,3) (1,2) (1,3): its 3rd patch is (1, 2).
    np.testing.assert_allclose(patch[4 + 2, :, 0], norm[16:32, 32:48].transpose(2, 0, 1), atol=1e-6)
    np.testing.assert_array_equal(patch[:, :, 0], patch[:, :, 1])
    with pytest.raises(ValueError, match="multiples of 32"):
        qwen3_vl.patchify(image[:48], vspec)


# --------------------------------------------------------------------------------------------------
# Full size, never allocated


def test_full_size_qwen3_vl_4b_parameter_count_matches_the_published_4_44b():
    """4,437,815,808 = sum of `p.numel()` over transformers' Qwen3VLForConditionalGeneration built from
    Qwen/Qwen3-VL-4B-Instruct (tied head counted once); the Hugging Face model page rounds it to 4.4B.
    Recomputed from its config.json: text 36 x 100,930,816 + 388,956,160 embedding + 2,560 final norm
    = 4,022,468,096; ViT 415,347,712 (incl. three DeepStack mergers)."""
    spec = bb.preset("qwen3_vl_4b")
    decoder = bb.abstract_decoder(spec, "bfloat16")
    vision = qwen3_vl.abstract_vision(spec.vision, "bfloat16")
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    assert count(decoder) == 4_022_468_096
    assert count(vision) == 415_347_712
    total = count(decoder) + count(vision)
    assert abs(total - 4.44e9) / 4.44e9 < 0.01
    assert total == 4_437_815_808
    chex.assert_shape(decoder.layers.kv, (36, 2, 8, 2560, 128))
    chex.assert_shape(vision.deepstack.fc2.kernel, (3, 4096, 2560))
    assert decoder.lm_head is None  # tied

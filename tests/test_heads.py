"""Action heads (models/heads/): full-size sizes by eval_shape, what each kind reads, time and masks, a plain numpy
reading of the published blocks, validation.

The heads run here on a synthetic `Prefix` (random K/V and hidden states of the tiny Qwen3-VL
backbone's shapes, one row with two padded positions); tests/test_mot.py runs them on a real prefix pass.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxygen_jax.models import backbone as bb
from oxygen_jax.models import heads as hd
from oxygen_jax.models.heads import joint, parts
from oxygen_jax.models import mot
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import param_count

QWEN3_VL_4B = 4_437_815_808  # tests/test_backbone.py: Qwen3-VL-4B by eval_shape (text + ViT)


def _count(tree) -> int:
    return param_count(tree)


# --------------------------------------------------------------------------------------------------
# Full size, never allocated


def test_full_size_xr0_is_within_1_percent_of_the_published_4_7b():
    spec = mot.preset("xr0")
    params = mot.abstract_model(spec, "bfloat16")
    head = params.heads["xr0"]
    per_layer = 1024 * 3072 + 3072 + 1024 * 1024 + 2 * 128 + 3 * 1024 * 4096 + 4 * 1024 + 6 * 1024
    io = (256 * 1024 + 1024 * 1024) + (1024 * 6144 + 6144) + 1024 + 2 * (32 * 1024 + 1024 * 1024) + (1024 * 32 + 32 * 32)
    assert _count(head) == 16 * per_layer + io == 278_458_368
    total = _count(params)
    assert total == QWEN3_VL_4B + 278_458_368 == 4_716_274_176
    assert abs(total - 4.7e9) / 4.7e9 < 0.01
    chex.assert_shape(head.layers.kv.kernel, (16, 2, 1024, 8, 128))  # the VLM's 8 KV heads x 128
    chex.assert_shape(head.layers.adaln, (16, 6, 1024))
    assert spec.reads() == mot.PrefixReads(tuple(range(20, 36)), (), False)  # the tail 16 of 36 layers


def test_full_size_starvla_qwenpi_v3_matches_the_published_table_up_to_weights_its_inference_never_runs():
    """QwenPI_v3.py's docstring: action_model 538,678,305 + project_layers 94,593,024, TOTAL 5,071,087,137.
    The head here holds only what inference runs: no DiT output block (proj_out_1 1024 -> 2048, proj_out_2 to
    GR00T's default output_dim 26) and no state encoder (QwenPI_v3 writes the state into the prompt)."""
    spec = mot.preset("starvla_qwenpi_v3")
    params = mot.abstract_model(spec, "bfloat16")
    head = params.heads["starvla_qwenpi_v3"]
    assert _count(head.hidden_proj) == 94_593_024 == 36 * (2 * 2560 + 2560 * 1024 + 1024)
    never_run = (1024 * 2048 + 2048) + (1024 * 26 + 26) + (7 * 1024 + 1024 + 1024 * 1024 + 1024)
    assert never_run == 3_183_642
    assert _count(head) - _count(head.hidden_proj) + never_run == 538_678_305
    total = _count(params)
    assert total + never_run == 5_071_087_137
    assert abs(total - 5.07e9) / 5.07e9 < 0.01
    chex.assert_shape(head.blocks.kv.kernel, (36, 2, 1024, 16, 64))  # every block cross-attends to 1024-wide context
    assert spec.reads().hidden_layers == tuple(range(1, 37))  # hidden_states[-36:]


def test_full_size_gr00t_alternates_cross_and_self_blocks_and_reads_the_last_hidden_state_only():
    spec = mot.preset("gr00t")
    head = mot.abstract_model(spec, "bfloat16").heads["gr00t"]
    chex.assert_shape(head.blocks.cross.kv.kernel, (8, 2, 2560, 12, 64))  # cross blocks read the 2560-wide VLM output
    chex.assert_shape(head.blocks.self_.kv.kernel, (8, 2, 768, 12, 64))
    chex.assert_shape(head.out_proj.kernel, (768, 1024))
    assert head.hidden_proj is None and _count(head) == 161_472_775
    assert spec.reads() == mot.PrefixReads((), (36,), False)


def test_bench_heads_are_scaled_down_to_the_bench_backbone():
    spec = mot.preset("bench")
    counts = {n: _count(p) for n, p in mot.abstract_model(spec).heads.items()}
    assert counts == {"xr0": 19_348_992, "starvla_qwenpi_v3": 35_878_919, "gr00t": 11_782_791}
    assert spec.head("xr0").kv_layers == (4, 5, 6, 7) and spec.reads().kv_layers == tuple(range(8))


# --------------------------------------------------------------------------------------------------
# Time, positions and masks


def test_time_inputs_follow_each_models_convention():
    step = jnp.arange(5)
    xr0, starvla = hd.preset("xr0"), hd.preset("starvla_qwenpi_v3")
    t, t_in = jax.vmap(lambda s: parts.time_input(xr0, s))(step)  # continuous t * 1000, t: 0 -> 1
    np.testing.assert_allclose(t_in, [0, 200, 400, 600, 800], rtol=1e-6)
    _, buckets = jax.vmap(lambda s: parts.time_input(xr0.replace(time_input="bucket", num_steps=10), s))(jnp.arange(10))
    np.testing.assert_array_equal(buckets, np.arange(10) * 100)  # integer floor: 0.7 * 1000 is 700, not 699
    _, b4 = jax.vmap(lambda s: parts.time_input(starvla, s))(jnp.arange(4))
    np.testing.assert_array_equal(b4, [0, 250, 500, 750])  # int(t * 1000) of QwenPI_v3, 4 steps
    t_back, _ = jax.vmap(lambda s: parts.time_input(xr0.replace(t_direction="1_to_0"), s))(step)
    np.testing.assert_allclose(t_back, [1.0, 0.8, 0.6, 0.4, 0.2], rtol=1e-6)


def test_sinusoid_conventions_worked_example():
    """dim 4 (two frequencies): freq_shift 0 -> [1, 1e-2] (XR0); freq_shift 1 -> [1, 1e-4] (diffusers'
    downscale_freq_shift=1); cos first (XR0 and diffusers' flip_sin_to_cos) or sin first (GR00T's action encoder)."""
    t = jnp.asarray([2.0])
    np.testing.assert_allclose(parts.sinusoid(t, 4, cos_first=True), [[np.cos(2), np.cos(0.02), np.sin(2), np.sin(0.02)]], rtol=1e-6)
    np.testing.assert_allclose(parts.sinusoid(t, 4, cos_first=True, freq_shift=1),
                               [[np.cos(2), np.cos(2e-4), np.sin(2), np.sin(2e-4)]], rtol=1e-6)
    np.testing.assert_allclose(parts.sinusoid(t, 4, cos_first=False), [[np.sin(2), np.sin(0.02), np.cos(2), np.cos(0.02)]], rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# Heads on a synthetic prefix


def _synthetic_prefix(seed: int = 0, b: int = 2, p: int = 7) -> Prefix:
    """Random K/V of all 3 layers and hidden states 0..3 of the tiny Qwen3-VL backbone; row 1 has 2 padded slots."""
    spec = bb.preset("qwen3vl_tiny")
    rng = np.random.default_rng(seed)
    ell, k, h, d = spec.depth, spec.num_kv_heads, spec.head_dim, spec.width
    mask = np.ones((b, p), bool)
    mask[1, :2] = False
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return Prefix(
        k=normal(ell, b, p, k, h), v=normal(ell, b, p, k, h), hidden=normal(ell + 1, b, p, d), mask=jnp.asarray(mask),
        positions=jnp.asarray(np.where(mask, np.cumsum(mask, -1) - 1, 0), jnp.int32),
        next_position=jnp.asarray([p, p - 2], jnp.int32), last_hidden=None, kv_layers=tuple(range(ell)),
        hidden_layers=tuple(range(ell + 1)), rope=spec.rope,
    )


def _replace_at(prefix: Prefix, field: str, index, value: float) -> Prefix:
    return dataclasses.replace(prefix, **{field: getattr(prefix, field).at[index].set(value)})


@functools.partial(jax.jit, static_argnums=1)
def _velocity(params, spec, prefix, x, state, step):
    """(the per-frame state, the velocity at `step`): one compiled program per head spec."""
    st = hd.prepare(params, spec, prefix, state)
    return st, hd.velocity(params, spec, st, x, step)


@functools.partial(jax.jit, static_argnums=1)
def _sample(params, spec, prefix, noise, state):
    """(the per-frame state, the actions)."""
    st = hd.prepare(params, spec, prefix, state)
    return st, hd.denoise(params, spec, st, noise)


def _inputs(spec: hd.HeadSpec, seed: int = 1, b: int = 2):
    rng = np.random.default_rng(seed)
    noise = jnp.asarray(rng.standard_normal((b, spec.horizon, spec.action_dim)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((b, spec.state_dim)), jnp.float32) if spec.state_dim else None
    return noise, state


def test_joint_head_is_causal_reads_only_its_tail_layers_and_never_sees_padded_prefix_slots():
    """XR0: action j ignores later actions; K/V of layers outside kv_layers (here layer 0) and of padded
    prefix slots are never read; changing a read layer (2) changes the velocity."""
    spec = hd.preset("xr0_tiny")
    params = hd.init_head(spec, 3)
    prefix = _synthetic_prefix()
    x, state = _inputs(spec)
    v = np.asarray(_velocity(params, spec, prefix, x, state, 2)[1])
    assert spec.kv_layers == (1, 2) and np.all(np.isfinite(v))

    later = _velocity(params, spec, prefix, x.at[:, -1].add(1.0), state, 2)[1]
    np.testing.assert_allclose(later[:, :-1], v[:, :-1], rtol=0, atol=1e-6)
    assert not np.allclose(later[:, -1], v[:, -1], atol=1e-3)
    for field, index in (("k", (0,)), ("v", (0,)), ("k", (slice(None), 1, slice(0, 2))), ("v", (slice(None), 1, slice(0, 2)))):
        moved = _velocity(params, spec, _replace_at(prefix, field, index, 9.0), x, state, 2)[1]
        np.testing.assert_allclose(moved, v, rtol=0, atol=1e-6, err_msg=f"{field}{index} must not be read")
    read = _velocity(params, spec, _replace_at(prefix, "k", (2,), 9.0), x, state, 2)[1]
    assert not np.allclose(read, v, atol=1e-3)


def test_joint_head_tokens_continue_the_prefix_positions_and_the_suffix_mask_is_causal():
    """1 sink + 1 state + Ha actions at positions next_position + [0, T); the worked example of the banded
    mask from `heads.joint._suffix_mask` (window 1) on 3 actions."""
    spec = hd.preset("xr0_tiny")
    params = hd.init_head(spec, 3)
    prefix = _synthetic_prefix()
    x, state = _inputs(spec)
    st = _velocity(params, spec, prefix, x, state, 2)[0]  # the same program as the test above
    t, p = spec.num_tokens, prefix.mask.shape[1]
    chex.assert_shape(st.mask, (2, t, p + t))
    np.testing.assert_array_equal(st.mask[1, :, :p], np.broadcast_to(prefix.mask[1], (t, p)))
    np.testing.assert_array_equal(st.mask[0, :, p:], np.tril(np.ones((t, t), bool)))
    angles = bb.rope_angles(prefix.rope, prefix.next_position[:, None] + jnp.arange(t)[None], spec.head_dim)
    np.testing.assert_allclose(st.sin[:, :, 0], np.sin(angles), atol=1e-6)

    banded = spec.replace(horizon=3, suffix_window=1)
    np.testing.assert_array_equal(joint._suffix_mask(banded), np.asarray([
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 1, 1]], bool))


@pytest.mark.parametrize("name", ["starvla_tiny", "gr00t_tiny"])
def test_cross_head_computes_each_blocks_context_kv_once_from_the_layer_it_reads(name):
    """prepare() holds block i's K/V = its own projection of hidden_states[hidden_layers[i]] (QwenPI_v3: after
    LayerNorm + Linear of that layer; GR00T: the last hidden state for every cross block); padded prefix slots
    never change the actions; the denoise loop itself never touches a [B, P, Dx] context."""
    spec = hd.preset(name)
    params = hd.init_head(spec, 4)
    prefix = _synthetic_prefix()
    noise, state = _inputs(spec)
    st, actions = _sample(params, spec, prefix, noise, state)
    host = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    cross = host.blocks.cross if isinstance(host.blocks, hd.BlockPair) else host.blocks
    for i, layer in enumerate(spec.hidden_layers):
        ctx = np.asarray(prefix.hidden[layer], np.float64)
        if host.hidden_proj is not None:
            ln, proj = host.hidden_proj.norm, host.hidden_proj.proj
            ctx = (ctx - ctx.mean(-1, keepdims=True)) / np.sqrt(ctx.var(-1, keepdims=True) + 1e-5)
            ctx = (ctx * ln.scale[i] + ln.bias[i]) @ proj.kernel[i] + proj.bias[i]
        k = np.einsum("BPX,XNH->BPNH", ctx, cross.kv.kernel[i, 0]) + cross.kv.bias[i, 0]
        v = np.einsum("BPX,XNH->BPNH", ctx, cross.kv.kernel[i, 1]) + cross.kv.bias[i, 1]
        np.testing.assert_allclose(st.k[i], k, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(st.v[i], v, rtol=1e-4, atol=1e-4)
    assert st.k.shape[0] == spec.num_cross_blocks

    padded = _replace_at(prefix, "hidden", (slice(None), 1, slice(0, 2)), 50.0)
    np.testing.assert_allclose(_sample(params, spec, padded, noise, state)[1], actions, rtol=0, atol=1e-6)
    assert not np.allclose(actions, noise, atol=1e-2)

    # The denoise loop adds no matmul over a [B, P, Dx] context: those all sit in prepare (once per frame).
    b, p = prefix.mask.shape
    traced = {f: jax.make_jaxpr(fn)(prefix).jaxpr for f, fn in (
        ("prepare", lambda pr: hd.prepare(params, spec, pr, state)), ("sample", lambda pr: hd.sample(params, spec, pr, noise, state)))}
    # A context operand is [B, P, Dx], or [G, B P, Dx] where a projection batches its G weight slabs
    # (`nn.layers.project_heads`).
    context = {f: [s for s in _dot_operand_shapes(j) if len(s) == 3 and (s[:2] == (b, p) or s[1] == b * p)]
               for f, j in traced.items()}
    assert context["prepare"] and context["sample"] == context["prepare"]


def _dot_operand_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Operand shapes of every dot_general of a jaxpr, loop and call bodies included (each body once)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out += [tuple(v.aval.shape) for v in eqn.invars]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if type(sub).__name__ == "Jaxpr":
                    out += _dot_operand_shapes(sub)
    return out


# --------------------------------------------------------------------------------------------------
# A plain numpy (float64) reading of the published blocks, written from their descriptions


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _np_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _np_silu(x):
    return x / (1 + np.exp(-x))


def _np_rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w


def _np_ln(x, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def _np_feats(t, dim, cos_first, shift):
    freqs = np.exp(-np.log(10_000.0) * np.arange(dim // 2) / (dim // 2 - shift))
    a = np.asarray(t, np.float64)[..., None] * freqs
    return np.concatenate([np.cos(a), np.sin(a)] if cos_first else [np.sin(a), np.cos(a)], -1)


def _np_attention(q, k, v, mask):
    """q [B, T, N, H] (scaled), k, v [B, S, K, H], mask [B, T, S]; query head n reads KV head n // (N / K)."""
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    logits = np.where(mask[:, None], np.einsum("btnh,bsnh->bnts", q, k), -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", probs / probs.sum(-1, keepdims=True), v)


def _np_xr0_velocity(p, spec, prefix, x, state, step):
    """XR0: t = step / S fed as t * 1000; per layer (shift, scale, gate) x 2 = adaln_table + t_projector(t_emb)."""
    feats = _np_feats(step / spec.num_steps * 1000, spec.time_embed_dim, True, 0)
    t_emb = _np_silu(feats @ p.time_mlp.fc1.kernel) @ p.time_mlp.fc2.kernel
    mod = np.einsum("d,dse->se", t_emb, p.time_proj.kernel) + p.time_proj.bias  # [6, Da]: the same t for every row
    b = x.shape[0]
    tokens = np.concatenate([np.broadcast_to(p.sink, (b, 1, spec.width)),
                             (_np_gelu(state @ p.state_in.fc1.kernel) @ p.state_in.fc2.kernel)[:, None],
                             _np_gelu(x @ p.action_in.fc1.kernel) @ p.action_in.fc2.kernel], axis=1)
    t = tokens.shape[1]
    pos = np.asarray(prefix.next_position)[:, None] + np.arange(t)
    angle = pos[..., None] / prefix.rope.theta ** (np.arange(spec.head_dim // 2) * 2 / spec.head_dim)  # equal M-RoPE axes
    sin, cos = np.sin(angle)[:, :, None], np.cos(angle)[:, :, None]
    rot = lambda y: np.concatenate([y[..., :spec.head_dim // 2] * cos - y[..., spec.head_dim // 2:] * sin,  # noqa: E731
                                    y[..., spec.head_dim // 2:] * cos + y[..., :spec.head_dim // 2] * sin], -1)
    mask = np.concatenate([np.broadcast_to(np.asarray(prefix.mask)[:, None], (b, t, prefix.mask.shape[1])),
                           np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))], -1)
    h_ = tokens
    for i, layer in enumerate(spec.kv_layers):
        lp = jax.tree.map(lambda a, i=i: a[i], p.layers)
        sh1, sc1, g1, sh2, sc2, g2 = lp.adaln + mod
        y = _np_rms(h_, lp.norms[0]) * (1 + sc1) + sh1
        q = np.einsum("btd,dnh->btnh", y, lp.q.kernel) + lp.q.bias
        k = np.einsum("btd,dkh->btkh", y, lp.kv.kernel[0]) + lp.kv.bias[0]
        v = np.einsum("btd,dkh->btkh", y, lp.kv.kernel[1]) + lp.kv.bias[1]
        q, k = rot(_np_rms(q, lp.q_norm)) / np.sqrt(spec.head_dim), rot(_np_rms(k, lp.k_norm))
        a = _np_attention(q, np.concatenate([prefix.k[layer], k], 1), np.concatenate([prefix.v[layer], v], 1), mask)
        h_ = _np_rms(h_ + g1 * np.einsum("btnh,nhd->btd", a, lp.out), lp.norms[1])
        y = _np_rms(h_, lp.norms[2]) * (1 + sc2) + sh2
        h_ = _np_rms(h_ + g2 * ((_np_silu(y @ lp.gating[0]) * (y @ lp.gating[1])) @ lp.linear), lp.norms[3])
    return _np_gelu(h_[:, -spec.horizon:] @ p.action_out.fc1.kernel) @ p.action_out.fc2.kernel


def _np_dense(x, lin):
    return x @ lin.kernel + lin.bias


def _np_block(blk, x, temb, ctx, mask, spec):
    """diffusers BasicTransformerBlock (ada_norm, no affine norms): ctx None = self-attention."""
    mod = np.einsum("bd,dse->sbe", _np_silu(temb), blk.ada.kernel) + blk.ada.bias[:, None]
    scale, shift = mod[0][:, None], mod[1][:, None]  # AdaLayerNorm: scale first
    y = _np_ln(x, 1e-5) * (1 + scale) + shift
    src = y if ctx is None else ctx
    q = np.einsum("btd,dnh->btnh", y, blk.q.kernel) + blk.q.bias
    k = np.einsum("bsx,xnh->bsnh", src, blk.kv.kernel[0]) + blk.kv.bias[0]
    v = np.einsum("bsx,xnh->bsnh", src, blk.kv.kernel[1]) + blk.kv.bias[1]
    m = np.ones((x.shape[0], x.shape[1], src.shape[1]), bool) if ctx is None else mask
    x = x + np.einsum("btnh,nhd->btd", _np_attention(q / np.sqrt(spec.head_dim), k, v, m), blk.out.kernel) + blk.out.bias
    y = _np_ln(x, 1e-5)
    return x + _np_dense(_np_gelu(_np_dense(y, blk.ff_in)), blk.ff_out)


def _np_gr00t_actions(p, spec, prefix, noise, state):
    """QwenGR00T: bucket = int(t * 1000); cross (even) / self (odd) blocks on hidden_states[-1]; DiT output block."""
    x, b = np.asarray(noise, np.float64), noise.shape[0]
    ctx = np.asarray(prefix.hidden[spec.hidden_layers[0]], np.float64)
    mask = np.broadcast_to(np.asarray(prefix.mask)[:, None], (b, spec.num_tokens, prefix.mask.shape[1]))
    for step in range(spec.num_steps):
        bucket = int(step / spec.num_steps * 1000)
        temb = _np_dense(_np_silu(_np_dense(_np_feats(np.full(b, bucket), 256, True, 1), p.time_mlp.fc1)), p.time_mlp.fc2)
        tau = _np_feats(np.full((b, spec.horizon), bucket), spec.width, False, 0)
        enc = p.action_in
        z = _np_dense(_np_silu(_np_dense(np.concatenate([_np_dense(x, enc.w1), tau], -1), enc.w2)), enc.w3)
        tokens = np.concatenate([_np_dense(np.maximum(_np_dense(state, p.state_in.fc1), 0), p.state_in.fc2)[:, None],
                                 np.broadcast_to(p.future, (b,) + p.future.shape), z + p.positions[:spec.horizon]], 1)
        for i in range(spec.num_cross_blocks):
            tokens = _np_block(jax.tree.map(lambda a, i=i: a[i], p.blocks.cross), tokens, temb, ctx, mask, spec)
            tokens = _np_block(jax.tree.map(lambda a, i=i: a[i], p.blocks.self_), tokens, temb, None, None, spec)
        mod = np.einsum("bd,dse->sbe", _np_silu(temb), p.out_mod.kernel) + p.out_mod.bias[:, None]
        shift, scale = mod[0][:, None], mod[1][:, None]  # the DiT output block: shift first
        y = _np_dense(_np_ln(tokens[:, -spec.horizon:], 1e-6) * (1 + scale) + shift, p.out_proj)
        x = x + _np_dense(np.maximum(_np_dense(y, p.action_out.fc1), 0), p.action_out.fc2) / spec.num_steps
    return x


def test_heads_match_a_plain_numpy_reading_of_the_published_blocks():
    """XR0's velocity (joint K/V attention, adaLN table, four RMSNorms, continued RoPE) and GR00T's whole
    denoise (bucketed time, action encoder, cross/self blocks, DiT output block, 2 Euler steps)."""
    prefix = _synthetic_prefix()
    host_prefix = _np(prefix)
    spec = hd.preset("xr0_tiny")
    params = hd.init_head(spec, 3)
    x, state = _inputs(spec)
    ours = _velocity(params, spec, prefix, x, state, 2)[1]
    ref = _np_xr0_velocity(_np(params), spec, host_prefix, np.asarray(x, np.float64), np.asarray(state, np.float64), 2)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)

    spec = hd.preset("gr00t_tiny")
    params = hd.init_head(spec, 4)
    noise, state = _inputs(spec)
    ref = _np_gr00t_actions(_np(params), spec, host_prefix, noise, np.asarray(state, np.float64))
    np.testing.assert_allclose(_sample(params, spec, prefix, noise, state)[1], ref, rtol=1e-4, atol=1e-4)


def test_state_token_and_noise_shapes_are_checked_with_a_message_naming_the_head():
    spec = hd.preset("gr00t_tiny")
    params = hd.init_head(spec, 4)
    prefix = _synthetic_prefix()
    noise, _ = _inputs(spec)
    with pytest.raises(ValueError, match=r"head 'gr00t' has a state token: pass its state \[B, Ds\] = \(2, 6\), got None"):
        hd.prepare(params, spec, prefix, None)
    with pytest.raises(ValueError, match=r"head 'gr00t' needs noise \[B, Ha, Ad\] = \(2, 4, 7\)"):
        hd.sample(params, spec, prefix, noise[:, :2], jnp.zeros((2, 6)))
    with pytest.raises(ValueError, match="is cross_last and needs CrossHead weights, got JointHead"):
        hd.prepare(hd.init_head(hd.preset("xr0_tiny")), spec, prefix, None)


# --------------------------------------------------------------------------------------------------
# Validation


def test_head_specs_reject_inconsistent_fields_with_one_line_naming_the_field():
    xr0, gr00t = hd.preset("xr0_tiny"), hd.preset("gr00t_tiny")
    cases = [
        (lambda: xr0.replace(kv_layers=(1,)), "kv_layers must name one backbone layer per head layer"),
        (lambda: xr0.replace(num_heads=3), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        (lambda: xr0.replace(hidden_layers=(3,)), r"JointKvSpec \(joint_kv\) has no field 'hidden_layers'"),
        (lambda: gr00t.replace(num_kv_heads=1), r"CrossLastSpec \(cross_last\) has no field 'num_kv_heads'"),
        (lambda: gr00t.replace(depth=1), "a 1-block DiT has no self block"),
        (lambda: hd.preset("starvla_tiny").replace(hidden_layers=(3, 3)), "one hidden state per cross block"),
        (lambda: gr00t.replace(max_positions=2), "max_positions >= horizon"),
        (lambda: hd.preset("xr0_large"), "unknown head preset 'xr0_large'"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            build()
        assert "\n" not in str(err.value)


def test_heads_are_checked_against_the_backbone_they_read():
    tiny = bb.preset("qwen3vl_tiny")
    cases = [
        (hd.preset("xr0"), "head_dim 128 must equal the backbone's 16"),
        (hd.preset("xr0_tiny").replace(num_heads=4, num_kv_heads=4), "num_kv_heads 4 must equal the backbone's 2"),
        (hd.preset("xr0_tiny").replace(kv_layers=(2, 3)), r"kv_layers \(2, 3\) must be backbone layers in \[0, 3\)"),
        (hd.preset("starvla_tiny").replace(hidden_layers=(2, 3, 4)), r"must be HF hidden_states indices in \[0, 3\]"),
        (hd.preset("gr00t_tiny").replace(hidden_layer=2), r"reads hidden_states\[3\] \(the last entry\)"),
        (hd.preset("starvla_bench"), "vlm_width 1024 must equal the backbone width 64"),
    ]
    for head, message in cases:
        with pytest.raises(ValueError, match=message):
            mot.ModelSpec(backbone=tiny, heads=(head,), image_token_id=500)

"""The joint-KV head kind (XR0): a DiT whose layers attend to some backbone layers' K/V ‖ their own.

Per layer: `x = x + g1 * Attn(mod(RMS(x)))`, `x = RMS(x)`, `x = x + g2 * SwiGLU(mod(RMS(x)))`,
`x = RMS(x)`; q/k RMSNorm over H, RoPE continuing after the prefix, keys = [prefix K of the
mapped backbone layer ‖ own K]; (shift, scale, gate) x 2 = per-layer table [6, Da] + a shared
projection of the time embedding (adaLN-single). Tokens: [sink, state MLP, action MLP].

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, T head
tokens (Ne extra + Ha actions), S = P + T keys, L head layers, Da head width, N heads, K KV heads,
H head dim, F MLP, Ad action dim, Ds state dim, Dt time features.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.heads.parts import (
    HeadState, Linear, Mlp, compute_dtype, extra_tokens, gelu, lin, linear_tree, mlp, mlp_tree, sinusoid, time_input,
)
from oxygen_jax.models.heads.spec import HeadSpec
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import Unstacked, _pytree, apply_rope, attention, scan_layers, stack_layers, unstack_layers


@_pytree
class JointLayers:
    """XR0 DiT layers, stacked on a leading L axis."""

    q: Linear  # kernel [L, Da, N, H], bias [L, N, H]
    kv: Linear  # kernel [L, 2, Da, K, H], bias [L, 2, K, H]; index 0 = K, 1 = V
    out: jax.Array  # [L, N, H, Da] (no bias)
    q_norm: jax.Array  # [L, H] RMSNorm scale (plain w)
    k_norm: jax.Array  # [L, H]
    norms: jax.Array  # [L, 4, Da]: before attention, after it, before the MLP, after it
    gating: jax.Array  # [L, 2, Da, F]; index 0 = gate (silu), 1 = up
    linear: jax.Array  # [L, F, Da]
    adaln: jax.Array  # [L, 6, Da]: (shift, scale, gate) for attention, then for the MLP


@_pytree
class JointHead:
    time_mlp: Mlp  # [Dt, Da], [Da, Da], no biases (silu between)
    time_proj: Linear  # kernel [Da, 6, Da], bias [6, Da]: shared by every layer
    sink: jax.Array | None  # [1, Da]
    state_in: Mlp | None  # [Ds, Da], [Da, Da], no biases
    action_in: Mlp  # [Ad, Da], [Da, Da], no biases
    action_out: Mlp  # [Da, Ad], [Ad, Ad], no biases
    layers: JointLayers | Unstacked


def head_tree(spec: HeadSpec, draw: bb.Draw) -> JointHead:
    """The parameters of `spec` with every leaf from `draw` (fan-in scaled; norm scales around 1)."""
    da, n, k, h, f, ad = spec.width, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim, spec.action_dim
    lin_, mlp_ = functools.partial(linear_tree, draw), functools.partial(mlp_tree, draw)
    L = spec.depth
    kv = lin_((da,), (k, h), lead=(L, 2))
    layers = JointLayers(
        q=lin_((da,), (n, h), lead=(L,)), kv=kv, out=draw((L, n, h, da), 1.0 / math.sqrt(n * h), 0.0),
        q_norm=draw((L, h), 0.1, 1.0), k_norm=draw((L, h), 0.1, 1.0), norms=draw((L, 4, da), 0.1, 1.0),
        gating=draw((L, 2, da, f), 1.0 / math.sqrt(da), 0.0), linear=draw((L, f, da), 1.0 / math.sqrt(f), 0.0),
        adaln=draw((L, 6, da), 1.0 / math.sqrt(da), 0.0),
    )
    return JointHead(
        time_mlp=mlp_(spec.time_embed_dim, da, da, bias=False), time_proj=lin_((da,), (6, da)),
        sink=draw((1, da), 1.0, 0.0) if "sink" in spec.extra_tokens else None,
        state_in=mlp_(spec.state_dim, da, da, bias=False) if spec.state_dim else None,
        action_in=mlp_(ad, da, da, bias=False), action_out=mlp_(da, ad, ad, bias=False), layers=layers,
    )


def unstack(params: JointHead) -> JointHead:
    return dataclasses.replace(params, layers=unstack_layers(params.layers))


def stack(params: JointHead) -> JointHead:
    return dataclasses.replace(params, layers=stack_layers(params.layers))


def _rms(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Qwen's RMSNorm: normalise in float32, cast back, multiply by w."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)).astype(x.dtype)
    return normed * scale.astype(x.dtype)


def _suffix_mask(spec: HeadSpec) -> jax.Array:
    """bool [T, T] among the head's own tokens.

    causal: token i sees tokens <= i; with `suffix_window` w, action j additionally sees only
    actions j - w .. j (the extra tokens stay visible). Example, 1 sink + 1 state + 3 actions,
    w = 1 (rows = queries):  s: 1 0 0 0 0 / st: 1 1 0 0 0 / a0: 1 1 1 0 0 / a1: 1 1 1 1 0 /
    a2: 1 1 0 1 1.
    """
    t, ne = spec.num_tokens, spec.num_extra
    i = jnp.arange(t)
    if spec.suffix_mask == "bidirectional":
        return jnp.ones((t, t), bool)
    mask = i[None, :] <= i[:, None]
    if spec.suffix_window is not None:
        both_actions = (i[:, None] >= ne) & (i[None, :] >= ne)
        mask &= ~both_actions | (i[:, None] - i[None, :] <= spec.suffix_window)
    return mask


def prepare(params: JointHead, spec: HeadSpec, prefix: Prefix, state: jax.Array | None) -> HeadState:
    """The mapped layers' K/V, the extra tokens, RoPE tables of the head tokens and the [B, T, P + T] mask."""
    dtype = compute_dtype(params)
    b, p = prefix.mask.shape
    t = spec.num_tokens
    k, v = prefix.layer_kv(spec.kv_layers)
    extra = extra_tokens(spec, params, b, state, dtype, gelu)
    pos = prefix.next_position[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    pos = pos + jnp.where(jnp.arange(t) >= spec.num_extra, spec.action_position_offset, 0)[None]
    radians = bb.rope_angles(prefix.rope, pos, spec.head_dim)[..., None, :]
    mask = jnp.concatenate([jnp.broadcast_to(prefix.mask[:, None, :], (b, t, p)),
                            jnp.broadcast_to(_suffix_mask(spec)[None], (b, t, t))], axis=-1)
    return HeadState(k=k.astype(dtype), v=v.astype(dtype), mask=mask, extra=extra,
                     sin=jnp.sin(radians), cos=jnp.cos(radians))


def _layer(spec: HeadSpec, lp: JointLayers, x, mod, ck, cv, st: HeadState) -> jax.Array:
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod + lp.adaln.astype(x.dtype)[None], 6, axis=1)  # [B, 1, Da] each
    h = _rms(x, lp.norms[0]) * (1 + scale1) + shift1
    q = lin("BTD,DNH->BTNH", h, lp.q)
    kv = lin("BTD,2DKH->BT2KH", h, lp.kv)  # bias [2, K, H] broadcasts over the trailing axes
    k, v = kv[:, :, 0], kv[:, :, 1]
    q = apply_rope(_rms(q, lp.q_norm), st.sin, st.cos) * jnp.asarray(spec.head_dim ** -0.5, q.dtype)
    k = apply_rope(_rms(k, lp.k_norm), st.sin, st.cos)
    a = attention(q, jnp.concatenate([ck, k], axis=1), jnp.concatenate([cv, v], axis=1), st.mask)
    x = _rms(x + gate1 * jnp.einsum("BTNH,NHD->BTD", a, lp.out.astype(a.dtype)), lp.norms[1])
    h = _rms(x, lp.norms[2]) * (1 + scale2) + shift2
    gate, up = jnp.einsum("BTD,2DF->2BTF", h, lp.gating.astype(h.dtype))
    return _rms(x + gate2 * ((jax.nn.silu(gate) * up) @ lp.linear.astype(h.dtype)), lp.norms[3])


def velocity(params: JointHead, spec: HeadSpec, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
    """v(x_t, t) float32 [B, Ha, Ad] at Euler step `step` (int32)."""
    dtype = compute_dtype(params)
    _, t_in = time_input(spec, step)
    b = x_t.shape[0]
    x_t = x_t.astype(dtype)
    feats = sinusoid(jnp.broadcast_to(t_in, (b,)), spec.time_embed_dim, cos_first=True).astype(dtype)
    temb = mlp(params.time_mlp, feats, jax.nn.silu)  # [B, Da]
    mod = lin("BD,D6E->B6E", temb, params.time_proj)  # [B, 6, Da]: no activation before it (XR0)
    x = jnp.concatenate([st.extra, mlp(params.action_in, x_t, gelu)], axis=1)

    def body(x, lp, kv, _):
        return _layer(spec, lp, x, mod, kv[0], kv[1], st), None

    x, _ = scan_layers(body, x, params.layers, (st.k, st.v))
    return mlp(params.action_out, x[:, -spec.horizon:], gelu).astype(jnp.float32)

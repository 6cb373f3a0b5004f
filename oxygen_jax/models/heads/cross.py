"""The cross-attention head kinds: StarVLA QwenPI_v3 (`cross_hidden`, one hidden state per cross block)
and QwenGR00T (`cross_last`, the last `hidden_states` entry only: under transformers 4.57, StarVLA's pin,
the last layer's output before the final norm; `models.hidden_states`).

Checked against StarVLA's own `Qwen_PI_v3` / `Qwen_GR00T` (starVLA/starVLA @ 0ed0aad) to 1e-4 on every
array of ../shared/fixtures/starvla_qwenpi_v3_tiny and starvla_gr00t_tiny (`eval/parity/starvla.py`).

Blocks are diffusers' `BasicTransformerBlock` as GR00T and StarVLA use it:
`x = x + Attn(LN(x) * (1 + scale) + shift)` (K/V from the context, or from the same tokens in a
self block), `x = x + FF(LN(x))`, GELU-tanh FF with biases, LayerNorms without affine weights,
(scale, shift) from `Linear(silu(temb))` per block; no RoPE, a learned position embedding on the
action tokens instead. Tokens: [state MLP (GR00T, with a state), future tokens, action encoder +
positions[0:Ha]]. QwenPI_v3 decodes the last block's output (`return_pre_output=True`); GR00T first runs
the DiT output block `proj_out_2(LN(x) * (1 + scale) + shift)` with `shift, scale =
proj_out_1(silu(temb))`: (shift, scale), the reverse of the blocks' (scale, shift).

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, T head
tokens, Lc cross blocks, D VLM width, Dx context width, Da head width, N heads, H head dim, F MLP,
Fo state/action MLP width, Do DiT output width, Ad action dim, Ds state dim, Dt time features.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.heads.parts import (
    HeadState, Linear, Mlp, compute_dtype, extra_tokens, gelu, lin, linear_tree, mlp, mlp_tree, sinusoid, time_input,
)
from oxygen_jax.models.heads.spec import HeadSpec
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import LayerNorm, Unstacked, _pytree, attention, layer_norm, scan_layers, stack_layers, unstack_layers


@_pytree
class CrossBlocks:
    """diffusers-style DiT blocks, stacked on a leading L axis (cross blocks read Dx, self blocks Da)."""

    ada: Linear  # kernel [L, Da, 2, Da], bias [L, 2, Da]: (scale, shift) of the pre-attention LayerNorm
    q: Linear  # kernel [L, Da, N, H], bias [L, N, H]
    kv: Linear  # kernel [L, 2, Dx, N, H], bias [L, 2, N, H]
    out: Linear  # kernel [L, N, H, Da], bias [L, Da]
    ff_in: Linear  # [L, Da, F], [L, F]
    ff_out: Linear  # [L, F, Da], [L, Da]


@_pytree
class BlockPair:
    """One cross block followed by one self block (block_pattern='cross_self')."""

    cross: CrossBlocks
    self_: CrossBlocks


@_pytree
class HiddenProj:
    """QwenPI_v3's per-layer projection of the hidden states: LayerNorm then Linear(D -> Dx)."""

    norm: LayerNorm  # [Lc, D]
    proj: Linear  # kernel [Lc, D, Dx], bias [Lc, Dx]


@_pytree
class ActionEncoder:
    """GR00T's action encoder: w3(swish(w2([w1(a) ‖ sincos(t)]))) per action token."""

    w1: Linear  # [Ad, Da]
    w2: Linear  # [2 Da, Da]
    w3: Linear  # [Da, Da]


@_pytree
class CrossHead:
    hidden_proj: HiddenProj | None
    time_mlp: Mlp  # [Dt, Da], [Da, Da], with biases (silu between)
    action_in: ActionEncoder
    positions: jax.Array  # [max_positions, Da]
    future: jax.Array | None  # [Nf, Da]
    state_in: Mlp | None  # [Ds, Fo], [Fo, Da] (relu)
    blocks: CrossBlocks | BlockPair | Unstacked  # leading Lc
    out_mod: Linear | None  # kernel [Da, 2, Da], bias [2, Da]: (shift, scale) of the output LayerNorm
    out_proj: Linear | None  # [Da, Do]
    action_out: Mlp  # [Da or Do, Fo], [Fo, Ad] (relu)


def head_tree(spec: HeadSpec, draw: bb.Draw) -> CrossHead:
    """The parameters of `spec` with every leaf from `draw` (fan-in scaled; norm scales around 1)."""
    da, n, h, f, ad = spec.width, spec.num_heads, spec.head_dim, spec.mlp_dim, spec.action_dim
    lin_, mlp_ = functools.partial(linear_tree, draw), functools.partial(mlp_tree, draw)

    def blocks(lc, ctx):
        return CrossBlocks(
            ada=lin_((da,), (2, da), lead=(lc,)), q=lin_((da,), (n, h), lead=(lc,)), kv=lin_((ctx,), (n, h), lead=(lc, 2)),
            out=lin_((n, h), (da,), lead=(lc,)), ff_in=lin_((da,), (f,), lead=(lc,)), ff_out=lin_((f,), (da,), lead=(lc,)),
        )

    lc, dx, fo = spec.num_cross_blocks, spec.context_width, spec.io_hidden
    stack = blocks(lc, dx) if spec.block_pattern == "all_cross" else BlockPair(cross=blocks(lc, dx), self_=blocks(lc, da))
    proj = None
    if spec.hidden_proj:
        proj = HiddenProj(norm=LayerNorm(scale=draw((lc, spec.vlm_width), 0.1, 1.0), bias=draw((lc, spec.vlm_width), 0.1, 0.0)),
                          proj=lin_((spec.vlm_width,), (dx,), lead=(lc,)))
    do = spec.dit_output_dim
    return CrossHead(
        hidden_proj=proj, time_mlp=mlp_(spec.time_embed_dim, da, da, bias=True),
        action_in=ActionEncoder(w1=lin_((ad,), (da,)), w2=lin_((2 * da,), (da,)), w3=lin_((da,), (da,))),
        positions=draw((spec.max_positions, da), 0.02, 0.0),
        future=draw((spec.num_future_tokens, da), 0.02, 0.0) if spec.num_future_tokens else None,
        state_in=mlp_(spec.state_dim, fo, da, bias=True) if spec.state_dim else None, blocks=stack,
        out_mod=lin_((da,), (2, da)) if do else None, out_proj=lin_((da,), (do,)) if do else None,
        action_out=mlp_(do or da, fo, ad, bias=True),
    )


def unstack(params: CrossHead) -> CrossHead:
    return dataclasses.replace(params, blocks=unstack_layers(params.blocks))


def stack(params: CrossHead) -> CrossHead:
    return dataclasses.replace(params, blocks=stack_layers(params.blocks))


def prepare(params: CrossHead, spec: HeadSpec, prefix: Prefix, state: jax.Array | None) -> HeadState:
    """The extra tokens and every cross block's K/V of its context (with QwenPI_v3's per-layer
    LayerNorm + Linear first), computed once for all `num_steps` steps."""
    dtype = compute_dtype(params)
    b, p = prefix.mask.shape
    t = spec.num_tokens
    reads = spec.hidden_layers if spec.kind == "cross_hidden" else spec.hidden_layers[:1]
    hidden = prefix.hidden_states(reads).astype(dtype)  # [Lc or 1, B, P, D]
    extra = extra_tokens(spec, params, b, state, dtype, jax.nn.relu)
    per_block = (hidden if spec.kind == "cross_hidden" else None, params.hidden_proj)

    def body(_, blk, extra_l, __):
        ctx = _project(hidden[0] if extra_l[0] is None else extra_l[0], extra_l[1])
        cross = blk.cross if isinstance(blk, BlockPair) else blk
        return None, lin("BPX,2XNH->BP2NH", ctx, cross.kv)

    _, kv = scan_layers(body, None, params.blocks, per_block)  # [Lc, B, P, 2, N, H]
    mask = jnp.broadcast_to(prefix.mask[:, None, :], (b, t, p))
    return HeadState(k=kv[:, :, :, 0], v=kv[:, :, :, 1], mask=mask, extra=extra)


def _project(ctx: jax.Array, hp: HiddenProj | None) -> jax.Array:
    """QwenPI_v3's `project_layers[i]`: LayerNorm (eps 1e-5, affine) + Linear(D -> Dx); identity without."""
    return ctx if hp is None else lin("BPD,DX->BPX", layer_norm(ctx, hp.norm, 1e-5), hp.proj)


def projected_context(params: CrossHead, spec: HeadSpec, prefix: Prefix) -> jax.Array:
    """[Lc, B, P, Dx]: what each cross block's K/V projection reads (QwenPI_v3: `project_layers[i]`
    of its hidden state; GR00T: the last hidden state). For checks; `prepare` computes it per block."""
    reads = spec.hidden_layers if spec.kind == "cross_hidden" else spec.hidden_layers[:1]
    hidden = prefix.hidden_states(reads).astype(compute_dtype(params))
    if params.hidden_proj is None:
        return jnp.broadcast_to(hidden[:1], (spec.num_cross_blocks,) + hidden.shape[1:])
    _, ctx = scan_layers(lambda _, hp, h, __: (None, _project(h, hp)), None, params.hidden_proj, hidden)
    return ctx


def _block(spec: HeadSpec, blk: CrossBlocks, x, temb_act, k, v, mask) -> jax.Array:
    """One diffusers BasicTransformerBlock; k, v None means self-attention over x."""
    scale, shift = jnp.split(lin("BD,D2E->B2E", temb_act, blk.ada), 2, axis=1)  # [B, 1, Da] each
    h = layer_norm(x, None, 1e-5) * (1 + scale) + shift
    q = lin("BTD,DNH->BTNH", h, blk.q) * jnp.asarray(spec.head_dim ** -0.5, h.dtype)
    if k is None:
        kv = lin("BTD,2DNH->BT2NH", h, blk.kv)
        k, v = kv[:, :, 0], kv[:, :, 1]
        mask = jnp.ones((x.shape[0], x.shape[1], x.shape[1]), bool)
    x = x + lin("BTNH,NHD->BTD", attention(q, k, v, mask), blk.out)
    h = layer_norm(x, None, 1e-5)
    return x + lin("BTF,FD->BTD", gelu(lin("BTD,DF->BTF", h, blk.ff_in)), blk.ff_out)


def velocity(params: CrossHead, spec: HeadSpec, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
    """v(x_t, t) float32 [B, Ha, Ad] at Euler step `step` (int32): t = k / S, bucket int(k / S * 1000)."""
    return velocity_at(params, spec, st, x_t, time_input(spec, step)[1])


def velocity_at(params: CrossHead, spec: HeadSpec, st: HeadState, x_t: jax.Array, t_in: jax.Array) -> jax.Array:
    """v(x_t) float32 [B, Ha, Ad] at the network's time input `t_in` (float32 [] or [B]: the integer
    bucket of StarVLA's heads, e.g. training's `(t * 1000).long()` per row)."""
    return velocity_parts(params, spec, st, x_t, t_in)["velocity"]


def velocity_parts(params: CrossHead, spec: HeadSpec, st: HeadState, x_t: jax.Array, t_in: jax.Array, *,
                   all_tokens: bool = False) -> dict[str, jax.Array]:
    """`velocity_at` with its stages: `temb` [B, Da], `tokens` [B, T, Da] (the DiT input), `dit_output`
    ([B, T, Da] or, GR00T, [B, T, Do]; only the last Ha rows unless `all_tokens`) and `velocity` [B, Ha, Ad].

    The same bucket enters twice, as in `LayerwiseFM_ActionHeader` / `GR00T_ActionHeader`: the DiT's
    `TimestepEncoder` (diffusers `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)`: cos
    first, frequencies 10000^(-i/127), then Linear-SiLU-Linear) feeds every block's AdaLayerNorm, and
    the `ActionEncoder` mixes [sin, cos] features (frequencies 10000^(-i/(Da/2))) into every action token.
    """
    dtype = compute_dtype(params)
    ha = spec.horizon
    b = x_t.shape[0]
    t_b = jnp.broadcast_to(jnp.asarray(t_in, jnp.float32), (b,))
    x_t = x_t.astype(dtype)
    feats = sinusoid(t_b, spec.time_embed_dim, cos_first=True, freq_shift=1).astype(dtype)
    temb = mlp(params.time_mlp, feats, jax.nn.silu)  # [B, Da]
    enc = params.action_in
    tau = sinusoid(jnp.broadcast_to(t_b[:, None], (b, ha)), spec.width, cos_first=False).astype(dtype)
    a = jnp.concatenate([lin("BTA,AD->BTD", x_t, enc.w1), tau], axis=-1)
    a = lin("BTD,DE->BTE", jax.nn.silu(lin("BTC,CD->BTD", a, enc.w2)), enc.w3)
    x = jnp.concatenate([st.extra, a + params.positions[:ha].astype(dtype)[None]], axis=1)
    temb_act = jax.nn.silu(temb)

    def body(x, blk, kv, _):
        if isinstance(blk, BlockPair):
            x = _block(spec, blk.cross, x, temb_act, kv[0], kv[1], st.mask)
            return _block(spec, blk.self_, x, temb_act, None, None, None), None
        return _block(spec, blk, x, temb_act, kv[0], kv[1], st.mask), None

    tokens = x
    x, _ = scan_layers(body, x, params.blocks, (st.k, st.v))
    x = x if all_tokens else x[:, -ha:]  # every stage after the blocks is per token
    if params.out_proj is not None:  # GR00T's DiT output block; QwenPI_v3 decodes the blocks' output directly
        shift, scale = jnp.split(lin("BD,D2E->B2E", temb_act, params.out_mod), 2, axis=1)  # (shift, scale) order
        x = lin("BTD,DO->BTO", layer_norm(x, None, 1e-6) * (1 + scale) + shift, params.out_proj)
    v = mlp(params.action_out, x[:, -ha:], jax.nn.relu).astype(jnp.float32)
    return dict(temb=temb, tokens=tokens, dit_output=x, velocity=v)

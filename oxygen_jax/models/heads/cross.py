"""The cross-attention head kinds, StarVLA's DiT heads: QwenPI_v3 (`CrossHiddenSpec`, kind `cross_hidden`:
cross block j reads its own hidden state) and QwenGR00T (`CrossLastSpec`, kind `cross_last`: every cross block
reads the last `hidden_states` entry; under transformers 4.57, StarVLA's pin, the last layer's output before
the final norm; `models.hidden_states`).

Checked against StarVLA's own `Qwen_PI_v3` / `Qwen_GR00T` (starVLA/starVLA @ 0ed0aad) to 1e-4 on every
array of its reference outputs (`eval/parity/starvla.py`).

Blocks are diffusers' `BasicTransformerBlock` as GR00T and StarVLA use it:
`x = x + Attn(LN(x) * (1 + scale) + shift)` (K/V from the context, or from the same tokens in a
self block), `x = x + FF(LN(x))`, GELU-tanh FF with biases, LayerNorms without affine weights,
(scale, shift) from `Linear(silu(temb))` per block; no RoPE, a learned position embedding on the
action tokens instead. Tokens: [state MLP (GR00T, with a state), future tokens, action encoder +
positions[0:Ha]]. QwenPI_v3 decodes the last block's output (`return_pre_output=True`); GR00T first runs
the DiT output block `proj_out_2(LN(x) * (1 + scale) + shift)` with `shift, scale =
proj_out_1(silu(temb))`: (shift, scale), the reverse of the blocks' (scale, shift).

Block pattern (StarVLA's `DiT.interleave_self_attention`): `all_cross`, every block cross-attends; or
`cross_self`, block i self-attends when i is odd, for any depth: 5 blocks are cross 0, self 1, cross 2,
self 3, cross 4. The weights keep the Lc cross blocks and the Ls = depth - Lc self blocks in two stacks
(`BlockPair`); the denoise step runs pairs (cross j, self j) and, for an odd depth, the last cross block.

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, T head
tokens, Lc cross blocks, Ls self blocks, D VLM width, Dx context width, Da head width, N heads, H head dim,
F MLP, Fo state/action MLP width, Do DiT output width, Ad action dim, Ds state dim, Dt time features.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.heads.parts import (
    HeadState, Linear, Mlp, compute_dtype, extra_tokens, gelu, lin, lin_heads, lin_merge, linear_tree, mlp, mlp_tree, sinusoid,
    time_input,
)
from oxygen_jax.models.heads.spec import DitSpec, require
from oxygen_jax.models.hidden_states import check_semantics
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import LayerNorm, Unstacked, _pytree, attention, layer_norm, scan_layers, stack_layers, unstack_layers


def cross_blocks(depth: int, block_pattern: str) -> tuple[int, ...]:
    """Indices of the blocks that cross-attend: all of them, or (cross_self) the even ones.

    Example: depth 5 -> all_cross (0, 1, 2, 3, 4), cross_self (0, 2, 4).
    """
    return tuple(range(0, depth, 1 if block_pattern == "all_cross" else 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossSpec(DitSpec):
    """A StarVLA DiT head: multi-head attention (K = N), cross blocks reading hidden states of the prefix,
    self blocks (`cross_self`) reading the head's own tokens. Tokens [state, future, actions]; time bucketed.

    Abstract: `CrossHiddenSpec` or `CrossLastSpec` say which hidden state each cross block reads.
    """

    vlm_width: int  # D of the hidden states read
    io_hidden: int  # Fo
    max_positions: int  # rows of the learned position table of the action tokens
    num_future_tokens: int = 0  # learned tokens after the state token
    block_pattern: Literal["all_cross", "cross_self"] = "all_cross"  # cross_self: odd blocks self-attend
    hidden_proj: int | None = None  # LayerNorm + Linear(D -> this) per read layer (QwenPI_v3)
    dit_output_dim: int | None = None  # adaLN output block + Linear(Da -> Do) before the decoder (GR00T)
    hidden_states: str | None = None  # the convention the head was trained with ("transformers_4_57" for
    #   StarVLA, whose pin is 4.57.0); the backbone must report it. None: any (random-weight tests, benchmarks)

    def _check(self, name: str) -> None:
        super()._check(name)
        require(self.width % 2 == 0, f"{name}: width must be even (sinusoid features of the action encoder), got {self.width}")
        require(self.block_pattern in ("all_cross", "cross_self"),
                f"{name}: block_pattern must be 'all_cross' or 'cross_self', got {self.block_pattern!r}")
        require(self.block_pattern == "all_cross" or self.depth >= 2,
                f"{name}: a 1-block DiT has no self block: use block_pattern='all_cross'")
        require(self.max_positions >= self.horizon,
                f"{name}: the learned position table needs max_positions >= horizon ({self.horizon}), got {self.max_positions}")
        for f in ("vlm_width", "io_hidden"):
            require(getattr(self, f) > 0, f"{name}: {f} must be positive, got {getattr(self, f)}")
        require(self.num_future_tokens >= 0, f"{name}: num_future_tokens must be >= 0, got {self.num_future_tokens}")
        for f in ("hidden_proj", "dit_output_dim"):
            require(getattr(self, f) is None or getattr(self, f) > 0, f"{name}: {f} must be None or positive")
        if self.hidden_states is not None:
            check_semantics(self.hidden_states)

    @property
    def num_kv_heads(self) -> int:
        """K = N: diffusers' attention is multi-head."""
        return self.num_heads

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def cross_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks that cross-attend (cross_self: the even ones)."""
        return cross_blocks(self.depth, self.block_pattern)

    @property
    def num_cross_blocks(self) -> int:
        """Lc."""
        return len(self.cross_blocks)

    @property
    def num_self_blocks(self) -> int:
        """Ls = depth - Lc: Lc or Lc - 1 for cross_self, 0 for all_cross."""
        return self.depth - self.num_cross_blocks

    @property
    def context_width(self) -> int:
        """Dx: width of what a cross block's K/V projection reads."""
        return self.hidden_proj or self.vlm_width

    @property
    def extra_tokens(self) -> tuple[str, ...]:
        """The tokens before the actions, in order: "state" (with a state_dim), "future" (with future tokens)."""
        return (("state",) if self.state_dim else ()) + (("future",) if self.num_future_tokens else ())

    @property
    def num_extra(self) -> int:
        """Ne: tokens before the actions."""
        return (1 if self.state_dim else 0) + self.num_future_tokens

    @property
    @abc.abstractmethod
    def context_layers(self) -> tuple[int, ...]:
        """The distinct hidden states `prepare` reads: one per cross block, or one shared by all."""

    def check_backbone(self, spec: BackboneSpec) -> None:
        name = f"head {self.name!r}"
        require(self.vlm_width == spec.width, f"{name}: vlm_width {self.vlm_width} must equal the backbone width {spec.width}")
        require(all(0 <= l <= spec.depth for l in self.hidden_layers),
                f"{name}: hidden_layers {self.hidden_layers} must be HF hidden_states indices in [0, {spec.depth}]")
        require(self.hidden_states in (None, spec.hidden_states),
                f"{name}: trained on {self.hidden_states} hidden states, but the backbone reports {spec.hidden_states}; "
                f"build it with BackboneSpec.replace(hidden_states={self.hidden_states!r})")

    def params_type(self) -> type:
        return CrossHead

    def head_tree(self, draw: bb.Draw) -> CrossHead:
        return head_tree(self, draw)

    def prepare(self, params: CrossHead, prefix: Prefix, state: jax.Array | None) -> HeadState:
        return prepare(params, self, prefix, state)

    def velocity(self, params: CrossHead, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
        return velocity(params, self, st, x_t, step)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossHiddenSpec(CrossSpec):
    """StarVLA QwenPI_v3: cross block j reads hidden state `hidden_layers[j]` (after its own LayerNorm +
    Linear with `hidden_proj`): `hidden_states[-depth:]`, block i reading entry i."""

    kind: ClassVar[str] = "cross_hidden"

    hidden_layers: tuple[int, ...]  # HF hidden_states index read by each cross block (0 = embeddings, L = the
    #   last entry), in the backbone's `BackboneSpec.hidden_states` convention (`models.hidden_states`)

    def _check(self, name: str) -> None:
        super()._check(name)
        require(len(self.hidden_layers) == self.num_cross_blocks,
                f"{name}: hidden_layers must name one hidden state per cross block ({self.num_cross_blocks}), got {len(self.hidden_layers)}")

    @property
    def context_layers(self) -> tuple[int, ...]:
        """The hidden states `prepare` reads: one per cross block."""
        return self.hidden_layers


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossLastSpec(CrossSpec):
    """StarVLA QwenGR00T: every cross block reads the last `hidden_states` entry (`hidden_layer`, the
    backbone's depth)."""

    kind: ClassVar[str] = "cross_last"

    hidden_layer: int  # HF hidden_states index read by every cross block: the backbone's depth
    block_pattern: Literal["all_cross", "cross_self"] = "cross_self"  # GR00T's default interleaves

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The hidden state of each cross block (all the same)."""
        return (self.hidden_layer,) * self.num_cross_blocks

    @property
    def context_layers(self) -> tuple[int, ...]:
        """The hidden states `prepare` reads: the one shared by every cross block."""
        return (self.hidden_layer,)

    def check_backbone(self, spec: BackboneSpec) -> None:
        super().check_backbone(spec)
        require(self.hidden_layer == spec.depth,
                f"head {self.name!r}: a cross_last head reads hidden_states[{spec.depth}] (the last entry), got {self.hidden_layer}")


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
    """The blocks of block_pattern='cross_self': cross block j runs before self block j; an odd depth ends
    with cross block Lc - 1 (Ls = Lc - 1)."""

    cross: CrossBlocks | Unstacked  # leading Lc
    self_: CrossBlocks | Unstacked  # leading Ls


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
    blocks: CrossBlocks | BlockPair | Unstacked  # all_cross: leading Lc; cross_self: BlockPair
    out_mod: Linear | None  # kernel [Da, 2, Da], bias [2, Da]: (shift, scale) of the output LayerNorm
    out_proj: Linear | None  # [Da, Do]
    action_out: Mlp  # [Da or Do, Fo], [Fo, Ad] (relu)

    @property
    def cross(self) -> CrossBlocks | Unstacked:
        """The cross blocks, leading Lc."""
        return self.blocks.cross if isinstance(self.blocks, BlockPair) else self.blocks

    def unstack(self) -> CrossHead:
        """Each block stack as `nn.layers.Unstacked` (the fast form on XLA's CPU backend)."""
        return dataclasses.replace(self, blocks=_map_stacks(unstack_layers, self.blocks))

    def stack(self) -> CrossHead:
        """Inverse of `unstack`."""
        return dataclasses.replace(self, blocks=_map_stacks(stack_layers, self.blocks))


def _map_stacks(fn, blocks):
    if isinstance(blocks, BlockPair):
        return BlockPair(cross=fn(blocks.cross), self_=fn(blocks.self_))
    return fn(blocks)


def head_tree(spec: CrossSpec, draw: bb.Draw) -> CrossHead:
    """The parameters of `spec` with every leaf from `draw` (fan-in scaled; norm scales around 1)."""
    da, n, h, f, ad = spec.width, spec.num_heads, spec.head_dim, spec.mlp_dim, spec.action_dim
    lin_, mlp_ = functools.partial(linear_tree, draw), functools.partial(mlp_tree, draw)

    def blocks(lc, ctx):
        return CrossBlocks(
            ada=lin_((da,), (2, da), lead=(lc,)), q=lin_((da,), (n, h), lead=(lc,)), kv=lin_((ctx,), (n, h), lead=(lc, 2)),
            out=lin_((n, h), (da,), lead=(lc,)), ff_in=lin_((da,), (f,), lead=(lc,)), ff_out=lin_((f,), (da,), lead=(lc,)),
        )

    lc, dx, fo = spec.num_cross_blocks, spec.context_width, spec.io_hidden
    stack = blocks(lc, dx) if not spec.num_self_blocks else BlockPair(cross=blocks(lc, dx), self_=blocks(spec.num_self_blocks, da))
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


def prepare(params: CrossHead, spec: CrossSpec, prefix: Prefix, state: jax.Array | None) -> HeadState:
    """The extra tokens and every cross block's K/V of its context (with QwenPI_v3's per-layer
    LayerNorm + Linear first), computed once for all `num_steps` steps."""
    dtype = compute_dtype(params)
    b, p = prefix.mask.shape
    t = spec.num_tokens
    hidden = prefix.hidden_states(spec.context_layers).astype(dtype)  # [Lc or 1, B, P, D]
    extra = extra_tokens(spec, params, b, state, dtype, jax.nn.relu)
    shared = len(spec.context_layers) < spec.num_cross_blocks
    per_block = (None if shared else hidden, params.hidden_proj)

    def body(_, blk, extra_l, __):
        ctx = _project(hidden[0] if extra_l[0] is None else extra_l[0], extra_l[1])
        return None, lin_heads(ctx, blk.kv)  # [B, P, 2, N, H]

    _, kv = scan_layers(body, None, params.cross, per_block)  # [Lc, B, P, 2, N, H]
    mask = jnp.broadcast_to(prefix.mask[:, None, :], (b, t, p))
    return HeadState(k=kv[:, :, :, 0], v=kv[:, :, :, 1], mask=mask, extra=extra)


def _project(ctx: jax.Array, hp: HiddenProj | None) -> jax.Array:
    """QwenPI_v3's `project_layers[i]`: LayerNorm (eps 1e-5, affine) + Linear(D -> Dx); identity without."""
    return ctx if hp is None else lin("BPD,DX->BPX", layer_norm(ctx, hp.norm, 1e-5), hp.proj)


def projected_context(params: CrossHead, spec: CrossSpec, prefix: Prefix) -> jax.Array:
    """[Lc, B, P, Dx]: what each cross block's K/V projection reads (QwenPI_v3: `project_layers[i]`
    of its hidden state; GR00T: the last hidden state). For checks; `prepare` computes it per block."""
    hidden = prefix.hidden_states(spec.context_layers).astype(compute_dtype(params))
    hidden = jnp.broadcast_to(hidden, (spec.num_cross_blocks,) + hidden.shape[1:])
    if params.hidden_proj is None:
        return hidden
    _, ctx = scan_layers(lambda _, hp, h, __: (None, _project(h, hp)), None, params.hidden_proj, hidden)
    return ctx


def _block(spec: CrossSpec, blk: CrossBlocks, x, temb_act, k, v, mask) -> jax.Array:
    """One diffusers BasicTransformerBlock; k, v None means self-attention over x."""
    scale, shift = jnp.split(lin("BD,D2E->B2E", temb_act, blk.ada), 2, axis=1)  # [B, 1, Da] each
    h = layer_norm(x, None, 1e-5) * (1 + scale) + shift
    q = lin("BTD,DNH->BTNH", h, blk.q) * jnp.asarray(spec.head_dim ** -0.5, h.dtype)
    if k is None:
        kv = lin_heads(h, blk.kv)  # [B, T, 2, N, H]
        k, v = kv[:, :, 0], kv[:, :, 1]
        mask = jnp.ones((x.shape[0], x.shape[1], x.shape[1]), bool)
    x = x + lin_merge(attention(q, k, v, mask), blk.out)
    h = layer_norm(x, None, 1e-5)
    return x + lin("BTF,FD->BTD", gelu(lin("BTD,DF->BTF", h, blk.ff_in)), blk.ff_out)


def _blocks(spec: CrossSpec, blocks: CrossBlocks | BlockPair | Unstacked, x, temb_act, st: HeadState) -> jax.Array:
    """Every block in order: cross block j reads st.k[j], st.v[j]; cross_self runs pairs (cross j, self j),
    then the last cross block when the depth is odd."""
    if not isinstance(blocks, BlockPair):
        x, _ = scan_layers(lambda x, blk, kv, _: (_block(spec, blk, x, temb_act, kv[0], kv[1], st.mask), None),
                           x, blocks, (st.k, st.v))
        return x

    def pair(x, self_blk, _, j):
        x = _block(spec, _layer_at(blocks.cross, j), x, temb_act, _row(st.k, j), _row(st.v, j), st.mask)
        return _block(spec, self_blk, x, temb_act, None, None, None), None

    x, _ = scan_layers(pair, x, blocks.self_)
    for j in range(spec.num_self_blocks, spec.num_cross_blocks):  # an odd depth's last block
        x = _block(spec, _layer_at(blocks.cross, j), x, temb_act, st.k[j], st.v[j], st.mask)
    return x


def _row(a: jax.Array, j) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(a, j, keepdims=False)


def _layer_at(layers: CrossBlocks | Unstacked, j) -> CrossBlocks:
    """Block j of a stack (a Python int, or a traced index into stacked leaves)."""
    if isinstance(layers, Unstacked):
        return layers.layers[j]
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), layers)


def velocity(params: CrossHead, spec: CrossSpec, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
    """v(x_t, t) float32 [B, Ha, Ad] at Euler step `step` (int32): t = k / S, bucket int(k / S * 1000)."""
    return velocity_at(params, spec, st, x_t, time_input(spec, step)[1])


def velocity_at(params: CrossHead, spec: CrossSpec, st: HeadState, x_t: jax.Array, t_in: jax.Array) -> jax.Array:
    """v(x_t) float32 [B, Ha, Ad] at the network's time input `t_in` (float32 [] or [B]: the integer
    bucket of StarVLA's heads, e.g. training's `(t * 1000).long()` per row)."""
    return velocity_parts(params, spec, st, x_t, t_in)["velocity"]


def velocity_parts(params: CrossHead, spec: CrossSpec, st: HeadState, x_t: jax.Array, t_in: jax.Array, *,
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

    tokens = x
    x = _blocks(spec, params.blocks, x, temb_act, st)
    x = x if all_tokens else x[:, -ha:]  # every stage after the blocks is per token
    if params.out_proj is not None:  # GR00T's DiT output block; QwenPI_v3 decodes the blocks' output directly
        shift, scale = jnp.split(lin("BD,D2E->B2E", temb_act, params.out_mod), 2, axis=1)  # (shift, scale) order
        x = lin("BTD,DO->BTO", layer_norm(x, None, 1e-6) * (1 + scale) + shift, params.out_proj)
    v = mlp(params.action_out, x[:, -ha:], jax.nn.relu).astype(jnp.float32)
    return dict(temb=temb, tokens=tokens, dit_output=x, velocity=v)

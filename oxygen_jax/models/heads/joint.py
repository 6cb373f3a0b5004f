"""The joint-KV head kind (XR0): a DiT whose layers attend to some backbone layers' K/V ‖ their own.

What Xiaomi-Robotics-0's released runtime computes (`MiBoTForActionGeneration` in `modeling_mibot.py`,
the remote code shipped inside every released checkpoint; measured against its reference outputs, which
this head matches to 1e-4, see docs/model_families.md and `eval/parity/xr0.py`):

* tokens [sink, state MLP, action MLP(x * action_mask)]: the noisy action is multiplied by the robot's
  per-dimension `action_mask` [Ha, Ad] at every step (`JointKvSpec.action_mask`, or a per-row mask given
  to `prepare`); the masked dims are still returned (they evolve from their noise);
* per layer: `x = x + g1 * Attn(mod(RMS(x)))`, `x = RMS(x)`, `x = x + g2 * SwiGLU(mod(RMS(x)))`,
  `x = RMS(x)` with plain-w RMSNorms; (shift, scale, gate) x 2 = per-layer table [6, Da] + a shared
  projection of the time embedding (adaLN-single);
* attention: the DiT's own q/k/v always have N = Da / H heads (fused qkv with bias, q/k RMSNorm over
  H, M-RoPE); the K heads of the backbone cache are repeated N / K times (`repeat_kv`) and put in
  front of the head's own keys: keys = [prefix K of the mapped backbone layer ‖ own K];
* positions: token j sits at (max prefix position + 1 + j) on each M-RoPE axis separately;
* mask: every head token sees every valid prefix token, causal among [sink, state, a_0 .. a_Ha-1].

The training code's rule (+10 on the action positions, a band of 4 among actions) is
`action_position_offset=10, suffix_window=4`; `loss` is its flow-matching loss.

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, T head
tokens (Ne extra + Ha actions), S = P + T keys, L head layers, Da head width, N heads, K KV heads,
H head dim, F MLP, Ha horizon, Ad action dim, Ds state dim, Dt time features, Mr = 3 M-RoPE axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from typing import ClassVar, Literal

from oxygen_jax.models import backbone as bb
from oxygen_jax.models.backbone import BackboneSpec
from oxygen_jax.models.heads.parts import (
    HeadState, Linear, Mlp, compute_dtype, extra_tokens, gelu, lin, lin_heads, linear_tree, mlp, mlp_tree, sinusoid,
    time_input,
)
from oxygen_jax.models.heads.spec import DitSpec, check_kv_heads, check_reads_kv, require
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import (Unstacked, _pytree, apply_rope, attention, merge_heads, project_heads, scan_layers, stack_layers,
                                  unstack_layers)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class JointKvSpec(DitSpec):
    """An XR0 head: layer l attends to the K/V of backbone layer `kv_layers[l]` ‖ its own tokens'.

    Its tokens are [sink, state, actions] (`extra_tokens`, from `sink` and `state_dim`) at the positions
    that continue the prefix's RoPE; its time is XR0's adaLN-single table.
    """

    kind: ClassVar[str] = "joint_kv"

    num_kv_heads: int  # K: the backbone cache's KV heads, repeated to the N heads (the DiT's own K/V have N)
    kv_layers: tuple[int, ...]  # backbone layer read by each head layer
    sink: bool = True  # a learned sink token first
    suffix_mask: Literal["causal", "bidirectional"] = "causal"  # attention among the head's tokens
    suffix_window: int | None = None  # action j also sees only actions j - window .. j
    action_position_offset: int = 0  # RoPE gap between the extra tokens and the actions
    action_mask: tuple[tuple[int, ...], ...] | None = None  # [Ha][Ad] 0/1, multiplies the noisy action at
    #   every step (XR0 `modeling_mibot.py`: the robot's `processor.get_action_mask`); None = all ones

    def _check(self, name: str) -> None:
        super()._check(name)
        check_kv_heads(name, self.num_heads, self.num_kv_heads)
        require(self.head_dim % 2 == 0, f"{name}: head_dim must be even for RoPE, got {self.head_dim}")
        require(len(self.kv_layers) == self.depth,
                f"{name}: kv_layers must name one backbone layer per head layer ({self.depth}), got {len(self.kv_layers)}")
        require(self.suffix_mask in ("causal", "bidirectional"), f"{name}: suffix_mask must be 'causal' or 'bidirectional'")
        require(self.suffix_window is None or self.suffix_window >= 0, f"{name}: suffix_window must be None or >= 0")
        require(self.action_position_offset >= 0, f"{name}: action_position_offset must be >= 0")
        if self.action_mask is not None:
            rows = self.action_mask
            require(len(rows) == self.horizon and all(len(r) == self.action_dim for r in rows)
                    and all(v in (0, 1) for r in rows for v in r),
                    f"{name}: action_mask must be {self.horizon} rows (horizon) of {self.action_dim} entries (action_dim), "
                    f"each 0 or 1; build it with tuple(tuple(int(v) for v in row) for row in mask)")

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def extra_tokens(self) -> tuple[str, ...]:
        """The tokens before the actions, in order: "sink", "state"."""
        return (("sink",) if self.sink else ()) + (("state",) if self.state_dim else ())

    @property
    def num_extra(self) -> int:
        """Ne: tokens before the actions."""
        return len(self.extra_tokens)

    def check_backbone(self, spec: BackboneSpec) -> None:
        check_reads_kv(self, spec)

    def params_type(self) -> type:
        return JointHead

    def head_tree(self, draw: bb.Draw) -> JointHead:
        return head_tree(self, draw)

    def prepare(self, params: JointHead, prefix: Prefix, state: jax.Array | None) -> JointState:
        return prepare(params, self, prefix, state)

    def velocity(self, params: JointHead, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
        return velocity(params, self, st, x_t, step)


@_pytree
class JointLayers:
    """XR0 DiT layers, stacked on a leading L axis."""

    q: Linear  # kernel [L, Da, N, H], bias [L, N, H]
    kv: Linear  # kernel [L, 2, Da, N, H], bias [L, 2, N, H]; index 0 = K, 1 = V (N heads, like q)
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

    def unstack(self) -> JointHead:
        """The layer stack as `nn.layers.Unstacked` (the fast form on XLA's CPU backend)."""
        return dataclasses.replace(self, layers=unstack_layers(self.layers))

    def stack(self) -> JointHead:
        """Inverse of `unstack`."""
        return dataclasses.replace(self, layers=stack_layers(self.layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class JointState(HeadState):
    """`HeadState` of a joint head (k, v: [L, B, P, N, H], the cache already repeated to N heads) plus

    Attributes:
      action_mask: float [B, Ha, Ad] multiplying the noisy action before the action MLP, or None (all ones).
    """

    action_mask: jax.Array | None = None


def head_tree(spec: JointKvSpec, draw: bb.Draw) -> JointHead:
    """The parameters of `spec` with every leaf from `draw` (fan-in scaled; norm scales around 1)."""
    da, n, h, f, ad = spec.width, spec.num_heads, spec.head_dim, spec.mlp_dim, spec.action_dim
    lin_, mlp_ = functools.partial(linear_tree, draw), functools.partial(mlp_tree, draw)
    L = spec.depth
    layers = JointLayers(
        q=lin_((da,), (n, h), lead=(L,)), kv=lin_((da,), (n, h), lead=(L, 2)), out=draw((L, n, h, da), 1.0 / math.sqrt(n * h), 0.0),
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


def _rms(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Qwen's RMSNorm: normalise in float32, cast back, multiply by w."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)).astype(x.dtype)
    return normed * scale.astype(x.dtype)


def _suffix_mask(spec: JointKvSpec) -> jax.Array:
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


def head_positions(spec: JointKvSpec, prefix: Prefix) -> jax.Array:
    """int32 [Mr, B, T] (M-RoPE prefix) or [B, T]: the head tokens' RoPE positions.

    Token j sits at max(valid prefix positions) + 1 + j on each M-RoPE axis separately (modeling_mibot:
    `arange(Q) + position_ids.max(dim=-1) + 1`), plus `action_position_offset` on the actions. Example:
    a prefix ending in a 2 x 2 image token block at t = 3, h = w = 3..4 (see `qwen3_vl.mrope_positions`)
    gives t: 4, 5, ...; h, w: 5, 6, ... The native code also counts left-pad slots (position 1) in the
    max; that changes nothing unless a row holds a single token.
    """
    t = spec.num_tokens
    start = jnp.max(jnp.where(prefix.mask, prefix.positions, -1), axis=-1) + 1  # [Mr, B] or [B]
    offsets = jnp.arange(t, dtype=jnp.int32) + jnp.where(jnp.arange(t) >= spec.num_extra, spec.action_position_offset, 0)
    return (start[..., None] + offsets).astype(jnp.int32)


def _action_mask(spec: JointKvSpec, b: int, action_mask: jax.Array | None, dtype) -> jax.Array | None:
    want = (spec.horizon, spec.action_dim)
    if action_mask is None:
        if spec.action_mask is None:
            return None
        action_mask = jnp.asarray(spec.action_mask, jnp.float32)
    if action_mask.shape not in (want, (b,) + want):
        raise ValueError(f"head {spec.name!r}: action_mask must be [Ha, Ad] = {want} or [B, Ha, Ad] = {(b,) + want}, "
                         f"got {tuple(action_mask.shape)}")
    return jnp.broadcast_to(action_mask.astype(dtype), (b,) + want)


def prepare(params: JointHead, spec: JointKvSpec, prefix: Prefix, state: jax.Array | None,
            action_mask: jax.Array | None = None) -> JointState:
    """The mapped layers' K/V (repeated to N heads), the extra tokens, RoPE tables, the mask and the action mask.

    Args:
      state: [B, Ds] robot state (the state token), or None without one.
      action_mask: [Ha, Ad] or [B, Ha, Ad] (1 = a dimension the robot has, 0 = padding); None takes
        `spec.action_mask` (None there too: all ones, the multiply is skipped).
    Returns:
      `JointState`: k, v [L, B, P, N, H], mask bool [B, T, P + T], extra [B, Ne, Da], sin / cos [B, T, 1, H/2].
    """
    dtype = compute_dtype(params)
    b, p = prefix.mask.shape
    t = spec.num_tokens
    k, v = prefix.layer_kv(spec.kv_layers)
    rep = spec.num_heads // spec.num_kv_heads
    if rep > 1:  # modeling_mibot's repeat_kv: head n reads cache head n // rep
        k, v = jnp.repeat(k, rep, axis=3), jnp.repeat(v, rep, axis=3)
    extra = extra_tokens(spec, params, b, state, dtype, gelu)
    radians = bb.rope_angles(prefix.rope, head_positions(spec, prefix), spec.head_dim)[..., None, :]
    mask = jnp.concatenate([jnp.broadcast_to(prefix.mask[:, None, :], (b, t, p)),
                            jnp.broadcast_to(_suffix_mask(spec)[None], (b, t, t))], axis=-1)
    return JointState(k=k.astype(dtype), v=v.astype(dtype), mask=mask, extra=extra, sin=jnp.sin(radians),
                      cos=jnp.cos(radians), action_mask=_action_mask(spec, b, action_mask, dtype))


def _layer(spec: JointKvSpec, lp: JointLayers, x, mod, ck, cv, st: HeadState) -> jax.Array:
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod + lp.adaln.astype(x.dtype)[None], 6, axis=1)  # [B, 1, Da] each
    h = _rms(x, lp.norms[0]) * (1 + scale1) + shift1
    q = lin("BTD,DNH->BTNH", h, lp.q)
    kv = lin_heads(h, lp.kv)  # [B, T, 2, N, H]
    k, v = kv[:, :, 0], kv[:, :, 1]
    q = apply_rope(_rms(q, lp.q_norm), st.sin, st.cos) * jnp.asarray(spec.head_dim ** -0.5, q.dtype)
    k = apply_rope(_rms(k, lp.k_norm), st.sin, st.cos)
    a = attention(q, jnp.concatenate([ck, k], axis=1), jnp.concatenate([cv, v], axis=1), st.mask)
    x = _rms(x + gate1 * merge_heads(a, lp.out.astype(a.dtype)), lp.norms[1])
    h = _rms(x, lp.norms[2]) * (1 + scale2) + shift2
    gate_up = project_heads(h, lp.gating.astype(h.dtype))  # [B, T, 2, F]
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return _rms(x + gate2 * ((jax.nn.silu(gate) * up) @ lp.linear.astype(h.dtype)), lp.norms[3])


def time_mod(params: JointHead, spec: JointKvSpec, t_in: jax.Array) -> jax.Array:
    """[B, 6, Da] `t_projector(t_embedder(t_in))` for the network time input t_in float32 [B] (t * 1000):
    cos-first sinusoid (Dt), Linear / SiLU / Linear, then Linear(Da, 6 Da) with no activation before it."""
    dtype = compute_dtype(params)
    feats = sinusoid(t_in, spec.time_embed_dim, cos_first=True).astype(dtype)
    return lin("BD,D6E->B6E", mlp(params.time_mlp, feats, jax.nn.silu), params.time_proj)


def _velocity(params: JointHead, spec: JointKvSpec, st: HeadState, x_t: jax.Array, t_in: jax.Array,
              return_layers: bool = False):
    dtype = compute_dtype(params)
    mod = time_mod(params, spec, t_in)
    x_t = x_t.astype(dtype)
    action_mask = getattr(st, "action_mask", None)
    if action_mask is not None:
        x_t = x_t * action_mask
    x = jnp.concatenate([st.extra, mlp(params.action_in, x_t, gelu)], axis=1)

    def body(x, lp, kv, _):
        x = _layer(spec, lp, x, mod, kv[0], kv[1], st)
        return x, (x if return_layers else None)

    x, outs = scan_layers(body, x, params.layers, (st.k, st.v))
    v = mlp(params.action_out, x[:, -spec.horizon:], gelu).astype(jnp.float32)
    return (v, outs) if return_layers else v


def velocity(params: JointHead, spec: JointKvSpec, st: HeadState, x_t: jax.Array, step: jax.Array) -> jax.Array:
    """v(x_t, t) float32 [B, Ha, Ad] at Euler step `step` (int32): t = step / S, fed as t * 1000."""
    _, t_in = time_input(spec, step)
    return _velocity(params, spec, st, x_t, jnp.broadcast_to(t_in, (x_t.shape[0],)))


def velocity_at(params: JointHead, spec: JointKvSpec, st: HeadState, x_t: jax.Array, t: jax.Array,
                return_layers: bool = False):
    """v(x_t, t) float32 [B, Ha, Ad] at per-row times t float32 [B] in [0, 1] (training; any t).

    With `return_layers`, also every layer's output [L, B, T, Da] (either layer layout).
    """
    t_in = jnp.asarray(t, jnp.float32) * spec.time_scale
    return _velocity(params, spec, st, x_t, jnp.broadcast_to(t_in, (x_t.shape[0],)), return_layers)


def loss(params: JointHead, spec: JointKvSpec, st: HeadState, actions: jax.Array, noise: jax.Array,
         t: jax.Array) -> jax.Array:
    """float32 []: XR0's flow-matching loss (Xiaomi's training code `XR0.compute_loss`).

    x_t = (1 - t) noise + t actions, target = actions - noise, loss = 0.5 mean (v(x_t, t) - target)²
    over the entries where the action mask is 1 (every entry without one).

    Args:
      actions, noise: [B, Ha, Ad]; t: float32 [B].
    """
    tb = jnp.asarray(t, jnp.float32)[:, None, None]
    x_t = (1.0 - tb) * noise + tb * actions
    err = jnp.square(velocity_at(params, spec, st, x_t, t) - (actions - noise))
    action_mask = getattr(st, "action_mask", None)
    w = jnp.ones_like(err) if action_mask is None else (action_mask == 1).astype(jnp.float32)
    return 0.5 * jnp.sum(err * w) / jnp.maximum(jnp.sum(w), 1.0)

"""The time-MLP joint head kind (π0's action expert): a Gemma stack whose layers attend to every backbone
layer's K/V ‖ their own, with the robot state as one token and the flow time mixed into each action token.

Per step (openpi's π0, `Pi0Config(pi05=False)`):

    s    = state_in(state)                                                 [B, 1, Da]   (once per frame)
    a    = time_mlp_out(swish(time_mlp_in([action_in(x_t) ‖ sincos(t)])))  [B, Ha, Da]
    x    = [s ‖ a]                                                          [B, 1 + Ha, Da]
    layer l: keys = [prefix K of backbone layer l ‖ own K]; the state token sees the valid prefix and
             itself, each action token the valid prefix, the state token and every action token
             (openpi's suffix ar mask [1, 1, 0, ...]); plain `(1 + w)` RMSNorms; RoPE positions
             next_position + [0, 1 + Ha)
    v    = action_out(final norm(x)[:, 1:])                                 float32 [B, Ha, Ad]

The stack is the one transformer (`backbone.forward_read`) at the head's dims with Gemma maths, like the
adaRMS kind (`heads.adarms`), with whose clock it integrates: openpi's accumulated float32 clock from t = 1.
The state token attends to nothing that changes between steps, but openpi recomputes it each step and so
does this head (its K/V are a small part of the step).

Horizon: position-free like π0.5's expert (positions continue the prefix), so `horizon` 0 means the
caller's chunk length.

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, L layers, K KV
heads, H head dim, N heads, Da head width, F head MLP, Ha horizon, Ad action dim (= Ds, the padded state).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models import flow
from oxygen_jax.models.backbone import DecoderLayers
from oxygen_jax.models.heads.adarms import AdaRmsState, GemmaJointSpec, posemb_sincos, prepare as _read_prefix, stack_spec
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import Dense, RMSNorm, Unstacked, _pytree, dense, stack_layers, unstack_layers
from oxygen_jax.nn.masks import make_attn_mask


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeMlpSpec(GemmaJointSpec):
    """π0's action expert as a head: a state token [B, Ad] -> [B, 1, Da] before the actions, the time mixed into each
    action token by an MLP (the rest, `GemmaJointSpec`: layer l reads backbone layer l, the clock from t = 1)."""

    kind: ClassVar[str] = "time_mlp_joint"

    @property
    def extra_tokens(self) -> tuple[str, ...]:
        return ("state",)

    @property
    def state_dim(self) -> int:
        """Ds = Ad: openpi pads the state to the model's action dim."""
        return self.action_dim

    def params_type(self) -> type:
        return TimeMlpHead

    def head_tree(self, draw: bb.Draw) -> TimeMlpHead:
        return head_tree(self, draw)

    def prepare(self, params: TimeMlpHead, prefix: Prefix, state: jax.Array | None) -> TimeMlpState:
        return prepare(params, self, prefix, state)

    def velocity(self, params: TimeMlpHead, st: TimeMlpState, x_t: jax.Array, t: jax.Array) -> jax.Array:
        return velocity(params, self, st, x_t, t)

    def denoise(self, params: TimeMlpHead, st: TimeMlpState, noise: jax.Array) -> jax.Array:
        return denoise(params, self, st, noise)


@_pytree
class TimeMlpHead:
    """π0's action-expert weights (`models.pi05.model.head_params` builds it from `Params`, no copy)."""

    action_in: Dense  # kernel [Ad, Da], bias [Da]
    state_in: Dense  # [Ad, Da] (openpi's state_proj)
    time_mlp_in: Dense  # [2 Da, Da] (action_time_mlp_in)
    time_mlp_out: Dense  # [Da, Da] (action_time_mlp_out)
    action_out: Dense  # [Da, Ad]
    layers: DecoderLayers | Unstacked  # any tree with DecoderLayers' fields; norms RMSNorm
    final_norm: RMSNorm  # scale [Da]

    def unstack(self) -> TimeMlpHead:
        return dataclasses.replace(self, layers=unstack_layers(self.layers))

    def stack(self) -> TimeMlpHead:
        return dataclasses.replace(self, layers=stack_layers(self.layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TimeMlpState(AdaRmsState):
    """`AdaRmsState` (the prefix's K/V of every layer, its mask, next position, RoPE) plus

    Attributes:
      state_token: [B, 1, Da] `state_in(state)`, the first suffix token of every step.
    """

    state_token: jax.Array = None


def head_tree(spec: TimeMlpSpec, draw: bb.Draw) -> TimeMlpHead:
    """The parameters of `spec` with every leaf from `draw` (fan-in scaled; norm scales around 0: `(1 + w)`)."""
    da, n, k, h, f, ad, L = spec.width, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim, spec.action_dim, spec.depth

    def lin(i, o):
        return Dense(kernel=draw((i, o), 1.0 / math.sqrt(i), 0.0), bias=draw((o,), 0.1, 0.0))

    layers = DecoderLayers(
        q=draw((L, n, da, h), 1.0 / math.sqrt(da), 0.0), kv=draw((L, 2, k, da, h), 1.0 / math.sqrt(da), 0.0),
        out=draw((L, n, h, da), 1.0 / math.sqrt(n * h), 0.0), attn_norm=RMSNorm(scale=draw((L, da), 0.1, 0.0)),
        ffw_norm=RMSNorm(scale=draw((L, da), 0.1, 0.0)), gating=draw((L, 2, da, f), 1.0 / math.sqrt(da), 0.0),
        linear=draw((L, f, da), 1.0 / math.sqrt(f), 0.0),
    )
    return TimeMlpHead(action_in=lin(ad, da), state_in=lin(ad, da), time_mlp_in=lin(2 * da, da),
                       time_mlp_out=lin(da, da), action_out=lin(da, ad), layers=layers,
                       final_norm=RMSNorm(scale=draw((da,), 0.1, 0.0)))


def _dtype(params: TimeMlpHead) -> jnp.dtype:
    return params.action_out.kernel.dtype


def prepare(params: TimeMlpHead, spec: TimeMlpSpec, prefix: Prefix, state: jax.Array | None) -> TimeMlpState:
    """The prefix's K/V, mask and next position (as `adarms.prepare`), and the state token.

    Args:
      state: [B, Ad] the normalised robot state zero-padded to the model's action dim.
    """
    b = prefix.mask.shape[0]
    if state is None or state.shape != (b, spec.state_dim):
        got = None if state is None else tuple(state.shape)
        raise ValueError(f"head {spec.name!r} ({spec.kind}) reads the robot state as a token: pass state [B, Ds] = "
                         f"({b}, {spec.state_dim}) (normalised, zero-padded), got {got}")
    read = _read_prefix(params, spec, prefix, None)
    token = dense(params.state_in, state.astype(_dtype(params)))[:, None, :]
    return TimeMlpState(**{f.name: getattr(read, f.name) for f in dataclasses.fields(read)}, state_token=token)


def action_tokens(params: TimeMlpHead, x_t: jax.Array, t: jax.Array) -> jax.Array:
    """[B, Ha, Da]: `time_mlp_out(swish(time_mlp_in([action_in(x_t) ‖ sincos(t)])))` for times t [B]."""
    dt = _dtype(params)
    a = dense(params.action_in, x_t.astype(dt))
    emb = posemb_sincos(t, a.shape[-1]).astype(dt)
    x = jnp.concatenate([a, jnp.broadcast_to(emb[:, None, :], a.shape)], axis=-1)
    return dense(params.time_mlp_out, jax.nn.swish(dense(params.time_mlp_in, x)))


def suffix_mask(b: int, ha: int) -> jax.Array:
    """bool [B, 1 + Ha, 1 + Ha] among the head's tokens: openpi's ar mask [1, 1, 0, ...] (state alone, then
    the actions as one bidirectional block that also sees the state).

    Example, Ha = 2 (rows = queries [s, a0, a1]): s: 1 0 0 / a0: 1 1 1 / a1: 1 1 1.
    """
    ar = jnp.arange(1 + ha) < 2
    return make_attn_mask(jnp.ones((b, 1 + ha), bool), ar)


def velocity(params: TimeMlpHead, spec: TimeMlpSpec, st: TimeMlpState, x_t: jax.Array, t: jax.Array) -> jax.Array:
    """Flow-matching velocity v(x_t, t) float32 [B, Ha, Ad] for noisy actions x_t [B, Ha, Ad] at times t [B]."""
    b, ha = x_t.shape[:2]
    x = jnp.concatenate([st.state_token.astype(_dtype(params)), action_tokens(params, x_t, t)], axis=1)
    positions = st.next_position[:, None] + jnp.arange(1 + ha, dtype=jnp.int32)[None]
    p = st.mask.shape[-1]
    mask = jnp.concatenate([jnp.broadcast_to(st.mask[:, None, :], (b, 1 + ha, p)), suffix_mask(b, ha)], axis=-1)
    sspec = stack_spec(spec, st.rope)
    h = bb.forward_read(sspec, params.layers, x, positions, mask, st.k, st.v)
    h, _ = bb.rms_norm(sspec, h[:, 1:], params.final_norm)
    return dense(params.action_out, h).astype(jnp.float32)


def denoise(params: TimeMlpHead, spec: TimeMlpSpec, st: TimeMlpState, noise: jax.Array) -> jax.Array:
    """`spec.num_steps` Euler steps from t = 1 (noise [B, Ha, Ad]) to t = 0 on the accumulated float32 clock."""
    b = noise.shape[0]
    v = lambda x, t: velocity(params, spec, st, x, jnp.broadcast_to(t, (b,)))  # noqa: E731
    return flow.integrate(v, noise, spec.num_steps, -1.0, t0=1.0)


def head_spec(name: str, *, width: int, depth: int, num_heads: int, num_kv_heads: int, head_dim: int, mlp_dim: int,
              action_dim: int, num_steps: int = 10, horizon: int = 0) -> TimeMlpSpec:
    """A `TimeMlpSpec` reading every one of the backbone's `depth` layers (π0's action expert)."""
    return TimeMlpSpec(name=name, width=width, depth=depth, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, mlp_dim=mlp_dim, action_dim=action_dim, horizon=horizon, num_steps=num_steps)

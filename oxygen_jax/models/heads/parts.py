"""What the DiT head kinds are built from: affine and MLP parameter pieces, the per-frame `HeadState`, the
time input of an Euler step, sinusoidal features and the extra tokens before the actions.

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, T head
tokens, L layers, K KV heads, H head dim, Da head width, Ds state dim, Ne extra tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from oxygen_jax.models.backbone import Draw
from oxygen_jax.models.heads.spec import DitSpec
from oxygen_jax.nn.layers import _pytree, merge_heads, project_heads


@_pytree
class Linear:
    """An affine map; the kernel keeps named axes split (e.g. [Da, N, H]) for einsum."""

    kernel: jax.Array  # [(L,) in..., out...]
    bias: jax.Array | None = None  # [(L,) out...]


@_pytree
class Mlp:
    """Two Linear layers with the head's activation between (gelu-tanh for joint, relu for cross)."""

    fc1: Linear  # [in, hidden]
    fc2: Linear  # [hidden, out]


def linear_tree(draw: Draw, in_shape, out_shape, lead=(), bias=True) -> Linear:
    """A `Linear` with leaves from `draw` (see `backbone.decoder_tree`): fan-in scaled kernel, small bias."""
    fan_in = math.prod(in_shape)
    return Linear(kernel=draw(lead + in_shape + out_shape, 1.0 / math.sqrt(fan_in), 0.0),
                  bias=draw(lead + out_shape, 0.1, 0.0) if bias else None)


def mlp_tree(draw: Draw, i: int, hid: int, o: int, bias: bool) -> Mlp:
    """An `Mlp` [i -> hid -> o] with leaves from `draw`."""
    return Mlp(fc1=linear_tree(draw, (i,), (hid,), bias=bias), fc2=linear_tree(draw, (hid,), (o,), bias=bias))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    """What a head reads at every denoise step; built once per frame by `prepare`, never written.

    Attributes:
      k, v: joint: [L, B, P, K, H] the mapped backbone layers' K/V; cross: [Lc, B, P, N, H] every
        cross block's K/V of its context.
      mask: bool joint: [B, T, P + T] (prefix validity ‖ suffix mask); cross: [B, T, P].
      extra: [B, Ne, Da] embedded extra tokens (constant over the steps).
      sin, cos: joint: [B, T, 1, H/2] RoPE tables of the head tokens; None for cross heads.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    extra: jax.Array
    sin: jax.Array | None = None
    cos: jax.Array | None = None


def compute_dtype(params) -> jnp.dtype:
    """The head's activation dtype: that of its weights."""
    return params.action_out.fc1.kernel.dtype


def lin(eq: str, x: jax.Array, p: Linear) -> jax.Array:
    """einsum(eq, x, kernel) + bias, in x's dtype."""
    y = jnp.einsum(eq, x, p.kernel.astype(x.dtype))
    return y if p.bias is None else y + p.bias.astype(y.dtype)


def lin_heads(x: jax.Array, p: Linear) -> jax.Array:
    """x [..., D] by a kernel [G, D, N, H] (e.g. G = 2: k|v) + bias -> [..., G, N, H], in x's dtype: one dot
    batched over the G slabs [D, N H] (`nn.layers.project_heads`: no per-call copy of the weight)."""
    w = p.kernel
    y = project_heads(x, w.reshape(w.shape[:2] + (-1,)).astype(x.dtype)).reshape(x.shape[:-1] + w.shape[:1] + w.shape[2:])
    return y if p.bias is None else y + p.bias.astype(y.dtype)


def lin_merge(a: jax.Array, p: Linear) -> jax.Array:
    """a [..., N, H] by a kernel [N, H, D] + bias -> [..., D], in a's dtype (`nn.layers.merge_heads`)."""
    y = merge_heads(a, p.kernel.astype(a.dtype))
    return y if p.bias is None else y + p.bias.astype(y.dtype)


def mlp(p: Mlp, x: jax.Array, act) -> jax.Array:
    return lin("...i,io->...o", act(lin("...i,io->...o", x, p.fc1)), p.fc2)


gelu = lambda x: jax.nn.gelu(x, approximate=True)  # noqa: E731


def sinusoid(t: jax.Array, dim: int, *, cos_first: bool, freq_shift: int = 0) -> jax.Array:
    """float32 [..., dim] features of t [...]: frequencies exp(-ln(1e4) i / (dim/2 - freq_shift)).

    `cos_first, freq_shift=0` is XR0's timestep embedding; `cos_first, freq_shift=1` is diffusers'
    `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1)` (GR00T's DiT); `sin first, 0` is
    GR00T's action encoder.
    """
    half = dim // 2
    freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    args = t.astype(jnp.float32)[..., None] * freqs
    parts = [jnp.cos(args), jnp.sin(args)] if cos_first else [jnp.sin(args), jnp.cos(args)]
    return jnp.concatenate(parts, axis=-1)


def time_input(spec: DitSpec, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(t float32 [], the network's time input float32 []) at Euler step `step` (int32, traced).

    0_to_1: t = step / S; 1_to_0: t = 1 - step / S. A bucketed input is StarVLA's
    `int(t_cont * num_timestep_buckets)` with `t_cont = k / S` in Python (double) floats
    (`LayerwiseFM_ActionHeader.predict_action`, `GR00T_ActionHeader.predict_action` @ 0ed0aad), read
    from a static table: S = 4 gives 0, 250, 500, 750, S = 5 gives 0, 200, 400, 600, 800 (never
    699 for 0.7 * 1000, as float32 would round).
    """
    s = spec.num_steps
    num = step if spec.t_direction == "0_to_1" else s - step
    t = num.astype(jnp.float32) / s
    if spec.time_input == "bucket":
        table = [int(((k if spec.t_direction == "0_to_1" else s - k) / s) * spec.time_scale) for k in range(s)]
        return t, jnp.asarray(table, jnp.float32)[step]
    return t, t * spec.time_scale


def extra_tokens(spec: DitSpec, params, b: int, state: jax.Array | None, dtype, state_act) -> jax.Array:
    """[B, Ne, Da]: the extra tokens of `spec.extra_tokens` in order (sink, state MLP with `state_act`, future)."""
    if "state" in spec.extra_tokens:
        if state is None or state.shape != (b, spec.state_dim):
            got = None if state is None else state.shape
            raise ValueError(f"head {spec.name!r} has a state token: pass its state [B, Ds] = {(b, spec.state_dim)}, got {got}")
    parts = []
    for name in spec.extra_tokens:
        if name == "sink":
            parts.append(jnp.broadcast_to(params.sink.astype(dtype)[None], (b, 1, spec.width)))
        elif name == "future":
            parts.append(jnp.broadcast_to(params.future.astype(dtype)[None], (b,) + params.future.shape))
        else:
            parts.append(mlp(params.state_in, state.astype(dtype)[:, None, :], state_act))
    if not parts:
        return jnp.zeros((b, 0, spec.width), dtype)
    return jnp.concatenate(parts, axis=1)

"""The adaRMS joint head kind (π0.5's action expert): a Gemma stack whose layers attend to every backbone
layer's K/V ‖ their own, conditioned on the flow time through adaRMSNorm.

Per step (openpi π0.5):

    cond = swish(time_mlp_out(swish(time_mlp_in(sincos(t)))))            [B, Da]
    x    = action_in(x_t)                                                  [B, Ha, Da]
    layer l: keys = [prefix K of backbone layer l ‖ own K], bidirectional inside the chunk,
             every valid prefix token visible; RoPE positions next_position + [0, Ha);
             `(1 + scale) * RMS(x) + shift` norms with (scale, shift, gate) = Dense(cond), the gate
             multiplying each residual branch (`backbone.rms_norm` with an `AdaRMSNorm`)
    v    = action_out(adaRMS final norm(x))                               float32 [B, Ha, Ad]

The stack is the one transformer (`backbone.forward_read`) at the head's dims with Gemma maths
(geglu-tanh MLP, `(1 + w)` norms, no q/k-norm) and the prefix's RoPE. The Euler loop is the accumulated
float32 clock of `flow.integrate(..., t0=1.0)` with direction -1 (openpi's rounding: the last time is
0.09999993 for 10 steps, not 0.1).

Horizon: the expert has no position table of its own (its positions continue the prefix's RoPE), so its
chunk length is free: `AdaRmsSpec.horizon = 0` means "the caller's" (the noise's Ha); a positive horizon
is checked against the noise like every other kind.

Axes (`oxygen_jax.axes`, plus the heads' own of `models.heads`): B batch, P prefix tokens, L layers,
K KV heads, H head dim, N heads, Da head width, F head MLP, Ha horizon, Ad action dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from oxygen_jax.models import backbone as bb
from oxygen_jax.models import flow
from oxygen_jax.models.backbone import BackboneSpec, DecoderLayers, RopeSpec
from oxygen_jax.models.heads.spec import HeadSpec, check_kv_heads, check_reads_kv, require
from oxygen_jax.models.prefix import Prefix
from oxygen_jax.nn.layers import AdaRMSNorm, Dense, Unstacked, _pytree, dense, stack_layers, unstack_layers
from oxygen_jax.nn.masks import make_attn_mask

_STATIC = dict(static=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaJointSpec(HeadSpec):
    """What π's action experts share (π0.5's `AdaRmsSpec`, π0's `heads.time_mlp.TimeMlpSpec`): a Gemma stack whose
    layer l reads backbone layer l, positions continuing the prefix, sincos time features of width Da on openpi's
    accumulated clock from t = 1 (noise) to 0. Abstract: the kinds add their tokens, time input and weights."""

    clock_start: ClassVar[float | None] = 1.0

    num_kv_heads: int  # K: the expert's own K/V heads, the backbone's (their K/V are concatenated)

    def _check(self, name: str) -> None:
        super()._check(name)
        check_kv_heads(name, self.num_heads, self.num_kv_heads)
        require(self.width % 2 == 0 and self.head_dim % 2 == 0,
                f"{name}: width ({self.width}, sincos time features) and head_dim ({self.head_dim}, RoPE) must be even")

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Every backbone layer: head layer l reads backbone layer l."""
        return tuple(range(self.depth))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def t_direction(self) -> str:
        """openpi's clock: t = 1 noise -> 0 actions."""
        return "1_to_0"

    @property
    def time_embed_dim(self) -> int:
        """Dt = Da: the sincos time features have the head's width."""
        return self.width

    def check_backbone(self, spec: BackboneSpec) -> None:
        name = f"head {self.name!r}"
        require(self.depth == spec.depth, f"{name}: an {self.kind} head has one layer per backbone layer: depth "
                                          f"{self.depth} must equal the backbone's {spec.depth}")
        check_reads_kv(self, spec)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaRmsSpec(GemmaJointSpec):
    """π0.5's action expert as a head: bidirectional inside its chunk, no extra tokens (π0.5 reads the state as
    prompt tokens), adaRMS time conditioning. `horizon` 0: the chunk length is the caller's (the noise's Ha)."""

    kind: ClassVar[str] = "adarms_joint"
    per_token_time: ClassVar[bool] = True  # adaRMS conditions each action token on its own time

    @property
    def extra_tokens(self) -> tuple[str, ...]:
        return ()

    @property
    def state_dim(self) -> int:
        return 0

    def params_type(self) -> type:
        return AdaRmsHead

    def head_tree(self, draw: bb.Draw) -> AdaRmsHead:
        return head_tree(self, draw)

    def prepare(self, params: AdaRmsHead, prefix: Prefix, state: jax.Array | None) -> AdaRmsState:
        return prepare(params, self, prefix, state)

    def velocity(self, params: AdaRmsHead, st: AdaRmsState, x_t: jax.Array, t: jax.Array) -> jax.Array:
        return velocity(params, self, st, x_t, t)

    def denoise(self, params: AdaRmsHead, st: AdaRmsState, noise: jax.Array) -> jax.Array:
        return denoise(params, self, st, noise)


@_pytree
class AdaRmsHead:
    """π0.5's action-expert weights (`models.pi05.model.head_params` builds it from `Params`, no copy)."""

    action_in: Dense  # kernel [Ad, Da], bias [Da]
    time_mlp_in: Dense  # [Da, Da]
    time_mlp_out: Dense  # [Da, Da]
    action_out: Dense  # [Da, Ad]
    layers: DecoderLayers | Unstacked  # any tree with DecoderLayers' fields (π0.5's ExpertLayers); norms AdaRMSNorm
    final_norm: AdaRMSNorm  # modulation kernel [Da, 3 Da], bias [3 Da]

    def unstack(self) -> AdaRmsHead:
        """The layer stack as `nn.layers.Unstacked` (the fast form on XLA's CPU backend)."""
        return dataclasses.replace(self, layers=unstack_layers(self.layers))

    def stack(self) -> AdaRmsHead:
        """Inverse of `unstack`."""
        return dataclasses.replace(self, layers=stack_layers(self.layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaRmsState:
    """What every denoise step reads, taken from the prefix once per frame (never written).

    Attributes:
      k, v: [L, B, P, K, H] the K/V of the backbone layers `AdaRmsSpec.kv_layers` (every layer).
      mask: bool [B, P] prefix validity.
      next_position: int32 [B] where the chunk's RoPE positions start.
      rope: static, the prefix's rotary embedding (continued by the chunk).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    next_position: jax.Array
    rope: RopeSpec = dataclasses.field(metadata=_STATIC)


def stack_spec(spec: AdaRmsSpec, rope: RopeSpec) -> BackboneSpec:
    """The head's own stack as a `BackboneSpec`: Gemma maths at its dims, continuing `rope`.

    It has no embedder or LM head (`vocab_size` is a placeholder the stack never reads).
    """
    return BackboneSpec(
        family="gemma", width=spec.width, depth=spec.depth, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, mlp_dim=spec.mlp_dim, vocab_size=1, mlp="geglu_tanh", norm_plus_one=True,
        qk_norm=False, rope=rope, embed_scale=True, tie_embeddings=True,
    )


def head_tree(spec: AdaRmsSpec, draw: bb.Draw) -> AdaRmsHead:
    """The parameters of `spec` with every leaf from `draw` (fan-in scaled; adaRMS gates open around 1)."""
    da, n, k, h, f, ad, L = spec.width, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim, spec.action_dim, spec.depth

    def lin(i, o, lead=()):
        return Dense(kernel=draw(lead + (i, o), 1.0 / math.sqrt(i), 0.0), bias=draw(lead + (o,), 0.1, 0.0))

    def ada(lead=()):
        m = lin(da, 3 * da, lead)  # (scale, shift, gate): an open gate so the expert is not an identity
        return AdaRMSNorm(modulation=Dense(kernel=m.kernel, bias=m.bias.at[..., 2 * da:].add(1.0)))

    layers = DecoderLayers(
        q=draw((L, n, da, h), 1.0 / math.sqrt(da), 0.0), kv=draw((L, 2, k, da, h), 1.0 / math.sqrt(da), 0.0),
        out=draw((L, n, h, da), 1.0 / math.sqrt(n * h), 0.0), attn_norm=ada((L,)), ffw_norm=ada((L,)),
        gating=draw((L, 2, da, f), 1.0 / math.sqrt(da), 0.0), linear=draw((L, f, da), 1.0 / math.sqrt(f), 0.0),
    )
    return AdaRmsHead(action_in=lin(ad, da), time_mlp_in=lin(da, da), time_mlp_out=lin(da, da), action_out=lin(da, ad),
                      layers=layers, final_norm=ada())


def compute_dtype(params: AdaRmsHead) -> jnp.dtype:
    """The head's activation dtype: that of its weights."""
    return params.action_out.kernel.dtype


def posemb_sincos(t: jax.Array, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> jax.Array:
    """Sine-cosine embedding of scalar times t [B] -> float32 [B, dim], sine half first (openpi's).

    Per-token times t [B, Ha] (training-time RTC, `runtime.rtc`) give [B, Ha, dim], each entry as for [B].
    """
    if t.ndim > 1:
        return posemb_sincos(t.reshape(-1), dim, min_period, max_period).reshape(t.shape + (dim,))
    fraction = jnp.linspace(0.0, 1.0, dim // 2)
    period = min_period * (max_period / min_period) ** fraction
    arg = jnp.einsum("i,j->ij", t.astype(jnp.float32), 1.0 / period * 2 * jnp.pi, precision=jax.lax.Precision.HIGHEST)
    return jnp.concatenate([jnp.sin(arg), jnp.cos(arg)], axis=-1)


def time_condition(params: AdaRmsHead, t: jax.Array) -> jax.Array:
    """adaRMS condition [B, Da] = swish(time_mlp_out(swish(time_mlp_in(sincos(t))))) for times t [B]
    (per-token times [B, Ha] give [B, Ha, Da])."""
    emb = posemb_sincos(t, params.time_mlp_in.kernel.shape[0]).astype(compute_dtype(params))
    return jax.nn.swish(dense(params.time_mlp_out, jax.nn.swish(dense(params.time_mlp_in, emb))))


def prepare(params: AdaRmsHead, spec: AdaRmsSpec, prefix: Prefix, state: jax.Array | None = None) -> AdaRmsState:
    """The K/V of every backbone layer the head reads, the prefix mask and where the chunk's positions start."""
    if state is not None:
        raise ValueError(f"head {spec.name!r} ({spec.kind}) reads no robot state (π0.5 reads it as prompt tokens); pass None")
    if prefix.rope is None:
        raise ValueError(f"head {spec.name!r} continues the prefix's RoPE, but the prefix carries none (Prefix.rope)")
    if prefix.kv_layers == spec.kv_layers:
        k, v = prefix.k, prefix.v
    else:
        k, v = prefix.layer_kv(spec.kv_layers)
    return AdaRmsState(k=k, v=v, mask=prefix.mask, next_position=prefix.next_position, rope=prefix.rope)


def velocity(params: AdaRmsHead, spec: AdaRmsSpec, st: AdaRmsState, x_t: jax.Array, t: jax.Array) -> jax.Array:
    """Flow-matching velocity v(x_t, t) float32 [B, Ha, Ad].

    Args:
      x_t: noisy actions [B, Ha, Ad].
      t: float32 times [B] (t = 1 noise, t = 0 actions), or one per action token [B, Ha] (per-token
        adaRMS conditioning, training-time RTC).
    """
    dt = compute_dtype(params)
    b, ha = x_t.shape[:2]
    cond = time_condition(params, t)
    x = dense(params.action_in, x_t.astype(dt))
    positions = st.next_position[:, None] + jnp.arange(ha, dtype=jnp.int32)[None]
    suffix_ar = jnp.arange(ha) == 0  # one block: bidirectional inside the chunk
    suffix_mask = make_attn_mask(jnp.ones((b, ha), bool), suffix_ar)
    p = st.mask.shape[-1]
    mask = jnp.concatenate([jnp.broadcast_to(st.mask[:, None, :], (b, ha, p)), suffix_mask], axis=-1)
    sspec = stack_spec(spec, st.rope)
    h = bb.forward_read(sspec, params.layers, x, positions, mask, st.k, st.v, cond)
    h, _ = bb.rms_norm(sspec, h, params.final_norm, cond)
    return dense(params.action_out, h).astype(jnp.float32)


def denoise(params: AdaRmsHead, spec: AdaRmsSpec, st: AdaRmsState, noise: jax.Array) -> jax.Array:
    """`spec.num_steps` Euler steps from t = 1 (noise [B, Ha, Ad]) to t = 0 on the accumulated float32 clock.

    Returns normalised, padded actions float32 [B, Ha, Ad].
    """
    b = noise.shape[0]
    v = lambda x, t: velocity(params, spec, st, x, jnp.broadcast_to(t, (b,)))  # noqa: E731
    return flow.integrate(v, noise, spec.num_steps, -1.0, t0=1.0)


def head_spec(name: str, *, width: int, depth: int, num_heads: int, num_kv_heads: int, head_dim: int, mlp_dim: int,
              action_dim: int, num_steps: int = 10, horizon: int = 0) -> AdaRmsSpec:
    """An `AdaRmsSpec` reading every one of the backbone's `depth` layers (π0.5's action expert:
    `models.pi05.model.head_spec`). `horizon` 0: the chunk length is the caller's (the noise's)."""
    return AdaRmsSpec(name=name, width=width, depth=depth, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, mlp_dim=mlp_dim, action_dim=action_dim, horizon=horizon, num_steps=num_steps)

"""One transformer decoder stack described by a `BackboneSpec`: π0.5's Gemma, Qwen3, Qwen3-VL text.

Axis legend: B batch, T query tokens, S key tokens, D width, F MLP hidden, N query heads, K KV heads,
R = N / K query heads per KV head, H head dim, L layers, V vocabulary, Mr = 3 M-RoPE axes (t, h, w),
Ed DeepStack layers, E adapters in a LoRA bank (all from `oxygen_jax.axes`).

What differs between the families is data in the spec, not code paths:

| spec field        | π0.5 Gemma            | Qwen3 / Qwen3-VL text                      |
|-------------------|-----------------------|--------------------------------------------|
| `mlp`             | `geglu_tanh`          | `swiglu`                                   |
| `norm_plus_one`   | `x̂ * (1 + w)` (f32)   | `w * x̂` (x̂ cast to the activation dtype)   |
| `qk_norm`         | no                    | RMSNorm over H on q and k, before RoPE     |
| `rope`            | 1-D, theta 1e4        | 1-D (Qwen3) / interleaved M-RoPE (Qwen3-VL) |
| `embed_scale`     | `x * sqrt(D)`         | none                                       |
| `tie_embeddings`  | tied                  | either                                     |
| `prefix_attention`| bidirectional/causal  | causal                                     |

This is the one transformer implementation: π0.5's experts run here with `pi05.spec.pi05_spec(config,
expert)` (`pi05/model.py`, `runtime/decode.py`), as do Qwen3 and Qwen3-VL. Because prefix tokens
never attend to suffix tokens, π0.5's joint two-expert forward is "prefix through expert 0, keep its
per-layer K/V" then "suffix through expert 1, attending to that K/V and to itself"; the three stack
entry points are that
decomposition and differ only in what happens to keys and values (same K/V layout [L, B, T, K, H],
K stored after q/k-norm and RoPE, 1/sqrt(H) folded into q):

* `forward_prefill` — no cache in; returns the stacked K/V it computed;
* `forward_read`    — attends to a read-only cache ‖ its own K/V (denoising);
* `forward_write`   — scatters its K/V into a slot cache, then attends to the cache (decoding and
                      request prompts). It alone takes per-row LoRA adapters (`lora.RowAdapters`):
                      the prefix cache and the actions cannot depend on them, by signature.

Positions are int [B, T] (1-D RoPE) or [Mr, B, T] (M-RoPE; [B, T] is accepted and means equal
axes, which is what text tokens and decode steps use). Layers may be stacked (`lax.scan`) or
`nn.layers.Unstacked` (an unrolled loop, the fast form on XLA's CPU backend; see `scan_layers`). A
layer is read by field name, so any tree with `DecoderLayers`' fields runs: π0.5's `ExpertLayers`
(`models/pi05/params.py`) is `DecoderLayers` without q/k-norm, and its adaRMSNorm runs when a `cond`
is given.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from oxygen_jax.models import hidden_states as hs
from oxygen_jax.models.lora import LayerRows, RowAdapters, check_bank_fits
from oxygen_jax.models.vision.siglip import SiglipConfig
from oxygen_jax.nn import kv_quant
from oxygen_jax.nn.layers import (AdaRMSNorm, RMSNorm, Unstacked, apply_rope, attention, merge_heads, project_heads, scan_layers,
                                   stacked_matmul, take_rows, vocab_logits)
from oxygen_jax.nn.masks import make_attn_mask

Family = Literal["gemma", "qwen3", "qwen3_vl", "qwen3_5"]  # qwen3_5: the full-attention layers of models/qwen35/model.py


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# --------------------------------------------------------------------------------------------------
# Specs


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """Rotary embedding over the half-split head (rotate_half convention of Gemma and HF Qwen).

    Interleaved M-RoPE (Qwen3-VL): frequency i of the H/2 rotates by the position of axis
    h if i % 3 == 1 and i < 3 * section[1], of axis w if i % 3 == 2 and i < 3 * section[2], else of
    axis t. With all three axes equal it is exactly 1-D RoPE.
    """

    theta: float = 10_000.0  # base wavelength
    kind: Literal["1d", "mrope_interleaved"] = "1d"
    mrope_section: tuple[int, ...] = ()  # (t, h, w) frequency counts, summing to H/2; M-RoPE only
    exact_division: bool = False  # angle = rounded position / timescale (openpi); else XLA may use the rounded reciprocal

    def __post_init__(self):
        _require(self.theta > 0, f"RopeSpec.theta must be positive, got {self.theta}")
        _require(self.kind in ("1d", "mrope_interleaved"), f"RopeSpec.kind must be '1d' or 'mrope_interleaved', got {self.kind!r}")
        if self.kind == "1d":
            _require(not self.mrope_section, "RopeSpec.mrope_section is only meaningful with kind='mrope_interleaved'")
        else:
            _require(len(self.mrope_section) == 3, f"RopeSpec.mrope_section needs 3 entries (t, h, w), got {self.mrope_section}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3VisionSpec:
    """The Qwen3-VL ViT: patch embed, learned position grid + 2-D RoPE, LayerNorm blocks, 2x2 mergers."""

    depth: int  # ViT blocks
    width: int  # W
    num_heads: int  # Nv; head dim W / Nv
    mlp_dim: int  # Fv (gelu-tanh MLP)
    out_width: int  # LLM width D that the mergers project to
    num_position_embeddings: int  # learned grid g*g (2304 = 48x48 for Qwen3-VL-4B)
    deepstack_layers: tuple[int, ...] = ()  # ViT blocks whose outputs feed DeepStack mergers, in order
    patch_size: int = 16  # P pixels per side
    temporal_patch_size: int = 2  # Tp frames per patch (an image is repeated to fill it)
    spatial_merge_size: int = 2  # m: m x m patches -> one LLM token
    in_channels: int = 3
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        for f in ("depth", "width", "num_heads", "mlp_dim", "out_width", "patch_size", "temporal_patch_size", "spatial_merge_size"):
            _require(getattr(self, f) > 0, f"Qwen3VisionSpec.{f} must be positive, got {getattr(self, f)}")
        _require(self.width % self.num_heads == 0, f"Qwen3VisionSpec.width ({self.width}) must be a multiple of num_heads ({self.num_heads})")
        _require(self.head_dim % 4 == 0, f"Qwen3VisionSpec head dim ({self.head_dim}) must be a multiple of 4 for 2-D RoPE")
        side = math.isqrt(self.num_position_embeddings)
        _require(side * side == self.num_position_embeddings,
                 f"Qwen3VisionSpec.num_position_embeddings must be a square grid, got {self.num_position_embeddings}")
        _require(all(0 <= i < self.depth for i in self.deepstack_layers) and len(set(self.deepstack_layers)) == len(self.deepstack_layers),
                 f"Qwen3VisionSpec.deepstack_layers must be distinct block indices in [0, {self.depth}), got {self.deepstack_layers}")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        """Pd = C * Tp * P * P: one flattened patch, in (C, Tp, P, P) order (HF's Conv3d input)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_width(self) -> int:
        """m² W: one merged token before the merger MLP."""
        return self.width * self.spatial_merge_size ** 2


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class BackboneSpec:
    """One transformer stack (a causal or prefix LM) and its vision encoder. Hashable and static."""

    family: Family
    width: int  # D
    depth: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K (N % K == 0)
    head_dim: int  # H
    mlp_dim: int  # F
    vocab_size: int  # V
    mlp: Literal["geglu_tanh", "swiglu"]  # gate activation: gelu(tanh approx.) or silu
    norm_plus_one: bool  # RMSNorm scale applied as (1 + w) (Gemma) or w (Qwen)
    qk_norm: bool  # RMSNorm over H on q and k before RoPE (Qwen3)
    rope: RopeSpec
    embed_scale: bool  # multiply embeddings by sqrt(D) (Gemma)
    tie_embeddings: bool  # LM head = embedding table
    prefix_attention: Literal["bidirectional", "causal"] = "causal"
    norm_eps: float = 1e-6
    vision: SiglipConfig | Qwen3VisionSpec | None = None
    rotary_dim: int = 0  # leading dims of H that rotate (Qwen3.5: H / 4; the rest pass through); 0 = all H
    # Which transformers version's `output_hidden_states` convention `prefill` reports (`models.hidden_states`).
    hidden_states: Literal["transformers_5", "transformers_4_57"] = "transformers_5"
    # The dtype sqrt(D) is rounded to before it scales the embeddings (None: the table's). openpi rounds it to the
    # dtype the table is stored in: bfloat16 in a training-layout checkpoint, also when that is restored in float32.
    embed_scale_dtype: Literal["float32", "bfloat16"] | None = None

    def __post_init__(self):
        hs.check_semantics(self.hidden_states)
        _require(self.family in ("gemma", "qwen3", "qwen3_vl", "qwen3_5"),
                 f"BackboneSpec.family must be 'gemma', 'qwen3', 'qwen3_vl' or 'qwen3_5', got {self.family!r}")
        _require(self.rotary_dim % 2 == 0 and 0 <= self.rotary_dim <= self.head_dim,
                 f"BackboneSpec.rotary_dim must be even and in [0, head_dim={self.head_dim}] (0 = all), got {self.rotary_dim}")
        for f in ("width", "depth", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size"):
            _require(getattr(self, f) > 0, f"BackboneSpec.{f} must be positive, got {getattr(self, f)}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"BackboneSpec.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _require(self.head_dim % 2 == 0, f"BackboneSpec.head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.mlp in ("geglu_tanh", "swiglu"), f"BackboneSpec.mlp must be 'geglu_tanh' or 'swiglu', got {self.mlp!r}")
        _require(self.prefix_attention in ("bidirectional", "causal"),
                 f"BackboneSpec.prefix_attention must be 'bidirectional' or 'causal', got {self.prefix_attention!r}")
        if self.rope.kind == "mrope_interleaved":
            _mrope_axis_map(self.rope.mrope_section, self.rotary_dim or self.head_dim)  # raises if the sections do not fit
        if isinstance(self.vision, Qwen3VisionSpec):
            _require(self.vision.out_width == self.width,
                     f"vision.out_width ({self.vision.out_width}) must equal the LLM width ({self.width})")
            _require(len(self.vision.deepstack_layers) <= self.depth,
                     f"{len(self.vision.deepstack_layers)} DeepStack features need at least as many LLM layers, got {self.depth}")

    def replace(self, **changes) -> BackboneSpec:
        return dataclasses.replace(self, **changes)


def _mrope_axis_map(section: tuple[int, ...], head_dim: int) -> np.ndarray:
    """int [H/2]: which position axis (0 t, 1 h, 2 w) rotates each frequency (see `RopeSpec`)."""
    half = head_dim // 2
    axis = np.zeros(half, np.int32)
    axis[1:3 * section[1]:3] = 1
    axis[2:3 * section[2]:3] = 2
    counts = tuple(int(np.sum(axis == a)) for a in range(3))
    _require(sum(section) == half and counts == tuple(section),
             f"mrope_section {tuple(section)} does not interleave over head_dim/2 = {half} frequencies "
             f"(it gives t/h/w counts {counts}); the sections must sum to head_dim/2 with h, w <= head_dim/6")
    return axis


def _qwen3(width, depth, heads, kv_heads, head_dim, mlp_dim, vocab, theta, tie, section=(), vision=None) -> BackboneSpec:
    rope = RopeSpec(theta=theta, kind="mrope_interleaved", mrope_section=section) if section else RopeSpec(theta=theta)
    return BackboneSpec(
        family="qwen3_vl" if vision is not None else "qwen3", width=width, depth=depth, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=mlp_dim, vocab_size=vocab, mlp="swiglu", norm_plus_one=False,
        qk_norm=True, rope=rope, embed_scale=False, tie_embeddings=tie, prefix_attention="causal", vision=vision,
    )


_PRESETS: dict[str, Callable[[], BackboneSpec]] = {
    # The dims of ../shared/fixtures/qwen3_tiny (untied head) and qwen3vl_tiny (tied, DeepStack [0, 1]).
    "qwen3_tiny": lambda: _qwen3(64, 3, 4, 2, 16, 128, 512, 1e6, tie=False),
    "qwen3vl_tiny": lambda: _qwen3(
        64, 3, 4, 2, 16, 128, 512, 5e6, tie=True, section=(4, 2, 2),
        vision=Qwen3VisionSpec(depth=3, width=32, num_heads=2, mlp_dim=64, out_width=64, num_position_embeddings=64,
                               deepstack_layers=(0, 1)),
    ),
    # Qwen3-VL-4B-Instruct (its config.json): text 36 x 2560, ViT 24 x 1024, DeepStack [5, 11, 17].
    "qwen3_vl_4b": lambda: _qwen3(
        2560, 36, 32, 8, 128, 9728, 151_936, 5e6, tie=True, section=(24, 20, 20),
        vision=Qwen3VisionSpec(depth=24, width=1024, num_heads=16, mlp_dim=4096, out_width=2560,
                               num_position_embeddings=2304, deepstack_layers=(5, 11, 17)),
    ),
}


def preset(name: str) -> BackboneSpec:
    """A named spec: 'qwen3_tiny', 'qwen3vl_tiny' (test sizes) or 'qwen3_vl_4b' (full size)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown backbone preset {name!r}; choose one of {sorted(_PRESETS)}")
    return _PRESETS[name]()


# --------------------------------------------------------------------------------------------------
# Parameters


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class DecoderLayers:
    """Per-layer weights stacked on a leading L axis (the layout of π0.5's `ExpertLayers` plus q/k-norm)."""

    q: jax.Array  # [L, N, D, H]
    kv: jax.Array  # [L, 2, K, D, H]; index 0 = K, 1 = V
    out: jax.Array  # [L, N, H, D]
    attn_norm: RMSNorm | AdaRMSNorm  # scale [L, D]
    ffw_norm: RMSNorm | AdaRMSNorm  # scale [L, D]
    gating: jax.Array  # [L, 2, D, F]; index 0 = gate (gelu or silu), 1 = up
    linear: jax.Array  # [L, F, D]
    q_norm: RMSNorm | None = None  # scale [L, H]
    k_norm: RMSNorm | None = None  # scale [L, H]


@_pytree
class Decoder:
    """A language model's weights: embedder, layer stack, final norm, optional untied head."""

    embedding: jax.Array  # [V, D]
    layers: DecoderLayers | Unstacked  # or any tree with DecoderLayers' fields (π0.5's ExpertLayers)
    final_norm: RMSNorm  # scale [D]
    lm_head: jax.Array | None = None  # [V, D]; None when the head is tied to `embedding`


Draw = Callable[[tuple[int, ...], float, float], jax.Array]  # (shape, std, mean) -> leaf


def numpy_draws(seed: int, dtype: str) -> Draw:
    """Leaf initialiser: leaf i ~ mean + std * N(0, 1) drawn with numpy from PCG64([seed, i]).

    Deterministic and free of per-shape compilation (shared by `init_decoder` and
    `qwen3_vl.init_vision`).
    """
    counter = itertools.count()

    def draw(shape, std, mean):
        rng = np.random.default_rng([int(seed), next(counter)])
        return jnp.asarray(np.float32(mean) + np.float32(std) * rng.standard_normal(shape, dtype=np.float32), dtype)

    return draw


def zeros_draws(dtype: str) -> Draw:
    """Leaf initialiser for `jax.eval_shape`: traced zeros, never allocated."""
    return lambda shape, std, mean: jnp.zeros(shape, dtype)


def decoder_tree(spec: BackboneSpec, draw: Draw) -> Decoder:
    """The `Decoder` of `spec` with every leaf from `draw`: fan-in scaled normals, norm scales around
    their identity value (0 for `(1 + w)` norms, 1 for plain `w`). The one description of its shapes."""
    d, n, k, h, f, v, depth = spec.width, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim, spec.vocab_size, spec.depth

    def normal(shape, fan_in):
        return draw(shape, 1.0 / math.sqrt(fan_in), 0.0)

    def norm(shape):
        return RMSNorm(scale=draw(shape, 0.1, 0.0 if spec.norm_plus_one else 1.0))

    layers = DecoderLayers(
        q=normal((depth, n, d, h), d), kv=normal((depth, 2, k, d, h), d), out=normal((depth, n, h, d), n * h),
        attn_norm=norm((depth, d)), ffw_norm=norm((depth, d)), gating=normal((depth, 2, d, f), d),
        linear=normal((depth, f, d), f),
        q_norm=norm((depth, h)) if spec.qk_norm else None, k_norm=norm((depth, h)) if spec.qk_norm else None,
    )
    return Decoder(
        embedding=normal((v, d), d), layers=layers, final_norm=norm((d,)),
        lm_head=None if spec.tie_embeddings else normal((v, d), d),
    )


def init_decoder(spec: BackboneSpec, seed: int = 0, dtype: str = "float32") -> Decoder:
    """Random weights for `spec` (tests and benchmarks; not a training initialisation)."""
    return decoder_tree(spec, numpy_draws(seed, dtype))


def abstract_decoder(spec: BackboneSpec, dtype: str = "float32") -> Decoder:
    """`jax.ShapeDtypeStruct` leaves of `spec`'s decoder via `jax.eval_shape`: nothing is allocated."""
    return jax.eval_shape(lambda: decoder_tree(spec, zeros_draws(dtype)))


# --------------------------------------------------------------------------------------------------
# Norms, RoPE, attention, MLP


def rms_norm(spec: BackboneSpec, x: jax.Array, norm: RMSNorm | AdaRMSNorm, cond: jax.Array | None = None):
    """RMSNorm over the last axis, `(1 + w)` or `w` by `spec.norm_plus_one`, or π0.5's adaRMSNorm.

    Args:
      x: [..., D]; norm: `RMSNorm` (scale [D]) or `AdaRMSNorm` (needs `cond` [B, Dc] or
        per token [B, T, Dc], x [B, T, D]).
    Returns:
      (normed x in x.dtype, gate [B, 1, D] or None). The adaptive norm's gate multiplies the
      residual branch (no sigmoid).
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + spec.norm_eps)
    if isinstance(norm, RMSNorm):
        if spec.norm_plus_one:
            return (normed * (1 + norm.scale.astype(jnp.float32))).astype(x.dtype), None
        # HF Qwen: the normalised activations are cast back first, then scaled by w.
        return normed.astype(x.dtype) * norm.scale.astype(x.dtype), None
    _require(spec.norm_plus_one, "adaRMSNorm is defined for (1 + scale) norms only")
    if cond is None:
        raise ValueError("adaRMSNorm needs a condition (the time embedding)")
    mod = cond.astype(x.dtype) @ norm.modulation.kernel.astype(x.dtype) + norm.modulation.bias.astype(x.dtype)
    # cond [B, Dc]: one condition per row; [B, T, Dc]: per token (training-time RTC's per-token flow time).
    scale, shift, gate = jnp.split(mod[:, None, :] if mod.ndim == 2 else mod, 3, axis=-1)
    out = normed * (1 + scale.astype(jnp.float32)) + shift.astype(jnp.float32)
    return out.astype(x.dtype), gate


def rope_angles(rope: RopeSpec, positions: jax.Array, head_dim: int) -> jax.Array:
    """Rotation angles float32 [B, T, H/2] for int positions [B, T] or [Mr, B, T].

    Angle i = position / theta^(2i/H), the position being that of the axis frequency i belongs
    to (M-RoPE) or the only one (1-D). A [B, T] position with M-RoPE means all axes equal.
    """
    timescale = rope.theta ** ((2.0 / head_dim) * jnp.arange(head_dim // 2, dtype=jnp.float32))
    if rope.kind == "1d":
        if positions.ndim != 2:
            raise ValueError(f"1-D RoPE needs positions [B, T], got shape {positions.shape}")
        return _angles(positions[..., None].astype(jnp.float32), timescale, rope.exact_division)
    if positions.ndim == 2:
        positions = jnp.broadcast_to(positions, (3,) + positions.shape)
    if positions.ndim != 3 or positions.shape[0] != 3:
        raise ValueError(f"M-RoPE needs positions [3, B, T] (or [B, T]), got shape {positions.shape}")
    per_freq = jnp.take(positions, jnp.asarray(_mrope_axis_map(rope.mrope_section, head_dim)), axis=0)  # [H/2, B, T]
    return _angles(jnp.moveaxis(per_freq, 0, -1).astype(jnp.float32), timescale, rope.exact_division)


def _angles(positions: jax.Array, timescale: jax.Array, exact: bool) -> jax.Array:
    """positions [..., 1 or H/2] / timescale [H/2]; `exact`: the divisor at full shape behind a barrier XLA cannot rewrite."""
    if exact:
        timescale = jax.lax.optimization_barrier(jnp.broadcast_to(timescale, jnp.broadcast_shapes(positions.shape, timescale.shape)))
    return positions / timescale


def _mlp(spec: BackboneSpec, x: jax.Array, gating: jax.Array, linear: jax.Array, lora: LayerRows | None = None):
    """Gated MLP `(act(x W0) * (x W1)) W2` with gating = [W0; W1] of shape [2, D, F].

    Both branches run as one batched matmul over the leading 2: XLA's CPU backend lowers
    `x @ gating[0]`, `x @ gating[1]` followed by the gelu product about 10x slower at decode batch
    sizes (measured 17 ms against 1.5 ms per bench-size layer at batch 1). `lora` adds per-row
    adapter terms to both branches and to the output projection.
    """
    lead, d = x.shape[:-1], x.shape[-1]
    xb = jnp.broadcast_to(x.reshape(1, -1, d), (2, x.size // d, d))
    gate_up = stacked_matmul(xb, gating.astype(x.dtype))  # [2, Y, F]
    if lora is not None:
        gate_up = lora.add("gating", gate_up, x.reshape(-1, d))
    gate, up = gate_up
    act = jax.nn.gelu(gate, approximate=True) if spec.mlp == "geglu_tanh" else jax.nn.silu(gate)
    h = act * up
    out = h @ linear.astype(x.dtype)
    if lora is not None:
        out = lora.add("linear", out, h)
    return out.reshape(lead + (linear.shape[-1],))


def _residual(x, y, gate):
    return x + y if gate is None else x + y * gate.astype(y.dtype)


KVFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _block(spec: BackboneSpec, lp, x, cond, rope, mask, kv_fn: KVFn, lora: LayerRows | None = None) -> jax.Array:
    """One decoder layer; `kv_fn(k, v) -> (keys, values)` chooses what it attends to.

    `lora` (this layer's bank slice and the row ids) adds each row's adapter term to the q, kv,
    attention-output and MLP projections; None leaves the program exactly the adapter-free one.
    """
    sin, cos = rope
    h, gate = rms_norm(spec, x, lp.attn_norm, cond)
    q = project_heads(h, lp.q.astype(h.dtype))
    kv = jnp.moveaxis(project_heads(h, lp.kv.astype(h.dtype)), -3, 0)  # [2, B, S, K, H]
    if lora is not None:
        q, kv = lora.add("q", q, h), lora.add("kv", kv, h)
    k, v = kv
    q_norm, k_norm = getattr(lp, "q_norm", None), getattr(lp, "k_norm", None)
    if spec.qk_norm:
        if q_norm is None or k_norm is None:
            raise ValueError(f"spec {spec.family!r} has q/k-norm but the layer weights have none")
        q, _ = rms_norm(spec, q, q_norm)
        k, _ = rms_norm(spec, k, k_norm)
    q = _rope_lead(q, sin, cos) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    k = _rope_lead(k, sin, cos)
    keys, values = kv_fn(k, v)
    a = attention(q, keys, values, mask)
    o = merge_heads(a, lp.out.astype(a.dtype))
    if lora is not None:
        o = lora.add("out", o, a)
    x = _residual(x, o, gate)
    h, gate = rms_norm(spec, x, lp.ffw_norm, cond)
    return _residual(x, _mlp(spec, h, lp.gating, lp.linear, lora), gate)


def _rope_lead(x, sin, cos):
    """RoPE on the leading 2 * sin.shape[-1] dims of H (all of them unless `rotary_dim` is set)."""
    r = 2 * sin.shape[-1]
    return apply_rope(x, sin, cos) if r == x.shape[-1] else jnp.concatenate([apply_rope(x[..., :r], sin, cos), x[..., r:]], -1)


def _rope_tables(spec: BackboneSpec, positions: jax.Array):
    radians = rope_angles(spec.rope, positions, spec.rotary_dim or spec.head_dim)[..., None, :]  # [B, T, 1, R/2]
    return jnp.sin(radians), jnp.cos(radians)


def _add_deepstack(x: jax.Array, deepstack: jax.Array | None, layer) -> jax.Array:
    """x + deepstack[layer] after the first Ed layers (Ed = deepstack.shape[0]); `layer` may be traced."""
    if deepstack is None:
        return x
    e = deepstack.shape[0]
    if isinstance(layer, int):
        return x + deepstack[layer].astype(x.dtype) if layer < e else x
    return jnp.where(layer < e, x + deepstack[jnp.minimum(layer, e - 1)].astype(x.dtype), x)



# --------------------------------------------------------------------------------------------------
# The stack


def forward_prefill(spec: BackboneSpec, layers, x, positions, mask, *, cond=None, deepstack=None, return_hidden=False,
                    keep_kv: tuple[int, ...] | None = None, keep_hidden: tuple[int, ...] | None = None):
    """Runs all layers over `x` with self-attention only.

    Args:
      x: [B, T, D] embeddings; positions: int [B, T] or [Mr, B, T]; mask: bool [B, T, T].
      cond: [B, Dc] adaRMS condition (π0.5's action expert only).
      deepstack: [Ed, B, T, D] added to the residual after layers 0..Ed-1 (Qwen3-VL; zero off-image).
      return_hidden: also return every layer's output, recorded before the DeepStack addition
        (HF's `output_hidden_states` convention).
      keep_kv: layers whose K/V are returned, in this order (default: all). Only these are stored
        by the layer loop (memory only: the numbers are those of the full stack).
      keep_hidden: layers whose outputs (before DeepStack) are returned as the third element, in
        this order; implies a third element like `return_hidden` (which is all layers).
    Returns:
      (hidden [B, T, D] before the final norm, (k, v) each [L or len(keep_kv), B, T, K, H]) and, with
      `return_hidden` / `keep_hidden`, layer outputs [L or len(keep_hidden), B, T, D] as a third element.
    """
    every = tuple(range(spec.depth))
    keep_kv = every if keep_kv is None else tuple(keep_kv)
    keep_hidden = every if keep_hidden is None and return_hidden else keep_hidden
    for name, keep in (("keep_kv", keep_kv), ("keep_hidden", keep_hidden or ())):
        _require(all(0 <= l < spec.depth for l in keep) and len(set(keep)) == len(keep),
                 f"forward_prefill: {name} must be distinct layers in [0, {spec.depth}), got {keep}")
    rope = _rope_tables(spec, positions)
    b, t = x.shape[:2]
    kv_shape = (len(keep_kv), b, t, spec.num_kv_heads, spec.head_dim)
    # Carried buffers, written per layer: a layer whose K/V or output nobody keeps is never stored.
    bufs = (jnp.zeros(kv_shape, x.dtype), jnp.zeros(kv_shape, x.dtype),
            None if keep_hidden is None else jnp.zeros((len(keep_hidden),) + x.shape, x.dtype))

    def body(carry, lp, _, layer):
        x, (kb, vb, hb) = carry
        out = {}

        def kv_fn(k, v):
            out["kv"] = (k, v)
            return k, v

        x = _block(spec, lp, x, cond, rope, mask, kv_fn)
        if keep_kv:
            kb, vb = _store(kb, out["kv"][0], keep_kv, layer), _store(vb, out["kv"][1], keep_kv, layer)
        if keep_hidden:
            hb = _store(hb, x, keep_hidden, layer)
        return (_add_deepstack(x, deepstack, layer), (kb, vb, hb)), None

    (x, (kb, vb, hb)), _ = scan_layers(body, (x, bufs), layers)
    return (x, (kb, vb)) if keep_hidden is None else (x, (kb, vb), hb)


def _store(buf: jax.Array, value: jax.Array, keep: tuple[int, ...], layer) -> jax.Array:
    """buf[keep.index(layer)] = value when `layer` (an int, or traced in a scan) is kept; else buf unchanged."""
    if isinstance(layer, int):
        return buf.at[keep.index(layer)].set(value.astype(buf.dtype)) if layer in keep else buf
    depth = max(keep) + 1
    slots = jnp.asarray([keep.index(l) if l in keep else len(keep) for l in range(depth)], jnp.int32)
    slot = jnp.where(layer < depth, slots[jnp.minimum(layer, depth - 1)], len(keep))  # len(keep): dropped
    return buf.at[slot].set(value.astype(buf.dtype), mode="drop")


def forward_read(spec: BackboneSpec, layers, x, positions, mask, cache_k, cache_v, cond=None):
    """Runs all layers over `x`, attending to the read-only cache followed by `x` itself.

    Args:
      x: [B, T, D]; positions: int [B, T] or [Mr, B, T]; mask: bool [B, T, S + T].
      cache_k, cache_v: [L, B, S, K, H] (never written).
    Returns:
      hidden [B, T, D] before the final norm.
    """
    rope = _rope_tables(spec, positions)

    def body(x, lp, cache, _):
        ck, cv = cache
        kv_fn = lambda k, v: (jnp.concatenate([ck, k], axis=1), jnp.concatenate([cv, v], axis=1))  # noqa: E731
        return _block(spec, lp, x, cond, rope, mask, kv_fn), None

    x, _ = scan_layers(body, x, layers, (cache_k, cache_v))
    return x


def forward_write(spec: BackboneSpec, layers, x, positions, mask, cache_k, cache_v, write_index, cond=None,
                  lora: RowAdapters | None = None):
    """Writes the K/V of `x` into the cache, then attends to the whole cache.

    Args:
      x: [B, T, D]; positions: int [B, T] or [Mr, B, T]; mask: bool [B, T, S] over the cache slots
        (it must allow the slots being written, e.g. causally).
      cache_k, cache_v: [L, B, S, K, H], float or `nn.kv_quant.QuantKV` (entries quantized as written).
      write_index: int [B, T] cache slot for each new token; an index >= S drops that write (rows
        that must not touch the cache).
      lora: per-row adapters of this stack: `RowAdapters(bank, ids)` with bank leaves [L, E, ...]
        and ids int32 [B] (0 = base weights, n = bank adapter n). Row b then runs with adapter
        ids[b] on q, kv, attention output, gate/up and down; rows on id 0 get exactly (bit for
        bit) the adapter-free result. None: the adapter-free program, unchanged.
    Returns:
      (hidden [B, T, D] before the final norm, (cache_k, cache_v) updated).
    """
    rope = _rope_tables(spec, positions)
    rows = jnp.arange(x.shape[0])[:, None]
    if lora is not None:
        check_bank_fits(lora.bank, layers)
        if lora.ids.shape != (x.shape[0],):
            raise ValueError(f"RowAdapters.ids must be [B] = ({x.shape[0]},), got {lora.ids.shape}")

    def body(carry, lp, bank_layer, layer):
        x, ck, cv = carry
        new = {}

        def kv_fn(k, v):
            # Scatter into the carried full cache so XLA updates it in place (no per-layer copy); a quantized
            # cache stores the entries quantized and is read back dequantized (`nn.kv_quant`).
            new["k"], keys = kv_quant.write_layer(ck, layer, rows, write_index, k)
            new["v"], values = kv_quant.write_layer(cv, layer, rows, write_index, v)
            return keys, values

        row_lora = None if lora is None else LayerRows(bank_layer, lora.ids)
        x = _block(spec, lp, x, cond, rope, mask, kv_fn, row_lora)
        return (x, new["k"], new["v"]), None

    # The bank travels with the layer loop: its leaves are [L, E, ...], sliced per layer.
    extra = None if lora is None else lora.bank.adapters
    (x, cache_k, cache_v), _ = scan_layers(body, (x, cache_k, cache_v), layers, extra)
    return x, (cache_k, cache_v)


# --------------------------------------------------------------------------------------------------
# Embedding, head, masks and positions


def embed_tokens(spec: BackboneSpec, decoder: Decoder, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D], scaled by sqrt(D) (rounded to `spec.embed_scale_dtype` or the table dtype) for Gemma.

    E.g. D = 2048: 45.2548 in float32, 45.25 in bfloat16 (openpi's factor for a bfloat16-stored table).
    """
    table = decoder.embedding
    x = take_rows(table, tokens)  # a quantized table dequantizes the gathered rows only
    factor = jnp.asarray(math.sqrt(table.shape[-1]), spec.embed_scale_dtype or table.dtype).astype(table.dtype)
    return x * factor if spec.embed_scale else x


def _head(spec: BackboneSpec, decoder: Decoder) -> jax.Array:
    if spec.tie_embeddings:
        return decoder.embedding
    if decoder.lm_head is None:
        raise ValueError(f"spec {spec.family!r} has an untied head but the weights have no lm_head")
    return decoder.lm_head


def final_norm(spec: BackboneSpec, decoder: Decoder, hidden: jax.Array) -> jax.Array:
    """The final RMSNorm: [..., D] -> [..., D]."""
    return rms_norm(spec, hidden, decoder.final_norm)[0]


def lm_logits(spec: BackboneSpec, decoder: Decoder, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] -> float32 logits [..., V] (tied or untied head by the spec)."""
    return vocab_logits(hidden, _head(spec, decoder))


def lm_logits_vocab_major(spec: BackboneSpec, decoder: Decoder, hidden: jax.Array) -> jax.Array:
    """`lm_logits(...).T` for hidden [B, D] -> [V, B]: the fast contraction order for decode batches on CPU."""
    return vocab_logits(hidden, _head(spec, decoder), vocab_major=True)


def prefix_mask(spec: BackboneSpec, input_mask: jax.Array) -> jax.Array:
    """bool [B, T, T] for a text-only prefix: causal or bidirectional over its valid tokens."""
    ar = jnp.full(input_mask.shape[-1:], spec.prefix_attention == "causal")
    return make_attn_mask(input_mask, ar)


def prefill(spec: BackboneSpec, decoder: Decoder, x, positions, input_mask, *, mask=None, deepstack=None, return_hidden=False,
            keep_kv: tuple[int, ...] | None = None, keep_hidden: tuple[int, ...] | None = None):
    """The prefix pass: stack, final norm, and (optionally) HF-convention hidden states.

    Args:
      x: [B, T, D] input embeddings (`embed_tokens`, or `qwen3_vl.embed_multimodal`).
      positions: int [B, T] or [Mr, B, T]; input_mask: bool [B, T] real tokens.
      mask: bool [B, T, T]; default `prefix_mask(spec, input_mask)`.
      keep_kv: layers whose K/V are returned (default all); the others are never stored.
      keep_hidden: HF hidden-state indices (0..L, see below) to return instead of all of them; the
        layer loop stores only these (memory only: the values are those `return_hidden` gives).
    Returns:
      dict with `hidden` (pre final norm) and `normed` [B, T, D], `k`, `v` [L or len(keep_kv), B, T, K, H];
      with `return_hidden`, `hidden_states` [L + 1, B, T, D] as HF reports them under `spec.hidden_states`
      (transformers 5, the default: the input embeddings, each layer's output before any DeepStack addition,
      the final-normed output last; transformers 4.57: after DeepStack, the un-normed last layer last; see
      `models.hidden_states`); with `keep_hidden`, `hidden_states` [len(keep_hidden), B, T, D], those indices.
    """
    mask = prefix_mask(spec, input_mask) if mask is None else mask
    depth = spec.depth
    if keep_hidden is not None:
        _require(all(0 <= l <= depth for l in keep_hidden),
                 f"prefill: keep_hidden must be HF hidden-state indices in [0, {depth}], got {keep_hidden}")
        inner = tuple(sorted({l - 1 for l in keep_hidden if 0 < l < depth}))
        out = forward_prefill(spec, decoder.layers, x, positions, mask, deepstack=deepstack, keep_kv=keep_kv,
                              keep_hidden=inner)
    else:
        out = forward_prefill(spec, decoder.layers, x, positions, mask, deepstack=deepstack, return_hidden=return_hidden,
                              keep_kv=keep_kv)
    hidden, (k, v) = out[:2]
    normed = final_norm(spec, decoder, hidden)
    result = dict(hidden=hidden, normed=normed, k=k, v=v)
    if keep_hidden is not None or return_hidden:  # in the convention of `spec.hidden_states` (`models.hidden_states`)
        inner, wanted = (inner, keep_hidden) if keep_hidden is not None else (tuple(range(depth)), tuple(range(depth + 1)))
        result["hidden_states"] = hs.stack(hs.entries(
            spec.hidden_states, wanted, depth, embeddings=x, layer_outputs={l: out[2][i] for i, l in enumerate(inner)},
            last=hidden, normed=normed, deepstack=deepstack), x)
    return result

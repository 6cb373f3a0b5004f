"""What one prefix pass leaves for the action heads and the language decoder: `PrefixCache` (π0.5's
prefill: every layer's K/V) and `PrefixOutputs` (a backbone's prefix pass: the K/V and hidden states
its readers keep, `mot.prefix_pass`).

Axes (`oxygen_jax.axes`): L layers, B batch, P prefix tokens, K KV heads, H head dim, D VLM width,
Mr = 3 M-RoPE axes (t, h, w).

    k, v         [L, B, P, K, H]  compute dtype; K after RoPE
    mask         bool [B, P]      True where a prefix token is valid (padding and masked cameras False)
    positions    int32 [B, P]     RoPE positions cumsum(mask) - 1 (π0.5, text); an M-RoPE (Qwen3-VL)
                 or [Mr, B, P]    prefix has one row per axis, image tokens sharing positions
    last_hidden  [B, D]           final-normed VLM output at the last valid prefix token: the
                                  logits of the first decoded token come from it

`next_position` [B] (derived) is where a continuation's RoPE positions start: the largest valid
prefix position + 1, on any axis. That is `num_valid` for 1-D positions cumsum(mask) - 1, and less
than `num_valid` for an M-RoPE prefix with images (HF's `rope_deltas`).

Consumers never write this cache: `denoise` reads it for all `num_steps` steps; the decode pool copies it
into its own slots at admission. `PrefixOutputs` (below) holds the same fields for a subset of the
layers (Lk kept K/V layers, Lh kept HF hidden states [Lh, B, P, D]), with `next_position` stored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oxygen_jax.models.backbone import RopeSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixCache:
    k: jax.Array
    v: jax.Array
    mask: jax.Array
    positions: jax.Array
    last_hidden: jax.Array

    @property
    def num_valid(self) -> jax.Array:
        """int32 [B]: valid prefix tokens."""
        return jnp.sum(self.mask, axis=-1, dtype=jnp.int32)

    @property
    def next_position(self) -> jax.Array:
        """int32 [B]: RoPE position of the first continuation token (max valid position + 1; 0 for an empty row)."""
        valid_positions = jnp.where(self.mask, self.positions, -1)  # [B, P] or [Mr, B, P]
        axes = tuple(range(valid_positions.ndim - 2)) + (valid_positions.ndim - 1,)
        return jnp.max(valid_positions, axis=axes).astype(jnp.int32) + 1

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def row(self, index: jax.Array | int) -> "PrefixCache":
        """The cache of one batch row, keeping a batch axis of 1 (index may be traced)."""
        take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, index, 1, axis)  # noqa: E731
        return PrefixCache(
            k=take(self.k, 1), v=take(self.v, 1), mask=take(self.mask, 0),
            positions=take(self.positions, self.positions.ndim - 2), last_hidden=take(self.last_hidden, 0),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixOutputs:
    """Everything heads and the language decoder read from one backbone prefix pass (`mot.prefix_pass`).

    Attributes:
      k, v: [Lk, B, P, K, H] K/V (post q/k-norm and RoPE) of the backbone layers `kv_layers`, in
        that order; None when nobody reads K/V.
      hidden: [Lh, B, P, D] HF-convention hidden states `hidden_layers` (0 = embeddings, l = output
        of layer l - 1 before any DeepStack addition, L = final-normed output); None when unread.
      mask: bool [B, P] valid prefix tokens.
      next_position: int32 [B] max prefix position + 1: where head tokens and decoded text continue.
      last_hidden: [B, D] final-normed output at the last valid token (the language decoder's first
        logits); None without a language decoder.
      kv_layers, hidden_layers: static, sorted backbone layer / HF hidden-state indices kept.
      rope: static, the backbone's rotary embedding (joint heads continue it).

    Example: a model with an XR0-style head reading layers 20..35 and a language decoder keeps
    kv_layers = (0, ..., 35); without the decoder it keeps (20, ..., 35) only.
    """

    k: jax.Array | None
    v: jax.Array | None
    hidden: jax.Array | None
    mask: jax.Array
    next_position: jax.Array
    last_hidden: jax.Array | None
    kv_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    hidden_layers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    rope: RopeSpec = dataclasses.field(metadata=dict(static=True))

    @property
    def length(self) -> int:
        """P: prefix positions."""
        return self.mask.shape[-1]

    def layer_kv(self, layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """K, V [len(layers), B, P, K, H] of the given backbone layers (a slice when contiguous)."""
        missing = [l for l in layers if l not in self.kv_layers]
        if missing or self.k is None:
            raise ValueError(f"the prefix kept the K/V of layers {self.kv_layers}, not {tuple(missing) or layers}; "
                             "build it with a ModelSpec that contains this head")
        rows = tuple(self.kv_layers.index(l) for l in layers)
        return select_layers(self.k, rows), select_layers(self.v, rows)

    def hidden_states(self, layers: tuple[int, ...]) -> jax.Array:
        """[len(layers), B, P, D] hidden states of the given HF indices."""
        missing = [l for l in layers if l not in self.hidden_layers]
        if missing or self.hidden is None:
            raise ValueError(f"the prefix kept hidden states {self.hidden_layers}, not {tuple(missing) or layers}; "
                             "build it with a ModelSpec that contains this head")
        return select_layers(self.hidden, tuple(self.hidden_layers.index(l) for l in layers))


def select_layers(x: jax.Array, rows: tuple[int, ...]) -> jax.Array:
    """x[rows] along the leading (layer) axis: a slice when the rows are contiguous, else a gather."""
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        return jax.lax.slice_in_dim(x, rows[0], rows[0] + len(rows), axis=0)
    return jnp.take(x, jnp.asarray(rows, jnp.int32), axis=0)

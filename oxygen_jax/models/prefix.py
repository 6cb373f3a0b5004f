"""The prefix KV cache: what one observation's prefill leaves for the action expert and the decoder.

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
into its own slots at admission.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
